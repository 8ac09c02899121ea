// The convolution op family of Diffusion Policy's U-Net, shared by the CPU (.cpp) and CUDA
// (.cu) implementations:
//   conv1d_gn_mish: Conv1d (odd kernel, "same" padding, stride 1) -> GroupNorm -> Mish, then
//                   optionally FiLM (scale * y + bias) and a residual add: a Conv1dBlock with
//                   whatever its ConditionalResidualBlock1D does to its output.
//   conv1d:         a plain Conv1d or ConvTranspose1d (any kernel size, stride, padding) plus
//                   bias, optionally plus a residual: the U-Net's down/upsampling, its 1x1
//                   residual convs and its final 1x1 conv.
//   conv1d_gn_mish_shortcut:
//                   conv1d_gn_mish (with FiLM) and a 1x1 Conv1d of the same x, returned
//                   together: the first conv of a residual block whose channel count changes
//                   and the block's shortcut, one launch for both on the CUDA streaming path.
//                   With `skip`, x is cat((x, skip), dim=1), read in place: the U-Net's up
//                   path, whose concatenation would otherwise be a launch (and a copy) of its
//                   own between two convs.
//   residual_block: a whole ConditionalResidualBlock1D given its FiLM: conv1d_gn_mish of the
//                   input (x, or x and skip) with FiLM, then conv1d_gn_mish of that with the
//                   residual added, the residual being the input or its 1x1 shortcut conv.
//                   Where the convs take the CUDA GEMM route, the first conv's epilogue writes
//                   the second's GEMM operand (im2col columns, or for a taps-major weight2 its
//                   output channels-last) and the second's epilogue adds the shortcut's GEMM
//                   result: the im2col and shortcut-epilogue launches between them go.
//                   With `channels_last` the output is stored [B][L][C] (strides (L * C, 1,
//                   C)): the layout in which the next block's first conv, where its taps are
//                   GEMM rows, reads it in place instead of transposing it.
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace dpa {

struct ConvProblem {
  int64_t batch;
  int64_t in_channels;
  int64_t out_channels;
  int64_t in_length;
  int64_t out_length;
  int64_t kernel_size;
  int64_t stride;
  int64_t padding;
  bool transposed;
  int64_t groups;      // GroupNorm groups; 0 for conv1d
  int64_t film_width;  // 0 (no FiLM), out_channels (bias) or 2 * out_channels (scale, bias)
};

// Each validates every argument, raising a Python exception that names it, and returns the
// sizes. `counters` (CUDA only) must be an int32 tensor of >= out_channels elements on x's
// device; see the op docs in registration.cpp.
ConvProblem check_conv1d_gn_mish_args(const at::Tensor& x, const at::Tensor& weight,
                                      const std::optional<at::Tensor>& bias,
                                      const std::optional<at::Tensor>& gn_weight,
                                      const std::optional<at::Tensor>& gn_bias,
                                      int64_t num_groups, double eps,
                                      const std::optional<at::Tensor>& film,
                                      const std::optional<at::Tensor>& residual,
                                      const std::optional<at::Tensor>& counters,
                                      const char* op = "conv1d_gn_mish",
                                      int64_t skip_channels = 0);

ConvProblem check_conv1d_args(const at::Tensor& x, const at::Tensor& weight,
                              const std::optional<at::Tensor>& bias, int64_t stride,
                              int64_t padding, bool transposed,
                              const std::optional<at::Tensor>& residual,
                              const std::optional<at::Tensor>& counters);

// (the conv1d_gn_mish problem, the shortcut's). `counters` here needs >= out_channels +
// shortcut channels elements: the first conv's, then the shortcut's. With `skip` ([B, C2, L]
// like x) the problems' in_channels are x's plus skip's.
std::pair<ConvProblem, ConvProblem> check_conv1d_gn_mish_shortcut_args(
    const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& gn_weight, const std::optional<at::Tensor>& gn_bias,
    int64_t num_groups, double eps, const at::Tensor& shortcut_weight,
    const std::optional<at::Tensor>& shortcut_bias, const std::optional<at::Tensor>& film,
    const std::optional<at::Tensor>& counters, const std::optional<at::Tensor>& skip);

struct ResidualBlockProblem {
  ConvProblem first, second;
  ConvProblem shortcut;  // meaningful only with has_shortcut
  bool has_shortcut;
};

// `counters` here needs >= out_channels elements, twice that with a shortcut (the streaming
// route's first launch is conv1d_gn_mish_shortcut's).
ResidualBlockProblem check_residual_block_args(
    const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& gn_weight, const std::optional<at::Tensor>& gn_bias,
    const at::Tensor& weight2, const std::optional<at::Tensor>& bias2,
    const std::optional<at::Tensor>& gn_weight2, const std::optional<at::Tensor>& gn_bias2,
    int64_t num_groups, double eps, const std::optional<at::Tensor>& shortcut_weight,
    const std::optional<at::Tensor>& shortcut_bias, const std::optional<at::Tensor>& film,
    const std::optional<at::Tensor>& counters, const std::optional<at::Tensor>& skip);

// A [B, C, L] tensor stored channels-last, [B][L][C] in memory, as residual_block returns its
// output when asked to; t itself where it is stored so already.
inline at::Tensor stored_channels_last(const at::Tensor& t) {
  return t.transpose(1, 2).contiguous().transpose(1, 2);
}

#ifdef DPA_WITH_CUDA
// The CUDA implementation streams the weights through a split-K kernel while
// batch * length (the conv's GEMM N) is below this, and uses im2col + cuBLAS from there on
// (a taps-major Conv1d weight, ops.taps_major, at any size); adjustable
// (ops.set_gemm_path_min_positions) so the benchmark can time both routes. 32: on an H100 at
// 32 positions the GEMM route is 1.3-3.2x faster on the U-Nets' large layers (batch 8,
// length 4), the streaming kernel up to 1.4x on small ones (batch 2, length 16); below 32
// streaming won everywhere against im2col's GEMM (BENCHMARKS.md).
constexpr int64_t kDefaultGemmPathMinPositions = 32;
extern std::atomic<int64_t> gemm_path_min_positions;
// L2 eviction priority of the streamed weights: evict-first (default) keeps activations,
// partial sums and code in L2 across a forward; normal for measurement
// (ops.set_weights_evict_first). Read when a launch is made or recorded.
extern std::atomic<bool> weights_evict_first;
// Whether convs on the streaming route run as thread-block clusters (Hopper+, where their plan
// fits: stream_conv_cluster_kernel, stream_conv_cluster_pair_kernel,
// stream_transposed_cluster_kernel) instead of split-K blocks with a finishing block.
// Switchable for measurement (ops.set_clusters).
extern std::atomic<bool> use_clusters;
// Whether a GEMM-route op with a 1x1 shortcut (conv1d_gn_mish_shortcut, residual_block) may
// run the shortcut's GEMM on a side stream, overlapping its main path, where that pays
// (shortcut_on_side_stream in conv1d_cuda.cu). Switchable for measurement
// (ops.set_side_stream); read when a launch is made or captured.
extern std::atomic<bool> use_side_stream;
// Variants of StreamProgram for measurement (ops.set_program_options), a bit mask:
// kProgramRelaxedPoll: stages wait by relaxed polling with back-off (read at run());
// kProgramNoPrefetch: no L2 prefetch of a block's weights while it waits (read at end()).
constexpr int kProgramRelaxedPoll = 1;
constexpr int kProgramNoPrefetch = 2;
extern std::atomic<int> program_options;
constexpr int kTraceEvents = 9;

// Traces the streaming launches made (or captured) on any thread from start to stop, for
// measurement: each launch's blocks stamp the global timer at the points that
// StreamProgram::run_traced lists, into the next rows of `buffer` (a CUDA int64 tensor
// [rows, kTraceEvents], zeros where a block does not get there), one row per block, launch
// after launch. stop returns the number of blocks (rows) of each launch traced, in order.
// Recorded programs are not traced this way (StreamProgram::run_traced is).
void start_launch_trace(const at::Tensor& buffer);
std::vector<int64_t> stop_launch_trace();

// A recorded sequence of the ops' streaming launches (a U-Net forward at a small batch),
// replayed as one persistent kernel: run() launches it on the current stream, so it can be
// captured in a CUDA graph. Between begin() and end(), conv1d_gn_mish, conv1d and
// conv1d_gn_mish_shortcut calls on this thread return their (unwritten) outputs and add a
// stage instead of launching. Every stage must read tensors that an earlier stage writes or
// that were declared with add_input (their contents at run time are used); otherwise, or
// where an op would not take its streaming route, the recording fails and failure() says why. The program keeps every
// tensor it reads or writes alive; weights must not be modified in a way that moves them.
class StreamProgram {
 public:
  struct Impl;
  StreamProgram();
  void begin();
  void add_input(const at::Tensor& t);
  void end();
  bool produced(const at::Tensor& t) const;  // whether a stage writes t (its first element)
  void run() const;
  // Runs once with a timeline: an int64 tensor [stages, blocks, kTraceEvents] of global-timer
  // nanoseconds at which each block's (last) work unit of each stage started, had waited for
  // its input, had staged it, had streamed its weights, had counted its partial sums, and, in
  // a block that finishes output tiles, had started finishing a tile, had added up its partial
  // sums, had its GroupNorm statistics, and had finished its tiles (0 where a block did not
  // get there).
  at::Tensor run_traced() const;
  std::vector<std::string> stage_names() const;  // what each stage computes, for reports
  int64_t num_stages() const;
  std::string failure() const;

 private:
  std::shared_ptr<Impl> impl_;
};
#endif

}  // namespace dpa
