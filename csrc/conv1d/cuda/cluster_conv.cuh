// Conv1d-layout convs as thread-block clusters (Hopper, sm_90): a cluster owns a GroupNorm
// group (or a plain conv's row tile) and adds up its blocks' splits and the group's
// statistics in distributed shared memory. Compiled for every arch, with an empty body below
// sm_90, where launch_plan.cpp never picks them.
#pragma once

#include <cooperative_groups.h>

#include "conv1d/cuda/stream_conv.cuh"

namespace dpa {

namespace cg = cooperative_groups;

// GroupNorm convs in thread-block clusters (Hopper). A cluster of row_tiles x splits blocks
// owns one GroupNorm group: cluster rank tile * splits + split streams its rows over its
// reduction slice as above. Each block owns a share of the group's outputs; the blocks push
// their sums straight into the owners' shared memory (st.async, counted by an mbarrier's
// transaction bytes), the owners add up the splits, push their share's moments to every
// block the same way, and each block merges them and applies the epilogue to its share:
// no workspace, counters, finishing block or cluster-wide barrier on the way, each exchange
// one one-way trip. (The finishing block's dependent global round trips cost 5-7 µs per
// layer beyond streaming: docs/tried.md, "One thread-block cluster per GroupNorm group".)

// Waits for the previous kernel (FiLM and the residual may come from it), then prefetches a
// thread's epilogue inputs and bias into L1, to be loaded once its sums are pushed. Loading
// them here would hold them in registers through the staging and streaming, and in half
// precision their conversions (or, where registers run short, their spills) make the thread
// wait for the loads before it stages its input (bf16 blocks' waits ended up to 0.5 µs later
// than fp32's: docs/tried.md, "Epilogue inputs only prefetched into L1").
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

template <typename T, int NT>
StreamKernel cluster_conv_kernel(bool vectorised, bool bulk) {
  constexpr int R = conv_rows<NT>(), kVec = 16 / sizeof(T);
  return bulk         ? stream_conv_cluster_kernel<T, NT, R, kVec, true>
         : vectorised ? stream_conv_cluster_kernel<T, NT, R, kVec, false>
                      : stream_conv_cluster_kernel<T, NT, R, 1, false>;
}

template <typename T, int NT>
PairKernel cluster_pair_kernel(bool vectorised, bool bulk) {
  constexpr int R = conv_rows<NT>(), kVec = 16 / sizeof(T);
  return bulk         ? stream_conv_cluster_pair_kernel<T, NT, R, kVec, true>
         : vectorised ? stream_conv_cluster_pair_kernel<T, NT, R, kVec, false>
                      : stream_conv_cluster_pair_kernel<T, NT, R, 1, false>;
}

// The cluster kernels of dtype T at every position tile, in one translation unit.
#define DPA_INSTANTIATE_CLUSTER_CONV(T)                                                         \
  template StreamKernel cluster_conv_kernel<T, 4>(bool, bool);                                 \
  template StreamKernel cluster_conv_kernel<T, 8>(bool, bool);                                 \
  template StreamKernel cluster_conv_kernel<T, 16>(bool, bool);                                \
  template StreamKernel cluster_conv_kernel<T, 32>(bool, bool);                                \
  template PairKernel cluster_pair_kernel<T, 4>(bool, bool);                                   \
  template PairKernel cluster_pair_kernel<T, 8>(bool, bool);                                   \
  template PairKernel cluster_pair_kernel<T, 16>(bool, bool);                                  \
  template PairKernel cluster_pair_kernel<T, 32>(bool, bool);

}  // namespace dpa
