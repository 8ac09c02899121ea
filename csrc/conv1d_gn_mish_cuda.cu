// CUDA implementation of conv1d_gn_mish in ONE launch (plus a memset of the arrival counters).
//
// At the batch sizes a robot runs (1..64) and Diffusion Policy's lengths (4..16), the
// convolution is a weight-streaming problem: every weight is read once and used for only
// B*L multiply-adds, so the kernel is organised around reading weights fast:
//   * a block owns (one batch row, COW output channels, LT positions); its 256 threads split
//     the input channels, one channel per thread per chunk, so each thread streams the K
//     taps of its channel for each of the COW output channels (K*COW independent loads);
//   * the input tile (with its zero-padded halo) is staged in shared memory once per chunk;
//     each thread keeps its channel's LT+K-1 window in registers, so one shared load feeds
//     up to K FMAs;
//   * the per-thread partial sums are reduced across the block with a transposing warp
//     reduction (each lane ends up owning distinct outputs, about V/2 + V/4 + ... shuffles
//     for V partials instead of 5 V), then across warps in shared memory;
//   * GroupNorm needs statistics over a whole (batch, group), which spans many blocks. Each
//     block writes its pre-norm fp32 outputs, then counts its contribution on a per-group
//     arrival counter; the block that completes a group normalises it (two-pass mean and
//     variance, so no cancellation) and applies Mish. No second launch, no host sync.
// Fast paths are templated on K (3, 5) and on LT/COW; any other odd K takes the same kernel
// with a run-time K (no register window), so every valid shape is supported.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <atomic>
#include <limits>

#include "checks.h"
#include "conv1d_gn_mish.h"

namespace dpa {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// Shared memory for the staged input tile: 48 KB is available without opting in, and the
// kernel's static arrays take up to about 4.5 KB of it.
constexpr int kMaxTileFloats = 40 * 1024 / sizeof(float);

struct ConvGnMishArgs {
  const void* x;
  const void* weight;
  const void* bias;
  const void* gn_weight;
  const void* gn_bias;
  void* out;
  float* pre;     // [B, C_out, L] fp32 conv outputs before normalisation
  int* arrivals;  // [B, G] output elements of each (batch, group) written so far
  int batch, in_channels, out_channels, length, kernel_size, groups;
  int co_tiles, l_tiles, rows_per_chunk;
  float eps;
};

template <typename T>
__device__ __forceinline__ float load_float(const void* base, int64_t i) {
  return static_cast<float>(static_cast<const T*>(base)[i]);
}

__device__ __forceinline__ float mish(float v) {
  // The formula PyTorch's own Mish kernel uses.
  return v * tanhf(log1pf(expf(v)));
}

// Transposing warp reduction: V partial sums per lane in, sums over the warp out. At each
// halving stage a lane keeps one half of its window and sends the other half to its partner,
// so after log2(V) stages (at most 5) each lane holds V/32 distinct totals; stages beyond
// that are plain butterflies. `base` tracks which slice of the V outputs the lane owns.
template <int N, int OFF, int V>
__device__ __forceinline__ void transpose_reduce(float (&v)[V], int lane, int& base) {
  if constexpr (OFF >= 1) {
    if constexpr (N > 1) {
      constexpr int H = N / 2;
      const bool upper = lane & OFF;
#pragma unroll
      for (int i = 0; i < H; ++i) {
        const float send = upper ? v[i] : v[i + H];
        const float keep = upper ? v[i + H] : v[i];
        v[i] = keep + __shfl_xor_sync(0xffffffffu, send, OFF);
      }
      if (upper) base += H;
      transpose_reduce<H, OFF / 2>(v, lane, base);
    } else {
      v[0] += __shfl_xor_sync(0xffffffffu, v[0], OFF);
      transpose_reduce<1, OFF / 2>(v, lane, base);
    }
  }
}

__device__ float block_sum(float v, float* scratch) {
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) total += scratch[w];
  return total;
}

// Normalises one complete (batch, group) slice of `pre` and writes Mish of it to `out`.
template <typename scalar_t>
__device__ void finish_group(const ConvGnMishArgs& a, int b, int g, float* scratch) {
  const int cpg = a.out_channels / a.groups;
  const int n = cpg * a.length;
  const int64_t offset = (static_cast<int64_t>(b) * a.out_channels + g * cpg) * a.length;
  // Other blocks wrote this slice: read through L2 (ld.cg), never a stale L1 line.
  const float* y = a.pre + offset;
  float s = 0.f;
  for (int i = threadIdx.x; i < n; i += kThreads) s += __ldcg(y + i);
  const float mean = block_sum(s, scratch) / n;
  float sq = 0.f;
  for (int i = threadIdx.x; i < n; i += kThreads) {
    const float d = __ldcg(y + i) - mean;
    sq += d * d;
  }
  const float rstd = 1.f / sqrtf(block_sum(sq, scratch) / n + a.eps);
  scalar_t* out = static_cast<scalar_t*>(a.out) + offset;
  for (int i = threadIdx.x; i < n; i += kThreads) {
    const int channel = g * cpg + i / a.length;
    const float gamma = a.gn_weight ? load_float<scalar_t>(a.gn_weight, channel) : 1.f;
    const float beta = a.gn_bias ? load_float<scalar_t>(a.gn_bias, channel) : 0.f;
    out[i] = static_cast<scalar_t>(mish((__ldcg(y + i) - mean) * rstd * gamma + beta));
  }
}

// GroupNorm + Mish over a complete pre-norm tensor, one block per (batch, group): the
// second half of the GEMM path.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) group_norm_mish_kernel(const ConvGnMishArgs a) {
  __shared__ float scratch[kWarps];
  finish_group<scalar_t>(a, blockIdx.x / a.groups, blockIdx.x % a.groups, scratch);
}

// KT: compile-time kernel size (0 = read a.kernel_size at run time).
// LT: positions per block. COW: output channels per block.
template <typename scalar_t, int KT, int LT, int COW>
__global__ void __launch_bounds__(kThreads)
    conv1d_gn_mish_kernel(const ConvGnMishArgs a) {
  extern __shared__ float x_tile[];
  constexpr int V = COW * LT;
  __shared__ float warp_sums[kWarps][V];
  __shared__ float scratch[kWarps];
  __shared__ int groups_to_finish[COW];
  __shared__ int num_groups_to_finish;

  const int K = KT > 0 ? KT : a.kernel_size;
  const int window = LT + K - 1;
  // An odd row stride puts the rows that a warp's lanes read in distinct banks.
  const int row_stride = window | 1;
  int tile = blockIdx.x;
  const int co_tile = tile % a.co_tiles;
  tile /= a.co_tiles;
  const int l_tile = tile % a.l_tiles;
  const int b = tile / a.l_tiles;
  const int co0 = co_tile * COW, l0 = l_tile * LT;
  const int cin = a.in_channels, length = a.length;
  const int pad = K / 2;

  float acc[V];
#pragma unroll
  for (int i = 0; i < V; ++i) acc[i] = 0.f;

  const int64_t x_batch = static_cast<int64_t>(b) * cin * length;
  for (int c0 = 0; c0 < cin; c0 += a.rows_per_chunk) {
    const int rows = min(a.rows_per_chunk, cin - c0);
    for (int e = threadIdx.x; e < rows * window; e += kThreads) {
      const int r = e / window, j = e - r * window;
      const int l = l0 - pad + j;
      x_tile[r * row_stride + j] =
          (l >= 0 && l < length)
              ? load_float<scalar_t>(a.x, x_batch + static_cast<int64_t>(c0 + r) * length + l)
              : 0.f;
    }
    __syncthreads();
    const int r = threadIdx.x;
    if (r < rows) {
      const float* xr = x_tile + r * row_stride;
      const int ci = c0 + r;
      if constexpr (KT > 0) {
        float xw[LT + KT - 1];
#pragma unroll
        for (int j = 0; j < LT + KT - 1; ++j) xw[j] = xr[j];
#pragma unroll
        for (int co = 0; co < COW; ++co) {
          if (co0 + co < a.out_channels) {
            const int64_t w0 = (static_cast<int64_t>(co0 + co) * cin + ci) * KT;
            float w[KT];
#pragma unroll
            for (int k = 0; k < KT; ++k) w[k] = load_float<scalar_t>(a.weight, w0 + k);
#pragma unroll
            for (int k = 0; k < KT; ++k)
#pragma unroll
              for (int l = 0; l < LT; ++l) acc[co * LT + l] = fmaf(w[k], xw[l + k], acc[co * LT + l]);
          }
        }
      } else {
#pragma unroll
        for (int co = 0; co < COW; ++co) {
          if (co0 + co < a.out_channels) {
            const int64_t w0 = (static_cast<int64_t>(co0 + co) * cin + ci) * K;
            for (int k = 0; k < K; ++k) {
              const float w = load_float<scalar_t>(a.weight, w0 + k);
#pragma unroll
              for (int l = 0; l < LT; ++l) acc[co * LT + l] = fmaf(w, xr[l + k], acc[co * LT + l]);
            }
          }
        }
      }
    }
    __syncthreads();
  }

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int base = 0;
  transpose_reduce<V, 16>(acc, lane, base);
  constexpr int kOwned = V >= 32 ? V / 32 : 1;
  // With V < 32 the trailing butterfly stages leave copies on lanes that differ only in
  // their low bits; the lane with those bits clear writes.
  constexpr int kCopies = V >= 32 ? 1 : 32 / V;
  if (lane % kCopies == 0) {
#pragma unroll
    for (int j = 0; j < kOwned; ++j) warp_sums[warp][base + j] = acc[j];
  }
  __syncthreads();

  const int co_end = min(co0 + COW, a.out_channels);
  const int l_end = min(l0 + LT, length);
  for (int i = threadIdx.x; i < V; i += kThreads) {
    const int co = co0 + i / LT, l = l0 + i % LT;
    if (co < co_end && l < l_end) {
      float total = a.bias ? load_float<scalar_t>(a.bias, co) : 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) total += warp_sums[w][i];
      a.pre[(static_cast<int64_t>(b) * a.out_channels + co) * length + l] = total;
    }
  }
  // Publish this block's outputs before counting them (release side of the arrival count).
  __threadfence();
  __syncthreads();

  const int cpg = a.out_channels / a.groups;
  if (threadIdx.x == 0) {
    int n = 0;
    const int positions = l_end - l0;
    for (int g = co0 / cpg; g * cpg < co_end; ++g) {
      const int channels = min(co_end, (g + 1) * cpg) - max(co0, g * cpg);
      const int contribution = channels * positions;
      const int before = atomicAdd(a.arrivals + b * a.groups + g, contribution);
      if (before + contribution == cpg * length) groups_to_finish[n++] = g;
    }
    num_groups_to_finish = n;
  }
  __syncthreads();
  const int n_finish = num_groups_to_finish;
  if (n_finish > 0) {
    __threadfence();  // acquire side: every other block's outputs of the group are visible
    for (int i = 0; i < n_finish; ++i) finish_group<scalar_t>(a, b, groups_to_finish[i], scratch);
  }
}

template <typename scalar_t, int KT, int LT, int COW>
void launch(const ConvGnMishArgs& a, cudaStream_t stream) {
  const int64_t blocks = static_cast<int64_t>(a.co_tiles) * a.l_tiles * a.batch;
  const int window = LT + (KT > 0 ? KT : a.kernel_size) - 1;
  const size_t smem = static_cast<size_t>(a.rows_per_chunk) * (window | 1) * sizeof(float);
  conv1d_gn_mish_kernel<scalar_t, KT, LT, COW>
      <<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t, int KT, int LT>
void launch_cow(const ConvGnMishArgs& a, int cow, cudaStream_t stream) {
  switch (cow) {
    case 8: return launch<scalar_t, KT, LT, 8>(a, stream);
    case 4: return launch<scalar_t, KT, LT, 4>(a, stream);
    case 2: return launch<scalar_t, KT, LT, 2>(a, stream);
    default: return launch<scalar_t, KT, LT, 1>(a, stream);
  }
}

template <typename scalar_t, int KT>
void launch_lt(const ConvGnMishArgs& a, int lt, int cow, cudaStream_t stream) {
  switch (lt) {
    case 4: return launch_cow<scalar_t, KT, 4>(a, cow, stream);
    case 8: return launch_cow<scalar_t, KT, 8>(a, cow, stream);
    default: return launch_cow<scalar_t, KT, 16>(a, cow, stream);
  }
}

int ceil_div(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

// Conv as im2col + one fp32 cuBLAS GEMM: with many positions (batch * length) each weight
// feeds enough outputs that tensor-core-free SGEMM tiling beats re-streaming the weights
// per batch row. TF32 follows torch.backends.cuda.matmul.allow_tf32 (off by default).
at::Tensor conv_as_gemm(const at::Tensor& x, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias, const ConvGnMishProblem& p) {
  const int64_t pad = p.kernel_size / 2;
  // Columns ordered (c_in, k) x (batch, position): one GEMM over every position at once
  // (a per-batch matmul would be B GEMMs of only L columns each).
  const at::Tensor cols = at::constant_pad_nd(x.to(at::kFloat), {pad, pad})
                              .unfold(2, p.kernel_size, 1)  // [B, C_in, L, K]
                              .permute({1, 3, 0, 2})
                              .reshape({p.in_channels * p.kernel_size, p.batch * p.length});
  const at::Tensor w = weight.to(at::kFloat).reshape({p.out_channels, -1});
  const at::Tensor pre = bias.has_value()
                             ? at::addmm(bias->to(at::kFloat).unsqueeze(1), w, cols)
                             : at::mm(w, cols);
  return pre.view({p.out_channels, p.batch, p.length}).permute({1, 0, 2}).contiguous();
}

}  // namespace

// Fewest batch * length positions for which the GEMM path is taken (see bench_conv_blocks.py
// --sweep-paths for the measurement that sets it).
std::atomic<int64_t> gemm_path_min_positions{kDefaultGemmPathMinPositions};

namespace {

at::Tensor conv1d_gn_mish_cuda(const at::Tensor& x_in, const at::Tensor& weight_in,
                               const std::optional<at::Tensor>& bias_in,
                               const std::optional<at::Tensor>& gn_weight_in,
                               const std::optional<at::Tensor>& gn_bias_in, int64_t num_groups,
                               double eps) {
  const ConvGnMishProblem p = check_conv1d_gn_mish_args(x_in, weight_in, bias_in, gn_weight_in,
                                                        gn_bias_in, num_groups, eps);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous();
  const auto bias = contiguous_or_none(bias_in), gn_weight = contiguous_or_none(gn_weight_in),
             gn_bias = contiguous_or_none(gn_bias_in);
  at::Tensor out = at::empty({p.batch, p.out_channels, p.length}, x.options());
  const bool gemm_path = p.batch * p.length >= gemm_path_min_positions.load();
  at::Tensor pre = gemm_path ? conv_as_gemm(x, weight, bias, p)
                             : at::empty({p.batch, p.out_channels, p.length},
                                         x.options().dtype(at::kFloat));
  // Only the fused kernel counts arrivals; the GEMM path's normalisation needs none.
  at::Tensor arrivals = at::zeros({gemm_path ? 0 : p.batch, p.groups}, x.options().dtype(at::kInt));

  const bool fast_k = p.kernel_size == 3 || p.kernel_size == 5;
  // Positions per block: the smallest of 4/8/16 that covers short sequences, 16 otherwise.
  const int lt = !fast_k ? 16 : p.length <= 4 ? 4 : p.length <= 8 ? 8 : 16;
  const int l_tiles = ceil_div(p.length, lt);
  // More output channels per block read the staged input tile for more weights, but leave
  // fewer blocks: take the most that still gives every SM a block.
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  int cow = 1;
  if (fast_k) {
    for (int c : {8, 4, 2}) {
      if (static_cast<int64_t>(ceil_div(p.out_channels, c)) * l_tiles * p.batch >= sms &&
          c <= p.out_channels) {
        cow = c;
        break;
      }
    }
  }
  const int row_stride = (lt + static_cast<int>(p.kernel_size) - 1) | 1;
  const int rows_per_chunk = std::min(kThreads, kMaxTileFloats / row_stride);
  TORCH_CHECK_VALUE(rows_per_chunk >= 1, "conv1d_gn_mish: kernel_size ", p.kernel_size,
                    " is too large for the CUDA kernel's shared-memory tile (max ",
                    kMaxTileFloats - lt, ")");
  const int64_t blocks = static_cast<int64_t>(ceil_div(p.out_channels, cow)) * l_tiles * p.batch;
  TORCH_CHECK_VALUE(blocks <= std::numeric_limits<int32_t>::max(),
                    "conv1d_gn_mish: batch * out_channels * length too large for one launch");

  ConvGnMishArgs a{};
  a.x = x.data_ptr();
  a.weight = weight.data_ptr();
  a.bias = optional_data(bias);
  a.gn_weight = optional_data(gn_weight);
  a.gn_bias = optional_data(gn_bias);
  a.out = out.data_ptr();
  a.pre = pre.data_ptr<float>();
  a.arrivals = arrivals.data_ptr<int>();
  a.batch = static_cast<int>(p.batch);
  a.in_channels = static_cast<int>(p.in_channels);
  a.out_channels = static_cast<int>(p.out_channels);
  a.length = static_cast<int>(p.length);
  a.kernel_size = static_cast<int>(p.kernel_size);
  a.groups = static_cast<int>(p.groups);
  a.co_tiles = ceil_div(p.out_channels, cow);
  a.l_tiles = l_tiles;
  a.rows_per_chunk = rows_per_chunk;
  a.eps = static_cast<float>(eps);

  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  DPA_DISPATCH_FLOAT_TYPES(x.scalar_type(), "conv1d_gn_mish", [&] {
    if (gemm_path) {
      group_norm_mish_kernel<scalar_t>
          <<<static_cast<unsigned>(p.batch * p.groups), kThreads, 0, stream>>>(a);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    } else if (p.kernel_size == 3) {
      launch_lt<scalar_t, 3>(a, lt, cow, stream);
    } else if (p.kernel_size == 5) {
      launch_lt<scalar_t, 5>(a, lt, cow, stream);
    } else {
      launch<scalar_t, 0, 16, 1>(a, stream);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(dpa, CUDA, m) { m.impl("conv1d_gn_mish", &conv1d_gn_mish_cuda); }

}  // namespace dpa
