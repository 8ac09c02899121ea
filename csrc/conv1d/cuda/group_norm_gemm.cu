// A GroupNorm conv of the GEMM route in one launch on Hopper's tensor cores (sm_90a): the
// GEMM, the GroupNorm statistics, Mish, FiLM and the residual, where the route otherwise runs
// cuBLAS's GEMM and then an epilogue launch. At a long horizon's batch 1 (LeRobot's U-Net at
// horizon 64: 2048 channels over 16 positions) each weight feeds a handful of multiply-adds
// and the GEMM is a stream of its weights; the epilogue launch took 5.1 µs of every such
// conv's ~22 (BENCHMARKS.md, "where a horizon-64 step goes"), and a GEMM of the package's own
// that left the epilogue a launch of its own only tied cuBLAS (docs/tried.md).
//
// A thread-block cluster owns one (batch row, GroupNorm group): its `splits` blocks each take
// the group's G weight rows (G = 128 or 256) over a slice of the reduction C_in x K.
//   * A producer warp streams the slice's weights into a shared-memory ring with the copy
//     engine (2-D tiles of G rows x 64 elements, 128-byte swizzled), starting before the
//     kernel waits for the previous one (programmatic dependent launch): the weights do not
//     depend on it.
//   * The other four warps (a warpgroup) wait for the previous kernel, stage the slice's
//     input channels in shared memory, and build the slice's im2col columns there, in the
//     swizzled K-major layout that wgmma reads (positions rounded up to N = 16, 32 or 64
//     with zeros). Then for each tile of the ring they issue wgmma's, asynchronously, and
//     hand the tile back to the producer (an mbarrier) once the wgmma's reading it are done.
//   * The blocks' fp32 partial sums meet in distributed shared memory: each block adds up, in
//     slice order, a share of the group's rows from every block, takes its share's moments,
//     and the blocks merge theirs (Chan et al.'s parallel form, the same bits in every block)
//     into the group's statistics, then apply the epilogue to their share.
// The weight is read in Conv1d's own layout [C_out][C_in][K] (a taps-major copy is not made
// for a conv this kernel takes: diffusion_policy_accelerated/model.py).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <cooperative_groups.h>
#include <cuda.h>
#include <dlfcn.h>

#include <algorithm>
#include <type_traits>

#include "common/kernel_config.h"
#include "common/launch.h"
#include "conv1d/cuda/device_common.cuh"
#include "conv1d/cuda/hopper.cuh"
#include "conv1d/cuda/launch_plan.h"
#include "conv1d/cuda/wgmma.cuh"

namespace dpa {

namespace {

namespace cg = cooperative_groups;

constexpr int kTileK = 64;       // reduction elements of a tile row: 128 bytes, the swizzle's width
constexpr int kAlign = 1024;     // the swizzle's period: every tile starts on one
constexpr int kMaxStages = 8;
constexpr int kMaxSplits = 16;   // Hopper's largest (non-portable) cluster
constexpr int kConsumers = 128;  // one warpgroup
constexpr int kGnThreads = kConsumers + 32;  // and the producer warp
constexpr int kGnWarps = kGnThreads / 32;
// A block's share of its group's outputs, per thread (all of the block's threads finish).
constexpr int kOwnedPerThread = 4;

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void mbarrier_init_count(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_address(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(shared_address(bar)) : "memory");
}
// A G x kTileK tile of the weights [C_out][C_in * K] at (row, k) into `shared`, 128-byte
// swizzled, counted on `bar` (elements past the reduction: zeros).
__device__ __forceinline__ void tile_load(void* shared, const CUtensorMap& map, int k, int row, uint64_t* bar,
                                          uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%2, %3}], [%4], %5;"
      ::"r"(shared_address(shared)), "l"(reinterpret_cast<uint64_t>(&map)), "r"(k), "r"(row),
      "r"(shared_address(bar)), "l"(policy)
      : "memory");
}
// A barrier of the consumer warpgroup alone (named barrier 1; __syncthreads is barrier 0).
__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync 1, %0;" ::"n"(kConsumers) : "memory");
}
__device__ __forceinline__ float gn_block_sum(float v, float* scratch) {
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kGnWarps; ++w) total += scratch[w];
  return total;
}
#endif

// Input element (b, c, pos) of the conv: x's channels, then x2's (a concatenation read in place).
template <typename T>
__device__ __forceinline__ const T* input_row(const StreamArgs& a, int b, int c) {
  return c < a.x_split ? static_cast<const T*>(a.x) + b * a.x_sb + c * a.x_sc
                       : static_cast<const T*>(a.x2) + b * a.x2_sb + (c - a.x_split) * a.x2_sc;
}

// MT: the group's 64-row tiles (G = 64 MT); N: wgmma's positions.
template <typename T, int N, int MT>
__global__ void __launch_bounds__(kGnThreads, 1)
    group_norm_gemm_kernel(const __grid_constant__ CUtensorMap weights, const StreamArgs a,
                           const GroupNormGemmPlan p, int cin) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int G = 64 * MT;
  constexpr int kTileBytesA = G * kTileK * 2, kTileBytesB = N * kTileK * 2;
  // Declared here, not only used: their size is what the host reads to tell a build with this
  // body from one without (has_wgmma_code).
  __shared__ uint64_t full[kMaxStages], empty[kMaxStages];
  __shared__ float4 share_moments;  // this block's: (count, mean, M2)
  __shared__ float2 stats;          // the group's (mean, rstd)
  __shared__ float scratch[kGnWarps];
  extern __shared__ float4 dynamic_f4[];
  char* shared = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(dynamic_f4) + kAlign - 1) / kAlign * kAlign);
  char* ring = shared;
  char* columns = ring + p.stages * kTileBytesA;
  // Groups of 256 rows build their columns a tile ahead into two slots (kInterleaved below).
  constexpr bool kInterleaved = MT == 4;
  T* staged = reinterpret_cast<T*>(columns + (kInterleaved ? 2 : p.tiles_per_split) * kTileBytesB);

  const cg::cluster_group cluster = cg::this_cluster();
  const int splits = p.splits, rank = static_cast<int>(cluster.block_rank());
  const int unit = blockIdx.x / splits, b = unit / a.groups, row0 = (unit - b * a.groups) * G;
  const int ktot = cin * a.ksize, kt0 = rank * p.tiles_per_split;
  const int tiles = min(p.tiles_per_split, (ktot + kTileK - 1) / kTileK - kt0);  // the plan leaves none empty
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  if (threadIdx.x == 0) {
    for (int s = 0; s < p.stages; ++s) {
      mbarrier_init_count(&full[s], 1);
      mbarrier_init_count(&empty[s], kConsumers / 32);
    }
    // The copy engine's completions (async proxy) must see the initialised barriers.
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  }
  allow_dependents();
  __syncthreads();

  float acc[MT][N / 2];
  if (warp == kConsumers / 32) {
    // The producer: one lane streams the slice's tiles through the ring.
    if (lane == 0) {
      asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&weights)) : "memory");
      const uint64_t policy = weight_policy(a.weights_evict_first);
      int stage = 0;
      uint32_t parity = 0;
      for (int c = 0; c < tiles; ++c) {
        if (c >= p.stages) mbarrier_wait(&empty[stage], parity ^ 1);
        mbarrier_expect_bytes(&full[stage], kTileBytesA);
        tile_load(ring + stage * kTileBytesA, weights, (kt0 + c) * kTileK, row0, &full[stage], policy);
        if (++stage == p.stages) stage = 0, parity ^= 1;
      }
    }
  } else {
    wait_for_producer();  // x, FiLM and the residual may come from the previous kernel
    // The slice's input channels [c_lo, c_hi) at every input position, staged.
    const int k_lo = kt0 * kTileK, k_hi = min(ktot, (kt0 + tiles) * kTileK);
    const int c_lo = k_lo / a.ksize, rows = (k_hi - 1) / a.ksize + 1 - c_lo, lin = a.lin;
    if (p.vector_input) {  // rows of 16-byte pieces (plan_group_norm_gemm checked their alignment)
      constexpr int kPer = 16 / sizeof(T);
      const int pieces = lin / kPer, total = rows * pieces;
      for (int i0 = threadIdx.x; i0 < total; i0 += 4 * kConsumers) {
        uint4 v[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int i = i0 + j * kConsumers, r = i / pieces;
          if (i < total) v[j] = reinterpret_cast<const uint4*>(input_row<T>(a, b, c_lo + r))[i - r * pieces];
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          if (i0 + j * kConsumers < total) reinterpret_cast<uint4*>(staged)[i0 + j * kConsumers] = v[j];
        }
      }
    } else {
      const int total = rows * lin;
      for (int i0 = threadIdx.x; i0 < total; i0 += 8 * kConsumers) {
        T v[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const int i = i0 + j * kConsumers, r = i / lin;
          if (i < total) v[j] = input_row<T>(a, b, c_lo + r)[(i - r * lin) * (c_lo + r < a.x_split ? a.x_sl : a.x2_sl)];
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          if (i0 + j * kConsumers < total) staged[i0 + j * kConsumers] = v[j];
        }
      }
    }
    consumers_sync();
    // The columns, tile by tile: row n (a position) of tile c holds reduction elements
    // (kt0 + c) * 64 + [0, 64), element k = channel * K + tap reading x at n * stride + tap -
    // pad; 16-byte chunk q of row n at chunk q ^ (n % 8). A warp stores 4 rows' 512 bytes.
    // Groups of 256 rows build tile c + 1 while the tensor cores multiply tile c (2048 ->
    // 2048 over 16 positions, µs per conv in a CUDA graph, H100: 24.1 against 25.3 with every
    // tile built before the loop; cuBLAS and the epilogue 28.1); smaller groups build every
    // tile first, their tiles too small to hide a barrier each (1024 -> 1024 over 32
    // positions: 14.1 against 15.4; cuBLAS 15.1).
    const auto build_columns = [&](int c) {
      for (int i = threadIdx.x; i < N * 8; i += kConsumers) {
        const int n = i / 8, q = i % 8;
        int k = (kt0 + c) * kTileK + q * 8;
        int channel = k / a.ksize, tap = k - channel * a.ksize;
        const int pos0 = n * a.stride - a.pad;
        uint32_t packed[4];
#pragma unroll
        for (int e = 0; e < 8; e += 2) {
          uint16_t pair[2];
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int pos = pos0 + tap;
            T v = static_cast<T>(0.f);
            if (k < ktot && n < a.lout && pos >= 0 && pos < lin) v = staged[(channel - c_lo) * lin + pos];
            pair[h] = reinterpret_cast<const uint16_t&>(v);
            ++k;
            if (++tap == a.ksize) tap = 0, ++channel;
          }
          packed[e / 2] = pair[0] | (static_cast<uint32_t>(pair[1]) << 16);
        }
        *reinterpret_cast<uint4*>(columns + (kInterleaved ? c % 2 : c) * kTileBytesB + n * 128 + ((q ^ (n % 8)) << 4)) =
            make_uint4(packed[0], packed[1], packed[2], packed[3]);
      }
      // The tensor cores (async proxy) read what these threads wrote.
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    };
    if (!p.timing_no_build) for (int c = 0; c < (kInterleaved ? 1 : tiles); ++c) build_columns(c);
    consumers_sync();

#pragma unroll
    for (int mi = 0; mi < MT; ++mi) {
#pragma unroll
      for (int i = 0; i < N / 2; ++i) acc[mi][i] = 0.f;
    }
    const uint32_t ring_address = shared_address(ring), columns_address = shared_address(columns);
    int stage = 0, previous = 0;
    uint32_t parity = 0;
    for (int c = 0; c < tiles; ++c) {
      mbarrier_wait(&full[stage], parity);
      wgmma_fence();
      if (!p.timing_no_mma)
#pragma unroll
      for (int kk = 0; kk < kTileK / 16; ++kk) {
        const uint64_t bd = swizzled_tile(columns_address + (kInterleaved ? c % 2 : c) * kTileBytesB + kk * 32);
#pragma unroll
        for (int mi = 0; mi < MT; ++mi) {
          wgmma(acc[mi], swizzled_tile(ring_address + stage * kTileBytesA + mi * 64 * 128 + kk * 32), bd, T{});
        }
      }
      wgmma_commit();
      if (c > 0) {
        // The previous tile's wgmma's are done: its stage goes back to the producer, and its
        // columns' slot is free for tile c + 1's.
        wgmma_wait<1>();
        if (lane == 0) mbarrier_arrive(&empty[previous]);
      }
      if (kInterleaved && c + 1 < tiles && !p.timing_no_build) {
        build_columns(c + 1);
        consumers_sync();  // tile c + 1's columns are whole
      }
      previous = stage;
      if (++stage == p.stages) stage = 0, parity ^= 1;
    }
    wgmma_wait<0>();
#pragma unroll
    for (int mi = 0; mi < MT; ++mi) fence_accumulators(acc[mi]);
  }

  // The block's partial sums [G][N] over the ring (every tile in it has been read).
  __syncthreads();
  float* partial = reinterpret_cast<float*>(ring);
  if (warp < kConsumers / 32) {
#pragma unroll
    for (int mi = 0; mi < MT; ++mi) {
      const int r = mi * 64 + warp * 16 + lane / 4;
#pragma unroll
      for (int i = 0; i < N / 8; ++i) {
        const int n = i * 8 + lane % 4 * 2;
        *reinterpret_cast<float2*>(partial + r * N + n) = make_float2(acc[mi][4 * i], acc[mi][4 * i + 1]);
        *reinterpret_cast<float2*>(partial + (r + 8) * N + n) = make_float2(acc[mi][4 * i + 2], acc[mi][4 * i + 3]);
      }
    }
  }
  cluster.sync();

  // This block's share: rows [rank * share, ...) of the group at every output position, each
  // the blocks' partial sums added in slice order after the bias.
  const int share = (G + splits - 1) / splits, lout = a.lout;
  const int count = max(0, min(share, G - rank * share)) * lout;
  // Every load is requested before any is used: distributed shared memory's round trips,
  // one after another, took several µs a launch.
  float v[kOwnedPerThread], parts[kOwnedPerThread][kMaxSplits];
  Epilogue e[kOwnedPerThread];
#pragma unroll
  for (int j = 0; j < kOwnedPerThread; ++j) {
    const int i = threadIdx.x + j * kGnThreads;
    if (i < count) {
      const int r = rank * share + i / lout, l = i % lout, c = row0 + r;
      e[j] = load_epilogue<T>(a, b, c, l);
      v[j] = a.bias ? load_float<T>(a.bias, c) : 0.f;
#pragma unroll
      for (int s = 0; s < kMaxSplits; ++s) {
        if (s < splits) parts[j][s] = cluster.map_shared_rank(partial, s)[r * N + l];
      }
    }
  }
#pragma unroll
  for (int j = 0; j < kOwnedPerThread; ++j) {
    if (threadIdx.x + j * kGnThreads < count) {
#pragma unroll
      for (int s = 0; s < kMaxSplits; ++s) {
        if (s < splits) v[j] += parts[j][s];
      }
    } else {
      v[j] = 0.f;
    }
  }
  // The share's moments (two passes), then the group's, merged from every block's.
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < kOwnedPerThread; ++j) sum += v[j];  // zeros past the share
  const float total = gn_block_sum(sum, scratch);
  const float mean = count > 0 ? total / count : 0.f;
  float m2 = 0.f;
#pragma unroll
  for (int j = 0; j < kOwnedPerThread; ++j) {
    if (threadIdx.x + j * kGnThreads < count) m2 += (v[j] - mean) * (v[j] - mean);
  }
  m2 = gn_block_sum(m2, scratch);
  if (threadIdx.x == 0) share_moments = make_float4(static_cast<float>(count), mean, m2, 0.f);
  cluster.sync();
  if (warp == 0) {
    const float4 m = lane < splits ? *cluster.map_shared_rank(&share_moments, lane) : float4{};
    const float n = warp_sum(m.x);
    const float group_mean = warp_sum(m.x * m.y) / n;
    const float group_m2 = warp_sum(m.z + m.x * (m.y - group_mean) * (m.y - group_mean));
    if (lane == 0) stats = make_float2(group_mean, rsqrtf(group_m2 / n + a.eps));
  }
  cluster.barrier_arrive();  // this block reads no other block's shared memory after this
  __syncthreads();
  const float2 st = stats;
#pragma unroll
  for (int j = 0; j < kOwnedPerThread; ++j) {
    const int i = threadIdx.x + j * kGnThreads;
    if (i < count) {
      const int r = rank * share + i / lout, l = i % lout;
      store_output<T>(a, b, row0 + r, l, apply_epilogue(e[j], mish((v[j] - st.x) * st.y * e[j].gamma + e[j].beta)));
    }
  }
  cluster.barrier_wait();  // no block leaves while another may still read its shared memory
#endif
}

using GroupNormGemmKernel = void (*)(CUtensorMap, StreamArgs, GroupNormGemmPlan, int);

template <typename T, int N>
GroupNormGemmKernel kernel_for_rows(int tiles) {
  return tiles == 2 ? group_norm_gemm_kernel<T, N, 2> : group_norm_gemm_kernel<T, N, 4>;
}

template <typename T>
GroupNormGemmKernel kernel_for(int n, int row_tiles) {
  return n == 16 ? kernel_for_rows<T, 16>(row_tiles)
         : n == 32 ? kernel_for_rows<T, 32>(row_tiles)
                   : kernel_for_rows<T, 64>(row_tiles);
}

GroupNormGemmKernel kernel_for(bool bf16, int n, int row_tiles) {
  return bf16 ? kernel_for<c10::BFloat16>(n, row_tiles) : kernel_for<c10::Half>(n, row_tiles);
}

// Whether the loaded kernel has its sm_90a body: a build whose arch list has no 9.0a (or a GPU
// other than Hopper) compiles it empty, with no shared memory of its own.
bool has_wgmma_code(GroupNormGemmKernel kernel, size_t& static_bytes) {
  cudaFuncAttributes attributes{};
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attributes, reinterpret_cast<const void*>(kernel)));
  static_bytes = attributes.sharedSizeBytes;
  return attributes.sharedSizeBytes > 0;
}

// The weight [C_out][C_in * K] as the copy engine reads it: tiles of G rows x kTileK, 128-byte
// swizzled. Encoded through the driver's cuTensorMapEncodeTiled, looked up at run time (the
// extension does not link the driver library).
CUtensorMap weight_map(const void* weight, int64_t ktot, int cout, int rows, bool bf16) {
  using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                              const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                              CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  static const Encode encode = [] {
    void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);  // the runtime's
    return library ? reinterpret_cast<Encode>(dlsym(library, "cuTensorMapEncodeTiled")) : nullptr;
  }();
  TORCH_CHECK(encode != nullptr, "group_norm_gemm: the CUDA driver has no cuTensorMapEncodeTiled");
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(ktot), static_cast<cuuint64_t>(cout)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ktot) * 2};
  const cuuint32_t box[2] = {kTileK, static_cast<cuuint32_t>(rows)}, unit[2] = {1, 1};
  const CUresult result =
      encode(&map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2,
             const_cast<void*>(weight), dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
             CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(result == CUDA_SUCCESS, "group_norm_gemm: cuTensorMapEncodeTiled failed (", static_cast<int>(result),
              ")");
  return map;
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

GroupNormGemmPlan plan_group_norm_gemm(const StreamArgs& a, int cin, bool bf16) {
  GroupNormGemmPlan none;
  const KernelConfig& config = kernel_config();
  if (!config.group_norm_gemm || !config.clusters || !hopper_launches() || a.groups <= 0 || a.cout % a.groups) {
    return none;
  }
  // Groups of 64 rows are not taken: per conv in a CUDA graph they tied cuBLAS's GEMM and
  // the epilogue or lost (H100, bf16, µs: 512 -> 512 over 64 positions 12.9 against 12.7,
  // 2048 -> 512 over 32 18.9 against 14.9).
  const int rows = a.cout / a.groups, row_tiles = rows / 64;
  if (rows % 64 != 0 || (row_tiles != 2 && row_tiles != 4)) return none;
  const int n = a.lout <= 16 ? 16 : a.lout <= 32 ? 32 : a.lout <= 64 ? 64 : 0;
  const int64_t ktot = static_cast<int64_t>(cin) * a.ksize;
  // The tensor map's row pitch: a multiple of 16 bytes.
  if (n == 0 || ktot % 8 != 0 || ktot >= (int64_t{1} << 30) || (a.weight && !aligned16(a.weight))) return none;
  const GroupNormGemmKernel kernel = kernel_for(bf16, n, row_tiles);
  size_t static_bytes = 0;
  if (!has_wgmma_code(kernel, static_bytes)) return none;
  const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
  const size_t budget = props->sharedMemPerBlockOptin - static_bytes - kAlign;
  const int tiles = ceil_div(ktot, kTileK);
  const size_t stage = static_cast<size_t>(rows) * kTileK * 2;
  // As many slices as a cluster has where each takes 2+ tiles, none empty, and a block's share
  // of the group's outputs fits its threads; 16 (a non-portable cluster) only where two blocks
  // fit an SM, so that the clusters of every group are resident at once.
  for (int splits = kMaxSplits; splits >= 1; splits /= 2) {
    const int per_split = ceil_div(tiles, splits);
    if (per_split < 2 || (splits - 1) * per_split >= tiles) continue;
    if (ceil_div(rows, splits) * a.lout > kOwnedPerThread * kGnThreads) return none;
    const int64_t x_rows = std::min<int64_t>(cin, ceil_div(int64_t{per_split} * kTileK, a.ksize) + 1);
    const size_t fixed = static_cast<size_t>(row_tiles == 4 ? 2 : per_split) * n * kTileK * 2 +
                         (x_rows * a.lin * 2 + 15) / 16 * 16;
    const size_t limit = splits > 8 ? props->sharedMemPerMultiprocessor / 2 - static_bytes - 2 * kAlign : budget;
    if (fixed + 2 * stage > limit) continue;
    GroupNormGemmPlan p;
    p.stages = static_cast<int>(std::min<size_t>({kMaxStages, static_cast<size_t>(per_split), (limit - fixed) / stage}));
    // The partial sums [rows][n] fp32 reuse the ring.
    if (static_cast<size_t>(rows) * n * 4 > p.stages * stage) continue;
    p.n = n;
    p.timing_no_mma = getenv("DPA_GNG_NO_MMA") != nullptr;
    p.timing_no_build = getenv("DPA_GNG_NO_BUILD") != nullptr;
    p.splits = splits;
    p.tiles_per_split = per_split;
    p.shared_bytes = fixed + p.stages * stage + kAlign;
    constexpr int kPer = 8;  // half-precision elements in 16 bytes
    const auto rows_vectorised = [&](const void* base, int64_t sb, int64_t sc, int64_t sl) {
      return base == nullptr || (sl == 1 && sc % kPer == 0 && sb % kPer == 0 && aligned16(base));
    };
    p.vector_input = a.lin % kPer == 0 && rows_vectorised(a.x, a.x_sb, a.x_sc, a.x_sl) &&
                     (a.x_split >= cin || rows_vectorised(a.x2, a.x2_sb, a.x2_sc, a.x2_sl));
    if (!clusters_fit(reinterpret_cast<const void*>(kernel), splits, p.shared_bytes,
                      splits > 8 ? a.batch * a.groups : 1, kGnThreads)) {
      continue;
    }
    return p;
  }
  return none;
}

void launch_group_norm_gemm(const StreamArgs& a, int cin, bool bf16, const GroupNormGemmPlan& p) {
  const int rows = a.cout / a.groups;
  TORCH_INTERNAL_ASSERT(p.n > 0 && p.splits >= 1 && p.splits <= kMaxSplits && p.stages >= 1 &&
                            p.stages <= kMaxStages && (rows == 128 || rows == 256),
                        "group_norm_gemm: no plan");
  const GroupNormGemmKernel kernel = kernel_for(bf16, p.n, rows / 64);
  const CUtensorMap map = weight_map(a.weight, static_cast<int64_t>(cin) * a.ksize, a.cout, rows, bf16);
  set_kernel_attributes(reinterpret_cast<const void*>(kernel), p.splits, p.shared_bytes);
  LaunchConfig launch(dim3(a.batch * a.groups * p.splits), dim3(kGnThreads), p.shared_bytes);
  launch.clusters(p.splits);
  launch.programmatic_dependent();
  C10_CUDA_CHECK(cudaLaunchKernelEx(launch.get(), kernel, map, a, p, cin));
}

}  // namespace dpa
