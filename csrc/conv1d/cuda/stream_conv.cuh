// The weight-streaming body that every Conv1d-layout kernel shares (splitk_conv.cuh,
// cluster_conv.cuh): a block streams a tile of weight rows over a slice of the reduction
// against its staged slice of the input, and leaves the sums reduced across each warp.
#pragma once

#include "conv1d/cuda/device_common.cuh"
#include "conv1d/cuda/hopper.cuh"

namespace dpa {

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

// ---------------------------------------------------------------------------------------
// Conv1d layout: block = (row tile of kWarps * R output channels, reduction slice). Warp w
// streams rows w*R .. w*R+R-1 of the tile; each lane reads EPL consecutive weights of each
// row per request. NT: positions (batch x length), padded; EPL: weights per lane per load.
// Streams rows [tile_lo, row_hi) (at most kWarps * R) over reduction slice `split` at
// positions n0.. n0 + NT - 1, and leaves the sums reduced across each warp: a lane owns
// acc[0 .. R * NT / 32) (one value, with copies on other lanes, where R * NT < 32), for
// rows and positions from `base`: see put_owned_sums. `wait()` returns once the input may be
// read: called by every thread, after the weight loads are issued.
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
  // worked out once per block. Plain loads: a tap's neighbours hit L1.
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

}  // namespace dpa
