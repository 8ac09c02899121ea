// Conv1d-layout convs on split-K blocks: each block streams a row tile over a slice of the
// reduction (stream_conv.cuh) and writes its sums to the workspace; the last block of each
// output tile finishes it (splitk_finish.cuh). The portable streaming path: every GPU from
// sm_80 on, and Hopper layers whose cluster plan does not fit.
#pragma once

#include "conv1d/cuda/splitk_finish.cuh"
#include "conv1d/cuda/stream_conv.cuh"

namespace dpa {

// A split-K block: its sums go to the workspace, and the last block of an output tile
// finishes it (arrive_and_finish).
template <typename T, int NT, int R, int EPL>
__device__ __forceinline__ void stream_conv_tile(const StreamArgs& a, int tile, int split, int n_tile) {
  const int tile_lo = tile * kWarps * R, row_hi = min(tile_lo + kWarps * R, a.m);
  const int n0 = n_tile * NT;
  float acc[R * NT];
  int base;
  stream_conv_sums<T, NT, R, EPL, stream_depth<T>(), false>(a, tile_lo, row_hi, split, n0,
                                                        WaitForProducer{}, acc, base);
  put_owned_sums<NT, R>(acc, base, [&](int r, int n, float v) {
    if (tile_lo + r < row_hi) a.ws[(static_cast<int64_t>(split) * a.m + tile_lo + r) * a.nt + n0 + n] = v;
  });
  extern __shared__ float4 shared_f4[];
  arrive_and_finish<T, false>(a, tile_lo, row_hi, reinterpret_cast<float*>(shared_f4), NT * a.split_len);
}

template <typename T, int NT, int R, int EPL>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm) stream_conv_kernel(const StreamArgs a) {
  stream_conv_tile<T, NT, R, EPL>(a, blockIdx.x, blockIdx.y, blockIdx.z);
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
                                  blockIdx.z);
}

template <typename T, int NT>
StreamKernel splitk_conv_kernel(bool vectorised) {
  constexpr int R = conv_rows<NT>(), kVec = 16 / sizeof(T);
  return vectorised ? stream_conv_kernel<T, NT, R, kVec> : stream_conv_kernel<T, NT, R, 1>;
}

template <typename T, int NT>
PairKernel splitk_pair_kernel(bool vectorised) {
  constexpr int R = conv_rows<NT>(), kVec = 16 / sizeof(T);
  return vectorised ? stream_conv_pair_kernel<T, NT, R, kVec> : stream_conv_pair_kernel<T, NT, R, 1>;
}

// The split-K kernels of dtype T at every position tile, in one translation unit.
#define DPA_INSTANTIATE_SPLITK_CONV(T)                                                          \
  template StreamKernel splitk_conv_kernel<T, 4>(bool);                                        \
  template StreamKernel splitk_conv_kernel<T, 8>(bool);                                        \
  template StreamKernel splitk_conv_kernel<T, 16>(bool);                                       \
  template StreamKernel splitk_conv_kernel<T, 32>(bool);                                       \
  template PairKernel splitk_pair_kernel<T, 4>(bool);                                          \
  template PairKernel splitk_pair_kernel<T, 8>(bool);                                          \
  template PairKernel splitk_pair_kernel<T, 16>(bool);                                         \
  template PairKernel splitk_pair_kernel<T, 32>(bool);

}  // namespace dpa
