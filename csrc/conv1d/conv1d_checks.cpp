// Argument checks of the conv ops, shared by their CPU and CUDA implementations.
#include "conv1d/conv1d.h"

#include <cmath>
#include <limits>

#include "common/checks.h"

namespace dpa {

namespace {

constexpr int64_t kIntMax = std::numeric_limits<int32_t>::max();

void check_input_and_weight(const at::Tensor& x, const at::Tensor& weight, const char* op,
                            const char* weight_layout) {
  check_float_tensor(x, op, "x");
  check_dim(x, 3, op, "x", "[batch, in_channels, length]");
  check_same_device(weight, x, op, "weight", "x");
  check_same_dtype(weight, x, op, "weight", "x");
  check_dim(weight, 3, op, "weight", weight_layout);
  TORCH_CHECK_VALUE(x.size(0) > 0 && x.size(1) > 0 && x.size(2) > 0, op,
                    ": x must be non-empty, got shape ", x.sizes());
}

// The optional tensors applied to the output: residual [B, C_out, L_out] and counters.
void check_output_extras(const ConvProblem& p, const at::Tensor& x,
                         const std::optional<at::Tensor>& residual,
                         const std::optional<at::Tensor>& counters, const char* op) {
  if (residual.has_value()) {
    check_same_device(*residual, x, op, "residual", "x");
    check_same_dtype(*residual, x, op, "residual", "x");
    TORCH_CHECK_VALUE(residual->dim() == 3 && residual->size(0) == p.batch &&
                          residual->size(1) == p.out_channels &&
                          residual->size(2) == p.out_length,
                      op, ": residual must have the output's shape [", p.batch, ", ",
                      p.out_channels, ", ", p.out_length, "], got ", residual->sizes());
  }
  if (counters.has_value()) {
    check_same_device(*counters, x, op, "counters", "x");
    TORCH_CHECK_TYPE(counters->scalar_type() == at::kInt, op,
                     ": counters must be int32, got ", counters->scalar_type());
    TORCH_CHECK_VALUE(counters->dim() == 1 && counters->size(0) >= p.out_channels &&
                          counters->is_contiguous(),
                      op, ": counters must be a contiguous 1-D tensor of at least out_channels (",
                      p.out_channels, ") elements, got shape ", counters->sizes());
  }
  TORCH_CHECK_VALUE(p.batch <= kIntMax && p.in_channels * p.kernel_size <= kIntMax &&
                        p.out_channels * p.kernel_size <= kIntMax && p.in_length <= kIntMax &&
                        p.out_length <= kIntMax && p.out_channels * p.out_length <= kIntMax,
                    op, ": sizes too large (channels x kernel_size, lengths and "
                    "out_channels x out_length must fit in int32); x ", x.sizes());
}

}  // namespace

ConvProblem check_conv1d_gn_mish_args(const at::Tensor& x, const at::Tensor& weight,
                                      const std::optional<at::Tensor>& bias,
                                      const std::optional<at::Tensor>& gn_weight,
                                      const std::optional<at::Tensor>& gn_bias,
                                      int64_t num_groups, double eps,
                                      const std::optional<at::Tensor>& film,
                                      const std::optional<at::Tensor>& residual,
                                      const std::optional<at::Tensor>& counters, const char* op,
                                      int64_t skip_channels) {
  check_input_and_weight(x, weight, op, "[out_channels, in_channels, kernel_size]");
  ConvProblem p{};
  p.batch = x.size(0);
  p.in_channels = x.size(1) + skip_channels;
  p.out_channels = weight.size(0);
  p.in_length = p.out_length = x.size(2);
  p.kernel_size = weight.size(2);
  p.stride = 1;
  p.padding = p.kernel_size / 2;
  p.groups = num_groups;
  TORCH_CHECK_VALUE(p.out_channels > 0, op, ": weight must have out_channels >= 1, got shape ",
                    weight.sizes());
  TORCH_CHECK_VALUE(weight.size(1) == p.in_channels, op, ": weight has in_channels ",
                    weight.size(1), " but x has ", p.in_channels, " channels",
                    skip_channels ? " (with skip's)" : "");
  TORCH_CHECK_VALUE(p.kernel_size >= 1 && p.kernel_size % 2 == 1, op,
                    ": kernel_size (weight.size(2)) must be odd so that padding kernel_size // 2 "
                    "keeps the length, got ", p.kernel_size);
  check_channel_vector(bias, p.out_channels, x, op, "bias");
  check_channel_vector(gn_weight, p.out_channels, x, op, "gn_weight");
  check_channel_vector(gn_bias, p.out_channels, x, op, "gn_bias");
  TORCH_CHECK_VALUE(num_groups >= 1 && p.out_channels % num_groups == 0, op,
                    ": num_groups must be >= 1 and divide out_channels (", p.out_channels,
                    "), got ", num_groups);
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps >= 0, op, ": eps must be finite and >= 0, got ",
                    eps);
  if (film.has_value()) {
    check_same_device(*film, x, op, "film", "x");
    check_same_dtype(*film, x, op, "film", "x");
    p.film_width = film->dim() == 2 ? film->size(1) : -1;
    TORCH_CHECK_VALUE(film->dim() == 2 && film->size(0) == p.batch &&
                          (p.film_width == p.out_channels || p.film_width == 2 * p.out_channels),
                      op, ": film must be [", p.batch, ", ", p.out_channels, "] (a bias) or [",
                      p.batch, ", ", 2 * p.out_channels, "] (a scale, then a bias), got ",
                      film->sizes());
  }
  check_output_extras(p, x, residual, counters, op);
  return p;
}

ConvProblem check_conv1d_args(const at::Tensor& x, const at::Tensor& weight,
                              const std::optional<at::Tensor>& bias, int64_t stride,
                              int64_t padding, bool transposed,
                              const std::optional<at::Tensor>& residual,
                              const std::optional<at::Tensor>& counters) {
  constexpr const char* op = "conv1d";
  check_input_and_weight(x, weight, op,
                         transposed ? "[in_channels, out_channels, kernel_size] (transposed)"
                                    : "[out_channels, in_channels, kernel_size]");
  ConvProblem p{};
  p.batch = x.size(0);
  p.in_channels = x.size(1);
  p.out_channels = weight.size(transposed ? 1 : 0);
  p.in_length = x.size(2);
  p.kernel_size = weight.size(2);
  p.stride = stride;
  p.padding = padding;
  p.transposed = transposed;
  const int64_t weight_in = weight.size(transposed ? 0 : 1);
  TORCH_CHECK_VALUE(p.out_channels > 0 && p.kernel_size > 0, op,
                    ": weight must have out_channels >= 1 and kernel_size >= 1, got shape ",
                    weight.sizes());
  TORCH_CHECK_VALUE(weight_in == p.in_channels, op, ": weight has in_channels ", weight_in,
                    " but x has ", p.in_channels, " channels");
  TORCH_CHECK_VALUE(stride >= 1, op, ": stride must be >= 1, got ", stride);
  TORCH_CHECK_VALUE(padding >= 0, op, ": padding must be >= 0, got ", padding);
  p.out_length = transposed ? (p.in_length - 1) * stride - 2 * padding + p.kernel_size
                            : (p.in_length + 2 * padding - p.kernel_size) / stride + 1;
  TORCH_CHECK_VALUE((transposed || p.in_length + 2 * padding >= p.kernel_size) &&
                        p.out_length >= 1,
                    op, ": input length ", p.in_length, " with kernel_size ", p.kernel_size,
                    ", stride ", stride, " and padding ", padding, " gives no output");
  check_channel_vector(bias, p.out_channels, x, op, "bias");
  check_output_extras(p, x, residual, counters, op);
  return p;
}

namespace {

// skip's channels (0 without one): concatenated to x's, read in place.
int64_t check_skip(const at::Tensor& x, const std::optional<at::Tensor>& skip, const char* op) {
  if (!skip.has_value()) return 0;
  check_float_tensor(x, op, "x");
  check_dim(x, 3, op, "x", "[batch, in_channels, length]");
  check_same_device(*skip, x, op, "skip", "x");
  check_same_dtype(*skip, x, op, "skip", "x");
  check_dim(*skip, 3, op, "skip", "[batch, skip_channels, length]");
  TORCH_CHECK_VALUE(skip->size(0) == x.size(0) && skip->size(1) > 0 && skip->size(2) == x.size(2),
                    op, ": skip must be [", x.size(0), ", skip_channels >= 1, ", x.size(2),
                    "] like x ", x.sizes(), " (it is concatenated to x's channels), got ",
                    skip->sizes());
  return skip->size(1);
}

// The 1x1 shortcut conv of the GroupNorm conv p's input.
ConvProblem check_shortcut(const ConvProblem& p, const at::Tensor& x,
                           const at::Tensor& shortcut_weight,
                           const std::optional<at::Tensor>& shortcut_bias, const char* op) {
  check_same_device(shortcut_weight, x, op, "shortcut_weight", "x");
  check_same_dtype(shortcut_weight, x, op, "shortcut_weight", "x");
  check_dim(shortcut_weight, 3, op, "shortcut_weight", "[shortcut_channels, in_channels, 1]");
  TORCH_CHECK_VALUE(shortcut_weight.size(0) > 0 && shortcut_weight.size(1) == p.in_channels &&
                        shortcut_weight.size(2) == 1,
                    op, ": shortcut_weight must be [shortcut_channels, ", p.in_channels,
                    ", 1] (a 1x1 conv of x), got ", shortcut_weight.sizes());
  ConvProblem shortcut = p;
  shortcut.out_channels = shortcut_weight.size(0);
  shortcut.kernel_size = 1;
  shortcut.padding = 0;
  shortcut.groups = 0;
  shortcut.film_width = 0;
  check_channel_vector(shortcut_bias, shortcut.out_channels, x, op, "shortcut_bias");
  check_output_extras(shortcut, x, std::nullopt, std::nullopt, op);
  return shortcut;
}

// counters for launches that use at most `channels` of them.
void check_counters(const ConvProblem& p, int64_t channels, const at::Tensor& x,
                    const std::optional<at::Tensor>& counters, const char* op) {
  if (!counters.has_value()) return;
  ConvProblem all = p;
  all.out_channels = channels;
  check_output_extras(all, x, std::nullopt, counters, op);
}

}  // namespace

std::pair<ConvProblem, ConvProblem> check_conv1d_gn_mish_shortcut_args(
    const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& gn_weight, const std::optional<at::Tensor>& gn_bias,
    int64_t num_groups, double eps, const at::Tensor& shortcut_weight,
    const std::optional<at::Tensor>& shortcut_bias, const std::optional<at::Tensor>& film,
    const std::optional<at::Tensor>& counters, const std::optional<at::Tensor>& skip) {
  constexpr const char* op = "conv1d_gn_mish_shortcut";
  const int64_t skip_channels = check_skip(x, skip, op);
  const ConvProblem p = check_conv1d_gn_mish_args(x, weight, bias, gn_weight, gn_bias, num_groups,
                                                  eps, film, std::nullopt, std::nullopt, op,
                                                  skip_channels);
  const ConvProblem shortcut = check_shortcut(p, x, shortcut_weight, shortcut_bias, op);
  check_counters(p, p.out_channels + shortcut.out_channels, x, counters, op);
  return {p, shortcut};
}

ResidualBlockProblem check_residual_block_args(const ResidualBlockArgs& args) {
  constexpr const char* op = "residual_block";
  const at::Tensor &x = args.x, &weight2 = args.weight2;
  const auto& shortcut_weight = args.shortcut_weight;
  ResidualBlockProblem r{};
  const int64_t skip_channels = check_skip(x, args.skip, op);
  r.first = check_conv1d_gn_mish_args(x, args.weight, args.bias, args.gn_weight, args.gn_bias,
                                      args.num_groups, args.eps, args.film, std::nullopt,
                                      std::nullopt, op, skip_channels);
  const int64_t channels = r.first.out_channels;
  r.has_shortcut = shortcut_weight.has_value();
  if (r.has_shortcut) {
    r.shortcut = check_shortcut(r.first, x, *shortcut_weight, args.shortcut_bias, op);
    TORCH_CHECK_VALUE(r.shortcut.out_channels == channels, op, ": shortcut_weight must have ",
                      channels, " output channels (the residual is added to the block's output), got ",
                      shortcut_weight->sizes());
  } else {
    TORCH_CHECK_VALUE(!args.shortcut_bias.has_value(), op,
                      ": shortcut_bias was given without shortcut_weight");
    TORCH_CHECK_VALUE(r.first.in_channels == channels, op,
                      ": without shortcut_weight the residual is the input itself, so the input's ",
                      r.first.in_channels, " channels", skip_channels ? " (with skip's)" : "",
                      " must equal out_channels (", channels, ")");
  }
  check_same_device(weight2, x, op, "weight2", "x");
  check_same_dtype(weight2, x, op, "weight2", "x");
  check_dim(weight2, 3, op, "weight2", "[out_channels, out_channels, kernel_size]");
  TORCH_CHECK_VALUE(weight2.size(0) == channels && weight2.size(1) == channels, op,
                    ": weight2 must be [", channels, ", ", channels,
                    ", kernel_size] (the second conv maps the first's output to as many "
                    "channels), got ", weight2.sizes());
  r.second = r.first;
  r.second.in_channels = channels;
  r.second.kernel_size = weight2.size(2);
  r.second.padding = r.second.kernel_size / 2;
  r.second.film_width = 0;
  TORCH_CHECK_VALUE(r.second.kernel_size >= 1 && r.second.kernel_size % 2 == 1, op,
                    ": weight2's kernel_size must be odd so that padding kernel_size // 2 keeps "
                    "the length, got ", r.second.kernel_size);
  check_channel_vector(args.bias2, channels, x, op, "bias2");
  check_channel_vector(args.gn_weight2, channels, x, op, "gn_weight2");
  check_channel_vector(args.gn_bias2, channels, x, op, "gn_bias2");
  check_output_extras(r.second, x, std::nullopt, std::nullopt, op);
  check_counters(r.first, channels + (r.has_shortcut ? channels : 0), x, args.counters, op);
  return r;
}

}  // namespace dpa
