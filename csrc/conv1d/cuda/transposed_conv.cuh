// ConvTranspose1d (the U-Net's Upsample1d) on the streaming route: its weights
// [C_in, C_out, K] are GEMM columns. Split-K blocks whose finishing block folds the taps into
// positions, and on Hopper thread-block clusters that do so in distributed shared memory.
#pragma once

#include <cooperative_groups.h>

#include "conv1d/cuda/splitk_finish.cuh"
#include "conv1d/cuda/hopper.cuh"

namespace dpa {

namespace cg = cooperative_groups;

// ConvTranspose1d layout: the GEMM Y[(c_out, k)][(b, j)] = sum_ci W[ci][(c_out, k)] x[b, ci, j]
// streams W's rows whole: block = (32 * EPL columns, a slice of input channels); lane owns
// EPL consecutive columns, warps take every kWarps-th input channel of the slice and are
// summed in shared memory at the end. The finishing block folds taps into positions.
//
// Streams the columns of tile `tile` over input-channel slice `split` at positions n0..
// n0 + NT - 1 and leaves their sums in warp 0's acc (EPL columns x NT positions a lane, from
// column tile * 32 * EPL + lane * EPL). Returns whether the lane's columns exist.
template <typename T, int NT, int EPL>
__device__ __forceinline__ bool stream_transposed_sums(const StreamArgs& a, int tile, int split, int n0,
                                                       float (&acc)[EPL * NT]) {
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
  wait_for_producer();
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

template <typename T, int NT, int EPL>
__device__ __forceinline__ void stream_transposed_tile(const StreamArgs& a, int tile, int split, int n_tile) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int tile_lo = tile * 32 * EPL, col = tile_lo + lane * EPL, n0 = n_tile * NT;
  float acc[EPL * NT];
  const bool active = stream_transposed_sums<T, NT, EPL>(a, tile, split, n0, acc);
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
  stream_transposed_tile<T, NT, EPL>(a, blockIdx.x, blockIdx.y, blockIdx.z);
}

// ConvTranspose1d in thread-block clusters (Hopper): a cluster of K / EPL column tiles x
// a.splits blocks owns a unit of 32 output channels (all K taps of each: 32 * K GEMM
// columns). Block rank tile * splits + split streams its tile over its slice of input
// channels as above and pushes warp 0's sums to the blocks that own them (block q: the
// unit's channels [q * share, ...)); each owner adds up the splits in order, folds the taps
// into positions and stores. No workspace, counters or finishing block: the split-K kernel's
// finishing block, an L2 round trip per tap of each of its outputs, made the U-Nets'
// upsampling 12-15 µs a launch (docs/tried.md, "Clusters instead of split-K finishing").
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
  const bool active = stream_transposed_sums<T, NT, EPL>(a, tile, split, 0, acc);
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

template <typename T, int NT>
StreamKernel splitk_transposed_kernel(bool vectorised) {
  constexpr int kVec = transposed_vector<T, NT>();
  return vectorised ? stream_conv_transposed_kernel<T, NT, kVec> : stream_conv_transposed_kernel<T, NT, 1>;
}

template <typename T, int NT>
StreamKernel cluster_transposed_kernel(bool vectorised) {
  constexpr int kVec = transposed_vector<T, NT>();
  return vectorised ? stream_transposed_cluster_kernel<T, NT, kVec> : stream_transposed_cluster_kernel<T, NT, 1>;
}

// The transposed conv kernels of dtype T at every position tile, in one translation unit.
#define DPA_INSTANTIATE_TRANSPOSED_CONV(T)                                                      \
  template StreamKernel splitk_transposed_kernel<T, 4>(bool);                                  \
  template StreamKernel splitk_transposed_kernel<T, 8>(bool);                                  \
  template StreamKernel splitk_transposed_kernel<T, 16>(bool);                                 \
  template StreamKernel splitk_transposed_kernel<T, 32>(bool);                                 \
  template StreamKernel cluster_transposed_kernel<T, 4>(bool);                                 \
  template StreamKernel cluster_transposed_kernel<T, 8>(bool);                                 \
  template StreamKernel cluster_transposed_kernel<T, 16>(bool);                                \
  template StreamKernel cluster_transposed_kernel<T, 32>(bool);

}  // namespace dpa
