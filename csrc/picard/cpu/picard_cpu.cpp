// CPU implementation of picard_window and picard_update (picard.h): the reference the CUDA
// kernels are tested against, and the CPU sampler's.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "common/checks.h"
#include "picard/picard.h"

namespace dpa {

namespace {

std::tuple<at::Tensor, at::Tensor> picard_window_cpu(const at::Tensor& trajectory, const at::Tensor& start,
                                                     int64_t window, const at::Tensor& film_table,
                                                     const std::optional<at::Tensor>& film_observation) {
  const PicardProblem p = check_picard_window_args(trajectory, start, window, film_table, film_observation);
  std::vector<int64_t> shape{p.window * p.batch};
  shape.insert(shape.end(), trajectory.sizes().begin() + 2, trajectory.sizes().end());
  at::Tensor states = at::empty(shape, trajectory.options());
  const at::Tensor films = at::empty({p.window * p.batch, film_table.size(1)}, film_table.options());
  const int* k = start.data_ptr<int>();
  for (int64_t r = 0; r < p.window; ++r) {
    for (int64_t b = 0; b < p.batch; ++b) {
      const int64_t i = window_step(k[b], r, p.steps), row = r * p.batch + b;
      states.select(0, row).copy_(trajectory.select(0, i).select(0, b));
      at::Tensor film = films.select(0, row);
      film.copy_(film_table.select(0, i));
      if (film_observation.has_value()) film.add_(film_observation->select(0, b));
    }
  }
  return {states, films};
}

void picard_update_cpu(const at::Tensor& trajectory, const at::Tensor& start, const at::Tensor& state,
                       const at::Tensor& model_output, const std::optional<at::Tensor>& noise,
                       const at::Tensor& table, const at::Tensor& thresholds, int64_t scheduler,
                       int64_t prediction_type, std::optional<double> clip_sample_range,
                       bool use_clipped_model_output, const std::optional<at::Tensor>& condition_data,
                       const std::optional<at::Tensor>& condition_mask, int64_t conditional_handle) {
  (void)conditional_handle;  // CUDA graphs only
  const PicardUpdateCheck checked =
      check_picard_update_args(trajectory, start, state, model_output, noise, table, thresholds, scheduler,
                               prediction_type, clip_sample_range, use_clipped_model_output, condition_data,
                               condition_mask);
  const PicardProblem p = checked.problem;
  const DenoiseConfig cfg = checked.config;
  const at::Tensor m = model_output.contiguous(), t = table.contiguous();
  const auto known = contiguous_or_none(condition_data), mask = contiguous_or_none(condition_mask);
  int* k_all = start.data_ptr<int>();
  const float* thr = thresholds.data_ptr<float>();
  const int64_t E = p.elements, B = p.batch, N = p.steps;
  DPA_DISPATCH_FLOAT_TYPES(trajectory.scalar_type(), "picard_update", [&] {
    scalar_t* x = trajectory.data_ptr<scalar_t>();
    const scalar_t* mo = m.data_ptr<scalar_t>();
    const scalar_t* z = noise.has_value() ? noise->data_ptr<scalar_t>() : nullptr;
    const scalar_t* kd = known.has_value() ? known->data_ptr<scalar_t>() : nullptr;
    const bool* km = mask.has_value() ? mask->data_ptr<bool>() : nullptr;
    at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
      std::vector<float> cum(E), prev(E);
      std::vector<double> err(p.window);
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t k = k_all[b];
        if (k >= N) continue;
        const auto at = [&](int64_t j, int64_t e) { return (j * B + b) * E + e; };
        for (int64_t e = 0; e < E; ++e) cum[e] = prev[e] = static_cast<float>(x[at(k, e)]);
        std::fill(err.begin(), err.end(), 0.0);
        int64_t last = k;  // the last state written
        for (int64_t r = 0; r < p.window && k + r < N; ++r) {
          const int64_t i = k + r;
          const float* c = t.data_ptr<float>() + i * kNumStepColumns;
          for (int64_t e = 0; e < E; ++e) {
            const int64_t o = b * E + e;
            const float f = km && km[o] ? static_cast<float>(kd[o])
                                        : static_cast<float>(denoise_element<scalar_t>(
                                              static_cast<float>(mo[(r * B + b) * E + e]), prev[e],
                                              z ? static_cast<float>(z[at(i, e)]) : 0.f, c, cfg));
            cum[e] += f - prev[e];
            const float old = static_cast<float>(x[at(i + 1, e)]);
            const scalar_t next = static_cast<scalar_t>(cum[e]);
            const double d = static_cast<double>(static_cast<float>(next)) - old;
            err[r] += d * d;
            x[at(i + 1, e)] = next;
            prev[e] = old;
          }
          last = i + 1;
        }
        int64_t converged = 0;
        while (converged < p.window && k + converged < N && err[converged] <= thr[k + converged] * E) ++converged;
        const int64_t next_k = std::min<int64_t>(k + converged + 1, N);
        // New states: guessed by stepping on with the window's last model output (picard.h).
        const int64_t r_last = last - 1 - k;
        for (int64_t j = last + 1; j <= std::min<int64_t>(next_k + p.window - 1, N); ++j) {
          const float* c = t.data_ptr<float>() + (j - 1) * kNumStepColumns;
          for (int64_t e = 0; e < E; ++e) {
            const int64_t o = b * E + e;
            x[at(j, e)] = km && km[o] ? kd[o]
                                      : denoise_element<scalar_t>(static_cast<float>(mo[(r_last * B + b) * E + e]),
                                                                  static_cast<float>(x[at(j - 1, e)]),
                                                                  z ? static_cast<float>(z[at(j - 1, e)]) : 0.f, c, cfg);
          }
        }
        k_all[b] = static_cast<int>(next_k);
      }
    });
  });
  state.data_ptr<int>()[0] += 1;
}

}  // namespace

TORCH_LIBRARY_IMPL(dpa, CPU, m) {
  m.impl("picard_window", &picard_window_cpu);
  m.impl("picard_update", &picard_update_cpu);
}

}  // namespace dpa
