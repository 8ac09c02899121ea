// Parallel-in-time sampling (Picard iterations, ParaDiGMS): the two ops around the batched
// U-Net evaluation of one iteration, written once for the CPU and CUDA implementations.
//
// A sampler step is x[i+1] = F_i(x[i]): the DDPM/DDIM update of denoise_step.h (noise and
// inpainting included, with all noise drawn up front). The trajectory x[0..N] is the fixed
// point of x[j] = x[k] + sum_{i=k}^{j-1} (F_i(x[i]) - x[i]). Each batch row b keeps a window of
// P steps from its start k_b (the first step whose input is not yet final):
//   picard_window  gathers the window's inputs x[k_b + r] and their FiLM rows (the timestep
//                  table's row of step k_b + r plus the row's observation part), r < P, as one
//                  batch of P * B rows (row r * B + b), for one U-Net evaluation;
//   picard_update  takes that evaluation, forms every window step's F_i, rebuilds the window
//                  by a cumulative sum, and compares each new state with the old: the states
//                  whose change is within tolerance (mean squared change over the row's
//                  elements <= thresholds[i], tol^2 times step i's noise variance) from the
//                  window's start on are final, and so is the state after them (it depends only
//                  on final states), where the window starts next. States that enter the
//                  window for the first time are guessed by stepping on from its last new state
//                  with its last model output, x[j] = F_{j-1}(x[j-1]) with that output: their
//                  noise (drawn up front) and the drift it predicts, which a copy of the last
//                  state lacks (fewer iterations; docs/tried.md). It counts the iteration and,
//                  inside a CUDA graph loop, sets the loop's condition: some row has not
//                  reached x[N].
// With thresholds 0 a state is final only once it no longer changes: the sequential
// sampler's trajectory up to fp32 rounding of the sums.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

#include "denoise_step/denoise_step.h"

namespace dpa {

// picard_update's loop state (int32): [0] iterations run, [1] and [2] scratch the CUDA kernel
// leaves zero (the rows that finished updating, and those still short of x[N]).
constexpr int kPicardStateSize = 3;

struct PicardProblem {
  int64_t steps;     // N
  int64_t batch;     // B
  int64_t elements;  // per batch row and state
  int64_t window;    // P
};

// Validate every argument, raising a Python exception naming it.
PicardProblem check_picard_window_args(const at::Tensor& trajectory, const at::Tensor& start, int64_t window,
                                       const at::Tensor& film_table,
                                       const std::optional<at::Tensor>& film_observation);
struct PicardUpdateCheck {
  PicardProblem problem;
  DenoiseConfig config;
};
PicardUpdateCheck check_picard_update_args(const at::Tensor& trajectory, const at::Tensor& start,
                                           const at::Tensor& state, const at::Tensor& model_output,
                                           const std::optional<at::Tensor>& noise, const at::Tensor& table,
                                           const at::Tensor& thresholds, int64_t scheduler,
                                           int64_t prediction_type, std::optional<double> clip_sample_range,
                                           bool use_clipped_model_output,
                                           const std::optional<at::Tensor>& condition_data,
                                           const std::optional<at::Tensor>& condition_mask);

// The step of window row r for a batch row whose window starts at k, clamped to the last step:
// rows past it (a finished row's, or a window reaching past x[N]) are evaluated, never used.
C10_HOST_DEVICE inline int64_t window_step(int64_t k, int64_t r, int64_t steps) { return k + r < steps ? k + r : steps - 1; }

}  // namespace dpa
