// Argument checks and the CPU implementation of conv1d_gn_mish.
#include "conv1d_gn_mish.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

#include "checks.h"

namespace dpa {

static constexpr const char* kOp = "conv1d_gn_mish";

ConvGnMishProblem check_conv1d_gn_mish_args(const at::Tensor& x, const at::Tensor& weight,
                                            const std::optional<at::Tensor>& bias,
                                            const std::optional<at::Tensor>& gn_weight,
                                            const std::optional<at::Tensor>& gn_bias,
                                            int64_t num_groups, double eps) {
  check_float_tensor(x, kOp, "x");
  check_dim(x, 3, kOp, "x", "[batch, in_channels, length]");
  check_same_device(weight, x, kOp, "weight", "x");
  check_same_dtype(weight, x, kOp, "weight", "x");
  check_dim(weight, 3, kOp, "weight", "[out_channels, in_channels, kernel_size]");
  ConvGnMishProblem p{x.size(0), x.size(1), weight.size(0), x.size(2), weight.size(2), num_groups};
  TORCH_CHECK_VALUE(p.batch > 0 && p.in_channels > 0 && p.length > 0, kOp,
                    ": x must be non-empty, got shape ", x.sizes());
  TORCH_CHECK_VALUE(p.out_channels > 0, kOp, ": weight must have out_channels >= 1, got shape ",
                    weight.sizes());
  TORCH_CHECK_VALUE(weight.size(1) == p.in_channels, kOp, ": weight has in_channels ",
                    weight.size(1), " but x has ", p.in_channels, " channels");
  TORCH_CHECK_VALUE(p.kernel_size >= 1 && p.kernel_size % 2 == 1, kOp,
                    ": kernel_size (weight.size(2)) must be odd so that padding kernel_size // 2 "
                    "keeps the length, got ", p.kernel_size);
  check_channel_vector(bias, p.out_channels, x, kOp, "bias");
  check_channel_vector(gn_weight, p.out_channels, x, kOp, "gn_weight");
  check_channel_vector(gn_bias, p.out_channels, x, kOp, "gn_bias");
  TORCH_CHECK_VALUE(num_groups >= 1 && p.out_channels % num_groups == 0, kOp,
                    ": num_groups must be >= 1 and divide out_channels (", p.out_channels,
                    "), got ", num_groups);
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps >= 0, kOp, ": eps must be finite and >= 0, got ",
                    eps);
  constexpr int64_t kIntMax = std::numeric_limits<int32_t>::max();
  TORCH_CHECK_VALUE(p.batch <= kIntMax && p.in_channels * p.kernel_size <= kIntMax &&
                        p.out_channels <= kIntMax && p.length <= kIntMax &&
                        (p.out_channels / num_groups) * p.length <= kIntMax,
                    kOp, ": sizes too large (each of batch, in_channels * kernel_size, "
                    "out_channels, length and a group's elements must fit in int32); x ",
                    x.sizes(), ", weight ", weight.sizes());
  return p;
}

namespace {

inline float mish(float v) { return v * std::tanh(std::log1p(std::exp(v))); }

at::Tensor conv1d_gn_mish_cpu(const at::Tensor& x, const at::Tensor& weight,
                              const std::optional<at::Tensor>& bias,
                              const std::optional<at::Tensor>& gn_weight,
                              const std::optional<at::Tensor>& gn_bias, int64_t num_groups,
                              double eps) {
  const ConvGnMishProblem p =
      check_conv1d_gn_mish_args(x, weight, bias, gn_weight, gn_bias, num_groups, eps);
  // The convolution itself goes through ATen's fp32 CPU conv (oneDNN / BLAS GEMM): on a CPU
  // that is already near peak, and upcasting first gives the fp32 accumulation the CUDA
  // kernels promise for every dtype. The normalisation and activation are fused below.
  std::optional<at::Tensor> bias_f;
  if (bias.has_value()) bias_f = bias->to(at::kFloat);
  const at::Tensor pre =
      at::conv1d(x.to(at::kFloat), weight.to(at::kFloat), bias_f, 1, p.kernel_size / 2)
          .contiguous();
  const at::Tensor gamma = gn_weight.has_value() ? gn_weight->to(at::kFloat).contiguous()
                                                 : at::ones({p.out_channels}, pre.options());
  const at::Tensor beta = gn_bias.has_value() ? gn_bias->to(at::kFloat).contiguous()
                                              : at::zeros({p.out_channels}, pre.options());
  at::Tensor out = at::empty({p.batch, p.out_channels, p.length}, x.options());

  const int64_t channels_per_group = p.out_channels / p.groups;
  const int64_t group_numel = channels_per_group * p.length;
  const float* pre_data = pre.data_ptr<float>();
  const float* gamma_data = gamma.data_ptr<float>();
  const float* beta_data = beta.data_ptr<float>();
  DPA_DISPATCH_FLOAT_TYPES(x.scalar_type(), kOp, [&] {
    scalar_t* out_data = out.data_ptr<scalar_t>();
    at::parallel_for(0, p.batch * p.groups, 1, [&](int64_t begin, int64_t end) {
      for (int64_t bg = begin; bg < end; ++bg) {
        const int64_t b = bg / p.groups, g = bg % p.groups;
        const int64_t offset = (b * p.out_channels + g * channels_per_group) * p.length;
        const float* y = pre_data + offset;
        double sum = 0;
        for (int64_t i = 0; i < group_numel; ++i) sum += y[i];
        const double mean = sum / group_numel;
        double sq = 0;
        for (int64_t i = 0; i < group_numel; ++i) sq += (y[i] - mean) * (y[i] - mean);
        const float rstd = static_cast<float>(1.0 / std::sqrt(sq / group_numel + eps));
        const float mean_f = static_cast<float>(mean);
        for (int64_t c = 0; c < channels_per_group; ++c) {
          const int64_t channel = g * channels_per_group + c;
          const float scale = rstd * gamma_data[channel];
          for (int64_t l = 0; l < p.length; ++l) {
            const int64_t i = c * p.length + l;
            out_data[offset + i] =
                static_cast<scalar_t>(mish((y[i] - mean_f) * scale + beta_data[channel]));
          }
        }
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(dpa, CPU, m) { m.impl("conv1d_gn_mish", &conv1d_gn_mish_cpu); }

}  // namespace dpa
