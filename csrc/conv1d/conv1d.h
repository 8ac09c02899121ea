// The convolution op family of Diffusion Policy's U-Net: the problem sizes and argument
// checks shared by the CPU (cpu/) and CUDA (cuda/) implementations. The ops:
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

#include <optional>
#include <utility>

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

// residual_block's arguments, in schema order (registration.cpp), for its CPU and CUDA
// implementations alike: residual_block_op unpacks the schema's arguments into it once.
struct ResidualBlockArgs {
  const at::Tensor& x;
  const at::Tensor& weight;
  const std::optional<at::Tensor>& bias;
  const std::optional<at::Tensor>& gn_weight;
  const std::optional<at::Tensor>& gn_bias;
  const at::Tensor& weight2;
  const std::optional<at::Tensor>& bias2;
  const std::optional<at::Tensor>& gn_weight2;
  const std::optional<at::Tensor>& gn_bias2;
  int64_t num_groups;
  double eps;
  const std::optional<at::Tensor>& shortcut_weight;
  const std::optional<at::Tensor>& shortcut_bias;
  const std::optional<at::Tensor>& film;
  const std::optional<at::Tensor>& counters;
  const std::optional<at::Tensor>& skip;
  bool channels_last;
};

// The op's schema signature around an implementation taking ResidualBlockArgs.
template <at::Tensor (*Impl)(const ResidualBlockArgs&)>
at::Tensor residual_block_op(
    const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& gn_weight, const std::optional<at::Tensor>& gn_bias,
    const at::Tensor& weight2, const std::optional<at::Tensor>& bias2,
    const std::optional<at::Tensor>& gn_weight2, const std::optional<at::Tensor>& gn_bias2,
    int64_t num_groups, double eps, const std::optional<at::Tensor>& shortcut_weight,
    const std::optional<at::Tensor>& shortcut_bias, const std::optional<at::Tensor>& film,
    const std::optional<at::Tensor>& counters, const std::optional<at::Tensor>& skip,
    bool channels_last) {
  return Impl(ResidualBlockArgs{x, weight, bias, gn_weight, gn_bias, weight2, bias2, gn_weight2,
                                gn_bias2, num_groups, eps, shortcut_weight, shortcut_bias, film,
                                counters, skip, channels_last});
}

// `counters` here needs >= out_channels elements, twice that with a shortcut (the streaming
// route's first launch is conv1d_gn_mish_shortcut's).
ResidualBlockProblem check_residual_block_args(const ResidualBlockArgs& args);

// A [B, C, L] tensor stored channels-last, [B][L][C] in memory, as residual_block returns its
// output when asked to; t itself where it is stored so already.
inline at::Tensor stored_channels_last(const at::Tensor& t) {
  return t.transpose(1, 2).contiguous().transpose(1, 2);
}

}  // namespace dpa
