// How a streaming conv is cut into blocks or thread-block clusters: the launch plans of the
// streaming kernels (conv_params.h lists the families), decided on the host from the
// problem's sizes and the device's SM count and shared memory.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime.h>

#include "conv1d/cuda/conv_params.h"

namespace dpa {

inline int ceil_div(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

// ceil(2^32 / d): the kernels' divide() by d with one multiply.
inline uint64_t division_magic(int d) { return ((uint64_t{1} << 32) + d - 1) / d; }

// Blocks in one wave: kBlocksPerSm on every SM. A second, partial wave would leave most SMs
// idle while it runs.
int wave_blocks();

// A streaming launch, fully decided before the workspace is allocated. pair_kernel: the
// same instantiation serving two problems (Conv1d layout, split-K only).
struct StreamLaunch {
  StreamKernel kernel = nullptr;
  PairKernel pair_kernel = nullptr;
  dim3 grid;
  size_t shared_bytes = 0;
  int cluster_blocks = 0;  // blocks per cluster (0: not a cluster launch)
};

// A conv1d_gn_mish_shortcut pair's cluster launch (cluster_pair_kernel); kernel null where
// the pair has no cluster plan.
struct ClusterPairLaunch {
  PairKernel kernel = nullptr;
  int a_units = 0, b_units = 0, cluster_blocks = 0;
  size_t shared_bytes = 0;
};

// Position tiles of a (a.positions set), and whether its blocks prefetch their own weights
// into L2 while they wait for the previous kernel.
void tile_positions(StreamArgs& a, const at::Tensor& weight);

// The launch of problem a (tiled) of dtype `dtype` on about `blocks` blocks: where
// `clustered` and the plan fits, a cluster kernel; else split-K. Sets a's split fields.
StreamLaunch plan_stream(StreamArgs& a, at::ScalarType dtype, bool transposed, const at::Tensor& weight,
                         int blocks, bool clustered);

// A residual block's first conv (a, GroupNorm) and its 1x1 shortcut (b) in one cluster
// launch, if their plans fit (kernel null otherwise).
ClusterPairLaunch plan_cluster_pair(StreamArgs& a, StreamArgs& b, at::ScalarType dtype, const at::Tensor& wa,
                                    const at::Tensor& wb);

// Whether `blocks` blocks of `kernel` (kThreads threads, static shared memory only) can be
// one cooperative launch: the device has them, and the blocks are resident at once within
// the SM budget and the current context's SMs (a green context's).
bool cooperative_fits(const void* kernel, int blocks);

// Whether `clusters` clusters of `cluster_blocks` blocks of `kernel` (kThreads threads,
// shared_bytes of dynamic shared memory) can all be resident at once on the SM budget.
bool clusters_fit(const void* kernel, int cluster_blocks, size_t shared_bytes, int clusters);

// What a launch of `kernel` must opt into: beyond 48 KB of static + dynamic shared memory,
// and clusters beyond the portable 8 blocks.
void set_kernel_attributes(const void* kernel, int cluster_blocks, size_t shared_bytes);

}  // namespace dpa
