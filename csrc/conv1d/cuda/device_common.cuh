// Device helpers shared by the CUDA conv kernels: weight loads and their L2 policy, the
// GPU-scope counting the split-K kernels synchronise through, warp and block reductions, the
// epilogue (GroupNorm affine, Mish, FiLM, residual) and the GroupNorm of a tile.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_runtime.h>

#include <cstring>
#include <type_traits>

#include "common/launch.h"
#include "conv1d/cuda/conv_params.h"

namespace dpa {

// Stamps the global timer for a traced launch (TraceEvent), by thread 0 of the block.
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

// L2 policy of the streamed weights. Evict-first (KernelConfig.weights_evict_first): each weight
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

// The GPU's global nanosecond timer.
__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// A GPU-scope acquire load of a counter that other blocks count on (atomic_add_acq_rel).
__device__ __forceinline__ int load_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
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

// static: one copy per translation unit, as any device function of a kernel there.
static __device__ float block_sum(float v, float* scratch) {
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

// The moments (mean, sum of squared deviations) of the first n values the block holds (thread
// t's v[j] is value t + j * kThreads), in two passes over them: the GroupNorm kernels'
// statistics over a group or a slice of one (the GEMM route's epilogues, split-K's finishing).
__device__ __forceinline__ float2 held_moments(const float (&v)[kHeldPerThread], int n, float* scratch) {
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < kHeldPerThread; ++j)
    if (threadIdx.x + j * kThreads < n) sum += v[j];
  const float mean = block_sum(sum, scratch) / n;
  float sq = 0.f;
#pragma unroll
  for (int j = 0; j < kHeldPerThread; ++j) {
    if (threadIdx.x + j * kThreads < n) {
      const float d = v[j] - mean;
      sq += d * d;
    }
  }
  return make_float2(mean, block_sum(sq, scratch));
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

// A kernel of its own waits for the kernel before it (programmatic dependent launch).
struct WaitForProducer {
  __device__ void operator()() const { wait_for_producer(); }
};

}  // namespace dpa
