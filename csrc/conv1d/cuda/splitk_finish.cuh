// The split-K kernels' finishing block: the last block to count its partial sums into an
// output tile (a per-tile arrival counter elects it) adds up the splits' sums in a fixed
// order and applies the epilogue. Shared by splitk_conv.cuh and transposed_conv.cuh.
#pragma once

#include "conv1d/cuda/device_common.cuh"

namespace dpa {

// Adds split 0.. splits-1 of workspace element `offset` (rows of m x nt floats apart) to s,
// in split order (deterministic), kBatch loads in flight at a time: the finishing loop of the
// tiles finish_held_tile does not take (tile_held), which requests a tile's splits at once.
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

// Complete pre-activations of an output tile, pre(c, n) with n = b * L_out + l: in the
// finishing block's shared memory or in the workspace (written by other blocks: read through
// L2); or in a cuBLAS result. One type for both streaming cases, so that the finishing code
// exists once per kernel (one copy per source made it ~110 KB of SASS: docs/tried.md,
// "Compact finishing code").
struct TilePre {
  const float* shared;  // [c - c_lo][n], or null: in the workspace
  const float* ws;
  int c_lo, positions;
  int64_t nt;
  __device__ float operator()(int c, int n) const {
    return shared ? shared[(c - c_lo) * positions + n] : __ldcg(ws + c * nt + n);
  }
};

// Whether a conv's output tile of `count` elements is finished held in registers
// (finish_held_tile): kHeldPerThread a thread, and a GroupNorm's statistics over one batch
// row. Larger tiles, and GroupNorm at batch 2 and up, take the loop in finish_conv_tile.
__device__ __forceinline__ bool tile_held(const StreamArgs& a, int count) {
  return count <= kHeldPerThread * kThreads && (a.groups == 0 || a.batch == 1);
}

// An output tile of channels [c_lo, ...), `count` elements, held in registers: thread t
// holds elements t + j * kThreads, j < H. Every held element's first kBatch splits' partial
// sums are requested at once, 32 loads a thread, and the epilogue inputs and bias behind
// them, so that the finishing block waits for one L2 round trip per kBatch splits (16 at two
// elements a thread, 8 at four: one round trip on the default U-Nets' layers, whose tiles of
// 1024 elements have 4-8 splits). The loop in finish_conv_tile below adds one element's
// splits 8 at a time, a round trip each, and re-reads the tile for the statistics: a traced
// portable 256->256 L16 launch (H100, fp32) took 6.7 µs after its last block streamed with
// it and 4.4 with this (docs/tried.md, "Finishing block holds its tile"). The sums,
// statistics and outputs have that loop's bits.
template <typename T, int H>
__device__ __forceinline__ void finish_held_tile(const StreamArgs& a, int c_lo, int count, float* scratch) {
  static_assert(H <= kHeldPerThread, "held_moments takes kHeldPerThread values a thread");
  constexpr int kBatch = 32 / H;
  const int P = a.positions;
  const int64_t split_stride = static_cast<int64_t>(a.m) * a.nt;
  bool held[H];
  int64_t at[H];  // the element's offset in a split's workspace
#pragma unroll
  for (int j = 0; j < H; ++j) {
    const int i = threadIdx.x + j * kThreads;
    held[j] = i < count;
    at[j] = static_cast<int64_t>(c_lo + i / P) * a.nt + i % P;
  }
  float sums[H][kBatch];
  const auto load_splits = [&](int split0) {
#pragma unroll
    for (int j = 0; j < H; ++j) {
#pragma unroll
      for (int s = 0; s < kBatch; ++s) {
        sums[j][s] = held[j] && split0 + s < a.splits ? __ldcg(a.ws + (split0 + s) * split_stride + at[j]) : 0.f;
      }
    }
  };
  load_splits(0);
  float v[kHeldPerThread] = {};
  Epilogue e[H];
#pragma unroll
  for (int j = 0; j < H; ++j) {
    const int i = threadIdx.x + j * kThreads, c = c_lo + i / P, n = i % P;
    e[j] = held[j] ? load_epilogue<T>(a, n / a.lout, c, n % a.lout) : Epilogue{};
    v[j] = held[j] && a.bias ? load_float<T>(a.bias, c) : 0.f;
  }
#pragma unroll 1
  for (int split0 = 0;;) {
#pragma unroll
    for (int j = 0; j < H; ++j) {
#pragma unroll
      for (int s = 0; s < kBatch; ++s) v[j] += sums[j][s];
    }
    split0 += kBatch;
    if (split0 >= a.splits) break;
    load_splits(split0);
  }
  trace_event(a, kTraceSummed);
  float mean = 0.f, rstd = 1.f;
  if (a.groups > 0) {
    const float2 moments = held_moments(v, count, scratch);
    mean = moments.x;
    rstd = rsqrtf(moments.y / count + a.eps);
    trace_event(a, kTraceNormalized);
  }
#pragma unroll
  for (int j = 0; j < H; ++j) {
    const int i = threadIdx.x + j * kThreads, c = c_lo + i / P, n = i % P;
    if (!held[j]) continue;
    const float pre = a.groups > 0 ? mish((v[j] - mean) * rstd * e[j].gamma + e[j].beta) : v[j];
    store_output<T>(a, n / a.lout, c, n % a.lout, apply_epilogue(e[j], pre));
  }
}

// Output tile `unit` of a conv: channels [unit * unit_rows, ...). Adds up the splits' partial
// sums and the bias into shared memory when the tile fits (else into split 0's workspace
// slot), then GroupNorm etc. or the plain epilogue. Not inlined, so that the finishing code
// exists once per kernel (see TilePre).
template <typename T>
__device__ __noinline__ void finish_conv_tile(const StreamArgs& a, int unit, float* shared,
                                              int shared_floats, float* scratch, float2* stats) {
  const int c_lo = unit * a.unit_rows, c_hi = min(c_lo + a.unit_rows, a.m);
  const int P = a.positions;
  const int count = (c_hi - c_lo) * P;
  trace_event(a, kTraceFinishing);
  if (tile_held(a, count)) {
    return count <= 2 * kThreads ? finish_held_tile<T, 2>(a, c_lo, count, scratch)
                                 : finish_held_tile<T, kHeldPerThread>(a, c_lo, count, scratch);
  }
  const TilePre pre{count <= shared_floats ? shared : nullptr, a.ws, c_lo, P, a.nt};
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
    if (threadIdx.x == 0) a.counters[finish_units[i]] = 0;  // ready for the next launch
  }
  if (n > 0) trace_event(a, kTraceFinished);
}

}  // namespace dpa
