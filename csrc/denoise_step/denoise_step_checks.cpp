// Argument checks of denoise_step, shared by its CPU and CUDA implementations.
#include "denoise_step/denoise_step.h"

#include "common/checks.h"

namespace dpa {

DenoiseConfig check_denoise_step_args(const at::Tensor& model_output, const at::Tensor& sample,
                                      const std::optional<at::Tensor>& noise,
                                      const at::Tensor& table, int64_t step, int64_t scheduler,
                                      int64_t prediction_type,
                                      std::optional<double> clip_sample_range,
                                      bool use_clipped_model_output,
                                      const std::optional<at::Tensor>& condition_data,
                                      const std::optional<at::Tensor>& condition_mask) {
  constexpr const char* kOp = "denoise_step";
  check_float_tensor(sample, kOp, "sample");
  TORCH_CHECK_VALUE(sample.numel() > 0, kOp, ": sample must be non-empty, got shape ",
                    sample.sizes());
  check_same_device(model_output, sample, kOp, "model_output", "sample");
  check_same_dtype(model_output, sample, kOp, "model_output", "sample");
  TORCH_CHECK_VALUE(model_output.sizes() == sample.sizes(), kOp, ": model_output has shape ",
                    model_output.sizes(), " but sample has shape ", sample.sizes(),
                    " (learned-variance outputs are not supported)");
  if (noise.has_value()) {
    check_same_device(*noise, sample, kOp, "noise", "sample");
    check_same_dtype(*noise, sample, kOp, "noise", "sample");
    TORCH_CHECK_VALUE(noise->sizes() == sample.sizes(), kOp, ": noise has shape ",
                      noise->sizes(), " but sample has shape ", sample.sizes());
  }
  TORCH_CHECK_VALUE(condition_data.has_value() == condition_mask.has_value(), kOp,
                    ": condition_data and condition_mask must be given together");
  if (condition_data.has_value()) {
    check_same_device(*condition_data, sample, kOp, "condition_data", "sample");
    check_same_dtype(*condition_data, sample, kOp, "condition_data", "sample");
    check_same_device(*condition_mask, sample, kOp, "condition_mask", "sample");
    TORCH_CHECK_TYPE(condition_mask->scalar_type() == at::kBool, kOp,
                     ": condition_mask must be bool, got ", condition_mask->scalar_type());
    TORCH_CHECK_VALUE(condition_data->sizes() == sample.sizes() &&
                          condition_mask->sizes() == sample.sizes(),
                      kOp, ": condition_data and condition_mask must have sample's shape ",
                      sample.sizes(), ", got ", condition_data->sizes(), " and ",
                      condition_mask->sizes());
  }
  check_same_device(table, sample, kOp, "table", "sample");
  TORCH_CHECK_TYPE(table.scalar_type() == at::kFloat, kOp, ": table must be float32, got ",
                   table.scalar_type());
  TORCH_CHECK_VALUE(table.dim() == 2 && table.size(1) == kNumStepColumns && table.size(0) > 0,
                    kOp, ": table must have shape [num_steps, ", int(kNumStepColumns),
                    "], got ", table.sizes());
  TORCH_CHECK_VALUE(step >= 0 && step < table.size(0), kOp, ": step must be in [0, ",
                    table.size(0), "), got ", step);
  TORCH_CHECK_VALUE(scheduler == kDDPM || scheduler == kDDIM, kOp,
                    ": scheduler must be 0 (DDPM) or 1 (DDIM), got ", scheduler);
  TORCH_CHECK_VALUE(prediction_type >= kEpsilon && prediction_type <= kVPrediction, kOp,
                    ": prediction_type must be 0 (epsilon), 1 (sample) or 2 (v_prediction), got ",
                    prediction_type);
  if (clip_sample_range.has_value()) {
    TORCH_CHECK_VALUE(std::isfinite(*clip_sample_range) && *clip_sample_range > 0, kOp,
                      ": clip_sample_range must be finite and > 0, got ", *clip_sample_range);
  }
  return DenoiseConfig{static_cast<int>(scheduler),
                       static_cast<int>(prediction_type),
                       clip_sample_range.has_value(),
                       static_cast<float>(clip_sample_range.value_or(0.0)),
                       use_clipped_model_output,
                       noise.has_value()};
}

}  // namespace dpa
