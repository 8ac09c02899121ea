// CPU implementations of the conv ops: ATen's conv (oneDNN / BLAS) in fp32, then one fused
// pass per (batch row, GroupNorm group) for what follows it.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

#include "common/checks.h"
#include "conv1d/conv1d.h"

namespace dpa {

namespace {

inline float mish(float v) { return v * std::tanh(std::log1p(std::exp(v))); }

std::optional<at::Tensor> to_float(const std::optional<at::Tensor>& t) {
  if (!t.has_value()) return std::nullopt;
  return t->to(at::kFloat).contiguous();
}

// The convolutions go through ATen's fp32 CPU conv (oneDNN / BLAS GEMM), which is already near
// a CPU's peak; upcasting first gives the fp32 accumulation the CUDA kernels promise for every
// dtype. What follows the conv is fused in one pass per (batch, group) below.
at::Tensor conv1d_gn_mish_cpu(const at::Tensor& x, const at::Tensor& weight,
                              const std::optional<at::Tensor>& bias,
                              const std::optional<at::Tensor>& gn_weight,
                              const std::optional<at::Tensor>& gn_bias, int64_t num_groups,
                              double eps, const std::optional<at::Tensor>& film,
                              const std::optional<at::Tensor>& residual,
                              const std::optional<at::Tensor>& counters) {
  const ConvProblem p = check_conv1d_gn_mish_args(x, weight, bias, gn_weight, gn_bias,
                                                  num_groups, eps, film, residual, counters);
  const at::Tensor pre =
      at::conv1d(x.to(at::kFloat), weight.to(at::kFloat), to_float(bias), 1, p.padding)
          .contiguous();
  const at::Tensor gamma = gn_weight.has_value() ? gn_weight->to(at::kFloat).contiguous()
                                                 : at::ones({p.out_channels}, pre.options());
  const at::Tensor beta = gn_bias.has_value() ? gn_bias->to(at::kFloat).contiguous()
                                              : at::zeros({p.out_channels}, pre.options());
  const auto film_f = to_float(film), residual_f = to_float(residual);
  at::Tensor out = at::empty({p.batch, p.out_channels, p.out_length}, x.options());

  const int64_t cpg = p.out_channels / p.groups, length = p.out_length;
  const int64_t group_numel = cpg * length;
  const float* pre_data = pre.data_ptr<float>();
  const float* gamma_data = gamma.data_ptr<float>();
  const float* beta_data = beta.data_ptr<float>();
  const float* film_data = film_f.has_value() ? film_f->data_ptr<float>() : nullptr;
  const float* residual_data = residual_f.has_value() ? residual_f->data_ptr<float>() : nullptr;
  const bool film_scale = p.film_width == 2 * p.out_channels;
  DPA_DISPATCH_FLOAT_TYPES(x.scalar_type(), "conv1d_gn_mish", [&] {
    scalar_t* out_data = out.data_ptr<scalar_t>();
    at::parallel_for(0, p.batch * p.groups, 1, [&](int64_t begin, int64_t end) {
      for (int64_t bg = begin; bg < end; ++bg) {
        const int64_t b = bg / p.groups, g = bg % p.groups;
        const int64_t offset = (b * p.out_channels + g * cpg) * length;
        const float* y = pre_data + offset;
        double sum = 0;
        for (int64_t i = 0; i < group_numel; ++i) sum += y[i];
        const double mean = sum / group_numel;
        double sq = 0;
        for (int64_t i = 0; i < group_numel; ++i) sq += (y[i] - mean) * (y[i] - mean);
        const float rstd = static_cast<float>(1.0 / std::sqrt(sq / group_numel + eps));
        const float mean_f = static_cast<float>(mean);
        for (int64_t c = 0; c < cpg; ++c) {
          const int64_t channel = g * cpg + c;
          const float scale = rstd * gamma_data[channel];
          const float* film_row = film_data ? film_data + b * p.film_width : nullptr;
          for (int64_t l = 0; l < length; ++l) {
            const int64_t i = c * length + l;
            float v = mish((y[i] - mean_f) * scale + beta_data[channel]);
            if (film_row) {
              v = film_scale ? v * film_row[channel] + film_row[p.out_channels + channel]
                             : v + film_row[channel];
            }
            if (residual_data) v += residual_data[offset + i];
            out_data[offset + i] = static_cast<scalar_t>(v);
          }
        }
      }
    });
  });
  return out;
}

at::Tensor conv1d_cpu(const at::Tensor& x, const at::Tensor& weight,
                      const std::optional<at::Tensor>& bias, int64_t stride, int64_t padding,
                      bool transposed, const std::optional<at::Tensor>& residual,
                      const std::optional<at::Tensor>& counters) {
  const ConvProblem p =
      check_conv1d_args(x, weight, bias, stride, padding, transposed, residual, counters);
  const at::Tensor xf = x.to(at::kFloat), wf = weight.to(at::kFloat);
  at::Tensor out = transposed ? at::conv_transpose1d(xf, wf, to_float(bias), stride, padding)
                              : at::conv1d(xf, wf, to_float(bias), stride, padding);
  TORCH_INTERNAL_ASSERT(out.size(2) == p.out_length);
  if (residual.has_value()) out.add_(residual->to(at::kFloat));
  return out.to(x.scalar_type()).contiguous();
}

std::tuple<at::Tensor, at::Tensor> conv1d_gn_mish_shortcut_cpu(
    const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& gn_weight, const std::optional<at::Tensor>& gn_bias,
    int64_t num_groups, double eps, const at::Tensor& shortcut_weight,
    const std::optional<at::Tensor>& shortcut_bias, const std::optional<at::Tensor>& film,
    const std::optional<at::Tensor>& counters, const std::optional<at::Tensor>& skip) {
  check_conv1d_gn_mish_shortcut_args(x, weight, bias, gn_weight, gn_bias, num_groups, eps,
                                     shortcut_weight, shortcut_bias, film, counters, skip);
  const std::optional<at::Tensor> none;
  const at::Tensor input = skip.has_value() ? at::cat({x, *skip}, 1) : x;
  return {conv1d_gn_mish_cpu(input, weight, bias, gn_weight, gn_bias, num_groups, eps, film, none, none),
          conv1d_cpu(input, shortcut_weight, shortcut_bias, 1, 0, false, none, none)};
}

at::Tensor residual_block_cpu(const ResidualBlockArgs& a) {
  check_residual_block_args(a);
  const std::optional<at::Tensor> none;
  const at::Tensor input = a.skip.has_value() ? at::cat({a.x, *a.skip}, 1) : a.x;
  const at::Tensor residual =
      a.shortcut_weight.has_value()
          ? conv1d_cpu(input, *a.shortcut_weight, a.shortcut_bias, 1, 0, false, none, none)
          : input;
  const at::Tensor h = conv1d_gn_mish_cpu(input, a.weight, a.bias, a.gn_weight, a.gn_bias,
                                          a.num_groups, a.eps, a.film, none, none);
  const at::Tensor out = conv1d_gn_mish_cpu(h, a.weight2, a.bias2, a.gn_weight2, a.gn_bias2,
                                            a.num_groups, a.eps, none, residual, none);
  return a.channels_last ? stored_channels_last(out) : out;
}

}  // namespace

TORCH_LIBRARY_IMPL(dpa, CPU, m) {
  m.impl("conv1d_gn_mish", &conv1d_gn_mish_cpu);
  m.impl("conv1d", &conv1d_cpu);
  m.impl("conv1d_gn_mish_shortcut", &conv1d_gn_mish_shortcut_cpu);
  m.impl("residual_block", &residual_block_op<residual_block_cpu>);
}

}  // namespace dpa
