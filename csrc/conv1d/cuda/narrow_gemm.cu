// The GEMM route's fp32 GEMM over few positions (NarrowGemm, conv_params.h): a batch-1 layer
// of a long horizon, or a deep layer of a small batch, [C_out, C_in * K] x [C_in * K, up to 32
// positions], whose weights are read once and feed only 16 or 32 multiply-adds each. cuBLAS's
// SIMT SGEMM tiles such a GEMM into a few 128 x 32 tiles over long reductions, which even cut
// into slices (gemm_splits) stream the weights well below the copy bandwidth. Here every block
// streams 32 weight rows over a slice of the reduction through a cp.async ring, so the bytes
// in flight are set by shared memory, not registers: LeRobot's 2048 -> 2048 k5 conv over 16
// positions (84 MB of weights) took 52 µs against 60 (im2col, GEMM and epilogue; docs/tried.md
// has the measurements), and one kernel serves any GPU from sm_80 (Ampere, Orin, Ada, Hopper).
// Over 32 positions it is bound by its multiply-adds and takes smaller layers only
// (gemm_route.cpp's kNarrowWideMaxWeights), with 4 stages (139 KB of shared memory: A100,
// H100; not sm_86/89's 99 KB).
//
// A block: kWarps warps x kRows weight rows, all kPositions positions (16, or 32 where the
// GEMM has more than 16), split_chunks chunks of kNarrowChunk reduction elements. Each stage of
// the ring holds a chunk of the columns, staged k-major with rows padded to kPositions + 4
// floats, and each warp's kRows x kChunk weights. Lane l owns reduction elements l + 32 j of a
// chunk: its 16-byte reads of a staged row (4 positions) then fall in distinct banks across
// the warp, and its weights are read back one float at a time (consecutive across lanes).
// Every staged column value feeds kRows multiply-adds, every weight kPositions. The lanes'
// partial sums meet in a transposing butterfly; the splits' partial sums are added by the
// epilogue, in slice order.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>

#include "common/launch.h"
#include "conv1d/cuda/device_common.cuh"
#include "conv1d/cuda/launch_plan.h"

namespace dpa {

namespace {

constexpr int kRows = 4;  // weight rows per warp
static_assert(kWarps * kRows == kNarrowRows, "conv_route.h plans with a block's weight rows");

// Floats per staged row: 16-byte reads of 8 consecutive rows fall in distinct banks.
constexpr int staged_row(int positions) { return positions + 4; }

// A 16-byte copy into shared memory, zero-filled where `valid` is false (nothing is read then).
__device__ __forceinline__ void copy16(float* shared, const float* global, bool valid, uint64_t policy) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;" ::"r"(dst), "l"(global),
               "r"(valid ? 16 : 0), "l"(policy));
#endif
}

__device__ __forceinline__ void commit_copies() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

// Returns once all but the `kPending` most recent groups of this thread's copies have landed.
template <int kPending>
__device__ __forceinline__ void wait_copies() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
#endif
}

// At 16 positions within 128 registers, so that two blocks fit an SM where shared memory
// lets them (launch_narrow_gemm places one an SM under PDL); at 32 a thread's 128 sums need
// the registers of a block an SM.
template <int kStages, int kPositions>
__global__ void __launch_bounds__(kThreads, kPositions == 16 ? 2 : 1) narrow_gemm_kernel(const NarrowGemm g) {
  constexpr int kStagedRow = staged_row(kPositions);
  extern __shared__ float4 shared_f4[];
  float* staged = reinterpret_cast<float*>(shared_f4);          // [kStages][kNarrowChunk][kStagedRow]
  float* ring = staged + kStages * kNarrowChunk * kStagedRow;    // [kStages][kWarps][kRows][kNarrowChunk]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row0 = (blockIdx.x * kWarps + warp) * kRows;
  const int first = blockIdx.y * g.split_chunks;
  const int chunks = min(g.split_chunks, (g.red + kNarrowChunk - 1) / kNarrowChunk - first);
  const float* weight = g.weight;
  const uint64_t policy = weight_policy(g.weights_evict_first), normal = weight_policy(false);

  // A lane copies 16 bytes of each of its warp's rows (elements 4 l .. 4 l + 3) and reads
  // back elements l + 32 j, which other lanes copied: the stage's wait and barrier below make
  // every thread's copies visible to the block.
  const auto copy_weights = [&](int stage, int chunk) {
    if (chunk >= chunks) return;
    const int k = (first + chunk) * kNarrowChunk + lane * 4;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int row = row0 + r;
      const bool valid = row < g.m && k < g.red;
      copy16(ring + ((stage * kWarps + warp) * kRows + r) * kNarrowChunk + lane * 4,
             valid ? weight + static_cast<int64_t>(row) * g.red + k : weight, valid, policy);
    }
  };
  const auto copy_columns = [&](int stage, int chunk) {
    if (chunk >= chunks) return;
    constexpr int kQuads = kPositions / 4;
#pragma unroll
    for (int i = threadIdx.x; i < kNarrowChunk * kQuads; i += kThreads) {
      const int kk = i / kQuads, q = i % kQuads;
      const int k = (first + chunk) * kNarrowChunk + kk, n = 4 * q;
      const bool valid = k < g.red && n < g.positions;
      copy16(staged + (stage * kNarrowChunk + kk) * kStagedRow + 4 * q,
             valid ? g.cols + static_cast<int64_t>(k) * g.ld_cols + n : g.cols, valid, normal);
    }
  };

  // The weights' first stages are requested before waiting for the previous kernel (im2col,
  // which lets this one launch at once: gemm_epilogue.cuh), the columns after: the weights
  // then stream while im2col, and the epilogue before it, run. One group of copies per stage
  // and kind here, one per stage below: waiting for all but kStages - 2 groups finds stage
  // c's columns (and weights) landed.
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    copy_weights(s, s);
    commit_copies();
  }
  allow_dependents();
  wait_for_producer();
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    copy_columns(s, s);
    commit_copies();
  }

  float acc[kRows * kPositions];
#pragma unroll
  for (int i = 0; i < kRows * kPositions; ++i) acc[i] = 0.f;
  int stage = 0;
  for (int chunk = 0; chunk < chunks; ++chunk) {
    wait_copies<kStages - 2>();
    __syncthreads();  // the stage's columns are every thread's copies; the stage refilled below was read by all
    const int refill = stage == 0 ? kStages - 1 : stage - 1;
    copy_weights(refill, chunk + kStages - 1);
    copy_columns(refill, chunk + kStages - 1);
    commit_copies();
    const float* weights = ring + (stage * kWarps + warp) * kRows * kNarrowChunk;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int k = lane + 32 * j;
      float w[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) w[r] = weights[r * kNarrowChunk + k];
      const float* x = staged + (stage * kNarrowChunk + k) * kStagedRow;
#pragma unroll
      for (int q = 0; q < kPositions / 4; ++q) {
        const float4 xv = *reinterpret_cast<const float4*>(x + 4 * q);
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          float* a = acc + r * kPositions + 4 * q;
          a[0] = fmaf(w[r], xv.x, a[0]);
          a[1] = fmaf(w[r], xv.y, a[1]);
          a[2] = fmaf(w[r], xv.z, a[2]);
          a[3] = fmaf(w[r], xv.w, a[3]);
        }
      }
    }
    stage = stage + 1 == kStages ? 0 : stage + 1;
  }

  int base = 0;
  transpose_reduce<kRows * kPositions, 16>(acc, lane, base);
  constexpr int kOwned = kRows * kPositions / 32;
  static_assert(kOwned >= 1, "a lane owns whole sums");
#pragma unroll
  for (int j = 0; j < kOwned; ++j) {
    const int row = row0 + (base + j) / kPositions, n = (base + j) % kPositions;
    if (row < g.m && n < g.positions) {
      g.out[(static_cast<int64_t>(blockIdx.y) * g.m + row) * g.positions + n] = acc[j];
    }
  }
}

// Shared-memory bytes of a stage of the ring (conv_route.cpp's narrow_stages counts the same).
size_t stage_bytes(int block_positions) {
  return static_cast<size_t>(kNarrowChunk) * (staged_row(block_positions) + kWarps * kRows) * sizeof(float);
}

}  // namespace

void launch_narrow_gemm(const NarrowGemm& g, int stages) {
  const int width = narrow_block_positions(g.positions);
  TORCH_INTERNAL_ASSERT(stages == 4 || (stages == 3 && width == 16), "narrow_gemm: 4 stages, or 3 at 16 positions");
  // The 16-byte column copies read whole quads of positions.
  TORCH_INTERNAL_ASSERT(g.positions >= 1 && g.positions <= kNarrowMaxPositions && g.positions % 4 == 0 &&
                            g.ld_cols % 4 == 0,
                        "narrow_gemm: a multiple of 4 positions up to ", kNarrowMaxPositions, ", got ", g.positions);
  const auto kernel = width == 16 ? (stages == 4 ? narrow_gemm_kernel<4, 16> : narrow_gemm_kernel<3, 16>)
                                  : narrow_gemm_kernel<4, 32>;
  // Under programmatic dependent launch, half an SM's shared memory (with the 1 KB each block
  // reserves, room for one), so that the scheduler places one block an SM also where the kernel
  // launches while the kernels before it run (im2col_narrow_kernel lets it): two blocks on an
  // SM stream at about half the speed each (docs/tried.md). A shortcut's GEMM on the side
  // stream then waits for SMs that the first conv's leaves, which measured faster than beside
  // it: LeRobot's U-Net at horizon 64, batch 1, fp32 75.9 against 77.1 ms. Without it the
  // kernel starts once the one before it has ended, and its blocks (planned one an SM) spread
  // over the SMs as they are.
  const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
  size_t bytes = stages * stage_bytes(width);
  if (pdl_launches()) {
    bytes = std::max(bytes, std::min(props->sharedMemPerMultiprocessor / 2, props->sharedMemPerBlockOptin));
  }
  set_kernel_attributes(reinterpret_cast<const void*>(kernel), 0, bytes);
  LaunchConfig launch(dim3(ceil_div(g.m, kNarrowRows), g.splits), dim3(kThreads), bytes);
  launch.programmatic_dependent();
  C10_CUDA_CHECK(cudaLaunchKernelEx(launch.get(), kernel, g));
}

}  // namespace dpa
