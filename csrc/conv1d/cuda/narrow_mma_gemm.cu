// The GEMM route's half-precision GEMM over few positions on Hopper (MmaGemm, conv_params.h):
// a long horizon's batch-1 layer with a taps-major weight, [C_out * K, C_in] x [C_in, L] over
// 8 to 64 positions, whose weights are read once and feed only L multiply-adds each. cuBLAS
// streams those weights at ~85% of the copy bandwidth, but takes no part in programmatic
// dependent launch: each of its GEMMs starts only once the GroupNorm epilogue before it has
// ended, and then waits for its first weights. Here every block requests its first stages of
// weights before it waits for the previous kernel (griddepcontrol.wait), so under a CUDA graph
// a layer's weights stream while the epilogue before it runs, and it lets the epilogue after
// it launch at once.
//
// A block: `rows` weight rows (a multiple of 16) over a slice of the reduction, at every
// position. Each stage of a shared-memory ring holds kStageK reduction elements of each row,
// copied by the copy engine as kStageK / 64 tiles of rows x 64 (one tensor copy each, 128-byte
// swizzled, counted on the stage's mbarrier: the weights' rows are 2-8 KB apart, and as one
// bulk copy a row, 80 copies of 256 bytes a stage, the kernel streamed 1.1 TB/s against
// cuBLAS's 2.4), and the same elements of the columns, [kStageK][positions], copied with
// cp.async (16 bytes a thread) into rows padded by 8 elements and counted on the same barrier
// (cp.async.mbarrier.arrive): ldmatrix's 8 rows then fall in distinct banks. Warps take
// 16-row tiles; where a block has fewer than 8 tiles, 2 to 8 warps share one, each taking
// every 2nd to 8th 16-element step of the reduction; their partial sums are added in shared
// memory, in warp order. Tensor cores (mma.sync m16n8k16, fp32 accumulation) do the
// multiply-adds. A reduction cut into slices is a thread-block cluster of the slices' blocks,
// which add up their sums in distributed shared memory in slice order: every output is whole,
// and the same bits on every run.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <cooperative_groups.h>
#include <cuda.h>
#include <dlfcn.h>

#include <algorithm>
#include <type_traits>

#include "common/launch.h"
#include "conv1d/cuda/device_common.cuh"
#include "conv1d/cuda/hopper.cuh"
#include "conv1d/cuda/launch_plan.h"

namespace dpa {

namespace {

namespace cg = cooperative_groups;

constexpr int kPad = 8;         // elements after each row of the columns' stage (16 bytes)
constexpr int kTileK = 64;      // reduction elements of a weight tile copy (128 bytes a row)
constexpr int kStageK = 128;    // ... of a stage
constexpr int kMaxStages = 12;
constexpr int kAlign = 1024;    // the 128-byte swizzle's period: each stage starts on one
constexpr int kMaxSplits = 8;   // a portable cluster
constexpr int kMaxRows = 128;   // 8 warps x 16 rows

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}
__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t (&r)[2], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(address));
}

// d += a (16 x 16, row-major) * b (16 x 8, column-major), fp32 accumulators.
template <typename T>
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// A barrier of kThreads async arrivals (every thread's cp.async) and one arrival with the
// copy engine's expected bytes.
__device__ __forceinline__ void mbarrier_init_count(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_address(bar)), "r"(count) : "memory");
}

// The barrier's phase awaits this thread's cp.async copies issued so far.
__device__ __forceinline__ void arrive_after_copies(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(shared_address(bar)) : "memory");
}

__device__ __forceinline__ void copy16(void* shared, const void* global) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(shared_address(shared)), "l"(global) : "memory");
}
#endif

// How many warps share a 16-row tile: as many as keep the most warps busy (a power of two).
__host__ __device__ constexpr int warps_per_tile(int tiles) {
  return tiles > kWarps / 2 ? 1 : tiles > kWarps / 4 ? 2 : tiles > kWarps / 8 ? 4 : 8;
}

// Bytes of one stage of the ring: the weights' tiles, then the columns' padded rows.
__host__ __device__ inline size_t a_stage_bytes(int rows) {
  return static_cast<size_t>(rows) * kStageK * 2;
}
__host__ __device__ inline size_t stage_bytes(int rows, int positions) {
  const size_t bytes = a_stage_bytes(rows) + static_cast<size_t>(kStageK) * (positions + kPad) * 2;
  return (bytes + kAlign - 1) / kAlign * kAlign;
}
// ... and of the warps' sums after the loop, which reuse the ring.
__host__ __device__ inline size_t sums_bytes(int rows, int positions) {
  return static_cast<size_t>(warps_per_tile(rows / 16)) * rows * positions * sizeof(float);
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// A rows x kTileK tile of the weights (rows past the matrix, elements past its reduction:
// zeros), into `shared` (kAlign-aligned) with the 128-byte swizzle: 16-byte chunk j of row r
// lands at chunk j ^ (r % 8).
__device__ __forceinline__ void tile_load(void* shared, const CUtensorMap& map, int k, int row, uint64_t* bar,
                                          uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%2, %3}], [%4], %5;"
      ::"r"(shared_address(shared)), "l"(reinterpret_cast<uint64_t>(&map)), "r"(k), "r"(row),
      "r"(shared_address(bar)), "l"(policy)
      : "memory");
}
#endif

// NP: positions rounded up to 16, 32 or 64 (a thread's accumulators: NP / 2).
template <typename T, int NP>
__global__ void __launch_bounds__(kThreads, 2)
    mma_gemm_kernel(const __grid_constant__ CUtensorMap weights, const MmaGemm g, const MmaGemmPlan p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ float4 shared_f4[];
  char* shared = reinterpret_cast<char*>(
      (reinterpret_cast<uintptr_t>(shared_f4) + kAlign - 1) / kAlign * kAlign);
  __shared__ uint64_t filled[kMaxStages];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int split = blockIdx.x % p.splits, row0 = blockIdx.x / p.splits * p.rows;
  const int valid_rows = min(p.rows, g.m - row0);
  const int e_begin = split * p.split_len, e_end = min(e_begin + p.split_len, g.red);
  const int chunks = (e_end - e_begin + kStageK - 1) / kStageK;  // the plan leaves no slice empty
  const int b_pitch = g.positions + kPad;
  const size_t a_bytes = a_stage_bytes(p.rows), s_bytes = stage_bytes(p.rows, g.positions);
  const auto stage_a = [&](int s) { return shared + s * s_bytes; };
  const auto stage_b = [&](int s) { return reinterpret_cast<T*>(shared + s * s_bytes + a_bytes); };
  const auto chunk_len = [&](int c) { return min(kStageK, e_end - e_begin - c * kStageK); };
  const T* cols = static_cast<const T*>(g.cols);

  // By thread 0: the stage's weight tiles (whole tiles: the copy engine counts their zeros).
  const auto copy_weights = [&](int s, int c) {
    const uint64_t policy = weight_policy(g.weights_evict_first);
    mbarrier_expect_bytes(&filled[s], static_cast<uint32_t>(a_bytes));
#pragma unroll
    for (int t = 0; t < kStageK / kTileK; ++t) {
      tile_load(stage_a(s) + t * p.rows * kTileK * 2, weights, e_begin + c * kStageK + t * kTileK, row0,
                &filled[s], policy);
    }
  };
  // By every thread: its 16-byte pieces of the chunk's columns, then its (async) arrival.
  const auto copy_columns = [&](int s, int c) {
    const int quads = g.positions / 8, pieces = chunk_len(c) * quads;
    const T* from = cols + static_cast<int64_t>(e_begin + c * kStageK) * g.positions;
    T* to = stage_b(s);
    for (int i = threadIdx.x; i < pieces; i += kThreads) {
      const int k = i / quads, q = i - k * quads;
      copy16(to + k * b_pitch + 8 * q, from + k * g.positions + 8 * q);
    }
    arrive_after_copies(&filled[s]);
  };

  const int first = min(p.stages, chunks);
  if (threadIdx.x == 0) {
    asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&weights)) : "memory");
    for (int s = 0; s < p.stages; ++s) mbarrier_init_count(&filled[s], kThreads + 1);
    // The copies' completions (async proxy) must see the initialised barriers.
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    for (int s = 0; s < first; ++s) copy_weights(s, s);
  }
  allow_dependents();
  wait_for_producer();  // the columns come from the previous kernel
  __syncthreads();      // the barriers are initialised
  for (int s = 0; s < first; ++s) copy_columns(s, s);

  const int tiles = p.rows / 16, per_tile = warps_per_tile(tiles);
  const int tile = warp % tiles, part = warp / tiles;
  const bool active = part < per_tile;
  const int n_tiles = g.positions / 8;
  float acc[NP / 8][4], acc2[NP / 8][4];
#pragma unroll
  for (int t = 0; t < NP / 8; ++t) {
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[t][i] = acc2[t][i] = 0.f;
  }
  // ldmatrix's rows: lane l gives row l % 16 of the warp's tile, 16-byte chunk l / 16 of the
  // step's two (swizzled within its 128-byte row), and of the columns row (l % 8) + 8 ((l / 8)
  // % 2) (reduction element), positions 8 (l / 16)..
  const int a_row = tile * 16 + lane % 16, a_chunk = lane / 16;
  const int b_lane = (lane % 8 + lane / 8 % 2 * 8) * b_pitch + lane / 16 * 8;

  int stage = 0;
  uint32_t parity = 0;
  for (int c = 0; c < chunks; ++c) {
    mbarrier_wait(&filled[stage], parity);
    if (active) {
      const uint32_t a_base = shared_address(stage_a(stage)) + a_row * kTileK * 2;
      const uint32_t b_base = shared_address(stage_b(stage) + b_lane);
      const int steps = chunk_len(c) / 16;
      // Steps in pairs, into two sets of accumulators: two chains of dependent mma's (and
      // their loads) in flight instead of one.
      const auto step = [&](int j, float (&sums)[NP / 8][4]) {
        // Step j: tile j / 4 of the stage, 16-byte chunks 2 (j % 4) + a_chunk of its row.
        const int chunk = (2 * (j % 4) + a_chunk) ^ (a_row % 8);
        uint32_t a[4];
        ldmatrix_x4(a, a_base + (j / 4) * p.rows * kTileK * 2 + chunk * 16);
        const uint32_t b_step = b_base + j * 16 * b_pitch * sizeof(T);
#pragma unroll
        for (int t = 0; t < NP / 8; t += 2) {
          if (t + 1 < n_tiles) {
            uint32_t b[4];
            ldmatrix_x4_trans(b, b_step + t * 8 * sizeof(T));
            mma<T>(sums[t], a, b[0], b[1]);
            mma<T>(sums[t + 1], a, b[2], b[3]);
          } else if (t < n_tiles) {
            uint32_t b[2];
            ldmatrix_x2_trans(b, b_step + t * 8 * sizeof(T));
            mma<T>(sums[t], a, b[0], b[1]);
          }
        }
      };
      int j = part;
      for (; j + per_tile < steps; j += 2 * per_tile) {
        step(j, acc);
        step(j + per_tile, acc2);
      }
      if (j < steps) step(j, acc);
    }
    if (c + p.stages < chunks) {
      // Every thread's reads of the stage before the copy engine's writes into it.
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      __syncthreads();
      if (threadIdx.x == 0) copy_weights(stage, c + p.stages);
      copy_columns(stage, c + p.stages);
    }
    if (++stage == p.stages) stage = 0, parity ^= 1;
  }

#pragma unroll
  for (int t = 0; t < NP / 8; ++t) {
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[t][i] += acc2[t][i];
  }
  // The warps' sums, [part][row][position] over the ring (every copy into it has landed),
  // then added up in part order into part 0's.
  __syncthreads();
  float* sums = reinterpret_cast<float*>(shared);
  const int tile_elements = p.rows * g.positions;
  if (active) {
    float* mine = sums + part * tile_elements + (tile * 16 + lane / 4) * g.positions + lane % 4 * 2;
#pragma unroll
    for (int t = 0; t < NP / 8; ++t) {
      if (t < n_tiles) {
        *reinterpret_cast<float2*>(mine + t * 8) = make_float2(acc[t][0], acc[t][1]);
        *reinterpret_cast<float2*>(mine + 8 * g.positions + t * 8) = make_float2(acc[t][2], acc[t][3]);
      }
    }
  }
  __syncthreads();
  if (per_tile > 1) {
    for (int i = threadIdx.x; i < tile_elements; i += kThreads) {
      float v = sums[i];
      for (int q = 1; q < per_tile; ++q) v += sums[q * tile_elements + i];
      sums[i] = v;
    }
  }
  float* out = g.out + static_cast<int64_t>(row0) * g.positions;
  if (p.splits == 1) {
    if (per_tile > 1) __syncthreads();
    for (int i = threadIdx.x; i < valid_rows * g.positions; i += kThreads) out[i] = sums[i];
    return;
  }
  // Block `split` of the cluster writes its share of the rows, each the slices' sums in order.
  const cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();
  const int share = (valid_rows + p.splits - 1) / p.splits;
  const int lo = split * share * g.positions, hi = min(valid_rows, (split + 1) * share) * g.positions;
  for (int i = lo + threadIdx.x; i < hi; i += kThreads) {
    float v = 0.f;
    for (int s = 0; s < p.splits; ++s) v += cluster.map_shared_rank(sums, s)[i];
    out[i] = v;
  }
  cluster.sync();  // no block leaves while others read its shared memory
#endif
}

using MmaKernel = void (*)(CUtensorMap, MmaGemm, MmaGemmPlan);

template <typename T>
MmaKernel mma_gemm_kernel_for(int positions) {
  return positions <= 16 ? mma_gemm_kernel<T, 16> : positions <= 32 ? mma_gemm_kernel<T, 32>
                                                                     : mma_gemm_kernel<T, 64>;
}

// Shared memory a block may take: what leaves an SM room for the GroupNorm epilogue's blocks
// (a few KB each) beside it, so that under PDL they launch while the GEMM streams and the next
// GEMM's blocks while they run (one block an SM: the plan's blocks fill the SMs once).
size_t shared_budget() {
  const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
  return std::min(props->sharedMemPerBlockOptin, props->sharedMemPerMultiprocessor - 24 * 1024);
}

// The weight [m][red] as the copy engine reads it, tiles of rows x kTileK, 128-byte swizzled.
// Encoded through the driver's cuTensorMapEncodeTiled, looked up at run time (the extension
// does not link the driver library).
CUtensorMap weight_map(const MmaGemm& g, int rows, bool bf16) {
  using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                              const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                              CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  static const Encode encode = [] {
    void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);  // the runtime's
    return library ? reinterpret_cast<Encode>(dlsym(library, "cuTensorMapEncodeTiled")) : nullptr;
  }();
  TORCH_CHECK(encode != nullptr, "mma_gemm: the CUDA driver has no cuTensorMapEncodeTiled");
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(g.red), static_cast<cuuint64_t>(g.m)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(g.red) * 2};
  const cuuint32_t box[2] = {kTileK, static_cast<cuuint32_t>(rows)}, unit[2] = {1, 1};
  const CUresult result =
      encode(&map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2,
             const_cast<void*>(g.weight), dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
             CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(result == CUDA_SUCCESS, "mma_gemm: cuTensorMapEncodeTiled failed (", static_cast<int>(result), ")");
  return map;
}

}  // namespace

MmaGemmPlan plan_mma_gemm(int m, int red, int positions) {
  MmaGemmPlan best;
  if (positions < 8 || positions > kMmaMaxPositions || positions % 8 != 0 || red % 16 != 0) return best;
  const int sms = sm_budget();
  const size_t budget = shared_budget() - kAlign;  // the ring's start is aligned up
  int64_t best_cost = 0;
  // The fewest weight elements the slowest block streams, with blocks filling the SMs once;
  // at equal cost the fewer slices (less to add up at the end). Slices are whole stages.
  for (int rows = 16; rows <= kMaxRows; rows += 16) {
    const int tiles = ceil_div(m, rows);
    for (int splits = 1; splits <= kMaxSplits && static_cast<int64_t>(tiles) * splits <= sms; ++splits) {
      const int split_len = ceil_div(ceil_div(red, splits), kStageK) * kStageK;
      if ((splits - 1) * split_len >= red) continue;  // an empty slice
      if (3 * stage_bytes(rows, positions) > budget || sums_bytes(rows, positions) > budget) continue;
      const int64_t cost = static_cast<int64_t>(rows) * split_len;
      if (best.rows == 0 || cost < best_cost) {
        best_cost = cost;
        best.rows = rows, best.splits = splits, best.split_len = split_len;
      }
    }
  }
  if (best.rows == 0) return best;
  const size_t stage = stage_bytes(best.rows, positions);
  best.stages = static_cast<int>(std::min<size_t>({kMaxStages, budget / stage,
                                                   static_cast<size_t>(ceil_div(best.split_len, kStageK))}));
  best.shared_bytes = std::max(best.stages * stage, sums_bytes(best.rows, positions)) + kAlign;
  return best;
}

template <typename T>
void launch_mma_gemm(const MmaGemm& g, const MmaGemmPlan& p) {
  TORCH_INTERNAL_ASSERT(p.rows > 0 && p.rows % 16 == 0 && p.rows <= kMaxRows && p.stages >= 1 &&
                            p.stages <= kMaxStages && p.splits >= 1 && p.splits <= kMaxSplits,
                        "mma_gemm: no plan");
  TORCH_INTERNAL_ASSERT(g.positions % 8 == 0 && g.positions <= kMmaMaxPositions && g.red % 16 == 0,
                        "mma_gemm: positions a multiple of 8 up to ", kMmaMaxPositions,
                        " and a reduction of 16s, got ", g.positions, " and ", g.red);
  const auto kernel = mma_gemm_kernel_for<T>(g.positions);
  const CUtensorMap map = weight_map(g, p.rows, std::is_same_v<T, c10::BFloat16>);
  const int blocks = ceil_div(g.m, p.rows) * p.splits;
  set_kernel_attributes(reinterpret_cast<const void*>(kernel), p.splits, p.shared_bytes);
  LaunchConfig launch(dim3(blocks), dim3(kThreads), p.shared_bytes);
  launch.programmatic_dependent();
  if (p.splits > 1) launch.clusters(p.splits);
  C10_CUDA_CHECK(cudaLaunchKernelEx(launch.get(), kernel, map, g, p));
}

template void launch_mma_gemm<c10::BFloat16>(const MmaGemm&, const MmaGemmPlan&);
template void launch_mma_gemm<c10::Half>(const MmaGemm&, const MmaGemmPlan&);

}  // namespace dpa
