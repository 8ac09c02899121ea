// CUDA implementations of conv1d_gn_mish and conv1d.
//
// At the batch sizes a robot runs and Diffusion Policy's lengths (4..16), a convolution is a
// GEMM with M = output channels, K = in_channels * kernel_size and a tiny N = batch * length:
// every weight is read once and used for only N multiply-adds, so the time is the time to
// stream the weights from HBM. Everything below is organised around streaming them at full
// bandwidth with as few serial steps per launch as possible:
//
//   * split-K over the whole GPU: a block owns a tile of weight-matrix rows and a slice of
//     the reduction, and every lane loads 16 bytes of weights per request, 2-3 requests
//     ahead, straight from the weights' own layout (no repacking, so checkpoints' tensors are
//     used as they are);
//   * the block's slice of the input is staged in shared memory once, in the order the lanes
//     read it, so one 16-byte shared load feeds 4 multiply-adds per weight row;
//   * weight loads are issued before the kernel waits for the previous kernel
//     (griddepcontrol.wait, with programmatic dependent launch), so under a CUDA graph the
//     next layer's weights are already in flight while this layer finishes;
//   * the split-K partial sums meet in a small fp32 workspace; a per-tile arrival counter
//     elects the last block of each output tile, which adds the partials in a fixed order
//     (deterministic), and applies the epilogue: bias, GroupNorm statistics over the whole
//     group (two-pass), Mish, FiLM, residual. No second launch, no host sync. The counters
//     are left at zero, so a caller can keep one buffer for every launch.
//
// Two layouts: Conv1d weights [C_out, C_in, K] are rows of the GEMM (stream_conv_kernel);
// ConvTranspose1d weights [C_in, C_out, K] are columns (stream_conv_transposed_kernel, which
// computes the GEMM over (C_out, K) and folds the taps into positions in its epilogue);
// stream_conv_pair_kernel runs two Conv1d-layout problems of one input in one launch (a
// residual block's first conv and its 1x1 shortcut). On Hopper, where a layer's plan fits,
// thread-block clusters replace the workspace, counters and finishing block: the splits meet
// in distributed shared memory (stream_conv_cluster_kernel: a cluster per GroupNorm group or
// plain conv row tile; stream_conv_cluster_pair_kernel: a pair's groups and its shortcut's
// row tiles; stream_transposed_cluster_kernel: 32 output channels); program_kernel runs a
// recorded sequence of these problems as the stages of one persistent launch (experimental:
// StreamProgram, slower than one launch per conv today, BENCHMARKS.md). Beyond ~32 positions
// each weight feeds enough outputs that im2col + cuBLAS wins; the epilogue is then one more
// launch (group_norm_epilogue_kernel, conv_epilogue_kernel). A weight stored taps-major
// (ops.taps_major, as ConditionalUnet1D passes them there) is multiplied as rows (output
// channel, tap) with x itself, and the epilogue adds each output's taps (GemmForm).
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cooperative_groups.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <iterator>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "checks.h"
#include "conv1d.h"
#include "dependent_launch.h"

namespace dpa {

namespace cg = cooperative_groups;

std::atomic<int64_t> gemm_path_min_positions{kDefaultGemmPathMinPositions};
std::atomic<bool> use_pdl{true};
std::atomic<int> program_options{0};
std::atomic<bool> weights_evict_first{true};
std::atomic<bool> use_clusters{true};
std::atomic<bool> use_side_stream{true};

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kBlocksPerSm = 2;
// Dynamic shared memory per block, at most: what kBlocksPerSm blocks can each have beside
// their static arrays (2 KB covers them) on the device, up to 96 KB (a wide position tile of
// a long reduction slice; B = 1 layers use a few KB).
int max_shared_bytes() {
  const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
  const int per_block = static_cast<int>(props->sharedMemPerMultiprocessor) / kBlocksPerSm - 2048;
  return std::min({96 * 1024, per_block, static_cast<int>(props->sharedMemPerBlockOptin) - 2048});
}
// Weight requests each lane keeps in flight per weight row: 3 in fp32; 2 in half precision,
// whose 16-byte requests carry twice the weights (16 a row ahead against fp32's 12) and
// whose weights take registers twice, packed and then converted (at 3 and 4 rows a warp,
// ptxas spilled up to 248 bytes a thread in fp16).
template <typename T>
constexpr int stream_depth() { return sizeof(T) == 4 ? 3 : 2; }
constexpr int kDepthTransposed = 4;
// Most chunks per warp in stream_conv_cluster_kernel's shared-memory weight ring.
constexpr int kMaxRingStages = 16;
// The most tiles one block can complete (its rows span at most this many output tiles).
constexpr int kMaxFinishUnits = 4 * kWarps + 2;
// Batch rows whose GroupNorm statistics a finishing block holds at once.
constexpr int kStats = 64;

struct StreamArgs {
  const void* x;  // [B, C_in, L_in], any strides (elements)
  int64_t x_sb, x_sc, x_sl;
  // Channels from x_split on come from x2 (a concatenation read in place: the U-Net's up
  // path, conv1d_gn_mish_shortcut's `skip`): x_split = C_in and x2 unused otherwise.
  const void* x2;
  int64_t x2_sb, x2_sc, x2_sl;
  int x_split;
  const void* weight;
  const void* bias;
  const void* gn_weight;
  const void* gn_bias;
  const void* film;      // [B, film_width], rows film_sb elements apart (0: one row for all)
  int64_t film_sb;
  const void* residual;  // [B, C_out, L_out], contiguous
  void* out;             // [B, C_out, L_out]
  float* ws;             // [splits, m, nt] partial sums
  int* counters;         // one per output tile, zero on entry and on exit
  int* done;             // a program's count of finished output tiles of this stage, or null
  int64_t* trace;        // a traced program's timestamps of this stage, or null: trace_event()
  int batch, cout, lin, lout, ksize, stride, pad;
  int positions;  // GEMM N: batch * L_out (conv) or batch * L_in (transposed)
  int nt;         // positions rounded up to the kernel's tile (workspace row stride)
  int m;          // GEMM rows streamed: C_out (conv) or C_out * K (transposed)
  int red;        // reduction length: C_in * K (conv) or C_in (transposed)
  int split_len;  // reduction elements per block
  int splits;
  int ring_stages;  // stream_conv_cluster_kernel<kBulk>'s weight chunks per warp in flight
  int n_tiles;    // position tiles (blockIdx.z): more than one only past 32 positions
  bool prefetch;  // prefetch the block's weights into L2 while waiting for the producer
  bool weights_evict_first;  // weight_policy()
  int unit_rows;  // GEMM rows per output tile (a GroupNorm group, or a block's rows)
  int groups;     // GroupNorm groups, 0 for a plain conv
  int film_width;
  float eps;
};

// ---------------------------------------------------------------------------------------
// Device helpers.

// A traced program's timeline (StreamProgram::run_traced) or traced launches'
// (start_launch_trace): per stage or launch and block, the global timer (ns) when the block's
// last work unit of the stage reached each of these points. stream_conv_cluster_kernel has
// no finishing block; it stamps kTraceArrived once its cluster's sums are visible, then
// kTraceSummed, kTraceFinishing (its share's moments taken), kTraceNormalized and
// kTraceFinished (leaving).
enum TraceEvent {
  kTraceStart, kTraceWaited, kTraceStaged, kTraceComputed, kTraceArrived,
  kTraceFinishing, kTraceSummed, kTraceNormalized, kTraceFinished  // finishing blocks only
};
__device__ __forceinline__ void trace_event(const StreamArgs& a, TraceEvent event) {
  if (a.trace != nullptr && threadIdx.x == 0) {
    int64_t now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    const int block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    a.trace[block * kTraceEvents + event] = now;
  }
}

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// Weight v of a pack as a float. bf16 is converted out of the pack's 32-bit words: through
// c10::BFloat16 element by element, the compiler kept each 16-bit weight in a register of its
// own (twice the registers for the same loads, and spills at 4 rows a warp).
template <typename T, int N>
__device__ __forceinline__ float weight_float(const Pack<T, N>& p, int v) {
  if constexpr (std::is_same_v<T, c10::BFloat16> && N % 2 == 0) {
    uint32_t word;
    memcpy(&word, &p.v[v & ~1], sizeof(word));
    return __uint_as_float(v % 2 ? word & 0xffff0000u : word << 16);
  } else {
    return static_cast<float>(p.v[v]);
  }
}

// L2 policy of the streamed weights. Evict-first (ops.set_weights_evict_first): each weight
// is read once per forward and a forward's weights do not fit L2, so they should not push out
// what is read again soon: activations, partial sums, counters and the kernels' own code.
__device__ __forceinline__ uint64_t weight_policy(bool evict_first) {
  uint64_t first, normal;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(first));
  asm("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(normal));
  return evict_first ? first : normal;
}

// A streamed weight load: read-only path, not kept in L1 (each weight is used by one block).
// volatile keeps the prologue's loads ahead of griddepcontrol.wait.
template <typename T, int N>
__device__ __forceinline__ Pack<T, N> load_stream(const T* p, uint64_t policy) {
  constexpr int kBytes = sizeof(T) * N;
  Pack<T, N> out;
  if constexpr (kBytes == 16) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p), "l"(policy));
    memcpy(&out, &r, 16);
  } else if constexpr (kBytes == 8) {
    uint2 r;
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v2.u32 {%0,%1}, [%2], %3;"
                 : "=r"(r.x), "=r"(r.y)
                 : "l"(p), "l"(policy));
    memcpy(&out, &r, 8);
  } else if constexpr (kBytes == 4) {
    unsigned r;
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.u32 %0, [%1], %2;"
                 : "=r"(r)
                 : "l"(p), "l"(policy));
    memcpy(&out, &r, 4);
  } else {
    static_assert(kBytes == 2, "weight loads are 2, 4, 8 or 16 bytes");
    unsigned short r;
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.u16 %0, [%1], %2;"
                 : "=h"(r)
                 : "l"(p), "l"(policy));
    memcpy(&out, &r, 2);
  }
  return out;
}

// GPU-scope counting by thread 0 of a block, after a barrier that orders the block's other
// threads' writes before it (CUTLASS's semaphores use the same pattern), instead of a
// sequentially consistent fence (__threadfence()) in every thread.
__device__ __forceinline__ int atomic_add_acq_rel(int* p, int v) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

__device__ __forceinline__ void atomic_add_release(int* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

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

// Butterfly sum over the warp: every lane ends with the same bits (each stage adds the same
// two values on both lanes of a pair).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

__device__ float block_sum(float v, float* scratch) {
  v = warp_sum(v);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) total += scratch[w];
  return total;
}

// Adds split 0.. splits-1 of workspace element `offset` (rows of m x nt floats apart) to s,
// in split order (deterministic), kBatch loads in flight at a time. (Batching 16 splits of two
// elements at once measured slower on an H100: BENCHMARKS.md.)
__device__ __forceinline__ float add_splits(const StreamArgs& a, int64_t offset, float s) {
  constexpr int kBatch = 8;
  const int64_t split_stride = static_cast<int64_t>(a.m) * a.nt;
  for (int split0 = 0; split0 < a.splits; split0 += kBatch) {
    float v[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j)
      v[j] = split0 + j < a.splits ? __ldcg(a.ws + (split0 + j) * split_stride + offset) : 0.f;
#pragma unroll
    for (int j = 0; j < kBatch; ++j) s += v[j];
  }
  return s;
}

// What an output element gets after the conv (and GroupNorm + Mish): its channel's GroupNorm
// affine, FiLM scale and shift, and the residual. Loaded as one batch so that the loads'
// round trip overlaps other work (the finishing block's statistics).
struct Epilogue {
  float gamma, beta, scale, shift, residual;
};

// Calls use(field of e, base, index) for each epilogue input the conv has, and where it is.
template <typename Use>
__device__ __forceinline__ void for_each_epilogue_input(const StreamArgs& a, int b, int c, int l,
                                                        Epilogue& e, const Use& use) {
  if (a.gn_weight) use(e.gamma, a.gn_weight, c);
  if (a.gn_bias) use(e.beta, a.gn_bias, c);
  if (a.film) {
    const int64_t row = b * a.film_sb;
    if (a.film_width == a.cout) {
      use(e.shift, a.film, row + c);
    } else {
      use(e.scale, a.film, row + c);
      use(e.shift, a.film, row + a.cout + c);
    }
  }
  if (a.residual) use(e.residual, a.residual, (static_cast<int64_t>(b) * a.cout + c) * a.lout + l);
}

template <typename T>
__device__ __forceinline__ Epilogue load_epilogue(const StreamArgs& a, int b, int c, int l) {
  Epilogue e{1.f, 0.f, 1.f, 0.f, 0.f};
  for_each_epilogue_input(a, b, c, l, e, [](float& field, const void* base, int64_t i) {
    field = load_float<T>(base, i);
  });
  return e;
}

template <typename T>
__device__ __forceinline__ void prefetch_to_l1(const void* base, int64_t i) {
  asm volatile("prefetch.global.L1 [%0];" ::"l"(static_cast<const T*>(base) + i));
}

__device__ __forceinline__ float apply_epilogue(const Epilogue& e, float v) {
  return v * e.scale + e.shift + e.residual;
}

template <typename T>
__device__ __forceinline__ void store_output(const StreamArgs& a, int b, int c, int l, float v) {
  static_cast<T*>(a.out)[(static_cast<int64_t>(b) * a.cout + c) * a.lout + l] = static_cast<T>(v);
}

// Complete pre-activations of an output tile, pre(c, n) with n = b * L_out + l: in the
// finishing block's shared memory or in the workspace (written by other blocks: read through
// L2); or in a cuBLAS result. One type for both streaming cases, so that the finishing code
// exists once per kernel (one copy per source made it ~110 KB of SASS: BENCHMARKS.md).
struct TilePre {
  const float* shared;  // [c - c_lo][n], or null: in the workspace
  const float* ws;
  int c_lo, positions;
  int64_t nt;
  __device__ float operator()(int c, int n) const {
    return shared ? shared[(c - c_lo) * positions + n] : __ldcg(ws + c * nt + n);
  }
};

// The GEMM route's pre-activations: a cuBLAS result [C_out, B * L] without the bias, which
// is added here (addmm would first copy it into every column of the output, a launch).
template <typename T>
struct GemmPre {
  const T* p;
  int64_t stride;
  const void* bias;
  __device__ float operator()(int c, int n) const {
    return static_cast<float>(p[c * stride + n]) + (bias ? load_float<T>(bias, c) : 0.f);
  }
};

// One output's sum over taps k = 0..taps-1, in tap order, of rows[index(k)] (index < 0: the
// tap adds nothing), from a GEMM result whose rows are (channel, tap). The loads go out in
// batches, unrolled, before any add, so that a batch costs one memory round trip: an add
// waiting on each tap's load in turn made the GroupNorm epilogue ~2.5 µs a launch slower.
// kTaps > 0: exactly that many taps, in one batch.
template <int kTaps, typename P, typename Index>
__device__ __forceinline__ float sum_tap_rows(const P* rows, int taps, const Index& index) {
  constexpr int kBatch = kTaps > 0 ? kTaps : 8;
  const int count = kTaps > 0 ? kTaps : taps;
  float v = 0.f;
  for (int k0 = 0; k0 < count; k0 += kBatch) {
    float t[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int64_t at = k0 + i < count ? index(k0 + i) : -1;
      t[i] = at >= 0 ? static_cast<float>(rows[at]) : 0.f;
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) v += t[i];
  }
  return v;
}

// The GEMM route's pre-activations where the weight's taps are GEMM rows (a taps-major
// weight, GemmForm::kTapRows; stride 1, "same" padding, as every GroupNorm conv): z is
// [C_out * K, B * L] in fp32, row c * K + k holding tap k's products at every input
// position. An output adds up its taps' rows, shifted, then the bias. kTaps: K where it is
// compiled in (0: any), so that the U-Nets' kernel sizes unroll completely.
template <typename T, int kTaps>
struct TapRowsPre {
  const float* z;
  int64_t positions;
  const void* bias;
  int taps, pad, length;
  __device__ float operator()(int c, int n) const {
    const int l = n % length, K = kTaps > 0 ? kTaps : taps;
    const float v = sum_tap_rows<kTaps>(z, K, [&](int k) -> int64_t {
      const int at = l + k - pad;
      return at >= 0 && at < length ? static_cast<int64_t>(c * K + k) * positions + n + k - pad : -1;
    });
    return v + (bias ? load_float<T>(bias, c) : 0.f);
  }
};

// GroupNorm -> Mish -> epilogue over one group's channels [c_lo, c_hi) of batch rows
// [b_lo, b_hi), kStats rows at a time. The statistics are two-pass (no cancellation), per
// batch row. A thread's first two elements' epilogue inputs are requested before the
// statistics, so their round trip overlaps the reductions. Loops are not unrolled: this code
// runs once per tile, and unrolling only multiplied its size.
template <typename T, typename Pre>
__device__ void normalize_group(const StreamArgs& a, const Pre& pre, int c_lo, int c_hi, int b_lo,
                                int b_hi, float* scratch, float2* stats) {
  const int L = a.lout;
  const int per_batch = (c_hi - c_lo) * L;
  for (int b0 = b_lo; b0 < b_hi; b0 += kStats) {
    const int b1 = min(b0 + kStats, b_hi);
    const int count = (b1 - b0) * per_batch;
    const auto epilogue_of = [&](int i) {
      const int b = b0 + i / per_batch, r = i % per_batch;
      return load_epilogue<T>(a, b, c_lo + r / L, r % L);
    };
    const int i0 = threadIdx.x, i1 = threadIdx.x + kThreads;
    const Epilogue held0 = i0 < count ? epilogue_of(i0) : Epilogue{};
    const Epilogue held1 = i1 < count ? epilogue_of(i1) : Epilogue{};
#pragma unroll 1
    for (int b = b0; b < b1; ++b) {
      float s = 0.f;
#pragma unroll 1
      for (int i = threadIdx.x; i < per_batch; i += kThreads) s += pre(c_lo + i / L, b * L + i % L);
      const float mean = block_sum(s, scratch) / per_batch;
      float sq = 0.f;
#pragma unroll 1
      for (int i = threadIdx.x; i < per_batch; i += kThreads) {
        const float d = pre(c_lo + i / L, b * L + i % L) - mean;
        sq += d * d;
      }
      const float rstd = rsqrtf(block_sum(sq, scratch) / per_batch + a.eps);
      if (threadIdx.x == 0) stats[b - b0] = make_float2(mean, rstd);
    }
    __syncthreads();
    trace_event(a, kTraceNormalized);
#pragma unroll 1
    for (int i = threadIdx.x; i < count; i += kThreads) {
      const Epilogue e = i == i0 ? held0 : i == i1 ? held1 : epilogue_of(i);
      const int b = b0 + i / per_batch, r = i % per_batch, c = c_lo + r / L, l = r % L;
      const float2 st = stats[b - b0];
      const float v = mish((pre(c, b * L + l) - st.x) * st.y * e.gamma + e.beta);
      store_output<T>(a, b, c, l, apply_epilogue(e, v));
    }
    __syncthreads();  // stats is rewritten by the next pass
  }
}

// Output tile `unit` of a conv: channels [unit * unit_rows, ...). Adds up the splits' partial
// sums and the bias into shared memory when the tile fits (else into split 0's workspace
// slot), then GroupNorm etc. or the plain epilogue. Not inlined: a program's conv bodies
// share one copy.
template <typename T>
__device__ __noinline__ void finish_conv_tile(const StreamArgs& a, int unit, float* shared,
                                              int shared_floats, float* scratch, float2* stats) {
  const int c_lo = unit * a.unit_rows, c_hi = min(c_lo + a.unit_rows, a.m);
  const int P = a.positions;
  const int count = (c_hi - c_lo) * P;
  const TilePre pre{count <= shared_floats ? shared : nullptr, a.ws, c_lo, P, a.nt};
  trace_event(a, kTraceFinishing);
#pragma unroll 1
  for (int i = threadIdx.x; i < count; i += kThreads) {
    const int c = c_lo + i / P, n = i % P;
    const float s = add_splits(a, static_cast<int64_t>(c) * a.nt + n,
                               a.bias ? load_float<T>(a.bias, c) : 0.f);
    if (pre.shared) {
      shared[i] = s;
    } else {
      a.ws[static_cast<int64_t>(c) * a.nt + n] = s;
    }
  }
  __syncthreads();
  trace_event(a, kTraceSummed);
  if (a.groups > 0) return normalize_group<T>(a, pre, c_lo, c_hi, 0, a.batch, scratch, stats);
#pragma unroll 1
  for (int i = threadIdx.x; i < count; i += kThreads) {
    const int c = c_lo + i / P, n = i % P, b = n / a.lout, l = n % a.lout;
    store_output<T>(a, b, c, l, apply_epilogue(load_epilogue<T>(a, b, c, l), pre(c, n)));
  }
}

// Output tile `unit` of a transposed conv: channels [c_lo, c_hi), whose GEMM rows are
// c * K + k. Each output position gathers the taps that land on it.
template <typename T>
__device__ __noinline__ void finish_transposed_tile(const StreamArgs& a, int unit) {
  const int K = a.ksize;
  const int c_lo = unit * (a.unit_rows / K), c_hi = min(c_lo + a.unit_rows / K, a.cout);
  const int count = (c_hi - c_lo) * a.batch * a.lout;
  for (int i = threadIdx.x; i < count; i += kThreads) {
    const int c = c_lo + i / (a.batch * a.lout);
    const int r = i % (a.batch * a.lout), b = r / a.lout, l = r % a.lout;
    float v = a.bias ? load_float<T>(a.bias, c) : 0.f;
    for (int k = 0; k < K; ++k) {
      const int t = l + a.pad - k;  // = j * stride for the input position j feeding tap k
      if (t < 0 || t % a.stride != 0 || t / a.stride >= a.lin) continue;
      v = add_splits(a, static_cast<int64_t>(c * K + k) * a.nt + b * a.lin + t / a.stride, v);
    }
    store_output<T>(a, b, c, l, apply_epilogue(load_epilogue<T>(a, b, c, l), v));
  }
}

// Copies a block's arguments into shared memory (all threads call it; no barrier before).
__device__ __forceinline__ void copy_args(StreamArgs& shared_args, const StreamArgs& a) {
  constexpr int kWords = sizeof(StreamArgs) / sizeof(int);
  static_assert(sizeof(StreamArgs) % sizeof(int) == 0 && kWords <= kThreads,
                "StreamArgs is copied as words, one per thread");
  if (threadIdx.x < kWords) {
    reinterpret_cast<int*>(&shared_args)[threadIdx.x] = reinterpret_cast<const int*>(&a)[threadIdx.x];
  }
  __syncthreads();
}

// After a block's partial sums are in the workspace: counts rows [r_lo, r_hi) on the
// counters of the output tiles they belong to, and finishes each tile it completed (its
// shared memory, now free, can hold the tile's pre-activations).
template <typename T, bool kTransposed>
__device__ void arrive_and_finish(const StreamArgs& a, int r_lo, int r_hi, float* shared,
                                  int shared_floats) {
  __shared__ int finish_units[kMaxFinishUnits];
  __shared__ int num_finish_units;
  __shared__ float scratch[kWarps];
  __shared__ float2 stats[kStats];
  __shared__ StreamArgs finishing;
  // The barrier orders every thread's partial sums before thread 0's count, whose release
  // publishes them; its acquire makes the other blocks' visible where it completes a tile.
  __syncthreads();
  if (threadIdx.x == 0) {
    int n = 0;
    for (int u = r_lo / a.unit_rows; u * a.unit_rows < r_hi; ++u) {
      const int u_lo = u * a.unit_rows, u_hi = min(u_lo + a.unit_rows, a.m);
      const int contribution = min(r_hi, u_hi) - max(r_lo, u_lo);
      const int target = (u_hi - u_lo) * a.splits * a.n_tiles;
      if (atomic_add_acq_rel(a.counters + u, contribution) + contribution == target) finish_units[n++] = u;
    }
    num_finish_units = n;
  }
  __syncthreads();
  trace_event(a, kTraceArrived);
  const int n = num_finish_units;
  // The finishing code is not inlined and takes its arguments by reference: from shared
  // memory, since a kernel parameter's address would make every thread of every block copy
  // all the parameters to local memory as it starts.
  if (n > 0) copy_args(finishing, a);
  for (int i = 0; i < n; ++i) {
    if constexpr (kTransposed) {
      finish_transposed_tile<T>(finishing, finish_units[i]);
    } else {
      finish_conv_tile<T>(finishing, finish_units[i], shared, shared_floats, scratch, stats);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      a.counters[finish_units[i]] = 0;  // ready for the next launch
      if (a.done) atomic_add_release(a.done, 1);  // the tile's outputs, ordered by the barrier
    }
  }
  if (n > 0) trace_event(a, kTraceFinished);
}

// Weight rows per warp of the Conv1d-layout kernel: about 32 accumulators. Every dtype takes
// as many rows: each staged input a lane reads from shared memory (16 bytes for 4 positions'
// worth of one column) feeds R rows' multiply-adds, and at one row per warp the shared-memory
// reads, not the weights, would bound a half-precision layer (128 bytes per clock per SM
// feed 32 multiply-adds per clock at R = 1, 2 bytes of bf16 weights per clock: ~1 TB/s
// over 132 SMs at NT = 16).
template <int NT>
constexpr int conv_rows() {
  return NT <= 8 ? 4 : NT == 16 ? 2 : 1;
}

// Vector width (elements) of the transposed kernel's weight loads: at most 4 elements (16
// bytes in fp32), or fewer where that would take more than 64 accumulators. A block's columns
// are 32 * EPL GEMM rows, and its last block finishes all of their output channels alone,
// one position after another: at 8 half-precision elements it had twice fp32's outputs to
// finish, and Diffusion Policy's bf16 upsampling took 23 µs against fp32's 13 (traced).
template <typename T, int NT>
constexpr int transposed_vector() { return std::min<int>({4, 16 / static_cast<int>(sizeof(T)), 64 / NT}); }

// Shared-memory position of reduction element `el` of a block's slice, chosen so that each
// lane's EPL consecutive elements sit at lane * 4 (+ 128 for elements 4..7): every lane's
// 16-byte shared loads are then consecutive across the warp (no bank conflicts).
template <int EPL>
__device__ __forceinline__ int staged_position(int el) {
  constexpr int kChunk = 32 * EPL;
  const int chunk = el / kChunk, rem = el % kChunk;
  const int lane = rem / EPL, v = rem % EPL;
  return chunk * kChunk + (v / 4) * 128 + lane * (EPL < 4 ? EPL : 4) + v % 4;
}

// Hopper's shared-memory barriers, bulk copies and cluster instructions, used only where
// stream_conv_cluster_kernel's body is compiled.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// The address of the same shared-memory location in block `rank` of the cluster.
__device__ __forceinline__ uint32_t in_block(uint32_t address, int rank) {
  uint32_t out;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(out) : "r"(address), "r"(rank));
  return out;
}

__device__ __forceinline__ void mbarrier_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(bar)) : "memory");
}

__device__ __forceinline__ void mbarrier_expect_bytes(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(bar)), "r"(bytes)
               : "memory");
}

// Until the barrier's phase of this parity completes (0: its first use, 1: its second, ...):
// its expected bytes have all arrived.
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(shared_address(bar)), "r"(parity)
        : "memory");
  } while (!done);
}

// A contiguous global -> shared copy by the copy engine (16-byte aligned, a multiple of 16
// bytes), counted on `bar`: it costs the issuing thread one instruction and no registers.
__device__ __forceinline__ void bulk_load(void* shared, const void* global, uint32_t bytes, uint64_t* bar,
                                          uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
      ::"r"(shared_address(shared)), "l"(global), "r"(bytes), "r"(shared_address(bar)), "l"(policy)
      : "memory");
}

// Stores into another block's shared memory, counted on that block's barrier.
__device__ __forceinline__ void push(uint32_t remote, float v, uint32_t remote_bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];"
               ::"r"(remote), "r"(__float_as_uint(v)), "r"(remote_bar) : "memory");
}
__device__ __forceinline__ void push(uint32_t remote, float4 v, uint32_t remote_bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];"
               ::"r"(remote), "r"(__float_as_uint(v.x)), "r"(__float_as_uint(v.y)),
               "r"(__float_as_uint(v.z)), "r"(__float_as_uint(v.w)), "r"(remote_bar) : "memory");
}
#endif

// ---------------------------------------------------------------------------------------
// Conv1d layout: block = (row tile of kWarps * R output channels, reduction slice). Warp w
// streams rows w*R .. w*R+R-1 of the tile; each lane reads EPL consecutive weights of each
// row per request. NT: positions (batch x length), padded; EPL: weights per lane per load.
// The block's work: row tile `tile`, reduction slice `split`, position tile `n_tile` (its
// blockIdx in a launch of its own). `wait()` returns once the input may be read: called by
// every thread, after the weight loads are issued.
// Streams rows [tile_lo, row_hi) (at most kWarps * R) over reduction slice `split` at
// positions n0.. n0 + NT - 1, and leaves the sums reduced across each warp: a lane owns
// acc[0 .. R * NT / 32) (one value, with copies on other lanes, where R * NT < 32), for
// rows and positions from `base`: see put_owned_sums.
// The weights come through registers, DEPTH requests per lane and row in flight, or (kBulk,
// Hopper, 16-byte aligned rows) through a ring of a.ring_stages chunks per warp in shared
// memory after the staged input, filled by bulk copies: as many bytes in flight as the ring
// holds, whatever the registers (a block per SM keeps half the register-held bytes of two).
template <typename T, int NT, int R, int EPL, int DEPTH, bool kBulk, typename Wait>
__device__ __forceinline__ void stream_conv_sums(const StreamArgs& a, int tile_lo, int row_hi,
                                                 int split, int n0, const Wait& wait,
                                                 float (&acc)[R * NT], int& base) {
  extern __shared__ float4 shared_f4[];
  float* staged = reinterpret_cast<float*>(shared_f4);  // [NT][split_len], see staged_position
  constexpr int kChunk = 32 * EPL;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row0 = tile_lo + warp * R;
  const int e_begin = split * a.split_len;
  const int e_end = min(e_begin + a.split_len, a.red);
  const int chunks = (e_end - e_begin + kChunk - 1) / kChunk;
  const T* weight = static_cast<const T*>(a.weight);
  trace_event(a, kTraceStart);

  // Rows past the end are never loaded; their sums stay garbage and are never written.
  const uint64_t policy = weight_policy(a.weights_evict_first);
  Pack<T, EPL> w[kBulk ? 1 : DEPTH][R];
  const auto load_chunk = [&](int d, int chunk) {
    const int e = e_begin + chunk * kChunk + lane * EPL;
    if (chunk < chunks && e < e_end) {
#pragma unroll
      for (int r = 0; r < R; ++r)
        if (row0 + r < row_hi)
          w[d][r] = load_stream<T, EPL>(weight + static_cast<int64_t>(row0 + r) * a.red + e, policy);
    }
  };
  // The bulk ring: [warp][stage][row][kChunk], a barrier per warp and stage.
  const int stages = kBulk ? a.ring_stages : DEPTH;
  const int warp_rows = max(0, min(R, row_hi - row0));
  T* ring = reinterpret_cast<T*>(staged + NT * a.split_len) + warp * stages * R * kChunk;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __shared__ uint64_t stage_filled[kBulk ? kWarps : 1][kBulk ? kMaxRingStages : 1];
#endif
  // By the whole warp, once it no longer reads the stage: lane 0 arms the stage's barrier,
  // then lane r copies row r.
  const auto fill_stage = [&](int stage, int chunk) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const int e = e_begin + chunk * kChunk;
    const uint32_t bytes = (min(e_end, e + kChunk) - e) * sizeof(T);
    uint64_t* bar = &stage_filled[warp][stage];
    if (lane == 0) mbarrier_expect_bytes(bar, warp_rows * bytes);
    __syncwarp();
    if (lane < warp_rows) {
      bulk_load(ring + (stage * R + lane) * kChunk, weight + static_cast<int64_t>(row0 + lane) * a.red + e,
                bytes, bar, policy);
    }
#endif
  };
  if constexpr (kBulk) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (warp_rows > 0) {
      if (lane == 0) {
        for (int stage = 0; stage < stages; ++stage) mbarrier_init(&stage_filled[warp][stage]);
        // The copies' completions (async proxy) must see the initialised barriers.
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      }
      __syncwarp();
      for (int chunk = 0; chunk < min(stages, chunks); ++chunk) fill_stage(chunk, chunk);
    }
#endif
  } else {
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) load_chunk(d, d);
  }
  if (a.prefetch) {
    // The rest of this block's weights: on their way to L2 while the previous kernel ends.
    // Rolled loops: this runs once per block, and unrolled it was most of the prologue's code.
    const int64_t first = e_begin + static_cast<int64_t>(stages) * kChunk;
    const int64_t bytes = (e_end - first) * static_cast<int64_t>(sizeof(T));
#pragma unroll 1
    for (int r = 0; r < R; ++r) {
      if (row0 + r >= row_hi) continue;
      const char* row = reinterpret_cast<const char*>(weight + static_cast<int64_t>(row0 + r) * a.red + first);
#pragma unroll 1
      for (int64_t offset = lane * 128; offset < bytes; offset += 32 * 128)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(row + offset));
    }
  }
  allow_dependents();
  wait();  // the input comes from the previous kernel (or stage)
  trace_event(a, kTraceWaited);

  // Stage the block's im2col slice. Each thread takes reduction columns (one (channel, tap)
  // each: one division) and loads kColumns of them at all NT positions at once, so it waits
  // for one round trip per kColumns columns; the positions' offsets into x (and x2) are
  // worked out once per block. Plain loads: a tap's neighbours hit L1, and a program's wait
  // for the previous stage is an acquire, which leaves no stale line in it.
  // Beyond 32 loads a thread (16 at NT >= 16, beside more accumulators), registers spill
  // (ptxas -v). With the weights in the shared-memory ring (kBulk) the registers that held
  // them take twice as many, so that a ring block's longer slice stages in fewer round trips,
  // each of which waits behind the ring's copies.
  constexpr int kLoads = (kBulk ? 2 : 1) * (NT >= 16 ? 16 : 32);
  constexpr int kColumns = kLoads >= NT ? kLoads / NT : 1;
  __shared__ int64_t position_offset[2][NT];
  __shared__ int position_start[NT];
  if (threadIdx.x < NT) {
    const int n = n0 + threadIdx.x;
    const int b = n / a.lout, l = n - b * a.lout;
    position_offset[0][threadIdx.x] = b * a.x_sb;
    position_offset[1][threadIdx.x] = b * a.x2_sb;
    // Past the last position: an input index no tap reaches, so the column reads zeros.
    position_start[threadIdx.x] = n < a.positions ? l * a.stride - a.pad : -(a.ksize + a.lin);
  }
  __syncthreads();
  const int len = e_end - e_begin;
  for (int el0 = threadIdx.x; el0 < len; el0 += kColumns * kThreads) {
    float v[kColumns][NT];
#pragma unroll
    for (int j = 0; j < kColumns; ++j) {
      const int el = el0 + j * kThreads;
      if (el >= len) break;
      const int e = e_begin + el;
      const int c = e / a.ksize, k = e - c * a.ksize;
      const bool second = c >= a.x_split;
      const T* column = second ? static_cast<const T*>(a.x2) + (c - a.x_split) * a.x2_sc
                               : static_cast<const T*>(a.x) + c * a.x_sc;
      const int64_t* offset = position_offset[second];
      const int64_t sl = second ? a.x2_sl : a.x_sl;
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        const int pos = position_start[n] + k;
        v[j][n] = pos >= 0 && pos < a.lin ? static_cast<float>(column[offset[n] + pos * sl]) : 0.f;
      }
    }
#pragma unroll
    for (int j = 0; j < kColumns; ++j) {
      const int el = el0 + j * kThreads;
      if (el >= len) break;
      const int slot = staged_position<EPL>(el);
#pragma unroll
      for (int n = 0; n < NT; ++n) staged[n * a.split_len + slot] = v[j][n];
    }
  }
  __syncthreads();
  trace_event(a, kTraceStaged);

#pragma unroll
  for (int i = 0; i < R * NT; ++i) acc[i] = 0.f;
  // A lane's EPL weights of a row in groups of (at most) 4, one 16-byte staged load per
  // position each: only a group's weights are held as floats at a time (R x 4, whatever the
  // dtype), and each accumulator still adds its weights in order.
  const auto accumulate = [&](const Pack<T, EPL> (&wp)[R], int chunk) {
    constexpr int kGroup = EPL < 4 ? EPL : 4;
    const float* xs = staged + chunk * kChunk + lane * kGroup;
#pragma unroll
    for (int q = 0; q < EPL / kGroup; ++q) {
      float wf[R][kGroup];
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int v = 0; v < kGroup; ++v) wf[r][v] = weight_float(wp[r], q * kGroup + v);
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        float xv[kGroup];
        if constexpr (kGroup == 4) {
          const float4 x4 = *reinterpret_cast<const float4*>(xs + n * a.split_len + q * 128);
          xv[0] = x4.x;
          xv[1] = x4.y;
          xv[2] = x4.z;
          xv[3] = x4.w;
        } else {
#pragma unroll
          for (int v = 0; v < kGroup; ++v) xv[v] = xs[n * a.split_len + v];
        }
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
          for (int v = 0; v < kGroup; ++v) acc[r * NT + n] = fmaf(wf[r][v], xv[v], acc[r * NT + n]);
      }
    }
  };
  if constexpr (kBulk) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (warp_rows > 0) {
      // The stage and its barrier's phase parity counted along: chunk % stages and
      // chunk / stages were an integer division a chunk (Nsight Compute's stall sampling).
      int stage = 0;
      uint32_t parity = 0;
      for (int chunk = 0; chunk < chunks; ++chunk) {
        mbarrier_wait(&stage_filled[warp][stage], parity);
        if (e_begin + chunk * kChunk + lane * EPL < e_end) {
          Pack<T, EPL> wp[R];
#pragma unroll
          for (int r = 0; r < R; ++r)
            wp[r] = *reinterpret_cast<const Pack<T, EPL>*>(ring + (stage * R + r) * kChunk + lane * EPL);
          accumulate(wp, chunk);
        }
        if (chunk + stages < chunks) {
          // Every lane has used its reads of the stage: order them before the copy engine's
          // (the async proxy's) writes into it.
          asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
          __syncwarp();
          fill_stage(stage, chunk + stages);
        }
        if (++stage == stages) stage = 0, parity ^= 1;
      }
    }
#endif
  } else {
    for (int chunk0 = 0; chunk0 < chunks; chunk0 += DEPTH) {
#pragma unroll
      for (int d = 0; d < DEPTH; ++d) {
        const int chunk = chunk0 + d;
        if (chunk < chunks && e_begin + chunk * kChunk + lane * EPL < e_end) accumulate(w[d], chunk);
        load_chunk(d, chunk + DEPTH);
      }
    }
  }

  trace_event(a, kTraceComputed);
  base = 0;
  transpose_reduce<R * NT, 16>(acc, lane, base);
}

// Calls put(row offset in the tile, position offset in the tile, sum) for each sum of
// stream_conv_sums' that this lane writes. With fewer than 32 sums, the trailing butterfly
// stages leave copies on lanes that differ only in their low bits; the lane with those bits
// clear writes.
template <int NT, int R, typename Put>
__device__ __forceinline__ void put_owned_sums(const float (&acc)[R * NT], int base, const Put& put) {
  constexpr int kOwned = R * NT >= 32 ? R * NT / 32 : 1;
  constexpr int kCopies = R * NT >= 32 ? 1 : 32 / (R * NT);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane % kCopies == 0) {
#pragma unroll
    for (int j = 0; j < kOwned; ++j) put(warp * R + (base + j) / NT, (base + j) % NT, acc[j]);
  }
}

// A split-K block: its sums go to the workspace, and the last block of an output tile
// finishes it (arrive_and_finish).
template <typename T, int NT, int R, int EPL, int DEPTH = stream_depth<T>(), typename Wait>
__device__ __forceinline__ void stream_conv_tile(const StreamArgs& a, int tile, int split,
                                                 int n_tile, const Wait& wait) {
  const int tile_lo = tile * kWarps * R, row_hi = min(tile_lo + kWarps * R, a.m);
  const int n0 = n_tile * NT;
  float acc[R * NT];
  int base;
  stream_conv_sums<T, NT, R, EPL, DEPTH, false>(a, tile_lo, row_hi, split, n0, wait, acc, base);
  put_owned_sums<NT, R>(acc, base, [&](int r, int n, float v) {
    if (tile_lo + r < row_hi) a.ws[(static_cast<int64_t>(split) * a.m + tile_lo + r) * a.nt + n0 + n] = v;
  });
  extern __shared__ float4 shared_f4[];
  arrive_and_finish<T, false>(a, tile_lo, row_hi, reinterpret_cast<float*>(shared_f4), NT * a.split_len);
}

// A kernel of its own waits for the kernel before it (programmatic dependent launch).
struct WaitForProducer {
  __device__ void operator()() const { wait_for_producer(); }
};

template <typename T, int NT, int R, int EPL>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm) stream_conv_kernel(const StreamArgs a) {
  stream_conv_tile<T, NT, R, EPL>(a, blockIdx.x, blockIdx.y, blockIdx.z, WaitForProducer{});
}

// Two convs of the same input in one launch, so that the second costs no launch, no input
// round trip and no finishing pass of its own: a residual block's first conv and its 1x1
// shortcut. Row tiles [0, a_tiles) are a's, the rest b's; each problem has its own
// reduction split (gridDim.y covers the larger), workspace and counters. The block's
// problem is copied to shared memory so that the body is compiled once: two inlined copies
// double the code each launch must fetch into a cold instruction cache.
template <typename T, int NT, int R, int EPL>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    stream_conv_pair_kernel(const StreamArgs a, const StreamArgs b, int a_tiles) {
  __shared__ StreamArgs problem;
  const bool first = blockIdx.x < a_tiles;
  if (blockIdx.y >= (first ? a.splits : b.splits)) return;
  copy_args(problem, first ? a : b);
  stream_conv_tile<T, NT, R, EPL>(problem, first ? blockIdx.x : blockIdx.x - a_tiles, blockIdx.y,
                                  blockIdx.z, WaitForProducer{});
}

// ---------------------------------------------------------------------------------------
// GroupNorm convs in thread-block clusters (Hopper). A cluster of row_tiles x splits blocks
// owns one GroupNorm group: cluster rank tile * splits + split streams its rows over its
// reduction slice as above. Each block owns a share of the group's outputs; the blocks push
// their sums straight into the owners' shared memory (st.async, counted by an mbarrier's
// transaction bytes), the owners add up the splits, push their share's moments to every
// block the same way, and each block merges them and applies the epilogue to its share:
// no workspace, counters, finishing block or cluster-wide barrier on the way, each exchange
// one one-way trip. (The finishing block's dependent global round trips cost 5-7 µs per
// layer beyond streaming: BENCHMARKS.md.)
constexpr int kMaxClusterBlocks = 16;  // Hopper's largest cluster (non-portable size)


// Waits for the previous kernel (FiLM and the residual may come from it), then prefetches a
// thread's epilogue inputs and bias into L1, to be loaded once its sums are pushed. Loading
// them here would hold them in registers through the staging and streaming, and in half
// precision their conversions (or, where registers run short, their spills) make the thread
// wait for the loads before it stages its input (bf16 blocks' waits ended up to 0.5 µs later
// than fp32's: BENCHMARKS.md).
template <typename T>
struct WaitThenPrefetchEpilogue {
  const StreamArgs& a;
  bool mine;
  int b, c, l;
  __device__ void operator()() const {
    wait_for_producer();
    if (mine) {
      Epilogue unused;
      for_each_epilogue_input(a, b, c, l, unused, [](float&, const void* base, int64_t i) {
        prefetch_to_l1<T>(base, i);
      });
      if (a.bias) prefetch_to_l1<T>(a.bias, c);
    }
  }
};

// Output unit `unit` of a (a GroupNorm group; for a plain conv, a.unit_rows rows without the
// statistics) by this block's cluster.
template <typename T, int NT, int R, int EPL, bool kBulk>
__device__ __forceinline__ void cluster_conv_unit(const StreamArgs& a, int unit) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int kTileRows = kWarps * R;
  static_assert(kTileRows * NT <= kThreads, "a block's share of a group is one element per thread");
  static_assert(kMaxClusterBlocks <= 32, "a lane per block of the cluster");
  // A block's share is at most ceil(tile rows / splits) rows, so its splits' sums fit here.
  __shared__ float received_sums[(kTileRows + kMaxClusterBlocks) * NT];  // [split][element]
  __shared__ float share_values[kTileRows * NT];
  __shared__ float4 received_moments[NT][kMaxClusterBlocks];  // [batch row][block]: (n, mean, M2)
  __shared__ float2 stats[NT];                                 // per batch row: (mean, rstd)
  __shared__ uint64_t sums_arrived, moments_arrived;
  const cg::cluster_group cluster = cg::this_cluster();
  const int size = static_cast<int>(cluster.num_blocks());
  const int rank = static_cast<int>(cluster.block_rank());
  const int group_lo = unit * a.unit_rows;
  const int unit_len = min(a.unit_rows, a.m - group_lo);  // a plain conv's last unit may be short
  const int tile_lo = group_lo + rank / a.splits * kTileRows;
  const int row_hi = min(tile_lo + kTileRows, group_lo + unit_len);
  // Block q's share of the group's outputs: rows [q * share, ...) of it at every position,
  // one element per thread, batch row major (each row's elements contiguous).
  const int share = (unit_len + size - 1) / size;
  const int L = a.lout;
  const auto share_rows = [&](int q) { return max(0, min(share, unit_len - q * share)); };
  const int per_batch = share_rows(rank) * L, count = per_batch * a.batch;
  const bool mine = static_cast<int>(threadIdx.x) < count;
  const int b = mine ? threadIdx.x / per_batch : 0;
  const int row = rank * share + (mine ? threadIdx.x % per_batch / L : 0), l = threadIdx.x % L;
  const int c = group_lo + row;
  if (threadIdx.x == 0) {
    mbarrier_init(&sums_arrived);
    mbarrier_init(&moments_arrived);
    mbarrier_expect_bytes(&sums_arrived, a.splits * count * sizeof(float));
    if (a.groups > 0) mbarrier_expect_bytes(&moments_arrived, size * a.batch * sizeof(float4));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  cluster.barrier_arrive();  // waited for before the first push: every barrier is set up

  float acc[R * NT];
  int base;
  stream_conv_sums<T, NT, R, EPL, stream_depth<T>(), kBulk>(
      a, tile_lo, row_hi, rank % a.splits, 0, WaitThenPrefetchEpilogue<T>{a, mine, b, c, l}, acc, base);
  cluster.barrier_wait();
  const int split = rank % a.splits;
  put_owned_sums<NT, R>(acc, base, [&](int r, int n, float sum) {
    if (tile_lo + r >= row_hi || n >= a.positions) return;
    const int group_row = tile_lo - group_lo + r, owner = group_row / share;
    const int owner_per_batch = share_rows(owner) * L;
    const int element = n / L * owner_per_batch + (group_row - owner * share) * L + n % L;
    push(in_block(shared_address(received_sums + split * owner_per_batch * a.batch + element), owner), sum,
         in_block(shared_address(&sums_arrived), owner));
  });
  // The loads' round trip overlaps the wait for the other blocks' sums.
  Epilogue e{};
  float v = 0.f;
  if (mine) {
    e = load_epilogue<T>(a, b, c, l);
    v = a.bias ? load_float<T>(a.bias, c) : 0.f;
  }
  mbarrier_wait(&sums_arrived, 0);
  trace_event(a, kTraceArrived);

  if (mine) {
    // In split order from the bias, as the split-K kernels add them (deterministic).
    for (int s = 0; s < a.splits; ++s) v += received_sums[s * count + threadIdx.x];
    share_values[threadIdx.x] = v;
  }
  if (a.groups == 0) {
    if (mine) store_output<T>(a, b, c, l, apply_epilogue(e, v));
    trace_event(a, kTraceFinished);
    return;
  }
  __syncthreads();
  trace_event(a, kTraceSummed);
  // Two-pass moments of the share, a warp per batch row; butterfly sums leave them on every
  // lane, and lane q pushes them to block q.
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int rb = warp; rb < a.batch; rb += kWarps) {
    const float* values = share_values + rb * per_batch;
    float sum = 0.f;
    for (int j = lane; j < per_batch; j += 32) sum += values[j];
    const float mean = per_batch > 0 ? warp_sum(sum) / per_batch : 0.f;
    float m2 = 0.f;
    for (int j = lane; j < per_batch; j += 32) m2 += (values[j] - mean) * (values[j] - mean);
    m2 = warp_sum(m2);
    if (lane < size) {
      push(in_block(shared_address(&received_moments[rb][rank]), lane),
           make_float4(static_cast<float>(per_batch), mean, m2, 0.f),
           in_block(shared_address(&moments_arrived), lane));
    }
  }
  trace_event(a, kTraceFinishing);
  mbarrier_wait(&moments_arrived, 0);
  // The group's moments, merged with the parallel form of Chan et al.'s update (no chain of
  // divisions). Butterfly sums leave the same bits on every lane of every block: every block
  // gets the same statistics.
  for (int rb = warp; rb < a.batch; rb += kWarps) {
    const float4 m = lane < size ? received_moments[rb][lane] : float4{};
    const float n = warp_sum(m.x);
    const float mean = warp_sum(m.x * m.y) / n;
    const float m2 = warp_sum(m.z + m.x * (m.y - mean) * (m.y - mean));
    if (lane == 0) stats[rb] = make_float2(mean, rsqrtf(m2 / n + a.eps));
  }
  __syncthreads();
  trace_event(a, kTraceNormalized);
  if (mine) {
    const float2 st = stats[b];
    store_output<T>(a, b, c, l, apply_epilogue(e, mish((v - st.x) * st.y * e.gamma + e.beta)));
  }
  // No block leaves before every push into its shared memory has arrived (both waits), and
  // none pushes after that: no barrier before leaving.
  trace_event(a, kTraceFinished);
#endif
}

template <typename T, int NT, int R, int EPL, bool kBulk>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    stream_conv_cluster_kernel(const StreamArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cluster_conv_unit<T, NT, R, EPL, kBulk>(a, blockIdx.x / cg::this_cluster().num_blocks());
#endif
}

// A residual block's first conv (GroupNorm, a's units: its groups) and its 1x1 shortcut (b,
// plain units) in one cluster launch, as stream_conv_pair_kernel pairs them on split-K
// blocks: the shortcut's rows take clusters of their own, finished without a finishing block.
template <typename T, int NT, int R, int EPL, bool kBulk>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    stream_conv_cluster_pair_kernel(const StreamArgs a, const StreamArgs b, int a_units) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __shared__ StreamArgs problem;
  const int unit = blockIdx.x / cg::this_cluster().num_blocks();
  const bool first = unit < a_units;
  copy_args(problem, first ? a : b);
  cluster_conv_unit<T, NT, R, EPL, kBulk>(problem, first ? unit : unit - a_units);
#endif
}

// ---------------------------------------------------------------------------------------
// ConvTranspose1d layout: the GEMM Y[(c_out, k)][(b, j)] = sum_ci W[ci][(c_out, k)] x[b, ci, j]
// streams W's rows whole: block = (32 * EPL columns, a slice of input channels); lane owns
// EPL consecutive columns, warps take every kWarps-th input channel of the slice and are
// summed in shared memory at the end. The finishing block folds taps into positions.
//
// Streams the columns of tile `tile` over input-channel slice `split` at positions n0..
// n0 + NT - 1 and leaves their sums in warp 0's acc (EPL columns x NT positions a lane, from
// column tile * 32 * EPL + lane * EPL). Returns whether the lane's columns exist.
template <typename T, int NT, int EPL, typename Wait>
__device__ __forceinline__ bool stream_transposed_sums(const StreamArgs& a, int tile, int split, int n0,
                                                       const Wait& wait, float (&acc)[EPL * NT]) {
  extern __shared__ float4 shared_f4[];
  float* shared = reinterpret_cast<float*>(shared_f4);
  constexpr int V = EPL * NT;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int col = tile * 32 * EPL + lane * EPL;
  const bool active = col < a.m;  // m % EPL == 0: a lane's columns are all in or all out
  const int c_begin = split * a.split_len;
  const int c_end = min(c_begin + a.split_len, a.red);
  const int rows = max(0, (c_end - c_begin - warp + kWarps - 1) / kWarps);
  const T* weight = static_cast<const T*>(a.weight);
  trace_event(a, kTraceStart);

  const uint64_t policy = weight_policy(a.weights_evict_first);
  Pack<T, EPL> w[kDepthTransposed];
  const auto load_row = [&](int d, int i) {
    if (active && i < rows)
      w[d] = load_stream<T, EPL>(weight + static_cast<int64_t>(c_begin + warp + kWarps * i) * a.m + col,
                                 policy);
  };
#pragma unroll
  for (int d = 0; d < kDepthTransposed; ++d) load_row(d, d);
  allow_dependents();
  wait();
  trace_event(a, kTraceWaited);

  // Stage x[b, ci, j] for the block's input channels at n = b * L_in + j: one channel per
  // thread at a time, all NT positions' loads in flight together.
  float* staged = shared;  // [split_len][NT]
  const T* x = static_cast<const T*>(a.x);
  for (int c = threadIdx.x; c < c_end - c_begin; c += kThreads) {
    const T* channel = x + (c_begin + c) * a.x_sc;
    float v[NT];
#pragma unroll
    for (int q = 0; q < NT; ++q) {
      const int n = n0 + q, b = n / a.lin, j = n - b * a.lin;
      v[q] = n < a.positions ? static_cast<float>(channel[b * a.x_sb + j * a.x_sl]) : 0.f;
    }
#pragma unroll
    for (int q = 0; q < NT; ++q) staged[c * NT + q] = v[q];
  }
  __syncthreads();
  trace_event(a, kTraceStaged);

#pragma unroll
  for (int i = 0; i < V; ++i) acc[i] = 0.f;
  for (int i0 = 0; i0 < rows; i0 += kDepthTransposed) {
#pragma unroll
    for (int d = 0; d < kDepthTransposed; ++d) {
      const int i = i0 + d;
      if (active && i < rows) {
        const float* xs = staged + (warp + kWarps * i) * NT;
#pragma unroll
        for (int n4 = 0; n4 < NT; n4 += 4) {
          const float4 x4 = *reinterpret_cast<const float4*>(xs + n4);
          const float xv[4] = {x4.x, x4.y, x4.z, x4.w};
#pragma unroll
          for (int v = 0; v < EPL; ++v) {
            const float wv = weight_float(w[d], v);
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[v * NT + n4 + q] = fmaf(wv, xv[q], acc[v * NT + n4 + q]);
          }
        }
      }
      load_row(d, i + kDepthTransposed);
    }
  }

  trace_event(a, kTraceComputed);
  // Sum the warps (a tree through shared memory, laid out [value][warp][lane]).
  float* partial = shared;
  for (int half = kWarps / 2; half >= 1; half /= 2) {
    __syncthreads();
    if (warp >= half && warp < 2 * half) {
#pragma unroll
      for (int j = 0; j < V; ++j) partial[(j * half + warp - half) * 32 + lane] = acc[j];
    }
    __syncthreads();
    if (warp < half) {
#pragma unroll
      for (int j = 0; j < V; ++j) acc[j] += partial[(j * half + warp) * 32 + lane];
    }
  }
  return active;
}

template <typename T, int NT, int EPL, typename Wait>
__device__ __forceinline__ void stream_transposed_tile(const StreamArgs& a, int tile, int split,
                                                       int n_tile, const Wait& wait) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int tile_lo = tile * 32 * EPL, col = tile_lo + lane * EPL, n0 = n_tile * NT;
  float acc[EPL * NT];
  const bool active = stream_transposed_sums<T, NT, EPL>(a, tile, split, n0, wait, acc);
  // A lane's sums are EPL rows of NT consecutive positions (nt is a multiple of NT): 16-byte
  // stores, a quarter of the scattered 4-byte ones.
  static_assert(NT % 4 == 0, "position tiles are multiples of 4");
  if (warp == 0 && active) {
    float* sums = a.ws + (static_cast<int64_t>(split) * a.m + col) * a.nt + n0;
#pragma unroll
    for (int v = 0; v < EPL; ++v)
#pragma unroll
      for (int n = 0; n < NT; n += 4)
        *reinterpret_cast<float4*>(sums + v * a.nt + n) =
            make_float4(acc[v * NT + n], acc[v * NT + n + 1], acc[v * NT + n + 2], acc[v * NT + n + 3]);
  }
  arrive_and_finish<T, true>(a, tile_lo, min(tile_lo + 32 * EPL, a.m), nullptr, 0);
}

template <typename T, int NT, int EPL>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    stream_conv_transposed_kernel(const StreamArgs a) {
  stream_transposed_tile<T, NT, EPL>(a, blockIdx.x, blockIdx.y, blockIdx.z, WaitForProducer{});
}

// ConvTranspose1d in thread-block clusters (Hopper): a cluster of K / EPL column tiles x
// a.splits blocks owns a unit of 32 output channels (all K taps of each: 32 * K GEMM
// columns). Block rank tile * splits + split streams its tile over its slice of input
// channels as above and pushes warp 0's sums to the blocks that own them (block q: the
// unit's channels [q * share, ...)); each owner adds up the splits in order, folds the taps
// into positions and stores. No workspace, counters or finishing block: the split-K kernel's
// finishing block, an L2 round trip per tap of each of its outputs, made the U-Nets'
// upsampling 12-15 µs a launch (BENCHMARKS.md).
template <typename T, int NT, int EPL>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    stream_transposed_cluster_kernel(const StreamArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __shared__ uint64_t sums_arrived;
  const cg::cluster_group cluster = cg::this_cluster();
  const int size = static_cast<int>(cluster.num_blocks());
  const int rank = static_cast<int>(cluster.block_rank());
  const int K = a.ksize, tiles = K / EPL;
  const int unit = blockIdx.x / size;
  const int c_lo = unit * 32, channels = min(32, a.cout - c_lo);
  const int share = (channels + size - 1) / size;
  const auto share_channels = [&](int q) { return max(0, min(share, channels - q * share)); };
  const int mine = share_channels(rank);
  // [split][own channel][tap][position], past the staged input and the warps' tree.
  extern __shared__ float4 shared_f4[];
  float* received = reinterpret_cast<float*>(shared_f4) + max(a.split_len * NT, kWarps / 2 * 32 * EPL * NT);
  if (threadIdx.x == 0) {
    mbarrier_init(&sums_arrived);
    mbarrier_expect_bytes(&sums_arrived, a.splits * mine * K * NT * sizeof(float));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  cluster.barrier_arrive();  // waited for before the first push: every barrier is set up

  const int tile = unit * tiles + rank / a.splits, split = rank % a.splits;
  float acc[EPL * NT];
  const bool active = stream_transposed_sums<T, NT, EPL>(a, tile, split, 0, WaitForProducer{}, acc);
  cluster.barrier_wait();
  if (threadIdx.x < 32 && active) {
    // EPL | K: a lane's columns are taps k0.. of one channel.
    const int col = tile * 32 * EPL + threadIdx.x * EPL;
    const int c = col / K - c_lo, k0 = col % K;
    const int owner = c / share, owned = share_channels(owner);
    const uint32_t bar = in_block(shared_address(&sums_arrived), owner);
    static_assert(NT % 4 == 0, "position tiles are multiples of 4");
#pragma unroll
    for (int v = 0; v < EPL; ++v) {
      const float* row = received + ((split * owned + c - owner * share) * K + k0 + v) * NT;
#pragma unroll
      for (int n = 0; n < NT; n += 4)
        push(in_block(shared_address(row + n), owner),
             make_float4(acc[v * NT + n], acc[v * NT + n + 1], acc[v * NT + n + 2], acc[v * NT + n + 3]), bar);
    }
  }
  mbarrier_wait(&sums_arrived, 0);
  trace_event(a, kTraceArrived);
  // Output (c, b, l) gathers tap k from input position j where l + pad - k = j * stride, the
  // taps in order and each tap's splits in order, as the split-K kernel's finishing block.
  const int per_channel = a.batch * a.lout;
  for (int i = threadIdx.x; i < mine * per_channel; i += kThreads) {
    const int own = i / per_channel, r = i % per_channel, b = r / a.lout, l = r % a.lout;
    const int c = c_lo + rank * share + own;
    float v = a.bias ? load_float<T>(a.bias, c) : 0.f;
    for (int k = 0; k < K; ++k) {
      const int t = l + a.pad - k;
      if (t < 0 || t % a.stride != 0 || t / a.stride >= a.lin) continue;
      const float* sums = received + (own * K + k) * NT + b * a.lin + t / a.stride;
      for (int s = 0; s < a.splits; ++s) v += sums[s * mine * K * NT];
    }
    store_output<T>(a, b, c, l, apply_epilogue(load_epilogue<T>(a, b, c, l), v));
  }
  // No block leaves before every push into its shared memory has arrived, and none pushes
  // after that: no barrier before leaving.
  trace_event(a, kTraceFinished);
#endif
}

// ---------------------------------------------------------------------------------------
// A program: a sequence of the streaming convs above (a whole U-Net forward) in one
// persistent launch of one block per wave slot. Each stage is a launch's worth of work
// units (blockIdx values); a block takes units blockIdx.x, + gridDim.x, ... of every stage in
// turn, issues a unit's weight loads at once and only then waits until the previous stage
// has finished all its output tiles (a counter its finishing blocks increment), so the
// launch, the kernel boundary and the cold code of ~30 launches per forward are paid once.

struct ProgramStage {
  StreamArgs a, b;  // b: a second problem sharing the stage (a residual block's shortcut)
  int kind;         // which instantiation runs it: program_kind()
  int a_tiles;      // row tiles of a; b's tiles follow (all of them a's when b is unused)
  int grid_x, grid_y, grid_z;
  int units;        // output tiles the stage finishes, a's and b's: the next stage waits for them
};

// Programs take the position tiles of small batches (NT 4, 8, 16: batch x length < 32, the
// streaming route) in either weight layout, with or without 16-byte weight loads.
constexpr int kProgramTileCount = 3;
__host__ __device__ constexpr int program_kind(bool transposed, int nt_index, bool vectorised) {
  return (transposed ? 2 * kProgramTileCount : 0) + nt_index * 2 + (vectorised ? 1 : 0);
}

__device__ __forceinline__ int load_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ int load_relaxed(const int* p) {
  int v;
  asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Waits until `*count` reaches `target` (no wait for the first stage: the launch is ordered
// after the kernels that wrote its inputs). `relaxed`: poll without acquire semantics, with
// a back-off, and fence once it is reached.
struct WaitForStage {
  const int* count;
  int target;
  bool relaxed;
  __device__ void operator()() const {
    if (count != nullptr && threadIdx.x == 0) {
      if (relaxed) {
        while (load_relaxed(count) < target) __nanosleep(32);
        asm volatile("fence.acq_rel.gpu;" ::: "memory");
      } else {
        while (load_acquire(count) < target) {
        }
      }
    }
    __syncthreads();
  }
};

// One call per instantiation, not inlined: each is then register-allocated on its own, as
// in its own kernel (inlined into one function, ptxas allocates the twelve bodies together
// and spills ~2 KB per thread). A call's ABI leaves fewer registers than a kernel has, so the
// conv body keeps kProgramDepth weight requests in flight instead of stream_depth<T>().
constexpr int kProgramDepth = 2;

template <typename T, int NT, int R, int EPL>
__device__ __noinline__ void program_conv_unit(const StreamArgs& a, int tile, int split, int n_tile,
                                               WaitForStage wait) {
  stream_conv_tile<T, NT, R, EPL, kProgramDepth>(a, tile, split, n_tile, wait);
}

template <typename T, int NT, int EPL>
__device__ __noinline__ void program_transposed_unit(const StreamArgs& a, int tile, int split,
                                                     int n_tile, WaitForStage wait) {
  stream_transposed_tile<T, NT, EPL>(a, tile, split, n_tile, wait);
}

template <typename T>
__device__ __forceinline__ void run_program_unit(int kind, const StreamArgs& a, int tile, int split,
                                                 int n_tile, const WaitForStage& wait) {
  constexpr int kVec = 16 / sizeof(T);
  switch (kind) {
#define DPA_PROGRAM_CONV(I, NT)                                                                     \
  case program_kind(false, I, false):                                                              \
    return program_conv_unit<T, NT, conv_rows<NT>(), 1>(a, tile, split, n_tile, wait);             \
  case program_kind(false, I, true):                                                               \
    return program_conv_unit<T, NT, conv_rows<NT>(), kVec>(a, tile, split, n_tile, wait);          \
  case program_kind(true, I, false):                                                               \
    return program_transposed_unit<T, NT, 1>(a, tile, split, n_tile, wait);                        \
  case program_kind(true, I, true):                                                                \
    return program_transposed_unit<T, NT, transposed_vector<T, NT>()>(a, tile, split, n_tile, wait);
    DPA_PROGRAM_CONV(0, 4)
    DPA_PROGRAM_CONV(1, 8)
    DPA_PROGRAM_CONV(2, 16)
#undef DPA_PROGRAM_CONV
  }
}

// done[s]: stage s's finished output tiles; done[num_stages] counts blocks leaving, so that
// the last one can put every count back to zero for the next launch.
template <typename T>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    program_kernel(const ProgramStage* stages, int num_stages, int* done, int options) {
  __shared__ StreamArgs problem;
  for (int s = 0; s < num_stages; ++s) {
    const ProgramStage& stage = stages[s];
    const int gx = stage.grid_x, gxy = gx * stage.grid_y, blocks = gxy * stage.grid_z;
    const WaitForStage wait{s > 0 ? done + s - 1 : nullptr, s > 0 ? stages[s - 1].units : 0,
                            (options & kProgramRelaxedPoll) != 0};
    for (int block = blockIdx.x; block < blocks; block += gridDim.x) {
      const int x = block % gx, y = block % gxy / gx, z = block / gxy;
      const bool first = x < stage.a_tiles;
      const StreamArgs& source = first ? stage.a : stage.b;
      if (y >= source.splits) continue;
      __syncthreads();  // the previous block's work has finished reading `problem`
      copy_args(problem, source);
      run_program_unit<T>(stage.kind, problem, first ? x : x - stage.a_tiles, y, z, wait);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(done + num_stages, 1) == static_cast<int>(gridDim.x) - 1) {
      for (int s = 0; s <= num_stages; ++s) done[s] = 0;
    }
  }
}

// GroupNorm -> Mish -> FiLM -> residual after a cuBLAS conv, one block per (batch, group).
// pre(c, b * L + l): the pre-activations, read from the GEMM's result (GemmPre,
// TapRowsPre). A group of up to
// kHeldPerThread * kThreads elements (every U-Net group of horizon 16) is read once into
// registers, with its epilogue inputs, and both statistics passes run on the registers: the
// two re-reads of normalize_group were dependent L2 round trips, on a kernel that is all
// latency (~6 µs a launch at batch 64, BENCHMARKS.md). Few enough held that a batch 64
// U-Net's blocks are resident at once. Same summation order as normalize_group, so the same
// bits.
constexpr int kHeldPerThread = 4;

// What residual_block changes in the GroupNorm epilogue on the GEMM route. residual_pre: the
// residual is a 1x1 shortcut's GEMM result [C_out, positions] (plus residual_bias), rounded
// to T as the separate ops store the shortcut's output. cols: the output is written as the
// next conv's im2col columns, transposed: cols[b * L + l][c * taps + k] =
// out[b, c, l + k - taps / 2] (zeros outside), where an im2col launch would have read it;
// with taps 1 (a next conv whose taps are GEMM rows) that is the output channels-last.
// Transposed because a block holds one (batch row, group): in this layout its columns are L
// runs of cpg * taps consecutive elements, stored coalesced; in im2col's
// [c * taps + k][positions] they were runs of L, and those scattered stores cost more than
// the im2col launches they replaced (BENCHMARKS.md).
// residual_rows: the residual (residual_block's input) stored channels-last, [B * L][C_out].
struct GemmEpilogueIo {
  const void* residual_pre;
  const void* residual_bias;
  void* cols;
  int taps;
  const void* residual_rows;
};

// Whether group_norm_epilogue_kernel holds a group in registers, which the GemmEpilogueIo
// options require.
bool group_held(int64_t channels_per_group, int64_t length) {
  return channels_per_group * length <= kHeldPerThread * kThreads;
}

template <typename T, typename Pre>
__device__ __forceinline__ void group_norm_epilogue(const StreamArgs& a, const Pre& pre, const GemmEpilogueIo& io) {
  __shared__ float scratch[kWarps];
  __shared__ float2 stats[1];
  __shared__ float staged[kHeldPerThread * kThreads];  // the group's outputs, for io.cols
  const int b = blockIdx.x / a.groups, g = blockIdx.x % a.groups;
  const int cpg = a.cout / a.groups, L = a.lout, count = cpg * L;
  const int64_t positions = static_cast<int64_t>(a.batch) * L;
  if (count > kHeldPerThread * kThreads) {
    return normalize_group<T>(a, pre, g * cpg, (g + 1) * cpg, b, b + 1, scratch, stats);
  }
  float v[kHeldPerThread];
  Epilogue e[kHeldPerThread];
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < kHeldPerThread; ++j) {
    const int i = threadIdx.x + j * kThreads, c = g * cpg + i / L, l = i % L;
    if (i < count) {
      v[j] = pre(c, b * L + l);
      e[j] = load_epilogue<T>(a, b, c, l);
      if (io.residual_pre) {
        float r = io.residual_bias ? load_float<T>(io.residual_bias, c) : 0.f;
        r += static_cast<float>(static_cast<const T*>(io.residual_pre)[c * positions + b * L + l]);
        e[j].residual = static_cast<float>(static_cast<T>(r));
      }
      if (io.residual_rows) {
        e[j].residual = load_float<T>(io.residual_rows, (static_cast<int64_t>(b) * L + l) * a.cout + c);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < kHeldPerThread; ++j)
    if (threadIdx.x + j * kThreads < count) s += v[j];
  const float mean = block_sum(s, scratch) / count;
  float sq = 0.f;
#pragma unroll
  for (int j = 0; j < kHeldPerThread; ++j) {
    if (threadIdx.x + j * kThreads < count) {
      const float d = v[j] - mean;
      sq += d * d;
    }
  }
  const float rstd = rsqrtf(block_sum(sq, scratch) / count + a.eps);
#pragma unroll
  for (int j = 0; j < kHeldPerThread; ++j) {
    const int i = threadIdx.x + j * kThreads;
    if (i >= count) continue;
    const float out = apply_epilogue(e[j], mish((v[j] - mean) * rstd * e[j].gamma + e[j].beta));
    if (io.cols) {
      staged[i] = out;
    } else {
      store_output<T>(a, b, g * cpg + i / L, i % L, out);
    }
  }
  if (!io.cols) return;
  __syncthreads();
  // Row l of the tile, element c * taps + k, is out[c, l + k - pad]. (c, k) of a thread's
  // next element advance by kThreads elements without a division.
  const int taps = io.taps, pad = taps / 2, width = cpg * taps;
  const int64_t row_stride = static_cast<int64_t>(a.cout) * taps;
  T* tile = static_cast<T*>(io.cols) + b * L * row_stride + g * width;
  const int c_step = kThreads / taps, k_step = kThreads % taps;
  for (int l = 0; l < L; ++l) {
    T* row = tile + l * row_stride;
    int c = threadIdx.x / taps, k = threadIdx.x % taps;
    for (int j = threadIdx.x; j < width; j += kThreads) {
      const int at = l + k - pad;
      row[j] = static_cast<T>(at >= 0 && at < L ? staged[c * L + at] : 0.f);
      c += c_step;
      k += k_step;
      if (k >= taps) {
        k -= taps;
        ++c;
      }
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    group_norm_epilogue_kernel(const StreamArgs a, const T* result, const GemmEpilogueIo io) {
  group_norm_epilogue<T>(a, GemmPre<T>{result, static_cast<int64_t>(a.batch) * a.lout, a.bias}, io);
}

// Here the functor is a kernel parameter: built in the kernel from a (as GemmPre is, which
// is faster so), a batch 64 half-precision step took ~2% longer on an H100.
template <typename T, int kTaps>
__global__ void __launch_bounds__(kThreads)
    tap_rows_group_norm_epilogue_kernel(const StreamArgs a, const TapRowsPre<T, kTaps> pre,
                                        const GemmEpilogueIo io) {
  group_norm_epilogue<T>(a, pre, io);
}

// What the rows of a GEMM-route conv's result are. kIm2col: output channels (the weight as
// [C_out, C_in * K] times im2col's columns), in x's dtype. kTapRows: (output channel, tap),
// c * K + k, over every input position, in fp32 (a taps-major Conv1d weight times x itself);
// kTransposed: the same for a transposed conv (its weight read transposed in place). Where
// taps are rows, each output adds up the taps that land on it (col2im), in tap order.
enum class GemmForm { kIm2col, kTapRows, kTransposed };

// The GEMM route's epilogue of a plain conv: the bias and the residual added to the GEMM's
// result (GemmForm), written as [B, C_out, L_out]. The host keeps every index below 2^31.
template <typename T, typename P>
__global__ void __launch_bounds__(kThreads) conv_epilogue_kernel(const StreamArgs a, const P* pre,
                                                                 GemmForm form) {
  const int i = blockIdx.x * kThreads + threadIdx.x;
  if (i >= a.batch * a.cout * a.lout) return;
  const int row = i / a.lout, o = i - row * a.lout, b = row / a.cout, c = row - b * a.cout;
  float v;
  if (form == GemmForm::kIm2col) {
    v = static_cast<float>(pre[c * a.positions + b * a.lout + o]);
  } else {
    v = sum_tap_rows<0>(pre, a.ksize, [&](int k) -> int64_t {
      int in;  // the input position whose tap k lands on output o
      if (form == GemmForm::kTapRows) {
        in = o * a.stride + k - a.pad;
      } else {
        const int t = o + a.pad - k;
        in = t >= 0 && t % a.stride == 0 ? t / a.stride : -1;
      }
      return in >= 0 && in < a.lin ? (c * a.ksize + k) * a.positions + b * a.lin + in : -1;
    });
  }
  if (a.bias) v += load_float<T>(a.bias, c);
  if (a.residual) v += load_float<T>(a.residual, i);
  static_cast<T*>(a.out)[i] = static_cast<T>(v);
}

// Which columns the GEMM route's im2col builds: cols[c * taps + k][b * length + l] =
// x[b, c, l * stride + k - pad], zeros outside x. A conv's are its taps at its output
// positions; a transposed conv's GEMM reads x itself, one column per input position.
struct Im2col {
  int taps, length, stride, pad;
};

// blockIdx.x picks positions, blockIdx.y rows, so that each element costs 32-bit arithmetic
// only: one 64-bit division per element made this kernel instruction-bound (~7 µs a launch
// at batch 64, BENCHMARKS.md). A thread's rows are loaded together, then stored: one round
// trip of latency for all of them. One launch, where ATen's pad, unfold and reshape took two
// copies.
constexpr int kIm2colRowsPerThread = 8;

// kSplit: channels from x_split on (a concatenation read in place) come from x2; a template
// argument because choosing per element cost this instruction-bound kernel about 1.5% of a
// batch 64 half-precision step (BENCHMARKS.md), convs without a concatenation included.
template <typename T, bool kSplit>
__global__ void __launch_bounds__(kThreads) im2col_kernel(const StreamArgs a, const Im2col cut,
                                                          int rows, T* __restrict__ cols) {
  const int positions = a.batch * cut.length;
  const int n = blockIdx.x * kThreads + threadIdx.x;
  if (n >= positions) return;
  const int b = n / cut.length, l = n - b * cut.length;
  const T* __restrict__ x_b = static_cast<const T*>(a.x) + b * a.x_sb;
  const T* __restrict__ x2_b = static_cast<const T*>(a.x2) + b * a.x2_sb;
  for (int row0 = blockIdx.y; row0 < rows; row0 += kIm2colRowsPerThread * gridDim.y) {
    T v[kIm2colRowsPerThread];
#pragma unroll
    for (int j = 0; j < kIm2colRowsPerThread; ++j) {
      const int row = row0 + j * gridDim.y;
      const int c = row / cut.taps, pos = l * cut.stride + row - c * cut.taps - cut.pad;
      const bool second = kSplit && c >= a.x_split;
      const T* column = second ? x2_b + (c - a.x_split) * a.x2_sc : x_b + c * a.x_sc;
      v[j] = row < rows && pos >= 0 && pos < a.lin ? column[pos * (second ? a.x2_sl : a.x_sl)]
                                                   : static_cast<T>(0.f);
    }
#pragma unroll
    for (int j = 0; j < kIm2colRowsPerThread; ++j) {
      const int row = row0 + j * gridDim.y;
      if (row < rows) cols[static_cast<int64_t>(row) * positions + n] = v[j];
    }
  }
}

// ---------------------------------------------------------------------------------------
// Host side.

int ceil_div(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

// Fills the fields every path shares.
StreamArgs common_args(const ConvProblem& p, const at::Tensor& x, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias, const at::Tensor& out,
                       const std::optional<at::Tensor>& residual) {
  StreamArgs a{};
  a.x = x.data_ptr();
  a.x_sb = x.stride(0);
  a.x_sc = x.stride(1);
  a.x_sl = x.stride(2);
  a.x_split = static_cast<int>(p.in_channels);
  a.weight = weight.data_ptr();
  a.weights_evict_first = weights_evict_first.load();
  a.bias = optional_data(bias);
  a.residual = optional_data(residual);
  a.out = out.defined() ? out.data_ptr() : nullptr;
  a.batch = static_cast<int>(p.batch);
  a.cout = static_cast<int>(p.out_channels);
  a.lin = static_cast<int>(p.in_length);
  a.lout = static_cast<int>(p.out_length);
  a.ksize = static_cast<int>(p.kernel_size);
  a.stride = static_cast<int>(p.stride);
  a.pad = static_cast<int>(p.padding);
  a.groups = static_cast<int>(p.groups);
  a.film_width = static_cast<int>(p.film_width);
  return a;
}

// A streaming launch, fully decided before the workspace is allocated. pair_kernel: the
// same instantiation serving two problems (Conv1d layout only).
struct StreamLaunch {
  void (*kernel)(StreamArgs);
  void (*pair_kernel)(StreamArgs, StreamArgs, int);
  dim3 grid;
  size_t shared_bytes;
  int program_kind;  // -1: a program cannot run this instantiation
  int cluster_blocks = 0;  // stream_conv_cluster_kernel's blocks per cluster (0: no clusters)
};

template <int NT>
int program_kind_of(bool transposed, bool vectorised) {
  constexpr int nt_index = NT == 4 ? 0 : NT == 8 ? 1 : NT == 16 ? 2 : -1;
  static_assert(nt_index < kProgramTileCount, "program tiles");
  return nt_index < 0 ? -1 : program_kind(transposed, nt_index, vectorised);
}

// What a launch of `kernel` must opt into: beyond 48 KB of static + dynamic shared memory,
// and clusters beyond the portable 8 blocks.
template <typename... Params>
void set_kernel_attributes(void (*kernel)(Params...), int cluster_blocks, size_t shared_bytes) {
  if (shared_bytes > 40 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(shared_bytes)));
  }
  if (cluster_blocks > 8) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  }
}

// Blocks in one wave: kBlocksPerSm on every SM. A second, partial wave would leave most SMs
// idle while it runs.
int wave_blocks() {
  return kBlocksPerSm * at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
}

// Sizes the split-K decomposition so that the problem runs on about `blocks` blocks: the
// reduction slice is a multiple of `granule` where it can be, and at most `max_split_len`
// (the shared memory's limit, which wins).
void plan_splits(StreamArgs& a, int m_tiles, int granule, int max_split_len, int blocks) {
  const int wanted = std::max(1, blocks / (m_tiles * a.n_tiles));
  const int len = ceil_div(ceil_div(a.red, wanted), granule) * granule;
  TORCH_INTERNAL_ASSERT(max_split_len >= 1, "no shared memory for a reduction slice");
  a.split_len = std::min(len, max_split_len);
  a.splits = ceil_div(a.red, a.split_len);
}

template <typename T, int NT>
StreamLaunch plan_conv(StreamArgs& a, bool vectorised, int blocks) {
  constexpr int kVec = 16 / sizeof(T);
  constexpr int R = conv_rows<NT>();
  const int granule = 32 * (vectorised ? kVec : 1);
  const int m_tiles = ceil_div(a.m, kWarps * R);
  plan_splits(a, m_tiles, granule, max_shared_bytes() / (NT * 4) / granule * granule, blocks);
  if (a.groups == 0) a.unit_rows = kWarps * R;
  return {vectorised ? stream_conv_kernel<T, NT, R, kVec> : stream_conv_kernel<T, NT, R, 1>,
          vectorised ? stream_conv_pair_kernel<T, NT, R, kVec> : stream_conv_pair_kernel<T, NT, R, 1>,
          dim3(m_tiles, a.splits, a.n_tiles), static_cast<size_t>(NT) * a.split_len * sizeof(float),
          program_kind_of<NT>(false, vectorised)};
}

// Whether `clusters` clusters of `cluster_blocks` blocks of `kernel` can all be resident at
// once (cached: the occupancy query is not free, and a U-Net asks about few shapes).
template <typename... Params>
bool clusters_fit(void (*kernel)(Params...), int cluster_blocks, size_t shared_bytes, int clusters) {
  static std::mutex mutex;
  static std::map<std::tuple<int, const void*, int, size_t>, int> resident;
  const int device = c10::cuda::current_device();
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_tuple(device, reinterpret_cast<const void*>(kernel), cluster_blocks, shared_bytes);
  auto found = resident.find(key);
  if (found == resident.end()) {
    set_kernel_attributes(kernel, cluster_blocks, shared_bytes);
    LaunchConfig launch(dim3(cluster_blocks * clusters), dim3(kThreads), shared_bytes);
    launch.clusters(cluster_blocks);
    int n = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&n, kernel, launch.get()));
    found = resident.emplace(key, n).first;
  }
  return found->second >= clusters;
}

// How a cluster streams one unit of a problem: row_tiles x splits blocks (row_tiles: set by
// the caller), each with a slice of split_len reduction elements staged in shared memory, its
// weights through registers or (bulk) through a ring of `stages` chunks per warp.
struct ClusterShape {
  int row_tiles, splits, split_len, stages;
  bool bulk;
  size_t shared_bytes;
};

// The shape of a unit of a.unit_rows rows whose reduction is split `splits` ways (fewer where
// whole granules cover it), or false where it does not fit in shared memory. `bulk`: the
// ring or registers, where the caller decides (a pair shares one kernel); `max_stages` caps
// the ring.
template <typename T, int NT>
bool cluster_shape(const StreamArgs& a, bool vectorised, int splits, std::optional<bool> bulk,
                   int max_stages, ClusterShape& shape) {
  constexpr int kVec = 16 / sizeof(T);
  constexpr int R = conv_rows<NT>();
  const int granule = 32 * (vectorised ? kVec : 1);
  shape.split_len = ceil_div(ceil_div(a.red, splits), granule) * granule;
  shape.splits = ceil_div(a.red, shape.split_len);
  // Within what two blocks per SM can each have, so that under programmatic dependent launch
  // the next kernel's block fits beside this one and requests its weights early.
  const size_t budget = max_shared_bytes();
  shape.shared_bytes = static_cast<size_t>(NT) * shape.split_len * sizeof(float);  // the staged input
  // Where a block's first stream_depth<T>() loads per lane and row cover its whole slice, the
  // weights come through registers. Longer slices stream through the shared-memory ring: with
  // one block per SM where split-K has two, registers alone would keep half the bytes in
  // flight, which on those slices cost more than the shorter finishing saves (BENCHMARKS.md).
  shape.bulk = bulk.value_or(shape.split_len > stream_depth<T>() * granule);
  shape.stages = 0;
  if (shape.bulk) {
    if (!vectorised) return false;  // bulk copies move 16-byte aligned runs
    const size_t stage_bytes = static_cast<size_t>(kWarps) * R * granule * sizeof(T);
    if (shape.shared_bytes < budget) {
      shape.stages = static_cast<int>(std::min<size_t>({static_cast<size_t>(ceil_div(shape.split_len, granule)),
                                                        static_cast<size_t>(max_stages),
                                                        (budget - shape.shared_bytes) / stage_bytes}));
    }
    if (shape.stages < 1) return false;
    shape.shared_bytes += shape.stages * stage_bytes;
  }
  return shape.shared_bytes <= budget;
}

void adopt(StreamArgs& a, const ClusterShape& shape) {
  a.split_len = shape.split_len;
  a.splits = shape.splits;
  a.ring_stages = shape.stages;
}

// Whether a streaming conv may run as thread-block clusters at all: one position tile (the
// kernels stage every position at once), the switch on (ops.set_clusters), a Hopper GPU.
bool clusters_usable(const StreamArgs& a) {
  return a.n_tiles == 1 && use_clusters.load() && at::cuda::getCurrentDeviceProperties()->major >= 9;
}

// A GroupNorm conv's cluster shape, if it has one: a group's row tiles times as many
// reduction splits as kMaxClusterBlocks allows.
template <typename T, int NT>
bool groupnorm_cluster_shape(const StreamArgs& a, bool vectorised, ClusterShape& shape) {
  if (a.groups == 0 || !clusters_usable(a)) return false;
  const int row_tiles = ceil_div(a.unit_rows, kWarps * conv_rows<NT>());
  if (row_tiles > kMaxClusterBlocks ||
      !cluster_shape<T, NT>(a, vectorised, kMaxClusterBlocks / row_tiles, std::nullopt, kMaxRingStages, shape)) {
    return false;
  }
  shape.row_tiles = row_tiles;
  // Past the ring's first fill no more in flight than registers keep: split-K does as well.
  if (shape.bulk && shape.stages < stream_depth<T>()) return false;
  // A one-block cluster has no distributed shared memory to push into (compute-sanitizer
  // flags it), and split-K with one split costs the same on such a small layer.
  return shape.row_tiles * shape.splits >= 2;
}

// The instantiation of a cluster kernel template for a shape.
#define DPA_CLUSTER_KERNEL(kernel, T, NT, shape, vectorised)                          \
  ((shape).bulk  ? kernel<T, NT, conv_rows<NT>(), 16 / sizeof(T), true>               \
   : (vectorised) ? kernel<T, NT, conv_rows<NT>(), 16 / sizeof(T), false>             \
                  : kernel<T, NT, conv_rows<NT>(), 1, false>)

// A plain conv's cluster shape, if it has one: one row tile per cluster, its reduction split
// as split-K would split it over the wave (plan_conv), in at most kMaxClusterBlocks ways.
template <typename T, int NT>
bool plain_cluster_shape(StreamArgs& a, bool vectorised, ClusterShape& shape) {
  constexpr int kTileRows = kWarps * conv_rows<NT>();
  if (a.groups != 0 || !clusters_usable(a)) return false;
  const int splits = std::clamp(wave_blocks() / ceil_div(a.m, kTileRows), 1, kMaxClusterBlocks);
  if (!cluster_shape<T, NT>(a, vectorised, splits, std::nullopt, kMaxRingStages, shape)) return false;
  shape.row_tiles = 1;
  if (shape.bulk && shape.stages < stream_depth<T>()) return false;
  a.unit_rows = kTileRows;
  return shape.splits >= 2;  // no distributed shared memory in a one-block cluster
}

// The cluster plan of a conv (stream_conv_cluster_kernel), if it has one: a GroupNorm conv's
// groups or a plain conv's row tiles, every unit's cluster resident at once (a second wave
// would double the time).
template <typename T, int NT>
bool plan_cluster(StreamArgs& a, bool vectorised, StreamLaunch& launch) {
  ClusterShape shape;
  if (!(a.groups > 0 ? groupnorm_cluster_shape<T, NT>(a, vectorised, shape)
                     : plain_cluster_shape<T, NT>(a, vectorised, shape))) {
    return false;
  }
  const auto kernel = DPA_CLUSTER_KERNEL(stream_conv_cluster_kernel, T, NT, shape, vectorised);
  const int size = shape.row_tiles * shape.splits;
  const int units = ceil_div(a.m, a.unit_rows);
  if (!clusters_fit(kernel, size, shape.shared_bytes, units)) return false;
  adopt(a, shape);
  launch = {kernel, nullptr, dim3(units * size), shape.shared_bytes, -1, size};
  return true;
}

// A conv1d_gn_mish_shortcut pair's cluster launch (stream_conv_cluster_pair_kernel).
struct ClusterPairLaunch {
  void (*kernel)(StreamArgs, StreamArgs, int) = nullptr;
  int a_units = 0, b_units = 0, cluster_blocks = 0;
  size_t shared_bytes = 0;
};

// The pair's cluster plan, if it has one: a's groups as plan_cluster has them; b's rows in
// units of clusters of the same size, its reduction split in as few ways as keep its slices
// no longer than a's (the longest slice sets the launch's time; fewer splits, more rows per
// cluster, fewer clusters) and as many row tiles as the cluster then holds (the ranks left
// over idle), and every cluster of both resident at once.
template <typename T, int NT>
ClusterPairLaunch plan_cluster_pair(StreamArgs& a, StreamArgs& b, bool vectorised) {
  ClusterShape sa, sb;
  if (!groupnorm_cluster_shape<T, NT>(a, vectorised, sa)) return {};
  const int size = sa.row_tiles * sa.splits;
  int splits = 1;
  while (splits <= size && !(cluster_shape<T, NT>(b, vectorised, splits, sa.bulk, sa.stages, sb) &&
                             sb.split_len <= sa.split_len)) {
    ++splits;
  }
  if (splits > size) return {};
  const int unit_rows = size / sb.splits * kWarps * conv_rows<NT>();
  ClusterPairLaunch launch;
  launch.kernel = DPA_CLUSTER_KERNEL(stream_conv_cluster_pair_kernel, T, NT, sa, vectorised);
  launch.a_units = a.groups;
  launch.b_units = ceil_div(b.m, unit_rows);
  launch.cluster_blocks = size;
  launch.shared_bytes = sa.shared_bytes;  // b's slice and ring are no larger
  if (!clusters_fit(launch.kernel, size, launch.shared_bytes, launch.a_units + launch.b_units)) return {};
  b.unit_rows = unit_rows;
  adopt(a, sa);
  adopt(b, sb);
  return launch;
}

template <typename T, int NT>
StreamLaunch plan_transposed(StreamArgs& a, bool vectorised) {
  constexpr int kVec = transposed_vector<T, NT>();
  const int epl = vectorised ? kVec : 1;
  const int m_tiles = ceil_div(a.m, 32 * epl);
  // At most 8 splits: the finishing block gathers every split of every tap of an output,
  // which costs more than fewer, longer blocks save on these small layers.
  plan_splits(a, m_tiles, ceil_div(a.red, 8), max_shared_bytes() / (NT * 4), wave_blocks());
  a.unit_rows = 32 * a.ksize;  // output tiles of 32 channels, all K taps of each
  // Shared memory holds the staged inputs, then the tree that sums the warps.
  const size_t floats = std::max<size_t>(static_cast<size_t>(a.split_len) * NT,
                                         static_cast<size_t>(kWarps / 2) * 32 * epl * NT);
  return {vectorised ? stream_conv_transposed_kernel<T, NT, kVec>
                     : stream_conv_transposed_kernel<T, NT, 1>,
          nullptr, dim3(m_tiles, a.splits, a.n_tiles), floats * sizeof(float),
          program_kind_of<NT>(true, vectorised)};
}

// Where the vector loads of a Conv1d-layout problem can be used: each lane's run of weights
// 16-byte aligned, a row length divisible by the vector, and an aligned base.
template <typename T>
bool rows_vectorised(const StreamArgs& a, const at::Tensor& weight) {
  return a.red % (16 / static_cast<int>(sizeof(T))) == 0 &&
         reinterpret_cast<uintptr_t>(weight.data_ptr()) % 16 == 0;
}

// plan(std::integral_constant<int, NT>) for the kernels' position tile NT of a.
template <typename Plan>
auto with_position_tile(const StreamArgs& a, const Plan& plan) {
  switch (a.nt / a.n_tiles) {
    case 4: return plan(std::integral_constant<int, 4>{});
    case 8: return plan(std::integral_constant<int, 8>{});
    case 16: return plan(std::integral_constant<int, 16>{});
    default: return plan(std::integral_constant<int, 32>{});
  }
}

template <typename T>
ClusterPairLaunch plan_cluster_pair(StreamArgs& a, StreamArgs& b, const at::Tensor& wa, const at::Tensor& wb) {
  const bool vectorised = rows_vectorised<T>(a, wa) && rows_vectorised<T>(b, wb);
  return with_position_tile(a, [&](auto nt) {
    return plan_cluster_pair<T, decltype(nt)::value>(a, b, vectorised);
  });
}

// The cluster plan of a transposed conv (stream_transposed_cluster_kernel), if it has one:
// a unit's K / EPL column tiles times as many input-channel splits as fill about one wave,
// up to kMaxClusterBlocks, and every unit's cluster resident at once.
template <typename T, int NT>
bool plan_transposed_cluster(StreamArgs& a, bool vectorised, StreamLaunch& launch) {
  constexpr int kVec = transposed_vector<T, NT>();
  const int epl = vectorised ? kVec : 1;
  if (!clusters_usable(a) || a.ksize % epl != 0 || a.ksize / epl > kMaxClusterBlocks) {
    return false;
  }
  const int tiles = a.ksize / epl, units = ceil_div(a.cout, 32);
  const int wanted = std::clamp(wave_blocks() / (units * tiles), 1, kMaxClusterBlocks / tiles);
  const int split_len = ceil_div(a.red, std::min(wanted, a.red));
  const int splits = ceil_div(a.red, split_len), size = tiles * splits;
  if (size < 2) return false;  // no distributed shared memory in a one-block cluster
  const size_t floats = std::max<size_t>(static_cast<size_t>(split_len) * NT, kWarps / 2 * 32 * epl * NT) +
                        static_cast<size_t>(splits) * ceil_div(32, size) * a.ksize * NT;
  const size_t shared_bytes = floats * sizeof(float);
  if (shared_bytes > static_cast<size_t>(max_shared_bytes())) return false;
  const auto kernel =
      vectorised ? stream_transposed_cluster_kernel<T, NT, kVec> : stream_transposed_cluster_kernel<T, NT, 1>;
  if (!clusters_fit(kernel, size, shared_bytes, units)) return false;
  a.split_len = split_len;
  a.splits = splits;
  launch = {kernel, nullptr, dim3(units * size), shared_bytes, -1, size};
  return true;
}

// clustered: a conv may take stream_conv_cluster_kernel, a transposed conv
// stream_transposed_cluster_kernel.
template <typename T>
StreamLaunch plan_stream(StreamArgs& a, bool transposed, const at::Tensor& weight, int blocks,
                         bool clustered = false) {
  const auto plan = [&](auto nt) {
    constexpr int NT = decltype(nt)::value;
    // Vector loads need each lane's run of weights 16-byte aligned: a row length (conv) or
    // column count (transposed) divisible by the vector, and an aligned base.
    const bool vectorised = transposed ? a.m % transposed_vector<T, NT>() == 0 &&
                                             reinterpret_cast<uintptr_t>(weight.data_ptr()) % 16 == 0
                                       : rows_vectorised<T>(a, weight);
    StreamLaunch launch;
    if (clustered && (transposed ? plan_transposed_cluster<T, NT>(a, vectorised, launch)
                                 : plan_cluster<T, NT>(a, vectorised, launch))) {
      return launch;
    }
    return transposed ? plan_transposed<T, NT>(a, vectorised) : plan_conv<T, NT>(a, vectorised, blocks);
  };
  return with_position_tile(a, plan);
}

// Position tiles, and whether the blocks prefetch their own weights into L2 while they wait
// for the previous kernel: that pays where a layer's weights fit in (half) the L2 next to
// the previous layer's; bigger ones would evict their own prefetched lines.
void tile_positions(StreamArgs& a, const at::Tensor& weight) {
  const int tile = a.positions <= 4 ? 4 : a.positions <= 8 ? 8 : a.positions <= 16 ? 16 : 32;
  a.n_tiles = ceil_div(a.positions, tile);
  a.nt = a.n_tiles * tile;
  a.prefetch = weight.nbytes() * 2 <= static_cast<size_t>(at::cuda::getCurrentDeviceProperties()->l2CacheSize);
}

// The split-K partial sums' workspace (returned: it must live until the launch is queued).
at::Tensor attach_workspace(StreamArgs& a, const at::Tensor& x) {
  at::Tensor ws = at::empty({static_cast<int64_t>(a.splits) * a.m * a.nt}, x.options().dtype(at::kFloat));
  a.ws = ws.data_ptr<float>();
  return ws;
}

// Launches on the current stream in clusters of `cluster_blocks` (0: not a cluster launch;
// a kernel that pushes into other blocks' shared memory needs one even for 1-block
// clusters), with programmatic dependent launch where the GPU has it.
template <typename... Params, typename... Args>
void launch_streaming(void (*kernel)(Params...), dim3 grid, int cluster_blocks, size_t shared_bytes,
                      Args... args) {
  set_kernel_attributes(kernel, cluster_blocks, shared_bytes);
  LaunchConfig launch(grid, dim3(kThreads), shared_bytes);
  launch.programmatic_dependent();
  launch.clusters(cluster_blocks);
  C10_CUDA_CHECK(cudaLaunchKernelEx(launch.get(), kernel, args...));
}

}  // namespace

// ---------------------------------------------------------------------------------------
// Recording a program (StreamProgram, conv1d.h).

struct StreamProgram::Impl {
  struct Region {
    uintptr_t lo, hi;
  };
  std::vector<ProgramStage> stages;
  std::vector<at::Tensor> keep_alive;
  std::vector<Region> readable;  // declared inputs and every stage's output
  std::vector<Region> outputs;
  std::optional<at::TensorOptions> options;  // the first stage's dtype and device
  size_t shared_bytes = 0;
  void (*kernel)(const ProgramStage*, int, int*, int) = nullptr;
  int grid = 0;
  at::Tensor device_stages, done;
  std::string failure;
  bool ended = false;

  void launch(const at::Tensor& stages_on_device, const char* method) const;
  static at::Tensor upload(const std::vector<ProgramStage>& stages, const at::TensorOptions& options) {
    const int64_t bytes = static_cast<int64_t>(stages.size() * sizeof(ProgramStage));
    at::Tensor host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte));
    std::memcpy(host.data_ptr(), stages.data(), bytes);
    return host.to(options.device());
  }
  void fail(const std::string& why) {
    if (failure.empty()) failure = why;
  }
  static Region region_of(const at::Tensor& t) {
    const auto lo = reinterpret_cast<uintptr_t>(t.data_ptr());
    return {lo, lo + t.nbytes()};
  }
  static bool contains(const std::vector<Region>& regions, const void* p) {
    const auto v = reinterpret_cast<uintptr_t>(p);
    return std::any_of(regions.begin(), regions.end(), [v](const Region& r) { return v >= r.lo && v < r.hi; });
  }
  // Whether a stage's input (both halves of a concatenation read in place) is what the
  // program has: a declared tensor or an earlier stage's output.
  bool check_input(const StreamArgs& a) {
    if (contains(readable, a.x) && (a.x2 == nullptr || contains(readable, a.x2))) return true;
    fail("stage " + std::to_string(stages.size()) +
         " reads an input that no earlier stage writes and that was not declared (a PyTorch "
         "op between the fused ones?)");
    return false;
  }
  bool check_readable(const void* p, const char* what) {
    if (p == nullptr || contains(readable, p)) return true;
    fail(std::string("stage ") + std::to_string(stages.size()) + "'s " + what +
         " is neither declared nor written by an earlier stage");
    return false;
  }
  // Per problem: fresh tile counters and workspace (kept), and its output made readable.
  void attach(StreamArgs& a, const at::Tensor& x) {
    const int64_t units = ceil_div(a.m, a.unit_rows);
    at::Tensor counters = at::zeros({units}, x.options().dtype(at::kInt));
    a.counters = counters.data_ptr<int>();
    keep_alive.push_back(counters);
    keep_alive.push_back(attach_workspace(a, x));
  }
  // A launch's worth of work: `a` (and `b`, sharing the grid from x-tile a_tiles on).
  void add_stage(StreamArgs a, const StreamArgs* b, int kind, dim3 grid, size_t launch_shared_bytes,
                 int a_tiles, const at::Tensor& x, const std::vector<at::Tensor>& operands) {
    if (!failure.empty()) return;
    if (!options.has_value()) {
      options = x.options();
    } else if (x.scalar_type() != options->dtype().toScalarType() || x.device() != options->device()) {
      return fail("the stages do not share one dtype and device");
    }
    if (kind < 0) {
      return fail("a position tile of 32 (batch x length from 17 to 31) has no program kernel");
    }
    StreamArgs second = b ? *b : StreamArgs{};
    if (!check_input(a) || (b && !check_input(second))) return;
    for (const StreamArgs* s : {&a, b ? &second : nullptr}) {
      if (s && !(check_readable(s->residual, "residual") && check_readable(s->film, "FiLM"))) return;
    }
    attach(a, x);
    if (b) attach(second, x);
    ProgramStage stage{};
    stage.a = a;
    stage.b = second;
    stage.kind = kind;
    stage.a_tiles = b ? a_tiles : static_cast<int>(grid.x);
    stage.grid_x = static_cast<int>(grid.x);
    stage.grid_y = static_cast<int>(grid.y);
    stage.grid_z = static_cast<int>(grid.z);
    stage.units = ceil_div(a.m, a.unit_rows) + (b ? ceil_div(second.m, second.unit_rows) : 0);
    stages.push_back(stage);
    shared_bytes = std::max(shared_bytes, launch_shared_bytes);
    keep_alive.push_back(x);
    keep_alive.insert(keep_alive.end(), operands.begin(), operands.end());
    // Outputs become readable only now: a stage never reads its own output.
    for (size_t i = 0; i < operands.size(); ++i) {
      if (operands[i].data_ptr() == a.out || (b && operands[i].data_ptr() == second.out)) {
        outputs.push_back(region_of(operands[i]));
        readable.push_back(region_of(operands[i]));
      }
    }
  }
};

namespace {

// The program being recorded on this thread, if any.
thread_local StreamProgram::Impl* recording = nullptr;

// Launches being traced (start_launch_trace): the buffer, its rows handed out so far, and the
// blocks of each traced launch.
struct LaunchTrace {
  std::mutex mutex;
  at::Tensor buffer;
  int64_t rows_used = 0;
  std::vector<int64_t> blocks;
};
LaunchTrace launch_trace;

// The trace rows of a launch of `grid` blocks, or null when launches are not traced.
int64_t* next_launch_trace(dim3 grid) {
  const std::lock_guard<std::mutex> lock(launch_trace.mutex);
  if (!launch_trace.buffer.defined()) return nullptr;
  const int64_t blocks = static_cast<int64_t>(grid.x) * grid.y * grid.z;
  TORCH_CHECK(launch_trace.rows_used + blocks <= launch_trace.buffer.size(0),
              "start_launch_trace: the buffer's ", launch_trace.buffer.size(0),
              " rows are full; a launch of ", blocks, " blocks does not fit");
  int64_t* rows = launch_trace.buffer.data_ptr<int64_t>() + launch_trace.rows_used * kTraceEvents;
  launch_trace.rows_used += blocks;
  launch_trace.blocks.push_back(blocks);
  return rows;
}

void note_gemm_route(const char* op) {
  if (recording) {
    recording->fail(std::string(op) + " takes its im2col + cuBLAS route (batch x length >= " +
                    std::to_string(gemm_path_min_positions.load()) +
                    ", or a taps-major weight), which a program does not run");
  }
}

// Runs a streaming kernel with `counters` (the caller's, or null for fresh zeros) and a
// workspace, or adds it to the program being recorded. `operands`: every tensor the kernel
// reads or writes besides x (the recording keeps them alive).
void run_streaming(StreamArgs& a, const ConvProblem& p, const at::Tensor& x,
                   const at::Tensor& weight, int* counters, const std::vector<at::Tensor>& operands) {
  tile_positions(a, weight);
  StreamLaunch launch{};
  DPA_DISPATCH_FLOAT_TYPES(x.scalar_type(), "dpa streaming conv", [&] {
    launch = plan_stream<scalar_t>(a, p.transposed, weight, wave_blocks(), recording == nullptr);
  });
  if (recording) {
    return recording->add_stage(a, nullptr, launch.program_kind, launch.grid, launch.shared_bytes,
                                0, x, operands);
  }
  a.trace = next_launch_trace(launch.grid);
  if (launch.cluster_blocks > 0) {
    return launch_streaming(launch.kernel, launch.grid, launch.cluster_blocks, launch.shared_bytes, a);
  }
  const at::Tensor own_counters =
      counters ? at::Tensor() : at::zeros({p.out_channels}, x.options().dtype(at::kInt));
  a.counters = counters ? counters : own_counters.data_ptr<int>();
  const at::Tensor ws = attach_workspace(a, x);
  launch_streaming(launch.kernel, launch.grid, 0, launch.shared_bytes, a);
}

// Two Conv1d problems on the same input and positions (a and b, weights wa and wb) in one
// launch; two launches where their plans need different kernel instantiations. The wave is
// shared so that the most weight bytes any block streams is as small as the integer splits
// allow: that block sets the launch's time. `counters`: a's then b's, or null for fresh zeros.
void run_streaming_pair(StreamArgs& a, StreamArgs& b, const ConvProblem& pa, const ConvProblem& pb,
                        const at::Tensor& x, const at::Tensor& wa, const at::Tensor& wb,
                        int* counters, const std::vector<at::Tensor>& operands) {
  tile_positions(a, wa);
  tile_positions(b, wb);
  if (!recording) {
    ClusterPairLaunch cluster;
    DPA_DISPATCH_FLOAT_TYPES(x.scalar_type(), "dpa streaming conv", [&] {
      cluster = plan_cluster_pair<scalar_t>(a, b, wa, wb);
    });
    if (cluster.kernel) {
      const dim3 grid((cluster.a_units + cluster.b_units) * cluster.cluster_blocks);
      a.trace = b.trace = next_launch_trace(grid);
      launch_streaming(cluster.kernel, grid, cluster.cluster_blocks, cluster.shared_bytes, a, b, cluster.a_units);
      return;
    }
  }
  StreamLaunch la{}, lb{};
  const auto plan = [&](int b_blocks) {
    DPA_DISPATCH_FLOAT_TYPES(x.scalar_type(), "dpa streaming conv", [&] {
      lb = plan_stream<scalar_t>(b, false, wb, b_blocks);
      la = plan_stream<scalar_t>(a, false, wa, std::max(1, wave_blocks() - b_blocks));
    });
    // Weight elements per block: rows per tile x reduction slice.
    return std::max(static_cast<int64_t>(ceil_div(a.m, la.grid.x)) * a.split_len,
                    static_cast<int64_t>(ceil_div(b.m, lb.grid.x)) * b.split_len);
  };
  plan(1);
  const int b_tiles = static_cast<int>(lb.grid.x) * b.n_tiles;
  int best_blocks = b_tiles;
  int64_t best = std::numeric_limits<int64_t>::max();
  for (int b_blocks = b_tiles; b_blocks < wave_blocks(); b_blocks += b_tiles) {
    const int64_t per_block = plan(b_blocks);
    if (per_block < best) best = per_block, best_blocks = b_blocks;
  }
  plan(best_blocks);
  const bool paired = la.pair_kernel == lb.pair_kernel;
  const dim3 grid(la.grid.x + lb.grid.x, std::max(la.grid.y, lb.grid.y), la.grid.z);
  const size_t shared_bytes = std::max(la.shared_bytes, lb.shared_bytes);
  if (recording) {
    if (paired) {
      return recording->add_stage(a, &b, la.program_kind, grid, shared_bytes,
                                  static_cast<int>(la.grid.x), x, operands);
    }
    recording->add_stage(a, nullptr, la.program_kind, la.grid, la.shared_bytes, 0, x, operands);
    return recording->add_stage(b, nullptr, lb.program_kind, lb.grid, lb.shared_bytes, 0, x, operands);
  }
  const at::Tensor own_counters =
      counters ? at::Tensor()
               : at::zeros({pa.out_channels + pb.out_channels}, x.options().dtype(at::kInt));
  a.counters = counters ? counters : own_counters.data_ptr<int>();
  b.counters = a.counters + pa.out_channels;
  const at::Tensor ws_a = attach_workspace(a, x), ws_b = attach_workspace(b, x);
  a.trace = next_launch_trace(paired ? grid : la.grid);
  b.trace = paired ? a.trace : next_launch_trace(lb.grid);
  if (!paired) {
    launch_streaming(la.kernel, la.grid, 0, la.shared_bytes, a);
    launch_streaming(lb.kernel, lb.grid, 0, lb.shared_bytes, b);
    return;
  }
  launch_streaming(la.pair_kernel, grid, 0, shared_bytes, a, b, static_cast<int>(la.grid.x));
}

// Whether a Conv1d weight [C_out, C_in, K] (K > 1) is stored taps-major, [C_out][K][C_in] in
// memory (ops.taps_major): then its rows c * K + k are a GEMM operand as it is, and the GEMM
// route multiplies them with x itself (GemmForm::kTapRows) instead of with im2col's K times
// larger columns. That GEMM, [C_out * K, C_in] x [C_in, B * L], has K times the output tiles
// and a K times shorter reduction: on an H100 cuBLAS ran 32 of the U-Nets' 36 half-precision
// GroupNorm convs of 256+ input channels at batch 8 and 64 faster so, by up to 43%, than as
// [C_out, C_in * K] x [C_in * K, B * L], and 2 slower
// (`python scripts/profile_gemm_route.py --taps-as-rows`, BENCHMARKS.md). Such a weight
// takes the GEMM route at any batch x length: its caller chose that layout for it, and the
// streaming kernels would read a contiguous copy made on every call.
bool taps_major(const at::Tensor& weight) {
  const int64_t cin = weight.size(1), taps = weight.size(2);
  return taps > 1 && weight.stride(0) == cin * taps && weight.stride(1) == 1 && weight.stride(2) == cin;
}

// Whether a Conv1d (or a GroupNorm conv) with this weight over `positions` (batch x output
// length) takes the im2col + cuBLAS route.
bool takes_gemm_route(int64_t positions, const at::Tensor& weight) {
  return positions >= gemm_path_min_positions.load() || taps_major(weight);
}

// The form of a conv's GEMM on the GEMM route (gemm_route) or, if not, the streaming route's
// view of its weight (the same but for kTapRows, which the streaming kernels do not read).
GemmForm gemm_form(const ConvProblem& p, const at::Tensor& weight, bool gemm_route) {
  if (p.transposed) return GemmForm::kTransposed;
  return gemm_route && taps_major(weight) ? GemmForm::kTapRows : GemmForm::kIm2col;
}

// StreamArgs' GEMM view [m, red] x [red, positions] of the form.
void set_gemm_view(StreamArgs& a, const ConvProblem& p, GemmForm form) {
  const bool tap_rows = form != GemmForm::kIm2col;
  a.m = static_cast<int>(p.out_channels * (tap_rows ? p.kernel_size : 1));
  a.red = static_cast<int>(p.in_channels * (tap_rows ? 1 : p.kernel_size));
  a.positions = static_cast<int>(p.batch * (tap_rows ? p.in_length : p.out_length));
}

// The GEMM route's B operand [red, positions]: im2col's columns, or, where taps are rows, x
// itself as [C_in, B * L_in].
at::Tensor im2col(const StreamArgs& a, const at::Tensor& x, GemmForm form) {
  const Im2col cut = form == GemmForm::kIm2col ? Im2col{a.ksize, a.lout, a.stride, a.pad} : Im2col{1, a.lin, 1, 0};
  at::Tensor cols = at::empty({a.red, a.positions}, x.options());
  const dim3 grid(ceil_div(a.positions, kThreads), std::min(ceil_div(a.red, kIm2colRowsPerThread), 65535));
  DPA_DISPATCH_FLOAT_TYPES(x.scalar_type(), "dpa im2col", [&] {
    const auto kernel = a.x2 ? im2col_kernel<scalar_t, true> : im2col_kernel<scalar_t, false>;
    kernel<<<grid, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(a, cut, a.red, cols.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return cols;
}

// One cuBLAS GEMM over every position (tensor cores for fp16 / bf16; fp32 follows
// torch.backends.cuda.matmul.allow_tf32, off by default): the [m, positions] result without
// the bias, which the epilogue adds. The weight is read in place (a transposed conv's
// [C_in, C_out * K] as the transposed operand). Where taps are rows the result is fp32: an
// output adds up K of its elements, and each one's rounding to half precision would add an
// error of its own.
at::Tensor gemm(const StreamArgs& a, const at::Tensor& weight, const at::Tensor& cols, GemmForm form) {
  at::Tensor rows;
  switch (form) {
    case GemmForm::kIm2col: rows = weight.reshape({a.m, a.red}); break;
    case GemmForm::kTapRows: rows = weight.as_strided({a.m, a.red}, {a.red, 1}); break;
    case GemmForm::kTransposed: rows = weight.reshape({a.red, a.m}).t(); break;
  }
  if (form == GemmForm::kIm2col || cols.scalar_type() == at::kFloat) return at::mm(rows, cols).contiguous();
  return at::mm(rows, cols, at::kFloat).contiguous();
}

at::Tensor conv_as_gemm(const StreamArgs& a, const at::Tensor& x, const at::Tensor& weight, GemmForm form) {
  return gemm(a, weight, im2col(a, x, form), form);
}

// x as the columns of a 1x1 conv's GEMM, [C_in, positions], within a conv's columns: all of
// them where the conv's taps are rows, else the centre tap's rows (tap k = pad reads
// x[b, c, l]), so that one im2col serves a residual block's first conv and its shortcut.
at::Tensor centre_columns(const StreamArgs& a, const at::Tensor& cols, GemmForm form) {
  if (form == GemmForm::kTapRows) return cols;
  return cols.as_strided({a.red / a.ksize, a.positions}, {a.ksize * a.positions, 1}, a.pad * a.positions);
}

// A conv1d_gn_mish call's operands, made contiguous (and kept alive here until the launch is
// queued), its output, and the kernels' arguments.
std::vector<at::Tensor> defined(std::initializer_list<std::optional<at::Tensor>> tensors) {
  std::vector<at::Tensor> out;
  for (const auto& t : tensors)
    if (t.has_value()) out.push_back(*t);
  return out;
}

struct GnMishCall {
  at::Tensor weight, out;
  std::optional<at::Tensor> bias, gn_weight, gn_bias, film, residual;
  StreamArgs a;
  std::vector<at::Tensor> operands() const {
    return defined({weight, out, bias, gn_weight, gn_bias, film, residual});
  }
};

GnMishCall gn_mish_call(const ConvProblem& p, const at::Tensor& x, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias,
                        const std::optional<at::Tensor>& gn_weight,
                        const std::optional<at::Tensor>& gn_bias, double eps,
                        const std::optional<at::Tensor>& film,
                        const std::optional<at::Tensor>& residual, GemmForm form,
                        bool with_output = true) {
  GnMishCall c;
  c.weight = form == GemmForm::kTapRows ? weight : weight.contiguous();
  c.bias = contiguous_or_none(bias);
  c.gn_weight = contiguous_or_none(gn_weight);
  c.gn_bias = contiguous_or_none(gn_bias);
  c.residual = contiguous_or_none(residual);
  // Rows may be strided (a slice of every block's FiLM, or one row broadcast to the batch).
  c.film = film.has_value() && film->stride(1) != 1 ? std::optional<at::Tensor>(film->contiguous()) : film;
  if (with_output) c.out = at::empty({p.batch, p.out_channels, p.out_length}, x.options());
  c.a = common_args(p, x, c.weight, c.bias, c.out, c.residual);
  c.a.gn_weight = optional_data(c.gn_weight);
  c.a.gn_bias = optional_data(c.gn_bias);
  c.a.film = optional_data(c.film);
  c.a.film_sb = c.film.has_value() ? c.film->stride(0) : 0;
  c.a.eps = static_cast<float>(eps);
  set_gemm_view(c.a, p, form);
  c.a.unit_rows = static_cast<int>(p.out_channels / p.groups);
  return c;
}

// The same for a plain (or transposed) conv1d call.
struct ConvCall {
  at::Tensor weight, out;
  std::optional<at::Tensor> bias, residual;
  StreamArgs a;
  std::vector<at::Tensor> operands() const { return defined({weight, out, bias, residual}); }
};

ConvCall conv_call(const ConvProblem& p, const at::Tensor& x, const at::Tensor& weight,
                   const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual,
                   GemmForm form) {
  ConvCall c;
  c.weight = form == GemmForm::kTapRows ? weight : weight.contiguous();
  c.bias = contiguous_or_none(bias);
  c.residual = contiguous_or_none(residual);
  c.out = at::empty({p.batch, p.out_channels, p.out_length}, x.options());
  c.a = common_args(p, x, c.weight, c.bias, c.out, c.residual);
  set_gemm_view(c.a, p, form);
  return c;
}

int* counters_data(const std::optional<at::Tensor>& counters) {
  return counters.has_value() ? counters->data_ptr<int>() : nullptr;
}

// pre: gemm()'s result of the form.
void launch_group_norm_epilogue(const GnMishCall& c, const at::Tensor& pre, GemmForm form,
                                const GemmEpilogueIo& io = {}) {
  const dim3 grid(c.a.batch * c.a.groups);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  DPA_DISPATCH_FLOAT_TYPES(c.weight.scalar_type(), "conv1d_gn_mish", [&] {
    if (form != GemmForm::kTapRows) {
      group_norm_epilogue_kernel<scalar_t><<<grid, kThreads, 0, stream>>>(c.a, pre.data_ptr<scalar_t>(), io);
    } else {
      const auto launch = [&](auto taps) {
        const TapRowsPre<scalar_t, decltype(taps)::value> rows{pre.data_ptr<float>(), c.a.positions, c.a.bias,
                                                               c.a.ksize, c.a.pad, c.a.lout};
        tap_rows_group_norm_epilogue_kernel<<<grid, kThreads, 0, stream>>>(c.a, rows, io);
      };
      // Diffusion Policy's kernel sizes compiled in.
      if (c.a.ksize == 5) {
        launch(std::integral_constant<int, 5>{});
      } else if (c.a.ksize == 3) {
        launch(std::integral_constant<int, 3>{});
      } else {
        launch(std::integral_constant<int, 0>{});
      }
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void launch_conv_epilogue(const ConvCall& c, const at::Tensor& pre, GemmForm form) {
  const int blocks = ceil_div(c.out.numel(), kThreads);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  DPA_DISPATCH_FLOAT_TYPES(c.weight.scalar_type(), "conv1d", [&] {
    if (form == GemmForm::kIm2col) {
      conv_epilogue_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(c.a, pre.data_ptr<scalar_t>(), form);
    } else {
      conv_epilogue_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(c.a, pre.data_ptr<float>(), form);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

// conv_epilogue_kernel indexes in 32 bits (every form's GEMM view counted).
bool conv_epilogue_fits(const ConvProblem& p) {
  const int64_t gemm_elements = p.out_channels * p.kernel_size * p.batch * std::max(p.in_length, p.out_length);
  return std::max({p.batch * p.out_channels * p.out_length, gemm_elements,
                   p.batch * p.in_channels * p.in_length}) <= std::numeric_limits<int>::max();
}

at::Tensor conv1d_gn_mish_cuda(const at::Tensor& x, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias,
                               const std::optional<at::Tensor>& gn_weight,
                               const std::optional<at::Tensor>& gn_bias, int64_t num_groups,
                               double eps, const std::optional<at::Tensor>& film,
                               const std::optional<at::Tensor>& residual,
                               const std::optional<at::Tensor>& counters) {
  const ConvProblem p = check_conv1d_gn_mish_args(x, weight, bias, gn_weight, gn_bias, num_groups,
                                                  eps, film, residual, counters);
  const c10::cuda::CUDAGuard guard(x.device());
  const bool gemm_route = takes_gemm_route(p.batch * p.out_length, weight);
  const GemmForm form = gemm_form(p, weight, gemm_route);
  GnMishCall c = gn_mish_call(p, x, weight, bias, gn_weight, gn_bias, eps, film, residual, form);
  if (gemm_route) {
    note_gemm_route("conv1d_gn_mish");
    launch_group_norm_epilogue(c, conv_as_gemm(c.a, x, c.weight, form), form);
    return c.out;
  }
  run_streaming(c.a, p, x, c.weight, counters_data(counters), c.operands());
  return c.out;
}

at::Tensor conv1d_cuda(const at::Tensor& x, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias, int64_t stride, int64_t padding,
                       bool transposed, const std::optional<at::Tensor>& residual,
                       const std::optional<at::Tensor>& counters) {
  const ConvProblem p =
      check_conv1d_args(x, weight, bias, stride, padding, transposed, residual, counters);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t positions = p.batch * (transposed ? p.in_length : p.out_length);
  if (transposed ? positions >= gemm_path_min_positions.load() : takes_gemm_route(positions, weight)) {
    note_gemm_route("conv1d");
    if (conv_epilogue_fits(p)) {
      const GemmForm form = gemm_form(p, weight, true);
      ConvCall c = conv_call(p, x, weight, bias, residual, form);
      launch_conv_epilogue(c, conv_as_gemm(c.a, x, c.weight, form), form);
      return c.out;
    }
    // Past 32-bit indices, cuDNN's convolution.
    at::Tensor out = transposed ? at::conv_transpose1d(x, weight, bias, stride, padding)
                                : at::conv1d(x, weight, bias, stride, padding);
    if (residual.has_value()) out.add_(*residual);
    return out.contiguous();
  }
  ConvCall c = conv_call(p, x, weight, bias, residual, gemm_form(p, weight, false));
  run_streaming(c.a, p, x, c.weight, counters_data(counters), c.operands());
  return c.out;
}

// A GEMM-route op's work that does not depend on its main path (a shortcut's GEMM) runs on
// a side stream: at these sizes each GEMM fills a fraction of the GPU, so the two overlap.
// The side stream starts after what the caller's stream has queued, and the caller's stream
// waits for it at join(), so callers and CUDA graph capture (the side stream joins the
// capture through the first event) see one stream's order. Tensors the side stream reads are
// the caller's stream's, alive until join(). Constructed with fork false, the work runs on
// the caller's stream.
class SideBranch {
 public:
  explicit SideBranch(bool fork)
      : main_(at::cuda::getCurrentCUDAStream()), side_(fork ? side_stream(main_) : main_) {
    if (side_ == main_) return;
    forked_.record(main_);
    forked_.block(side_);
  }
  SideBranch(const SideBranch&) = delete;
  SideBranch& operator=(const SideBranch&) = delete;
  // An exception between fork and join must still leave the side stream inside the caller's
  // order; an error from the join itself is dropped there, the first exception is the one
  // that reaches the caller.
  ~SideBranch() {
    if (side_ == main_ || joined_.isCreated()) return;
    try {
      join();
    } catch (...) {
    }
  }

  template <typename F>
  void run(F&& work) {
    const c10::cuda::CUDAStreamGuard guard(side_);
    work();
  }

  void join() {
    if (side_ == main_) return;
    joined_.record(side_);
    joined_.block(main_);
  }

 private:
  // One side stream per caller's stream, not per device: two captures under way at once on
  // two streams (two threads, each with its own model copy) that shared one would merge, an
  // error. A side stream is kept for the process's life, as PyTorch's pool streams are, and
  // reused each time, so that cuBLAS keeps one workspace for it; callers use a handful of
  // streams (torch.cuda.Stream() hands out one of 32 per device).
  static at::cuda::CUDAStream side_stream(const at::cuda::CUDAStream& main) {
    static std::mutex mutex;
    static std::map<std::pair<c10::DeviceIndex, c10::StreamId>, at::cuda::CUDAStream> streams;
    const std::lock_guard<std::mutex> lock(mutex);
    const auto key = std::make_pair(main.device_index(), main.id());
    auto it = streams.find(key);
    if (it == streams.end()) {
      const c10::cuda::CUDAGuard guard(main.device_index());
      cudaStream_t created = nullptr;
      C10_CUDA_CHECK(cudaStreamCreateWithFlags(&created, cudaStreamNonBlocking));
      it = streams.emplace(key, c10::cuda::getStreamFromExternal(created, main.device_index())).first;
    }
    return it->second;
  }

  at::cuda::CUDAStream main_, side_;
  at::cuda::CUDAEvent forked_, joined_;
};

// Whether a GEMM-route op's 1x1 shortcut GEMM over `positions` columns runs on a side stream
// (SideBranch). On the H100, in half precision and in fp32 below 256 positions, cuBLAS's
// GEMMs leave enough of the GPU idle that the overlap took 0.9-12 µs off 25 of the 30 U-Net
// blocks measured there, left 4 within 0.2 µs and lengthened one by 2.5 µs. In fp32 from
// 256 positions on, its SIMT GEMMs fill the GPU, and the overlap lengthened blocks by up to
// 8 µs about as often as it shortened them
// (`python scripts/profile_gemm_route.py --side-stream`, BENCHMARKS.md).
bool shortcut_on_side_stream(at::ScalarType dtype, int64_t positions) {
  return use_side_stream.load() && (dtype != at::kFloat || positions < 256);
}

// The input's channels from x's on come from skip (a concatenation read in place).
void read_skip_in_place(StreamArgs& a, const at::Tensor& x, const at::Tensor& skip) {
  a.x2 = skip.data_ptr();
  a.x2_sb = skip.stride(0), a.x2_sc = skip.stride(1), a.x2_sl = skip.stride(2);
  a.x_split = static_cast<int>(x.size(1));
}

std::tuple<at::Tensor, at::Tensor> conv1d_gn_mish_shortcut_cuda(
    const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& gn_weight, const std::optional<at::Tensor>& gn_bias,
    int64_t num_groups, double eps, const at::Tensor& shortcut_weight,
    const std::optional<at::Tensor>& shortcut_bias, const std::optional<at::Tensor>& film,
    const std::optional<at::Tensor>& counters, const std::optional<at::Tensor>& skip) {
  const auto [p, ps] = check_conv1d_gn_mish_shortcut_args(
      x, weight, bias, gn_weight, gn_bias, num_groups, eps, shortcut_weight, shortcut_bias, film,
      counters, skip);
  const c10::cuda::CUDAGuard guard(x.device());
  const bool gemm_route = takes_gemm_route(p.batch * p.out_length, weight);
  if (gemm_route && !conv_epilogue_fits(ps)) {
    const std::optional<at::Tensor> none;
    const at::Tensor input = skip.has_value() ? at::cat({x, *skip}, 1) : x;
    return {conv1d_gn_mish_cuda(input, weight, bias, gn_weight, gn_bias, num_groups, eps, film, none, none),
            conv1d_cuda(input, shortcut_weight, shortcut_bias, 1, 0, false, none, none)};
  }
  const GemmForm form = gemm_form(p, weight, gemm_route);
  GnMishCall c = gn_mish_call(p, x, weight, bias, gn_weight, gn_bias, eps, film, std::nullopt, form);
  ConvCall cs = conv_call(ps, x, shortcut_weight, shortcut_bias, std::nullopt, GemmForm::kIm2col);
  if (skip.has_value()) {
    read_skip_in_place(c.a, x, *skip);
    read_skip_in_place(cs.a, x, *skip);
  }
  if (gemm_route) {
    note_gemm_route("conv1d_gn_mish_shortcut");
    const at::Tensor cols = im2col(c.a, x, form);
    const at::Tensor centre = centre_columns(c.a, cols, form);
    SideBranch shortcut(shortcut_on_side_stream(x.scalar_type(), cs.a.positions));
    shortcut.run([&] {
      launch_conv_epilogue(cs, gemm(cs.a, cs.weight, centre, GemmForm::kIm2col), GemmForm::kIm2col);
    });
    launch_group_norm_epilogue(c, gemm(c.a, c.weight, cols, form), form);
    shortcut.join();
    return {c.out, cs.out};
  }
  std::vector<at::Tensor> operands = c.operands();
  for (const at::Tensor& t : cs.operands()) operands.push_back(t);
  if (skip.has_value()) operands.push_back(*skip);
  run_streaming_pair(c.a, cs.a, p, ps, x, c.weight, cs.weight, counters_data(counters), operands);
  return {c.out, cs.out};
}

at::Tensor residual_block_cuda(
    const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& gn_weight, const std::optional<at::Tensor>& gn_bias,
    const at::Tensor& weight2, const std::optional<at::Tensor>& bias2,
    const std::optional<at::Tensor>& gn_weight2, const std::optional<at::Tensor>& gn_bias2,
    int64_t num_groups, double eps, const std::optional<at::Tensor>& shortcut_weight,
    const std::optional<at::Tensor>& shortcut_bias, const std::optional<at::Tensor>& film,
    const std::optional<at::Tensor>& counters, const std::optional<at::Tensor>& skip,
    bool channels_last) {
  const ResidualBlockProblem r = check_residual_block_args(
      x, weight, bias, gn_weight, gn_bias, weight2, bias2, gn_weight2, gn_bias2, num_groups, eps,
      shortcut_weight, shortcut_bias, film, counters, skip);
  const c10::cuda::CUDAGuard guard(x.device());
  const ConvProblem& p = r.first;
  const std::optional<at::Tensor> none;
  const int64_t positions = p.batch * p.out_length;
  const bool fused = takes_gemm_route(positions, weight) && takes_gemm_route(positions, weight2) &&
                     conv_epilogue_fits(p) && conv_epilogue_fits(r.second) &&
                     group_held(p.out_channels / p.groups, p.out_length);
  if (!fused) {
    // The ops one after the other: on the streaming route each conv is one launch already.
    at::Tensor h, residual;
    if (r.has_shortcut) {
      std::tie(h, residual) = conv1d_gn_mish_shortcut_cuda(
          x, weight, bias, gn_weight, gn_bias, num_groups, eps, *shortcut_weight, shortcut_bias,
          film, counters, skip);
    } else {
      residual = skip.has_value() ? at::cat({x, *skip}, 1) : x;
      h = conv1d_gn_mish_cuda(residual, weight, bias, gn_weight, gn_bias, num_groups, eps, film,
                              none, counters);
    }
    const at::Tensor out = conv1d_gn_mish_cuda(h, weight2, bias2, gn_weight2, gn_bias2, num_groups,
                                               eps, none, residual, counters);
    return channels_last ? stored_channels_last(out) : out;
  }
  note_gemm_route("residual_block");
  const GemmForm form = gemm_form(p, weight, true), form2 = gemm_form(r.second, weight2, true);
  GnMishCall first = gn_mish_call(p, x, weight, bias, gn_weight, gn_bias, eps, film, none, form,
                                  /*with_output=*/false);
  if (skip.has_value()) read_skip_in_place(first.a, x, *skip);
  // x stored channels-last (a previous block's channels_last output) is, where the taps are
  // GEMM rows, that GEMM's operand [C_in, B * L] as it is: no transposing launch.
  const bool x_rows =
      form == GemmForm::kTapRows && !skip.has_value() && x.transpose(1, 2).is_contiguous();
  const at::Tensor cols = x_rows ? x.transpose(1, 2).reshape({first.a.positions, p.in_channels}).t()
                                 : im2col(first.a, x, form);
  GemmEpilogueIo io{};
  std::optional<at::Tensor> identity, shortcut_pre, shortcut_bias_c;
  std::optional<SideBranch> shortcut;
  if (r.has_shortcut) {
    const at::Tensor centre = centre_columns(first.a, cols, form);
    const at::Tensor shortcut_w = shortcut_weight->contiguous().reshape({p.out_channels, p.in_channels});
    shortcut_pre = at::empty({p.out_channels, positions}, x.options());
    shortcut.emplace(shortcut_on_side_stream(x.scalar_type(), positions));
    shortcut->run([&] { at::mm_out(*shortcut_pre, shortcut_w, centre); });
    shortcut_bias_c = contiguous_or_none(shortcut_bias);
    io.residual_pre = shortcut_pre->data_ptr();
    io.residual_bias = optional_data(shortcut_bias_c);
  } else if (x_rows) {
    io.residual_rows = x.data_ptr();  // read in place, not copied to [B, C, L] first
  } else {
    identity = skip.has_value() ? at::cat({x, *skip}, 1) : x;
  }
  const at::Tensor pre = gemm(first.a, first.weight, cols, form);
  // The second conv's input exists only as its GEMM columns, transposed (GemmEpilogueIo):
  // im2col's, or where its taps are rows, the first conv's output channels-last.
  const int taps2 = form2 == GemmForm::kTapRows ? 1 : static_cast<int>(r.second.kernel_size);
  const at::Tensor cols2 = at::empty({positions, r.second.in_channels * taps2}, x.options());
  launch_group_norm_epilogue(first, pre, form, GemmEpilogueIo{nullptr, nullptr, cols2.data_ptr(), taps2});
  GnMishCall second = gn_mish_call(r.second, x, weight2, bias2, gn_weight2, gn_bias2, eps, none, identity, form2,
                                   /*with_output=*/!channels_last);
  second.a.x = nullptr;  // its input is cols2
  if (channels_last) {
    // Written as one-tap columns: [B * L][C_out] is the output channels-last.
    second.out = at::empty({p.batch, p.out_length, p.out_channels}, x.options()).transpose(1, 2);
    io.cols = second.out.data_ptr();
    io.taps = 1;
  }
  const at::Tensor pre2 = gemm(second.a, second.weight, cols2.t(), form2);
  if (shortcut) shortcut->join();
  launch_group_norm_epilogue(second, pre2, form2, io);
  return second.out;
}

}  // namespace

void start_launch_trace(const at::Tensor& buffer) {
  TORCH_CHECK_VALUE(buffer.is_cuda() && buffer.scalar_type() == at::kLong && buffer.dim() == 2 &&
                        buffer.size(1) == kTraceEvents && buffer.is_contiguous(),
                    "start_launch_trace: buffer must be a contiguous CUDA int64 tensor [rows, ",
                    kTraceEvents, "]");
  const std::lock_guard<std::mutex> lock(launch_trace.mutex);
  launch_trace.buffer = buffer;
  launch_trace.rows_used = 0;
  launch_trace.blocks.clear();
}

std::vector<int64_t> stop_launch_trace() {
  const std::lock_guard<std::mutex> lock(launch_trace.mutex);
  launch_trace.buffer = at::Tensor();
  return std::move(launch_trace.blocks);
}

StreamProgram::StreamProgram() : impl_(std::make_shared<Impl>()) {}

void StreamProgram::begin() {
  TORCH_CHECK(recording == nullptr, "StreamProgram.begin: another program is being recorded on this thread");
  TORCH_CHECK(!impl_->ended && impl_->stages.empty(), "StreamProgram.begin: this program was recorded already");
  recording = impl_.get();
}

void StreamProgram::add_input(const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.is_cuda(), "StreamProgram.add_input: the tensor must be on a CUDA device");
  impl_->keep_alive.push_back(t);
  impl_->readable.push_back(Impl::region_of(t));
}

void StreamProgram::end() {
  if (recording == impl_.get()) recording = nullptr;
  if (impl_->ended) return;
  impl_->ended = true;
  Impl& p = *impl_;
  if (p.failure.empty() && p.stages.empty()) p.fail("no streaming conv was recorded");
  if (!p.failure.empty()) return;
  const c10::cuda::CUDAGuard guard(p.options->device());
  DPA_DISPATCH_FLOAT_TYPES(p.options->dtype().toScalarType(), "StreamProgram", [&] {
    p.kernel = program_kernel<scalar_t>;
  });
  if (p.shared_bytes > 40 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(p.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(p.shared_bytes)));
  }
  // Every block must be resident at once: blocks wait for each other's stages.
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, p.kernel, kThreads, p.shared_bytes));
  p.grid = wave_blocks();
  if (per_sm * at::cuda::getCurrentDeviceProperties()->multiProcessorCount < p.grid) {
    return p.fail("the program kernel fits " + std::to_string(per_sm) + " blocks per SM, " +
                  std::to_string(kBlocksPerSm) + " are needed");
  }
  p.done = at::zeros({static_cast<int64_t>(p.stages.size()) + 1}, p.options->dtype(at::kInt));
  for (size_t s = 0; s < p.stages.size(); ++s) {
    p.stages[s].a.done = p.done.data_ptr<int>() + s;
    p.stages[s].b.done = p.done.data_ptr<int>() + s;
    if (program_options.load() & kProgramNoPrefetch) p.stages[s].a.prefetch = p.stages[s].b.prefetch = false;
  }
  p.device_stages = Impl::upload(p.stages, *p.options);
}

bool StreamProgram::produced(const at::Tensor& t) const {
  return Impl::contains(impl_->outputs, t.data_ptr());
}

void StreamProgram::run() const { impl_->launch(impl_->device_stages, "run"); }

at::Tensor StreamProgram::run_traced() const {
  const Impl& p = *impl_;
  std::vector<ProgramStage> traced = p.stages;
  at::Tensor trace;
  if (p.ended && p.failure.empty()) {
    trace = at::zeros({num_stages(), p.grid, kTraceEvents}, p.options->dtype(at::kLong));
    for (size_t s = 0; s < traced.size(); ++s) {
      traced[s].a.trace = traced[s].b.trace = trace.data_ptr<int64_t>() + s * p.grid * kTraceEvents;
    }
  }
  p.launch(p.ended && p.failure.empty() ? Impl::upload(traced, *p.options) : at::Tensor(), "run_traced");
  return trace;
}

std::vector<std::string> StreamProgram::stage_names() const {
  std::vector<std::string> names;
  for (const ProgramStage& stage : impl_->stages) {
    const bool transposed = stage.kind >= program_kind(true, 0, false);
    const auto name = [transposed](const StreamArgs& a) {
      const int cin = transposed ? a.red : a.red / a.ksize;
      return std::string(transposed ? "conv_transpose1d " : a.groups ? "conv1d_gn_mish " : "conv1d ") +
             std::to_string(cin) + "->" + std::to_string(a.cout) + " k" + std::to_string(a.ksize) + " L" +
             std::to_string(a.lin);
    };
    names.push_back(stage.a_tiles < stage.grid_x ? name(stage.a) + " + " + name(stage.b) : name(stage.a));
  }
  return names;
}

void StreamProgram::Impl::launch(const at::Tensor& stages_on_device, const char* method) const {
  TORCH_CHECK(ended, "StreamProgram.", method, ": the program is still being recorded (call end())");
  TORCH_CHECK(failure.empty(), "StreamProgram.", method, ": the recording failed: ", failure);
  const Impl& p = *this;
  const c10::cuda::CUDAGuard guard(p.options->device());
  LaunchConfig launch(dim3(p.grid), dim3(kThreads), p.shared_bytes);
  launch.cooperative();
  C10_CUDA_CHECK(cudaLaunchKernelEx(launch.get(), p.kernel,
                                    reinterpret_cast<const ProgramStage*>(stages_on_device.data_ptr()),
                                    static_cast<int>(p.stages.size()), p.done.data_ptr<int>(),
                                    program_options.load()));
}

int64_t StreamProgram::num_stages() const { return static_cast<int64_t>(impl_->stages.size()); }

std::string StreamProgram::failure() const { return impl_->failure; }

TORCH_LIBRARY_IMPL(dpa, CUDA, m) {
  m.impl("conv1d_gn_mish", &conv1d_gn_mish_cuda);
  m.impl("conv1d", &conv1d_cuda);
  m.impl("conv1d_gn_mish_shortcut", &conv1d_gn_mish_shortcut_cuda);
  m.impl("residual_block", &residual_block_cuda);
}

}  // namespace dpa
