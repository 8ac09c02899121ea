// CUDA implementation of picard_window and picard_update (picard.h). picard_window is one
// elementwise launch; picard_update one block per batch row, whose threads own elements of
// the row's states across the whole window (the cumulative sum runs along the window in each
// thread), then the last block to finish counts the iteration and, inside a graph loop, sets
// its condition. Both read their inputs from device memory only, so a CUDA graph replays them
// unchanged while the windows move.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "common/checks.h"
#include "common/cuda/strided.cuh"
#include "common/launch.h"
#include "picard/picard.h"

namespace dpa {

namespace {

constexpr int kThreads = 256;

template <typename scalar_t, typename film_t>
__global__ void picard_window_kernel(const scalar_t* __restrict__ x, const int* __restrict__ start,
                                     const film_t* __restrict__ film_table, const film_t* __restrict__ film_obs,
                                     scalar_t* __restrict__ states, film_t* __restrict__ films, int64_t steps,
                                     int64_t batch, int64_t elements, int64_t width, int64_t rows) {
  allow_dependents();
  wait_for_producer();
  const int64_t state_total = rows * elements, total = state_total + rows * width;
  for (int64_t n = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; n < total;
       n += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (n < state_total) {
      const int64_t row = n / elements, e = n % elements, b = row % batch;
      const int64_t i = window_step(start[b], row / batch, steps);
      states[n] = x[(i * batch + b) * elements + e];
    } else {
      const int64_t m = n - state_total, row = m / width, w = m % width, b = row % batch;
      const int64_t i = window_step(start[b], row / batch, steps);
      float v = static_cast<float>(film_table[i * width + w]);
      if (film_obs != nullptr) v += static_cast<float>(film_obs[b * width + w]);
      films[m] = static_cast<film_t>(v);
    }
  }
}

constexpr int kWarps = kThreads / 32;

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) picard_update_kernel(
    scalar_t* __restrict__ x, int* __restrict__ start, int* __restrict__ state,
    const scalar_t* __restrict__ model_output, const StridedLayout mo_layout, const scalar_t* __restrict__ noise,
    const float* __restrict__ table, const float* __restrict__ thresholds, const scalar_t* __restrict__ condition_data,
    const bool* __restrict__ condition_mask, PicardProblem p, DenoiseConfig cfg, unsigned long long conditional) {
  // [kWarps][window]: each warp's sum of squared changes of each window state, added in a
  // fixed order (no atomics), so that a replay decides exactly as the last one did.
  extern __shared__ float partial[];
  __shared__ int next_k;
  __shared__ bool last_block;
  wait_for_producer();
  const int64_t b = blockIdx.x, B = p.batch, E = p.elements, N = p.steps;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t k = start[b];
  const int64_t last = k < N ? std::min<int64_t>(k + p.window, N) : k;  // the last state written
  for (int64_t n = threadIdx.x; n < kWarps * p.window; n += blockDim.x) partial[n] = 0.f;
  __syncthreads();
  for (int64_t e0 = 0; e0 < E; e0 += blockDim.x) {  // uniform over the block: every lane shuffles
    const int64_t e = e0 + threadIdx.x, o = b * E + e;
    const bool active = e < E, known = active && condition_mask != nullptr && condition_mask[o];
    float prev = active && k < N ? static_cast<float>(x[(k * B + b) * E + e]) : 0.f, cum = prev;
    for (int64_t i = k; i < last; ++i) {
      const int64_t r = i - k;
      float d2 = 0.f;
      if (active) {
        const float f = known ? static_cast<float>(condition_data[o])
                              : static_cast<float>(denoise_element<scalar_t>(
                                    static_cast<float>(model_output[offset_of(mo_layout, (r * B + b) * E + e)]),
                                    prev, noise != nullptr ? static_cast<float>(noise[(i * B + b) * E + e]) : 0.f,
                                    table + i * kNumStepColumns, cfg));
        cum += f - prev;
        scalar_t* slot = x + ((i + 1) * B + b) * E + e;
        const float old = static_cast<float>(*slot);
        const scalar_t next = static_cast<scalar_t>(cum);
        const float d = static_cast<float>(next) - old;
        d2 = d * d;
        *slot = next;
        prev = old;
      }
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) d2 += __shfl_xor_sync(0xffffffffu, d2, offset);
      if (lane == 0) partial[warp * p.window + r] += d2;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t converged = 0;
    for (; k + converged < last; ++converged) {
      float err = 0.f;
      for (int w = 0; w < kWarps; ++w) err += partial[w * p.window + converged];
      if (!(err <= thresholds[k + converged] * static_cast<float>(E))) break;
    }
    next_k = static_cast<int>(k < N ? std::min<int64_t>(k + converged + 1, N) : N);
  }
  __syncthreads();
  // States that enter the next window for the first time are guessed by stepping on from the
  // last new one with the window's last model output (picard.h). Each thread steps the elements
  // it wrote above, so it reads back its own writes.
  const int64_t fill_end = std::min<int64_t>(next_k + p.window - 1, N), r_last = last - 1 - k;
  for (int64_t e = threadIdx.x; e < E && last < fill_end; e += blockDim.x) {
    const int64_t o = b * E + e;
    const bool known = condition_mask != nullptr && condition_mask[o];
    const float output = static_cast<float>(model_output[offset_of(mo_layout, (r_last * B + b) * E + e)]);
    for (int64_t j = last + 1; j <= fill_end; ++j) {
      const float prev = static_cast<float>(x[((j - 1) * B + b) * E + e]);
      x[(j * B + b) * E + e] =
          known ? condition_data[o]
                : denoise_element<scalar_t>(output, prev,
                                            noise != nullptr ? static_cast<float>(noise[((j - 1) * B + b) * E + e]) : 0.f,
                                            table + (j - 1) * kNumStepColumns, cfg);
    }
  }
  if (threadIdx.x == 0) {
    start[b] = next_k;
    if (next_k < N) atomicAdd(&state[2], 1);
    __threadfence();
    last_block = atomicAdd(&state[1], 1) == static_cast<int>(B) - 1;
  }
  __syncthreads();
  if (last_block && threadIdx.x == 0) {
    __threadfence();
    const int unfinished = atomicExch(&state[2], 0);
    state[1] = 0;
    state[0] += 1;
#if CUDART_VERSION >= 12040
    if (conditional != 0) cudaGraphSetConditional(conditional, unfinished > 0 ? 1u : 0u);
#endif
  }
}

std::tuple<at::Tensor, at::Tensor> picard_window_cuda(const at::Tensor& trajectory, const at::Tensor& start,
                                                      int64_t window, const at::Tensor& film_table,
                                                      const std::optional<at::Tensor>& film_observation) {
  const PicardProblem p = check_picard_window_args(trajectory, start, window, film_table, film_observation);
  const c10::cuda::CUDAGuard guard(trajectory.device());
  std::vector<int64_t> shape{p.window * p.batch};
  shape.insert(shape.end(), trajectory.sizes().begin() + 2, trajectory.sizes().end());
  at::Tensor states = at::empty(shape, trajectory.options());
  const int64_t width = film_table.size(1), rows = p.window * p.batch;
  at::Tensor films = at::empty({rows, width}, film_table.options());
  const at::Tensor table = film_table.contiguous();
  const auto obs = contiguous_or_none(film_observation);
  const int64_t total = rows * (p.elements + width);
  const int blocks = static_cast<int>(std::min<int64_t>((total + kThreads - 1) / kThreads, 8LL * sm_budget()));
  DPA_DISPATCH_FLOAT_TYPES(trajectory.scalar_type(), "picard_window", [&] {
    using state_t = scalar_t;
    DPA_DISPATCH_FLOAT_TYPES(film_table.scalar_type(), "picard_window", [&] {
      LaunchConfig launch(dim3(blocks), dim3(kThreads), 0);
      launch.programmatic_dependent();
      C10_CUDA_CHECK(cudaLaunchKernelEx(launch.get(), picard_window_kernel<state_t, scalar_t>,
                                        trajectory.data_ptr<state_t>(), start.data_ptr<int>(),
                                        table.data_ptr<scalar_t>(),
                                        obs.has_value() ? obs->data_ptr<scalar_t>() : nullptr,
                                        states.data_ptr<state_t>(), films.data_ptr<scalar_t>(), p.steps, p.batch,
                                        p.elements, width, rows));
    });
  });
  return {states, films};
}

void picard_update_cuda(const at::Tensor& trajectory, const at::Tensor& start, const at::Tensor& state,
                        const at::Tensor& model_output, const std::optional<at::Tensor>& noise,
                        const at::Tensor& table, const at::Tensor& thresholds, int64_t scheduler,
                        int64_t prediction_type, std::optional<double> clip_sample_range,
                        bool use_clipped_model_output, const std::optional<at::Tensor>& condition_data,
                        const std::optional<at::Tensor>& condition_mask, int64_t conditional_handle) {
  const PicardUpdateCheck checked =
      check_picard_update_args(trajectory, start, state, model_output, noise, table, thresholds, scheduler,
                               prediction_type, clip_sample_range, use_clipped_model_output, condition_data,
                               condition_mask);
  const PicardProblem p = checked.problem;
  const DenoiseConfig cfg = checked.config;
  const c10::cuda::CUDAGuard guard(trajectory.device());
  TORCH_CHECK_VALUE(p.window <= 4096, "picard_update: window must be at most 4096 steps, got ", p.window);
  at::Tensor m;
  const StridedLayout layout = strided_of(model_output, m);
  const at::Tensor t = table.contiguous();
  const auto known = contiguous_or_none(condition_data), mask = contiguous_or_none(condition_mask);
  const size_t shared = static_cast<size_t>(kWarps) * p.window * sizeof(float);
  DPA_DISPATCH_FLOAT_TYPES(trajectory.scalar_type(), "picard_update", [&] {
    const auto kernel = picard_update_kernel<scalar_t>;
    if (shared > 40 * 1024) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(shared)));
    }
    LaunchConfig launch(dim3(static_cast<unsigned>(p.batch)), dim3(kThreads), shared);
    launch.programmatic_dependent();
    C10_CUDA_CHECK(cudaLaunchKernelEx(launch.get(), kernel, trajectory.data_ptr<scalar_t>(), start.data_ptr<int>(),
                                      state.data_ptr<int>(), m.data_ptr<scalar_t>(), layout,
                                      noise.has_value() ? noise->data_ptr<scalar_t>() : nullptr,
                                      t.data_ptr<float>(), thresholds.data_ptr<float>(),
                                      known.has_value() ? known->data_ptr<scalar_t>() : nullptr,
                                      mask.has_value() ? mask->data_ptr<bool>() : nullptr, p, cfg,
                                      static_cast<unsigned long long>(conditional_handle)));
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(dpa, CUDA, m) {
  m.impl("picard_window", &picard_window_cuda);
  m.impl("picard_update", &picard_update_cuda);
}

}  // namespace dpa
