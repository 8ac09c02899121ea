// CUDA implementation of denoise_step: one elementwise launch on the current stream. The
// step's constants are read from the device table, so the launch needs no host data and a
// captured CUDA graph replays it unchanged. In the denoising loop it sits between the U-Net's
// last conv and the next step's first, so it is launched as a programmatic dependent (its
// launch overlaps the conv's tail) and lets the next conv launch at once, and it reads the
// U-Net's output through its strides (a transposed view; a contiguous copy would be one more
// launch on that chain).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "common/checks.h"
#include "common/cuda/strided.cuh"
#include "common/launch.h"
#include "denoise_step/denoise_step.h"

namespace dpa {
namespace {

template <typename scalar_t>
__global__ void denoise_step_kernel(const scalar_t* __restrict__ model_output,
                                    const StridedLayout model_output_layout,
                                    const scalar_t* __restrict__ sample,
                                    const scalar_t* __restrict__ noise,
                                    const scalar_t* __restrict__ condition_data,
                                    const bool* __restrict__ condition_mask,
                                    const float* __restrict__ row, scalar_t* __restrict__ out,
                                    int64_t numel, DenoiseConfig cfg) {
  float c[kNumStepColumns];
#pragma unroll
  for (int j = 0; j < kNumStepColumns; ++j) c[j] = row[j];  // the table is never written
  allow_dependents();
  wait_for_producer();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < numel;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (condition_mask && condition_mask[i]) {
      out[i] = condition_data[i];
      continue;
    }
    out[i] = denoise_element<scalar_t>(
        static_cast<float>(model_output[offset_of(model_output_layout, i)]),
        static_cast<float>(sample[i]), noise ? static_cast<float>(noise[i]) : 0.f, c, cfg);
  }
}

at::Tensor denoise_step_cuda(const at::Tensor& model_output, const at::Tensor& sample,
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
  const c10::cuda::CUDAGuard guard(sample.device());
  at::Tensor m;
  const StridedLayout layout = strided_of(model_output, m);
  const at::Tensor s = sample.contiguous();
  const auto n = contiguous_or_none(noise);
  const auto known = contiguous_or_none(condition_data), mask = contiguous_or_none(condition_mask);
  const at::Tensor t = table.contiguous();
  at::Tensor out = at::empty(s.sizes(), s.options());
  constexpr int kThreads = 256;
  const int64_t numel = s.numel();
  const int sms = sm_budget();
  const int blocks = static_cast<int>(std::min<int64_t>((numel + kThreads - 1) / kThreads, 8LL * sms));
  const float* row = t.data_ptr<float>() + step * kNumStepColumns;
  DPA_DISPATCH_FLOAT_TYPES(s.scalar_type(), "denoise_step", [&] {
    LaunchConfig launch(dim3(blocks), dim3(kThreads), 0);
    launch.programmatic_dependent();
    C10_CUDA_CHECK(cudaLaunchKernelEx(
        launch.get(), denoise_step_kernel<scalar_t>, m.data_ptr<scalar_t>(), layout,
        s.data_ptr<scalar_t>(), n.has_value() ? n->data_ptr<scalar_t>() : nullptr,
        known.has_value() ? known->data_ptr<scalar_t>() : nullptr,
        mask.has_value() ? mask->data_ptr<bool>() : nullptr, row, out.data_ptr<scalar_t>(),
        numel, cfg));
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(dpa, CUDA, m) { m.impl("denoise_step", &denoise_step_cuda); }

}  // namespace dpa
