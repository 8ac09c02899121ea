// The conv ops' CUDA entry points: each validates its arguments (conv1d_checks.cpp), then
// takes the streaming route (streaming.h) or the im2col + cuBLAS route (gemm_route.h).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "common/checks.h"
#include "common/kernel_config.h"
#include "conv1d/conv1d.h"
#include "conv1d/cuda/conv_params.h"
#include "conv1d/cuda/gemm_route.h"
#include "conv1d/cuda/streaming.h"

namespace dpa {

namespace {

// Fills the fields every path shares.
StreamArgs common_args(const ConvProblem& p, const at::Tensor& x, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias, const at::Tensor& out,
                       const std::optional<at::Tensor>& residual) {
  StreamArgs a{};
  a.x = x.data_ptr();
  a.x_sb = x.stride(0);
  a.x_sc = x.stride(1);
  a.x_sl = x.stride(2);
  a.x_split = static_cast<int>(p.in_channels);
  a.weight = weight.data_ptr();
  a.weights_evict_first = kernel_config().weights_evict_first;
  a.bias = optional_data(bias);
  a.residual = optional_data(residual);
  a.out = out.defined() ? out.data_ptr() : nullptr;
  a.batch = static_cast<int>(p.batch);
  a.cout = static_cast<int>(p.out_channels);
  a.lin = static_cast<int>(p.in_length);
  a.lout = static_cast<int>(p.out_length);
  a.ksize = static_cast<int>(p.kernel_size);
  a.stride = static_cast<int>(p.stride);
  a.pad = static_cast<int>(p.padding);
  a.groups = static_cast<int>(p.groups);
  a.film_width = static_cast<int>(p.film_width);
  return a;
}

// A conv1d_gn_mish call's operands, made contiguous (and kept alive here until the launch is
// queued), its output, and the kernels' arguments.
struct GnMishCall {
  at::Tensor weight, out;
  std::optional<at::Tensor> bias, gn_weight, gn_bias, film, residual;
  StreamArgs a;
};

GnMishCall gn_mish_call(const ConvProblem& p, const at::Tensor& x, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias,
                        const std::optional<at::Tensor>& gn_weight,
                        const std::optional<at::Tensor>& gn_bias, double eps,
                        const std::optional<at::Tensor>& film,
                        const std::optional<at::Tensor>& residual, GemmForm form,
                        bool with_output = true) {
  GnMishCall c;
  c.weight = form == GemmForm::kTapRows ? weight : weight.contiguous();
  c.bias = contiguous_or_none(bias);
  c.gn_weight = contiguous_or_none(gn_weight);
  c.gn_bias = contiguous_or_none(gn_bias);
  c.residual = contiguous_or_none(residual);
  // Rows may be strided (a slice of every block's FiLM, or one row broadcast to the batch).
  c.film = film.has_value() && film->stride(1) != 1 ? std::optional<at::Tensor>(film->contiguous()) : film;
  if (with_output) c.out = at::empty({p.batch, p.out_channels, p.out_length}, x.options());
  c.a = common_args(p, x, c.weight, c.bias, c.out, c.residual);
  c.a.gn_weight = optional_data(c.gn_weight);
  c.a.gn_bias = optional_data(c.gn_bias);
  c.a.film = optional_data(c.film);
  c.a.film_sb = c.film.has_value() ? c.film->stride(0) : 0;
  c.a.eps = static_cast<float>(eps);
  set_gemm_view(c.a, p, form);
  c.a.unit_rows = static_cast<int>(p.out_channels / p.groups);
  return c;
}

// The same for a plain (or transposed) conv1d call.
struct ConvCall {
  at::Tensor weight, out;
  std::optional<at::Tensor> bias, residual;
  StreamArgs a;
};

ConvCall conv_call(const ConvProblem& p, const at::Tensor& x, const at::Tensor& weight,
                   const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual,
                   GemmForm form) {
  ConvCall c;
  c.weight = form == GemmForm::kTapRows ? weight : weight.contiguous();
  c.bias = contiguous_or_none(bias);
  c.residual = contiguous_or_none(residual);
  c.out = at::empty({p.batch, p.out_channels, p.out_length}, x.options());
  c.a = common_args(p, x, c.weight, c.bias, c.out, c.residual);
  set_gemm_view(c.a, p, form);
  return c;
}

int* counters_data(const std::optional<at::Tensor>& counters) {
  return counters.has_value() ? counters->data_ptr<int>() : nullptr;
}

at::Tensor conv1d_gn_mish_cuda(const at::Tensor& x, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias,
                               const std::optional<at::Tensor>& gn_weight,
                               const std::optional<at::Tensor>& gn_bias, int64_t num_groups,
                               double eps, const std::optional<at::Tensor>& film,
                               const std::optional<at::Tensor>& residual,
                               const std::optional<at::Tensor>& counters) {
  const ConvProblem p = check_conv1d_gn_mish_args(x, weight, bias, gn_weight, gn_bias, num_groups,
                                                  eps, film, residual, counters);
  const c10::cuda::CUDAGuard guard(x.device());
  const bool gemm_route = takes_gemm_route(p, weight);
  const GemmForm form = gemm_form(p, weight, gemm_route);
  GnMishCall c = gn_mish_call(p, x, weight, bias, gn_weight, gn_bias, eps, film, residual, form);
  if (gemm_route) {
    c.a.counters = counters_data(counters);  // a sliced epilogue's, in one launch
    launch_group_norm_epilogue(c.a, x.scalar_type(), conv_as_gemm(c.a, x, c.weight, form), form);
    return c.out;
  }
  run_streaming(c.a, p, x, c.weight, counters_data(counters));
  return c.out;
}

at::Tensor conv1d_cuda(const at::Tensor& x, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias, int64_t stride, int64_t padding,
                       bool transposed, const std::optional<at::Tensor>& residual,
                       const std::optional<at::Tensor>& counters) {
  const ConvProblem p =
      check_conv1d_args(x, weight, bias, stride, padding, transposed, residual, counters);
  const c10::cuda::CUDAGuard guard(x.device());
  if (takes_gemm_route(p, weight)) {
    if (conv_epilogue_fits(p)) {
      const GemmForm form = gemm_form(p, weight, true);
      ConvCall c = conv_call(p, x, weight, bias, residual, form);
      launch_conv_epilogue(c.a, x.scalar_type(), conv_as_gemm(c.a, x, c.weight, form), form);
      return c.out;
    }
    // Past 32-bit indices, cuDNN's convolution.
    at::Tensor out = transposed ? at::conv_transpose1d(x, weight, bias, stride, padding)
                                : at::conv1d(x, weight, bias, stride, padding);
    if (residual.has_value()) out.add_(*residual);
    return out.contiguous();
  }
  ConvCall c = conv_call(p, x, weight, bias, residual, gemm_form(p, weight, false));
  run_streaming(c.a, p, x, c.weight, counters_data(counters));
  return c.out;
}

// The input's channels from x's on come from skip (a concatenation read in place).
void read_skip_in_place(StreamArgs& a, const at::Tensor& x, const at::Tensor& skip) {
  a.x2 = skip.data_ptr();
  a.x2_sb = skip.stride(0), a.x2_sc = skip.stride(1), a.x2_sl = skip.stride(2);
  a.x_split = static_cast<int>(x.size(1));
}

std::tuple<at::Tensor, at::Tensor> conv1d_gn_mish_shortcut_cuda(
    const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& gn_weight, const std::optional<at::Tensor>& gn_bias,
    int64_t num_groups, double eps, const at::Tensor& shortcut_weight,
    const std::optional<at::Tensor>& shortcut_bias, const std::optional<at::Tensor>& film,
    const std::optional<at::Tensor>& counters, const std::optional<at::Tensor>& skip) {
  const auto [p, ps] = check_conv1d_gn_mish_shortcut_args(
      x, weight, bias, gn_weight, gn_bias, num_groups, eps, shortcut_weight, shortcut_bias, film,
      counters, skip);
  const c10::cuda::CUDAGuard guard(x.device());
  const bool gemm_route = takes_gemm_route(p, weight);
  if (gemm_route && !conv_epilogue_fits(ps)) {
    const std::optional<at::Tensor> none;
    const at::Tensor input = skip.has_value() ? at::cat({x, *skip}, 1) : x;
    return {conv1d_gn_mish_cuda(input, weight, bias, gn_weight, gn_bias, num_groups, eps, film, none, none),
            conv1d_cuda(input, shortcut_weight, shortcut_bias, 1, 0, false, none, none)};
  }
  const GemmForm form = gemm_form(p, weight, gemm_route);
  GnMishCall c = gn_mish_call(p, x, weight, bias, gn_weight, gn_bias, eps, film, std::nullopt, form);
  ConvCall cs = conv_call(ps, x, shortcut_weight, shortcut_bias, std::nullopt, GemmForm::kIm2col);
  if (skip.has_value()) {
    read_skip_in_place(c.a, x, *skip);
    read_skip_in_place(cs.a, x, *skip);
  }
  if (gemm_route) {
    // The first conv's GEMM runs after im2col on this stream; the shortcut's forks off.
    const bool narrow = takes_narrow_gemm(c.a, c.weight, form, false);
    const at::Tensor cols = gemm_columns(c.a, x, form, narrow);
    const at::Tensor centre = centre_columns(c.a, cols, form);
    SideBranch shortcut(shortcut_on_side_stream(x.scalar_type(), cs.a.positions));
    const bool beside_cublas = shortcut.forked() && !narrow;
    shortcut.run([&] {
      launch_conv_epilogue(cs.a, x.scalar_type(), gemm(cs.a, cs.weight, centre, GemmForm::kIm2col, beside_cublas),
                           GemmForm::kIm2col);
    });
    c.a.counters = counters_data(counters);
    launch_group_norm_epilogue(c.a, x.scalar_type(), gemm(c.a, c.weight, cols, form), form);
    shortcut.join();
    return {c.out, cs.out};
  }
  run_streaming_pair(c.a, cs.a, p, ps, x, c.weight, cs.weight, counters_data(counters));
  return {c.out, cs.out};
}

at::Tensor residual_block_cuda(const ResidualBlockArgs& args) {
  const ResidualBlockProblem r = check_residual_block_args(args);
  const at::Tensor& x = args.x;
  const auto &weight = args.weight, &weight2 = args.weight2;
  const auto &skip = args.skip, &shortcut_weight = args.shortcut_weight, &counters = args.counters;
  const int64_t num_groups = args.num_groups;
  const double eps = args.eps;
  const c10::cuda::CUDAGuard guard(x.device());
  const ConvProblem& p = r.first;
  const std::optional<at::Tensor> none;
  const int64_t positions = p.batch * p.out_length;
  const bool fused = block_fused(conv_shape(p, weight), conv_shape(r.second, weight2), p.groups, kernel_config(),
                                 route_device()) &&
                     conv_epilogue_fits(p) && conv_epilogue_fits(r.second);
  if (!fused) {
    // The ops one after the other: on the streaming route each conv is one launch already.
    at::Tensor h, residual;
    if (r.has_shortcut) {
      std::tie(h, residual) = conv1d_gn_mish_shortcut_cuda(
          x, weight, args.bias, args.gn_weight, args.gn_bias, num_groups, eps, *shortcut_weight,
          args.shortcut_bias, args.film, counters, skip);
    } else {
      residual = skip.has_value() ? at::cat({x, *skip}, 1) : x;
      h = conv1d_gn_mish_cuda(residual, weight, args.bias, args.gn_weight, args.gn_bias, num_groups,
                              eps, args.film, none, counters);
    }
    const at::Tensor out = conv1d_gn_mish_cuda(h, weight2, args.bias2, args.gn_weight2, args.gn_bias2,
                                               num_groups, eps, none, residual, counters);
    return args.channels_last ? stored_channels_last(out) : out;
  }
  const GemmForm form = gemm_form(p, weight, true), form2 = gemm_form(r.second, weight2, true);
  GnMishCall first = gn_mish_call(p, x, weight, args.bias, args.gn_weight, args.gn_bias, eps, args.film, none,
                                  form, /*with_output=*/false);
  first.a.counters = counters_data(counters);  // a sliced epilogue's, in one launch
  if (skip.has_value()) read_skip_in_place(first.a, x, *skip);
  // x stored channels-last (a previous block's channels_last output) is, where the taps are
  // GEMM rows, that GEMM's operand [C_in, B * L] as it is (gemm_columns), and its residual.
  const bool x_rows =
      form == GemmForm::kTapRows && !skip.has_value() && x.transpose(1, 2).is_contiguous();
  const at::Tensor cols = gemm_columns(first.a, x, form);
  GemmEpilogueIo io{};
  std::optional<at::Tensor> identity, shortcut_pre, shortcut_bias_c;
  // Allocated on this stream and read on the side stream: held until the join, so that the
  // allocator does not hand a contiguous copy's memory to this stream while the side reads it.
  at::Tensor shortcut_w;
  std::optional<SideBranch> shortcut;
  if (r.has_shortcut) {
    const at::Tensor centre = centre_columns(first.a, cols, form);
    shortcut_w = shortcut_weight->contiguous().reshape({p.out_channels, p.in_channels});
    shortcut_pre = at::empty({p.out_channels, positions}, x.options());
    shortcut.emplace(shortcut_on_side_stream(x.scalar_type(), positions));
    shortcut->run([&] { at::mm_out(*shortcut_pre, shortcut_w, centre); });
    shortcut_bias_c = contiguous_or_none(args.shortcut_bias);
    io.residual_pre = shortcut_pre->data_ptr();
    io.residual_bias = optional_data(shortcut_bias_c);
  } else if (x_rows) {
    io.residual_rows = x.data_ptr();  // read in place, not copied to [B, C, L] first
  } else {
    identity = skip.has_value() ? at::cat({x, *skip}, 1) : x;
  }
  const at::Tensor pre = gemm(first.a, first.weight, cols, form, shortcut && shortcut->forked());
  // The second conv's input exists only as its GEMM columns, transposed (GemmEpilogueIo):
  // im2col's, or where its taps are rows, the first conv's output channels-last.
  const int taps2 = form2 == GemmForm::kTapRows ? 1 : static_cast<int>(r.second.kernel_size);
  const at::Tensor cols2 = at::empty({positions, r.second.in_channels * taps2}, x.options());
  launch_group_norm_epilogue(first.a, x.scalar_type(), pre, form,
                             GemmEpilogueIo{nullptr, nullptr, cols2.data_ptr(), taps2});
  GnMishCall second = gn_mish_call(r.second, x, weight2, args.bias2, args.gn_weight2, args.gn_bias2, eps, none,
                                   identity, form2, /*with_output=*/!args.channels_last);
  second.a.x = nullptr;  // its input is cols2
  second.a.counters = first.a.counters;  // left zero by the first epilogue
  if (args.channels_last) {
    // Written as one-tap columns: [B * L][C_out] is the output channels-last.
    second.out = at::empty({p.batch, p.out_length, p.out_channels}, x.options()).transpose(1, 2);
    io.cols = second.out.data_ptr();
    io.taps = 1;
  }
  const at::Tensor pre2 = gemm(second.a, second.weight, cols2.t(), form2);
  if (shortcut) shortcut->join();
  launch_group_norm_epilogue(second.a, x.scalar_type(), pre2, form2, io);
  return second.out;
}

}  // namespace

TORCH_LIBRARY_IMPL(dpa, CUDA, m) {
  m.impl("conv1d_gn_mish", &conv1d_gn_mish_cuda);
  m.impl("conv1d", &conv1d_cuda);
  m.impl("conv1d_gn_mish_shortcut", &conv1d_gn_mish_shortcut_cuda);
  m.impl("residual_block", &residual_block_op<residual_block_cuda>);
}

}  // namespace dpa
