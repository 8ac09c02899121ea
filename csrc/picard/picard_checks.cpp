// Argument checks of picard_window and picard_update, shared by their CPU and CUDA
// implementations.
#include "picard/picard.h"

#include "common/checks.h"

namespace dpa {

namespace {

// trajectory [N + 1, B, ...] (contiguous) and start [B] int32 on its device.
PicardProblem check_trajectory(const at::Tensor& trajectory, const at::Tensor& start, int64_t window,
                               const char* op) {
  check_float_tensor(trajectory, op, "trajectory");
  TORCH_CHECK_VALUE(trajectory.dim() >= 3 && trajectory.size(0) >= 2 && trajectory.numel() > 0, op,
                    ": trajectory must be [steps + 1, batch, ...] with steps >= 1, got shape ", trajectory.sizes());
  TORCH_CHECK_VALUE(trajectory.is_contiguous(), op, ": trajectory must be contiguous");
  check_same_device(start, trajectory, op, "start", "trajectory");
  TORCH_CHECK_TYPE(start.scalar_type() == at::kInt, op, ": start must be int32, got ", start.scalar_type());
  TORCH_CHECK_VALUE(start.dim() == 1 && start.size(0) == trajectory.size(1) && start.is_contiguous(), op,
                    ": start must be a contiguous [batch] = [", trajectory.size(1), "] tensor, got ", start.sizes());
  TORCH_CHECK_VALUE(window >= 1, op, ": window must be >= 1, got ", window);
  const int64_t batch = trajectory.size(1);
  return PicardProblem{trajectory.size(0) - 1, batch, trajectory.numel() / trajectory.size(0) / batch, window};
}

}  // namespace

PicardProblem check_picard_window_args(const at::Tensor& trajectory, const at::Tensor& start, int64_t window,
                                       const at::Tensor& film_table,
                                       const std::optional<at::Tensor>& film_observation) {
  constexpr const char* kOp = "picard_window";
  const PicardProblem p = check_trajectory(trajectory, start, window, kOp);
  check_same_device(film_table, trajectory, kOp, "film_table", "trajectory");
  check_float_tensor(film_table, kOp, "film_table");
  TORCH_CHECK_VALUE(film_table.dim() == 2 && film_table.size(0) == p.steps, kOp,
                    ": film_table must be [steps, width] = [", p.steps, ", width], got ", film_table.sizes());
  if (film_observation.has_value()) {
    check_same_device(*film_observation, trajectory, kOp, "film_observation", "trajectory");
    check_same_dtype(*film_observation, film_table, kOp, "film_observation", "film_table");
    TORCH_CHECK_VALUE(film_observation->dim() == 2 && film_observation->size(0) == p.batch &&
                          film_observation->size(1) == film_table.size(1),
                      kOp, ": film_observation must be [batch, width] = [", p.batch, ", ", film_table.size(1),
                      "], got ", film_observation->sizes());
  }
  return p;
}

PicardUpdateCheck check_picard_update_args(const at::Tensor& trajectory, const at::Tensor& start,
                                           const at::Tensor& state, const at::Tensor& model_output,
                                           const std::optional<at::Tensor>& noise, const at::Tensor& table,
                                           const at::Tensor& thresholds, int64_t scheduler,
                                           int64_t prediction_type, std::optional<double> clip_sample_range,
                                           bool use_clipped_model_output,
                                           const std::optional<at::Tensor>& condition_data,
                                           const std::optional<at::Tensor>& condition_mask) {
  constexpr const char* kOp = "picard_update";
  TORCH_CHECK_VALUE(model_output.dim() >= 1 && trajectory.size(1) > 0 && model_output.size(0) % trajectory.size(1) == 0,
                    kOp, ": model_output must be [window * batch, ...], got ", model_output.sizes());
  const PicardProblem p = check_trajectory(trajectory, start, model_output.size(0) / trajectory.size(1), kOp);
  check_same_device(state, trajectory, kOp, "state", "trajectory");
  TORCH_CHECK_VALUE(state.scalar_type() == at::kInt && state.dim() == 1 && state.size(0) == kPicardStateSize &&
                        state.is_contiguous(),
                    kOp, ": state must be a contiguous int32 [", kPicardStateSize, "] tensor");
  // One state of one row is what denoise_step steps: its checks cover model_output, noise,
  // the table and the conditioning.
  const at::Tensor one = trajectory.select(0, 0);  // [B, ...]
  std::vector<int64_t> rows_shape{p.window * p.batch};
  rows_shape.insert(rows_shape.end(), one.sizes().begin() + 1, one.sizes().end());
  TORCH_CHECK_VALUE(model_output.sizes() == at::IntArrayRef(rows_shape), kOp, ": model_output must be ",
                    at::IntArrayRef(rows_shape), " (window * batch rows of trajectory's states), got ",
                    model_output.sizes());
  check_same_device(model_output, trajectory, kOp, "model_output", "trajectory");
  check_same_dtype(model_output, trajectory, kOp, "model_output", "trajectory");
  if (noise.has_value()) {
    TORCH_CHECK_VALUE(noise->dim() == trajectory.dim() && noise->size(0) == p.steps &&
                          noise->sizes().slice(1) == trajectory.sizes().slice(1) && noise->is_contiguous(),
                      kOp, ": noise must be a contiguous [steps, batch, ...] tensor, got ", noise->sizes());
  }
  check_same_device(thresholds, trajectory, kOp, "thresholds", "trajectory");
  TORCH_CHECK_VALUE(thresholds.scalar_type() == at::kFloat && thresholds.dim() == 1 &&
                        thresholds.size(0) == p.steps && thresholds.is_contiguous(),
                    kOp, ": thresholds must be a contiguous float32 [steps] = [", p.steps, "] tensor, got ",
                    thresholds.scalar_type(), " ", thresholds.sizes());
  TORCH_CHECK_VALUE(table.dim() == 2 && table.size(0) == p.steps, kOp, ": table must have ", p.steps,
                    " rows, one a step, got ", table.sizes());
  const DenoiseConfig config = check_denoise_step_args(
      one, one, noise.has_value() ? std::optional<at::Tensor>(noise->select(0, 0)) : std::nullopt, table, 0,
      scheduler, prediction_type, clip_sample_range, use_clipped_model_output, condition_data, condition_mask);
  return PicardUpdateCheck{p, config};
}

}  // namespace dpa
