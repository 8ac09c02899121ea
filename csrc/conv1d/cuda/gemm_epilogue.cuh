// The im2col + cuBLAS route's kernels: im2col (the GEMM's right operand), and the epilogues
// that turn a cuBLAS result into the op's output (GroupNorm, Mish, FiLM, residual; or the
// plain conv's bias and residual). gemm_route.cpp runs the GEMMs and calls the launchers.
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <cooperative_groups.h>
#include <type_traits>
#include <utility>

#include "common/launch.h"
#include "conv1d/cuda/device_common.cuh"
#include "conv1d/cuda/hopper.cuh"
#include "conv1d/cuda/launch_plan.h"

namespace dpa {

namespace cg = cooperative_groups;

// The GEMM route's own kernels (im2col and the epilogues; not the cooperative one) are
// launched as programmatic dependents (launch_dependent, or the cluster epilogue's own launch)
// and wait for the kernel before them before they read or write anything a kernel may touch:
// where that one is a cuBLAS GEMM its blocks' exits stand in for its trigger, so an epilogue
// is resident as the GEMM ends. Every block waits first, before any early exit: a kernel's
// completion then implies its producer's, which the next kernel's wait relies on. The
// epilogues also let the next kernel launch at once (start_as_dependent); im2col_kernel does
// not: launched early, the narrow GEMM after it found SMs taken by its waiting blocks. H100,
// LeRobot's U-Net at horizon 64, batch 1, fp32 ms per DDPM-100 action: 86.4 before, 82.1 so,
// 83.7 with neither triggering early, 97.6 with im2col triggering too (docs/tried.md has
// batch 8). Before the narrow GEMM, im2col_narrow_kernel does, with few blocks.
__device__ __forceinline__ void start_as_dependent() {
  allow_dependents();
  wait_for_producer();
}

template <typename... Params, typename... Args>
void launch_dependent(dim3 grid, void (*kernel)(Params...), Args&&... args) {
  LaunchConfig launch(grid, dim3(kThreads), 0);
  launch.programmatic_dependent();
  C10_CUDA_CHECK(cudaLaunchKernelEx(launch.get(), kernel, std::forward<Args>(args)...));
}

// One output's sum over taps k = 0..taps-1, in tap order, of rows[index(k)] (index < 0: the
// tap adds nothing), from a GEMM result whose rows are (channel, tap); also a split GEMM's
// partial sums, one "tap" per split. The loads go out in batches, unrolled, before any add,
// so that a batch costs one memory round trip: an add waiting on each tap's load in turn made
// the GroupNorm epilogue ~2.5 µs a launch slower. kTaps > 0: exactly that many taps, in one
// batch.
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

// The GEMM route's pre-activations: a cuBLAS result [C_out, B * L] without the bias, which
// is added here (addmm would first copy it into every column of the output, a launch); or
// its `splits` partial sums over slices of the reduction (GemmResult), added up in slice order.
template <typename T>
struct GemmPre {
  const T* p;
  int64_t stride;
  const void* bias;
  int splits;
  int64_t split_stride;
  __device__ float operator()(int c, int n) const {
    const int64_t at = c * stride + n;
    const float v = splits == 1 ? static_cast<float>(p[at])
                                : sum_tap_rows<0>(p, splits, [&](int s) { return s * split_stride + at; });
    return v + (bias ? load_float<T>(bias, c) : 0.f);
  }
};

template <typename T>
__device__ __forceinline__ GemmPre<T> gemm_pre(const StreamArgs& a, const GemmResult& result) {
  return GemmPre<T>{static_cast<const T*>(result.data), a.positions, a.bias, result.splits, result.split_stride};
}

// The GEMM route's pre-activations where the weight's taps are GEMM rows (a taps-major
// weight, GemmForm::kTapRows; stride 1, "same" padding, as every GroupNorm conv): z is
// [C_out * K, B * L] in fp32, row c * K + k holding tap k's products at every input
// position. An output adds up its taps' rows, shifted, then the bias. kTaps: K where it is
// compiled in (0: any), so that the U-Nets' kernel sizes unroll completely.
template <typename T, int kTaps>
struct TapRowsPre {
  static constexpr int kCompiledTaps = kTaps;
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

// An output's epilogue inputs (load_epilogue), the residual taken from io where it says so.
template <typename T>
__device__ __forceinline__ Epilogue load_epilogue_io(const StreamArgs& a, const GemmEpilogueIo& io, int b, int c,
                                                     int l) {
  Epilogue e = load_epilogue<T>(a, b, c, l);
  const int L = a.lout;
  const int64_t positions = static_cast<int64_t>(a.batch) * L;
  if (io.residual_pre) {
    float r = io.residual_bias ? load_float<T>(io.residual_bias, c) : 0.f;
    r += static_cast<float>(static_cast<const T*>(io.residual_pre)[c * positions + b * L + l]);
    e.residual = static_cast<float>(static_cast<T>(r));
  }
  if (io.residual_rows) {
    e.residual = load_float<T>(io.residual_rows, (static_cast<int64_t>(b) * L + l) * a.cout + c);
  }
  return e;
}

// GroupNorm -> Mish -> FiLM -> residual after a cuBLAS conv, one block per (batch, group).
// pre(c, b * L + l): the pre-activations, read from the GEMM's result (GemmPre,
// TapRowsPre). A group of up to kHeldPerThread * kThreads elements is held in registers
// (conv_params.h says why); the launcher cuts larger ones into slices (GroupSlices).
template <typename T, typename Pre>
__device__ __forceinline__ void group_norm_epilogue(const StreamArgs& a, const Pre& pre, const GemmEpilogueIo& io) {
  __shared__ float scratch[kWarps];
  __shared__ float staged[kHeldPerThread * kThreads];  // the group's outputs, for io.cols
  start_as_dependent();
  const int b = blockIdx.x / a.groups, g = blockIdx.x % a.groups;
  const int cpg = a.cout / a.groups, L = a.lout, count = cpg * L;
  float v[kHeldPerThread];
  Epilogue e[kHeldPerThread];
#pragma unroll
  for (int j = 0; j < kHeldPerThread; ++j) {
    const int i = threadIdx.x + j * kThreads, c = g * cpg + i / L, l = i % L;
    if (i < count) {
      v[j] = pre(c, b * L + l);
      e[j] = load_epilogue_io<T>(a, io, b, c, l);
    }
  }
  const float2 moments = held_moments(v, count, scratch);
  const float mean = moments.x, rstd = rsqrtf(moments.y / count + a.eps);
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
    group_norm_epilogue_kernel(const StreamArgs a, const GemmResult result, const GemmEpilogueIo io) {
  group_norm_epilogue<T>(a, gemm_pre<T>(a, result), io);
}

// Here the functor is a kernel parameter: built in the kernel from a (as GemmPre is, which
// is faster so), a batch 64 half-precision step took ~2% longer on an H100.
template <typename T, int kTaps>
__global__ void __launch_bounds__(kThreads)
    tap_rows_group_norm_epilogue_kernel(const StreamArgs a, const TapRowsPre<T, kTaps> pre,
                                        const GemmEpilogueIo io) {
  group_norm_epilogue<T>(a, pre, io);
}

// The sliced GroupNorm epilogue (GroupSlices): each block takes slice blockIdx.x % slices of
// (batch row, group) blockIdx.x / slices, and normalizes the values it holds once it has its
// group's other slices' moments. Three ways, in order of preference:
// - Hopper: each group's slices one thread-block cluster (group_slices_cluster_kernel), the
//   moments pushed into every block's shared memory;
// - one cooperative launch where every block can be resident at once and the op has counters
//   (group_slices_kernel): the moments meet in global memory, on a counter per group;
// - two launches: group_slice_moments_kernel stores the slice's pre-activations and moments,
//   and group_slice_normalize_kernel reads them back.
// All three merge the same moments in the same order: the same bits.

// Slices k0..k1 - 1's moments m[k - k0] merged into a group's running (merged count, mean,
// sum of squared deviations), in slice order: Chan et al.'s pairwise update (no cancellation,
// and the same bits on every run and in every sliced kernel).
__device__ __forceinline__ void merge_slice_moments(const float2* m, int k0, int k1, const GroupSlices& s, int count,
                                                    float& merged, float& mean, float& m2) {
  for (int k = k0; k < k1; ++k) {
    const float nk = static_cast<float>(min(s.slice_len, count - k * s.slice_len));
    const float total = merged + nk, delta = m[k - k0].x - mean;
    mean += delta * (nk / total);
    m2 += m[k - k0].y + delta * delta * (merged * nk / total);
    merged = total;
  }
}

// A group's mean and 1 / std from its slices' moments in global memory: kThreads slices'
// moments at a time through shared memory, merged by thread 0.
__device__ __forceinline__ float2 merged_slice_stats(const StreamArgs& a, const GroupSlices& s, int unit, int count) {
  __shared__ float2 moments[kThreads];
  __shared__ float2 stats;
  float merged = 0.f, mean = 0.f, m2 = 0.f;
  for (int k0 = 0; k0 < s.slices; k0 += kThreads) {
    if (k0 + threadIdx.x < s.slices) {
      moments[threadIdx.x] = __ldcg(s.moments + static_cast<int64_t>(unit) * s.slices + k0 + threadIdx.x);
    }
    __syncthreads();
    if (threadIdx.x == 0) merge_slice_moments(moments, k0, min(k0 + kThreads, s.slices), s, count, merged, mean, m2);
    __syncthreads();  // moments is rewritten by the next round
  }
  if (threadIdx.x == 0) stats = make_float2(mean, rsqrtf(m2 / count + a.eps));
  __syncthreads();
  return stats;
}

// Which slice a block of the sliced epilogue holds: its (batch, group) unit, the slice within
// it, and the slice's elements lo..lo + n of the group's count (cpg channels x L positions).
struct GroupSlice {
  int unit, slice, b, g, L, cpg, count, lo, n;
};

__device__ __forceinline__ GroupSlice group_slice_of(const StreamArgs& a, const GroupSlices& s) {
  GroupSlice q;
  q.unit = blockIdx.x / s.slices;
  q.slice = blockIdx.x % s.slices;
  q.b = q.unit / a.groups;
  q.g = q.unit % a.groups;
  q.L = a.lout;
  q.cpg = a.cout / a.groups;
  q.count = q.cpg * q.L;
  q.lo = q.slice * s.slice_len;
  q.n = min(s.slice_len, q.count - q.lo);
  return q;
}

// f(j, i, c, l) for each element of slice q the thread holds: held value j is the group's
// element i, channel c at position l. The sliced kernels' one way to walk a slice.
template <typename F>
__device__ __forceinline__ void for_held(const GroupSlice& q, const F& f) {
#pragma unroll
  for (int j = 0; j < kHeldPerThread; ++j) {
    const int i = q.lo + threadIdx.x + j * kThreads;
    if (i < q.lo + q.n) f(j, i, q.g * q.cpg + i / q.L, i % q.L);
  }
}

// GroupNorm (stats: mean, 1 / std) -> Mish -> FiLM -> residual on the slice's held values,
// stored as the op's output, or with io.cols channels-last ([B * L][C_out]: io.taps is 1 for
// a slice) through shared memory, so that consecutive threads store consecutive channels of
// one position (the slice's channels c0.. of row l are contiguous there).
template <typename T>
__device__ __forceinline__ void normalize_held(const StreamArgs& a, const GroupSlice& q, const GemmEpilogueIo& io,
                                               const float (&v)[kHeldPerThread],
                                               const Epilogue (&e)[kHeldPerThread], float2 stats) {
  __shared__ float staged[kHeldPerThread * kThreads];
  for_held(q, [&](int j, int i, int c, int l) {
    const float out = apply_epilogue(e[j], mish((v[j] - stats.x) * stats.y * e[j].gamma + e[j].beta));
    if (io.cols) {
      staged[i - q.lo] = out;
    } else {
      store_output<T>(a, q.b, c, l, out);
    }
  });
  if (!io.cols) return;
  __syncthreads();
  const int c0 = q.lo / q.L, width = (q.lo + q.n - 1) / q.L - c0 + 1;  // the slice's channels
  T* rows = static_cast<T*>(io.cols) + static_cast<int64_t>(q.b) * q.L * a.cout + q.g * q.cpg;
  for (int m = threadIdx.x; m < q.L * width; m += kThreads) {
    const int l = m / width, c = c0 + m % width, i = c * q.L + l;
    if (i >= q.lo && i < q.lo + q.n) rows[static_cast<int64_t>(l) * a.cout + c] = static_cast<T>(staged[i - q.lo]);
  }
}

// The one-launch kernels' start: slice q's pre-activations and epilogue inputs loaded and
// held, and the slice's moments.
template <typename T, typename Pre>
__device__ __forceinline__ float2 load_slice(const StreamArgs& a, const Pre& pre, const GemmEpilogueIo& io,
                                             const GroupSlice& q, float (&v)[kHeldPerThread],
                                             Epilogue (&e)[kHeldPerThread], float* scratch) {
  start_as_dependent();
  for_held(q, [&](int j, int, int c, int l) {
    v[j] = pre(c, q.b * q.L + l);
    e[j] = load_epilogue_io<T>(a, io, q.b, c, l);
  });
  return held_moments(v, q.n, scratch);
}

// Thread 0 of each of a group's `slices` blocks: counts in on the group's counter, waits
// until all have, then counts out; the last out zeroes it, as every op's counters are between
// launches. Each count is a release of what the block stored before (its moments) and an
// acquire of the others'. Waiting on other blocks is safe only in a cooperative launch, which
// makes them all resident. Counters that were not zero on entry (a caller's, or one model run
// on two streams at once, which the README rules out) could leave a block waiting for ever:
// after a second the kernel traps instead, an error the process sees, not a hung GPU.
__device__ __forceinline__ void slices_meet(int* counter, int slices) {
  atomic_add_acq_rel(counter, 1);
  const uint64_t start = global_timer_ns();
  while (load_acquire(counter) < slices) {
    if (global_timer_ns() - start > 1000000000ull) __trap();
  }
  if (atomic_add_acq_rel(counter, 1) == 2 * slices - 1) atomicExch(counter, 0);
}

// At most 64 registers, so that four blocks an SM are resident (the io options took it to 74).
template <typename T, typename Pre>
__global__ void __launch_bounds__(kThreads, 4)
    group_slices_kernel(const StreamArgs a, const Pre pre, const GroupSlices s, const GemmEpilogueIo io) {
  __shared__ float scratch[kWarps];
  const GroupSlice q = group_slice_of(a, s);
  float v[kHeldPerThread];
  Epilogue e[kHeldPerThread];
  const float2 moments = load_slice<T>(a, pre, io, q, v, e, scratch);
  if (threadIdx.x == 0) {
    s.moments[static_cast<int64_t>(q.unit) * s.slices + q.slice] = moments;
    slices_meet(a.counters + q.unit, s.slices);
  }
  __syncthreads();
  normalize_held<T>(a, q, io, v, e, merged_slice_stats(a, s, q.unit, q.count));
}

// The cluster: block q of a group's cluster holds slice q, and lanes r < slices of its block
// push its moments into block r's shared memory (st.async, counted on that block's
// mbarrier): no moment goes through L2, and no block waits on a global counter (the
// cooperative kernel's two atomics and its moments' load are dependent L2 round trips).
// LeRobot's U-Net at horizon 64, batch 1, DDPM-100 (H100): bf16 48.1 -> 44.4 ms, fp32
// 98.4 -> 94.6 (docs/tried.md).
template <typename T, typename Pre>
__global__ void __launch_bounds__(kThreads)
    group_slices_cluster_kernel(const StreamArgs a, const Pre pre, const GroupSlices s,
                                const GemmEpilogueIo io) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __shared__ float scratch[kWarps];
  __shared__ float2 received[kMaxClusterBlocks];  // slice r's moments
  __shared__ uint64_t arrived;
  __shared__ float2 stats;
  const cg::cluster_group cluster = cg::this_cluster();
  const GroupSlice q = group_slice_of(a, s);  // q.slice is the block's rank in the cluster
  if (threadIdx.x == 0) {
    mbarrier_init(&arrived);
    mbarrier_expect_bytes(&arrived, s.slices * sizeof(float2));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  cluster.barrier_arrive();  // waited for before the first push: every barrier is set up
  float v[kHeldPerThread];
  Epilogue e[kHeldPerThread];
  const float2 moments = load_slice<T>(a, pre, io, q, v, e, scratch);
  cluster.barrier_wait();
  if (threadIdx.x < s.slices) {
    push(in_block(shared_address(&received[q.slice]), threadIdx.x), moments,
         in_block(shared_address(&arrived), threadIdx.x));
  }
  mbarrier_wait(&arrived, 0);
  if (threadIdx.x == 0) {
    float merged = 0.f, mean = 0.f, m2 = 0.f;
    merge_slice_moments(received, 0, s.slices, s, q.count, merged, mean, m2);
    stats = make_float2(mean, rsqrtf(m2 / q.count + a.eps));
  }
  __syncthreads();
  normalize_held<T>(a, q, io, v, e, stats);
  // No block leaves before every push into its shared memory has arrived, and none pushes
  // after that: no barrier before leaving.
#endif
}

// The two launches' first: the slice's pre-activations and moments, stored.
template <typename T, typename Pre>
__global__ void __launch_bounds__(kThreads)
    group_slice_moments_kernel(const StreamArgs a, const Pre pre, const GroupSlices s) {
  __shared__ float scratch[kWarps];
  start_as_dependent();
  const GroupSlice q = group_slice_of(a, s);
  float v[kHeldPerThread];
  for_held(q, [&](int j, int i, int c, int l) {
    v[j] = pre(c, q.b * q.L + l);
    s.pre[static_cast<int64_t>(q.unit) * q.count + i] = v[j];
  });
  const float2 moments = held_moments(v, q.n, scratch);
  if (threadIdx.x == 0) s.moments[static_cast<int64_t>(q.unit) * s.slices + q.slice] = moments;
}

// Second launch: the group's statistics from its slices' moments, then the slice normalized.
// Its epilogue inputs and pre-activations are requested before the merge, so that their
// round trip overlaps it.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    group_slice_normalize_kernel(const StreamArgs a, const GroupSlices s, const GemmEpilogueIo io) {
  start_as_dependent();
  const GroupSlice q = group_slice_of(a, s);
  float v[kHeldPerThread];
  Epilogue e[kHeldPerThread];
  for_held(q, [&](int j, int i, int c, int l) {
    v[j] = __ldcg(s.pre + static_cast<int64_t>(q.unit) * q.count + i);
    e[j] = load_epilogue_io<T>(a, io, q.b, c, l);
  });
  normalize_held<T>(a, q, io, v, e, merged_slice_stats(a, s, q.unit, q.count));
}

// The GEMM route's epilogue of a plain conv: the bias and the residual added to the GEMM's
// result (GemmForm), written as [B, C_out, L_out]. The host keeps every index below 2^31.
template <typename T, typename P>
__global__ void __launch_bounds__(kThreads) conv_epilogue_kernel(const StreamArgs a, const GemmResult result,
                                                                 GemmForm form) {
  start_as_dependent();
  const int i = blockIdx.x * kThreads + threadIdx.x;
  if (i >= a.batch * a.cout * a.lout) return;
  const int row = i / a.lout, o = i - row * a.lout, b = row / a.cout, c = row - b * a.cout;
  const P* pre = static_cast<const P*>(result.data);
  float v;
  if (form == GemmForm::kIm2col) {
    v = GemmPre<P>{pre, a.positions, nullptr, result.splits, result.split_stride}(c, b * a.lout + o);
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

// blockIdx.x picks positions, blockIdx.y rows, so that each element costs 32-bit arithmetic
// only: one 64-bit division per element made this kernel instruction-bound (~7 µs a launch
// at batch 64; docs/tried.md, "im2col on a 2-D grid"). A thread's rows are loaded together,
// then stored: one round trip of latency for all of them. One launch, where ATen's pad,
// unfold and reshape took two copies.
constexpr int kIm2colRowsPerThread = 8;

// kSplit: channels from x_split on (a concatenation read in place) come from x2; a template
// argument because choosing per element cost this instruction-bound kernel about 1.5% of a
// batch 64 half-precision step (docs/tried.md, "No PyTorch kernel between steps"), convs
// without a concatenation included.
template <typename T, bool kSplit>
__global__ void __launch_bounds__(kThreads) im2col_kernel(const StreamArgs a, const Im2col cut,
                                                          int rows, T* __restrict__ cols) {
  wait_for_producer();
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

// floor(n / d) for magic = ceil(2^32 / d) (division_magic), exact for n * (d - 1) < 2^32:
// n * magic / 2^32 = n / d + n * e / (d 2^32) with e = magic * d - 2^32 < d. One multiply.
__device__ __forceinline__ int divide(int n, uint64_t magic) {
  return static_cast<int>((static_cast<uint64_t>(n) * magic) >> 32);
}

// im2col before the narrow GEMM (narrow_gemm.cu: at most 32 positions): a thread takes
// elements e + j * (blocks x kThreads) of the columns' rows x positions, so that a few blocks
// hold all of them where im2col_kernel's grid has a block per 8 rows, nearly all of whose
// threads have no position. Few blocks let it launch the GEMM at once (allow_dependents):
// the GEMM's blocks, one an SM, find room beside its waiting blocks and request their first
// weights while the epilogue before im2col still runs. With im2col_kernel's thousands of
// waiting blocks they did not (gemm_epilogue.cuh's launch comment above).
template <typename T, bool kSplit>
__global__ void __launch_bounds__(kThreads) im2col_narrow_kernel(const StreamArgs a, const Im2col cut, int rows,
                                                                 T* __restrict__ cols, uint64_t positions_magic,
                                                                 uint64_t taps_magic, uint64_t length_magic) {
  allow_dependents();
  wait_for_producer();
  const int positions = a.batch * cut.length, elements = rows * positions;
  const int step = gridDim.x * kThreads;
  for (int e0 = blockIdx.x * kThreads + threadIdx.x; e0 < elements; e0 += kIm2colRowsPerThread * step) {
    T v[kIm2colRowsPerThread];
#pragma unroll
    for (int j = 0; j < kIm2colRowsPerThread; ++j) {
      const int e = e0 + j * step;
      const int row = divide(e, positions_magic), n = e - row * positions;
      const int b = divide(n, length_magic), l = n - b * cut.length;
      const int c = divide(row, taps_magic), pos = l * cut.stride + row - c * cut.taps - cut.pad;
      const bool second = kSplit && c >= a.x_split;
      const T* column = second ? static_cast<const T*>(a.x2) + b * a.x2_sb + (c - a.x_split) * a.x2_sc
                               : static_cast<const T*>(a.x) + b * a.x_sb + c * a.x_sc;
      v[j] = e < elements && pos >= 0 && pos < a.lin ? column[pos * (second ? a.x2_sl : a.x_sl)]
                                                     : static_cast<T>(0.f);
    }
#pragma unroll
    for (int j = 0; j < kIm2colRowsPerThread; ++j) {
      const int e = e0 + j * step;
      if (e < elements) cols[e] = v[j];
    }
  }
}

template <typename T>
void launch_im2col(const StreamArgs& a, const Im2col& cut, int rows, T* cols, bool narrow_next) {
  const int positions = a.batch * cut.length;
  // Only where the GEMM can launch early: without programmatic dependent launch the few
  // blocks gain nothing, and they took longer than im2col_kernel's (docs/tried.md). divide()
  // is exact for its dividends (elements below rows x positions, rows, positions) where rows
  // x positions x max(positions, taps) < 2^32, which every U-Net layer meets by far
  // (LeRobot's widest: 20480 x 16 x 16); a wider conv takes im2col_kernel.
  if (narrow_next && pdl_launches() &&
      int64_t{rows} * positions * std::max(positions, cut.taps) < (int64_t{1} << 32)) {
    TORCH_INTERNAL_ASSERT(positions <= kNarrowMaxPositions, "im2col before the narrow GEMM: at most ",
                          kNarrowMaxPositions, " positions, got ", positions);
    // Up to two blocks an SM: a 4096-channel k5 conv's 20480 rows x 16 positions in one pass.
    const int blocks = std::clamp(ceil_div(int64_t{rows} * positions, kThreads * kIm2colRowsPerThread), 1,
                                  2 * sm_budget());
    launch_dependent(dim3(blocks), a.x2 ? im2col_narrow_kernel<T, true> : im2col_narrow_kernel<T, false>, a, cut,
                     rows, cols, division_magic(positions), division_magic(cut.taps), division_magic(cut.length));
    return;
  }
  const dim3 grid((a.positions + kThreads - 1) / kThreads,
                  std::min((rows + kIm2colRowsPerThread - 1) / kIm2colRowsPerThread, 65535));
  launch_dependent(grid, a.x2 ? im2col_kernel<T, true> : im2col_kernel<T, false>, a, cut, rows, cols);
}

// f(pre functor) for the GEMM result of the form: TapRowsPre, Diffusion Policy's kernel sizes
// compiled in, or GemmPre.
template <typename T, typename F>
void with_pre(const StreamArgs& a, const GemmResult& pre, GemmForm form, const F& f) {
  if (form != GemmForm::kTapRows) {
    return f(GemmPre<T>{static_cast<const T*>(pre.data), a.positions, a.bias, pre.splits, pre.split_stride});
  }
  const auto rows = [&](auto taps) {
    return TapRowsPre<T, decltype(taps)::value>{static_cast<const float*>(pre.data), a.positions, a.bias, a.ksize,
                                                a.pad, a.lout};
  };
  if (a.ksize == 5) return f(rows(std::integral_constant<int, 5>{}));
  if (a.ksize == 3) return f(rows(std::integral_constant<int, 3>{}));
  return f(rows(std::integral_constant<int, 0>{}));
}

template <typename T>
bool group_slices_fit(const StreamArgs& a, GemmForm form, int blocks) {
  bool fits = false;
  with_pre<T>(a, GemmResult{}, form, [&](const auto& rows) {
    using Pre = std::decay_t<decltype(rows)>;
    fits = cooperative_fits(reinterpret_cast<const void*>(group_slices_kernel<T, Pre>), blocks);
  });
  return fits;
}

template <typename T>
bool group_slices_cluster_fit(const StreamArgs& a, GemmForm form, int slices, int clusters) {
  bool fits = false;
  with_pre<T>(a, GemmResult{}, form, [&](const auto& rows) {
    using Pre = std::decay_t<decltype(rows)>;
    fits = clusters_fit(reinterpret_cast<const void*>(group_slices_cluster_kernel<T, Pre>), slices, 0, clusters);
  });
  return fits;
}

template <typename T>
void launch_group_norm_epilogue(const StreamArgs& a, const GemmResult& pre, GemmForm form,
                                const GemmEpilogueIo& io, const GroupSlices& slices) {
  const int units = a.batch * a.groups;
  TORCH_INTERNAL_ASSERT(slices.slices == 1 || !io.cols || io.taps == 1,
                        "a sliced GroupNorm epilogue writes columns of one tap only");
  if (slices.slices > 1) {
    const dim3 grid(units * slices.slices);
    with_pre<T>(a, pre, form, [&](const auto& rows) {
      using Pre = std::decay_t<decltype(rows)>;
      if (slices.cluster) {  // group_slices_cluster_fit
        LaunchConfig launch(grid, dim3(kThreads), 0);
        launch.clusters(slices.slices);
        launch.programmatic_dependent();
        C10_CUDA_CHECK(cudaLaunchKernelEx(launch.get(), group_slices_cluster_kernel<T, Pre>, a, rows, slices, io));
        return;
      }
      if (slices.cooperative) {  // one launch (group_slices_fit)
        LaunchConfig launch(grid, dim3(kThreads), 0);
        launch.cooperative();
        const cudaError_t error =
            cudaLaunchKernelEx(launch.get(), group_slices_kernel<T, Pre>, a, rows, slices, io);
        if (error == cudaSuccess) return;
        // Refused where the process has fewer SMs than planned for (a green context or an MPS
        // share without KernelConfig.sm_count): the two launches instead.
        if (error != cudaErrorCooperativeLaunchTooLarge) C10_CUDA_CHECK(error);
        (void)cudaGetLastError();
      }
      launch_dependent(grid, group_slice_moments_kernel<T, Pre>, a, rows, slices);
      launch_dependent(grid, group_slice_normalize_kernel<T>, a, slices, io);
    });
  } else if (form != GemmForm::kTapRows) {
    launch_dependent(dim3(units), group_norm_epilogue_kernel<T>, a, pre, io);
  } else {
    with_pre<T>(a, pre, form, [&](const auto& rows) {
      using Pre = std::decay_t<decltype(rows)>;
      if constexpr (!std::is_same_v<Pre, GemmPre<T>>) {
        launch_dependent(dim3(units), tap_rows_group_norm_epilogue_kernel<T, Pre::kCompiledTaps>, a, rows, io);
      }
    });
  }
}

template <typename T>
void launch_conv_epilogue(const StreamArgs& a, const GemmResult& pre, GemmForm form) {
  const int64_t outputs = static_cast<int64_t>(a.batch) * a.cout * a.lout;
  const int blocks = static_cast<int>((outputs + kThreads - 1) / kThreads);
  const auto kernel = form == GemmForm::kIm2col ? conv_epilogue_kernel<T, T> : conv_epilogue_kernel<T, float>;
  launch_dependent(dim3(blocks), kernel, a, pre, form);
}

// The GEMM route's kernels of dtype T, in one translation unit.
#define DPA_INSTANTIATE_GEMM_EPILOGUE(T)                                                              \
  template void launch_im2col<T>(const StreamArgs&, const Im2col&, int, T*, bool);                    \
  template void launch_group_norm_epilogue<T>(const StreamArgs&, const GemmResult&, GemmForm,        \
                                              const GemmEpilogueIo&, const GroupSlices&);             \
  template bool group_slices_fit<T>(const StreamArgs&, GemmForm, int);                                 \
  template bool group_slices_cluster_fit<T>(const StreamArgs&, GemmForm, int, int);                    \
  template void launch_conv_epilogue<T>(const StreamArgs&, const GemmResult&, GemmForm);

}  // namespace dpa
