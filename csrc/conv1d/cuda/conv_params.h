// The CUDA conv kernels' parameters and launch-time constants, shared by the host code that
// plans and launches them (.cpp) and the kernels (.cu, .cuh).
//
// At the batch sizes a robot runs and Diffusion Policy's lengths (4..16), a convolution is a
// GEMM with M = output channels, K = in_channels * kernel_size and a tiny N = batch * length:
// every weight is read once and used for only N multiply-adds, so the time is the time to
// stream the weights from HBM. The streaming kernels are organised around streaming them at
// full bandwidth with as few serial steps per launch as possible:
//
//   * split-K over the whole GPU: a block owns a tile of weight-matrix rows and a slice of
//     the reduction, and every lane loads 16 bytes of weights per request, 2-3 requests
//     ahead, straight from the weights' own layout (no repacking, so checkpoints' tensors are
//     used as they are);
//   * the block's slice of the input is staged in shared memory once, in the order the lanes
//     read it, so one 16-byte shared load feeds 4 multiply-adds per weight row;
//   * weight loads are issued before the kernel waits for the previous kernel
//     (griddepcontrol.wait, with programmatic dependent launch), so under a CUDA graph the
//     next layer's weights are already in flight while this layer finishes;
//   * the split-K partial sums meet in a small fp32 workspace; a per-tile arrival counter
//     elects the last block of each output tile, which adds the partials in a fixed order
//     (deterministic), and applies the epilogue: bias, GroupNorm statistics over the whole
//     group (two-pass), Mish, FiLM, residual. No second launch, no host sync. The counters
//     are left at zero, so a caller can keep one buffer for every launch.
//
// The kernel families, one header each (each instantiated per dtype in instantiate/):
//   stream_conv.cuh      the weight-streaming body every Conv1d-layout kernel shares;
//   splitk_conv.cuh      Conv1d layout, split-K blocks with a finishing block
//                        (stream_conv_kernel; stream_conv_pair_kernel: two problems of one
//                        input, a residual block's first conv and its 1x1 shortcut);
//   cluster_conv.cuh     the same on Hopper as thread-block clusters that add up the splits
//                        and take a GroupNorm group's statistics in distributed shared memory:
//                        no workspace, counters or finishing block;
//   transposed_conv.cuh  ConvTranspose1d, whose weights [C_in, C_out, K] are GEMM columns,
//                        split-K and clusters;
//   gemm_epilogue.cuh    the im2col + cuBLAS route's kernels (im2col, the GroupNorm and plain
//                        epilogues), taken from ~32 positions on, where each weight feeds
//                        enough outputs that cuBLAS wins;
//   narrow_gemm.cu       that route's fp32 GEMM where it has few positions (a batch-1 long
//                        horizon's layers), in place of cuBLAS's SIMT SGEMM.
// Which route a conv takes, and why: conv1d/conv_route.h; how a
// streaming conv is cut into blocks or clusters: launch_plan.cpp.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <vector_types.h>  // float2

#include <algorithm>
#include <cstdint>

#include "conv1d/conv_route.h"

namespace dpa {

constexpr int kWarps = kThreads / 32;
constexpr int kBlocksPerSm = 2;
// Weight requests each lane keeps in flight per weight row: 3 in fp32; 2 in half precision,
// whose 16-byte requests carry twice the weights (16 a row ahead against fp32's 12) and
// whose weights take registers twice, packed and then converted (at 3 and 4 rows a warp,
// ptxas spilled up to 248 bytes a thread in fp16).
template <typename T>
constexpr int stream_depth() { return sizeof(T) == 4 ? 3 : 2; }
constexpr int kDepthTransposed = 4;
// Most chunks per warp in the cluster kernel's shared-memory weight ring.
constexpr int kMaxRingStages = 16;
// The most tiles one block can complete (its rows span at most this many output tiles).
constexpr int kMaxFinishUnits = 4 * kWarps + 2;
// Batch rows whose GroupNorm statistics a finishing block holds at once.
constexpr int kStats = 64;
constexpr int kMaxClusterBlocks = 16;  // Hopper's largest cluster (non-portable size)

// Weight rows per warp of the Conv1d-layout kernel: about 32 accumulators. Every dtype takes
// as many rows: each staged input a lane reads from shared memory (16 bytes for 4 positions'
// worth of one column) feeds R rows' multiply-adds, and at one row per warp the shared-memory
// reads, not the weights, would bound a half-precision layer (128 bytes per clock per SM
// feed 32 multiply-adds per clock at R = 1, 2 bytes of bf16 weights per clock: ~1 TB/s
// over 132 SMs at NT = 16).
template <int NT>
constexpr int conv_rows() {
  return NT <= 8 ? 4 : NT == 16 ? 2 : 1;
}

// Vector width (elements) of the transposed kernel's weight loads: at most 4 elements (16
// bytes in fp32), or fewer where that would take more than 64 accumulators. A block's columns
// are 32 * EPL GEMM rows, and its last block finishes all of their output channels alone,
// one position after another: at 8 half-precision elements it had twice fp32's outputs to
// finish, and Diffusion Policy's bf16 upsampling took 23 µs against fp32's 13 (traced).
template <typename T, int NT>
constexpr int transposed_vector() { return std::min<int>({4, 16 / static_cast<int>(sizeof(T)), 64 / NT}); }

// A streaming launch's traced moments (ops._C.start_launch_trace, scripts/dev/trace_conv.py):
// per launch and block, the global timer (ns) when the block's last work unit reached each of
// these points. The cluster kernels have no finishing block; they stamp kTraceArrived once
// their cluster's sums are visible, then kTraceSummed, kTraceFinishing (their share's moments
// taken), kTraceNormalized and kTraceFinished (leaving).
enum TraceEvent {
  kTraceStart, kTraceWaited, kTraceStaged, kTraceComputed, kTraceArrived,
  kTraceFinishing, kTraceSummed, kTraceNormalized, kTraceFinished  // finishing blocks only
};
constexpr int kTraceEvents = 9;

// One streaming conv launch's problem (and, on the GEMM route, the epilogue's).
struct StreamArgs {
  const void* x;  // [B, C_in, L_in], any strides (elements)
  int64_t x_sb, x_sc, x_sl;
  // Channels from x_split on come from x2 (a concatenation read in place: the U-Net's up
  // path, conv1d_gn_mish_shortcut's `skip`): x_split = C_in and x2 unused otherwise.
  const void* x2;
  int64_t x2_sb, x2_sc, x2_sl;
  int x_split;
  const void* weight;
  const void* bias;
  const void* gn_weight;
  const void* gn_bias;
  const void* film;      // [B, film_width], rows film_sb elements apart (0: one row for all)
  int64_t film_sb;
  const void* residual;  // [B, C_out, L_out], contiguous
  void* out;             // [B, C_out, L_out]
  float* ws;             // [splits, m, nt] partial sums
  int* counters;         // one per output tile, zero on entry and on exit
  int64_t* trace;        // a traced launch's timestamps (TraceEvent), or null
  int batch, cout, lin, lout, ksize, stride, pad;
  int positions;  // GEMM N: batch * L_out (conv) or batch * L_in (transposed)
  int nt;         // positions rounded up to the kernel's tile (workspace row stride)
  int m;          // GEMM rows streamed: C_out (conv) or C_out * K (transposed)
  int red;        // reduction length: C_in * K (conv) or C_in (transposed)
  int split_len;  // reduction elements per block
  int splits;
  int ring_stages;  // the cluster kernel's (kBulk) weight chunks per warp in flight
  int n_tiles;    // position tiles (blockIdx.z): more than one only past 32 positions
  bool prefetch;  // prefetch the block's weights into L2 while waiting for the producer
  bool weights_evict_first;  // weight_policy()
  int unit_rows;  // GEMM rows per output tile (a GroupNorm group, or a block's rows)
  int groups;     // GroupNorm groups, 0 for a plain conv
  int film_width;
  float eps;
};

// The streaming kernels of each family for dtype T and position tile NT (4, 8, 16 or 32), by
// the options the launch plan picks: `vectorised` 16-byte weight loads, `bulk` weights through
// the cluster kernel's shared-memory ring. Defined beside the kernels and instantiated once
// per dtype (instantiate/), so that the host code sees only these declarations.
using StreamKernel = void (*)(StreamArgs);
using PairKernel = void (*)(StreamArgs, StreamArgs, int);
template <typename T, int NT>
StreamKernel splitk_conv_kernel(bool vectorised);
template <typename T, int NT>
PairKernel splitk_pair_kernel(bool vectorised);
template <typename T, int NT>
StreamKernel cluster_conv_kernel(bool vectorised, bool bulk);
template <typename T, int NT>
PairKernel cluster_pair_kernel(bool vectorised, bool bulk);
template <typename T, int NT>
StreamKernel splitk_transposed_kernel(bool vectorised);
template <typename T, int NT>
StreamKernel cluster_transposed_kernel(bool vectorised);

// ---------------------------------------------------------------------------------------
// The im2col + cuBLAS route (gemm_epilogue.cuh, gemm_route.cpp).

// A GEMM-route conv's GEMM result in device memory: of the form's rows over every position,
// or (kIm2col only) `splits` partial sums over consecutive slices of the reduction,
// split_stride elements apart, which the epilogue adds up in slice order (gemm_splits).
struct GemmResult {
  const void* data;
  int splits;
  int64_t split_stride;
};

// Which columns the GEMM route's im2col builds: cols[c * taps + k][b * length + l] =
// x[b, c, l * stride + k - pad], zeros outside x. A conv's are its taps at its output
// positions; a transposed conv's GEMM reads x itself, one column per input position.
struct Im2col {
  int taps, length, stride, pad;
};

// The GroupNorm epilogue holds a group of up to kHeldPerThread * kThreads elements
// (conv_route.h's group_held: every U-Net group of horizon 16) in registers, with its
// epilogue inputs, and runs both statistics passes on them: re-reading them were dependent
// L2 round trips, on a kernel that is all latency (docs/tried.md, "im2col on a 2-D grid").
// Few enough held that a batch 64 U-Net's blocks are resident at once. Larger groups are cut
// into slices (GroupSlices). The Conv1d-layout split-K kernels' finishing block holds its
// tile the same way where it fits (splitk_finish.cuh, finish_held_tile).

// What residual_block changes in the GroupNorm epilogue on the GEMM route. residual_pre: the
// residual is a 1x1 shortcut's GEMM result [C_out, positions] (plus residual_bias), rounded
// to T as the separate ops store the shortcut's output. cols: the output is written as the
// next conv's im2col columns, transposed: cols[b * L + l][c * taps + k] =
// out[b, c, l + k - taps / 2] (zeros outside), where an im2col launch would have read it;
// with taps 1 (a next conv whose taps are GEMM rows) that is the output channels-last.
// Transposed because a block holds one (batch row, group): in this layout its columns are L
// runs of cpg * taps consecutive elements, stored coalesced; in im2col's
// [c * taps + k][positions] they were runs of L, and those scattered stores cost more than
// the im2col launches they replaced. A group cut into slices (GroupSlices) takes columns of
// one tap only (staged in shared memory, then stored a position's channels at a time).
// residual_rows: the residual (residual_block's input) stored channels-last, [B * L][C_out].
struct GemmEpilogueIo {
  const void* residual_pre;
  const void* residual_bias;
  void* cols;
  int taps;
  const void* residual_rows;
};

// A GroupNorm epilogue cut into slices, for groups larger than a block holds: each group is
// cut into `slices` slices of slice_len elements (the last may be shorter, none empty), one
// block each. In one cooperative launch (a.counters: one per batch row and group), or two:
// the slices' pre-activations and moments, then the group's statistics merged from its
// slices' and the slices normalised (gemm_epilogue.cuh).
struct GroupSlices {
  float* pre;       // [batch * groups][group elements], for two launches
  float2* moments;  // [batch * groups][slices]: each slice's mean and sum of squared deviations
  int slices, slice_len;
  bool cluster;      // each group's slices one thread-block cluster (Hopper, slices <= 16)
  bool cooperative;  // else one launch, where it fits (two if the driver refuses it)
};

// The GEMM route's kernels for dtype T on the current stream (gemm_epilogue.cuh).
// im2col: the columns `cut` of a's input into cols [rows, a.batch * cut.length]; narrow_next:
// for the narrow GEMM, which under PDL it lets launch at once.
template <typename T>
void launch_im2col(const StreamArgs& a, const Im2col& cut, int rows, T* cols, bool narrow_next);
// The GroupNorm epilogue over `pre`, the GEMM's result of the form (T, or fp32 where taps are
// rows): one block per (batch row, group) holding it (group_held), or with slices.slices > 1
// one per slice of one (io.cols of one tap only then).
template <typename T>
void launch_group_norm_epilogue(const StreamArgs& a, const GemmResult& pre, GemmForm form,
                                const GemmEpilogueIo& io, const GroupSlices& slices);
// Whether the sliced epilogue of the form fits one cooperative launch of `blocks` blocks.
template <typename T>
bool group_slices_fit(const StreamArgs& a, GemmForm form, int blocks);
// Whether its cluster kernel's `clusters` clusters of `slices` blocks are all resident at once.
template <typename T>
bool group_slices_cluster_fit(const StreamArgs& a, GemmForm form, int slices, int clusters);
// The plain conv's epilogue (bias, residual) over `pre`, into a.out ([B, C_out, L_out]).
template <typename T>
void launch_conv_epilogue(const StreamArgs& a, const GemmResult& pre, GemmForm form);

// The GEMM route's fp32 GEMM over few positions (narrow_gemm.cu), in place of cuBLAS's where
// conv_route.h's narrow_splits takes it: out[s][m][n], for s < splits, is the sum over
// reduction slice s (split_chunks chunks of kNarrowChunk elements) of weight[m][k] *
// cols[k][n]: a GemmResult of `splits` partial sums.
struct NarrowGemm {
  const float* weight;  // [m][red], 16-byte aligned, red % 4 == 0
  const float* cols;    // [red][positions], rows ld_cols apart; 16-byte aligned, positions % 4 == 0
  int64_t ld_cols;
  float* out;           // [splits][m][positions]
  int m, red, positions, splits, split_chunks;
  bool weights_evict_first;
};
void launch_narrow_gemm(const NarrowGemm& g, int stages);

}  // namespace dpa
