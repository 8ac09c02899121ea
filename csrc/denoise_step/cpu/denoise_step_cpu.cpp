// CPU implementation of denoise_step.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common/checks.h"
#include "denoise_step/denoise_step.h"

namespace dpa {

namespace {

at::Tensor denoise_step_cpu(const at::Tensor& model_output, const at::Tensor& sample,
                            const std::optional<at::Tensor>& noise, const at::Tensor& table,
                            int64_t step, int64_t scheduler, int64_t prediction_type,
                            std::optional<double> clip_sample_range,
                            bool use_clipped_model_output,
                            const std::optional<at::Tensor>& condition_data,
                            const std::optional<at::Tensor>& condition_mask) {
  const DenoiseConfig cfg =
      check_denoise_step_args(model_output, sample, noise, table, step, scheduler,
                              prediction_type, clip_sample_range, use_clipped_model_output,
                              condition_data, condition_mask);
  const at::Tensor m = model_output.contiguous(), s = sample.contiguous();
  const auto n = contiguous_or_none(noise);
  const auto known = contiguous_or_none(condition_data), mask = contiguous_or_none(condition_mask);
  const at::Tensor row = table.select(0, step).contiguous();
  at::Tensor out = at::empty(s.sizes(), s.options());
  const float* c = row.data_ptr<float>();
  DPA_DISPATCH_FLOAT_TYPES(s.scalar_type(), "denoise_step", [&] {
    const scalar_t* m_data = m.data_ptr<scalar_t>();
    const scalar_t* s_data = s.data_ptr<scalar_t>();
    const scalar_t* n_data = n.has_value() ? n->data_ptr<scalar_t>() : nullptr;
    const scalar_t* known_data = known.has_value() ? known->data_ptr<scalar_t>() : nullptr;
    const bool* mask_data = mask.has_value() ? mask->data_ptr<bool>() : nullptr;
    scalar_t* out_data = out.data_ptr<scalar_t>();
    at::parallel_for(0, s.numel(), 2048, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        out_data[i] = mask_data && mask_data[i]
                          ? known_data[i]
                          : denoise_element<scalar_t>(
                                static_cast<float>(m_data[i]), static_cast<float>(s_data[i]),
                                n_data ? static_cast<float>(n_data[i]) : 0.f, c, cfg);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(dpa, CPU, m) { m.impl("denoise_step", &denoise_step_cpu); }

}  // namespace dpa
