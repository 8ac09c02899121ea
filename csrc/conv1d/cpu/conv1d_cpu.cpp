// CPU implementations of the conv ops: the convolution (conv_route_cpu.h), then one fused pass
// per (batch row, GroupNorm group) for what follows it.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "common/checks.h"
#include "conv1d/conv1d.h"
#include "conv1d/cpu/conv_route_cpu.h"
#include "conv1d/cpu/epilogue_cpu.h"

namespace dpa {

namespace {

std::optional<at::Tensor> to_float(const std::optional<at::Tensor>& t) {
  if (!t.has_value()) return std::nullopt;
  return t->to(at::kFloat).contiguous();
}

// The convolutions run as ATen's conv (the one plain PyTorch runs), one GEMM, or the package's
// weight-streaming GEMM, whichever was fastest when the shape was first timed on this CPU
// (conv_route_cpu.h): in the input's dtype, or a half-precision conv on fp32 copies of its
// operands where that timed faster. Upcasting every half-precision conv (an earlier version)
// converted every weight on every call and made bf16 slower than plain PyTorch on the Zen 4 of
// conv_route_cpu.h, so it is one of the timed routes instead. What follows the conv is fused
// in one vectorised pass per (batch row, group) (epilogue_cpu.h), faster than ATen's
// GroupNorm, Mish and elementwise kernels one after the other.
at::Tensor conv1d_gn_mish_cpu(const at::Tensor& x, const at::Tensor& weight,
                              const std::optional<at::Tensor>& bias,
                              const std::optional<at::Tensor>& gn_weight,
                              const std::optional<at::Tensor>& gn_bias, int64_t num_groups,
                              double eps, const std::optional<at::Tensor>& film,
                              const std::optional<at::Tensor>& residual,
                              const std::optional<at::Tensor>& counters) {
  const ConvProblem p = check_conv1d_gn_mish_args(x, weight, bias, gn_weight, gn_bias,
                                                  num_groups, eps, film, residual, counters);
  const at::Tensor pre = cpu::conv1d(x, weight, bias, 1, p.padding).to(at::kFloat).contiguous();
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
  const int64_t film_stride = film_f.has_value() ? film_f->stride(0) : 0;
  const float* residual_data = residual_f.has_value() ? residual_f->data_ptr<float>() : nullptr;
  const bool film_scale = p.film_width == 2 * p.out_channels;
  DPA_DISPATCH_FLOAT_TYPES(x.scalar_type(), "conv1d_gn_mish", [&] {
    scalar_t* out_data = out.data_ptr<scalar_t>();
    // About 32K elements a task: fewer groups per task would cost more in scheduling than
    // the pass itself at the U-Net's small groups.
    const int64_t grain = std::max<int64_t>(1, (1 << 15) / group_numel);
    at::parallel_for(0, p.batch * p.groups, grain, [&](int64_t begin, int64_t end) {
      // fp32 outputs are written in place; half types through a float group, rounded once.
      constexpr bool kFloat = std::is_same_v<scalar_t, float>;
      std::vector<float> staged(kFloat ? 0 : group_numel), scratch(cpu::scratch_floats(cpg));
      for (int64_t bg = begin; bg < end; ++bg) {
        const int64_t b = bg / p.groups, g = bg % p.groups, c0 = g * cpg;
        const int64_t offset = (b * p.out_channels + c0) * length;
        cpu::GroupEpilogue e{};
        e.y = pre_data + offset;
        e.channels = cpg;
        e.length = length;
        e.mean = static_cast<float>(cpu::group_sum(e.y, group_numel) / group_numel);
        e.rstd = static_cast<float>(1.0 / std::sqrt(cpu::group_sum(e.y, group_numel, &e.mean) / group_numel + eps));
        e.gamma = gamma_data + c0;
        e.beta = beta_data + c0;
        if (film_data) {
          const float* row = film_data + b * film_stride;
          e.scale = film_scale ? row + c0 : nullptr;
          e.shift = row + (film_scale ? p.out_channels : 0) + c0;
        }
        e.residual = residual_data ? residual_data + offset : nullptr;
        e.out = kFloat ? reinterpret_cast<float*>(out_data + offset) : staged.data();
        e.scratch = scratch.data();
        cpu::apply_group(e);
        if (!kFloat) {
          for (int64_t i = 0; i < group_numel; ++i) out_data[offset + i] = static_cast<scalar_t>(staged[i]);
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
  at::Tensor out = transposed ? cpu::conv_transpose1d(x, weight, bias, stride, padding)
                              : cpu::conv1d(x, weight, bias, stride, padding);
  TORCH_INTERNAL_ASSERT(out.size(2) == p.out_length);
  // A half-precision conv run in fp32 adds the residual in fp32 and rounds once.
  if (residual.has_value()) out.add_(*residual);
  if (out.scalar_type() == x.scalar_type()) return out.contiguous();
  // One copy for the dtype and the contiguous layout together (Tensor::to keeps a 3-D view's
  // permuted strides).
  return at::empty(out.sizes(), out.options().dtype(x.scalar_type())).copy_(out);
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
