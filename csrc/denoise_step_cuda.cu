// CUDA implementation of denoise_step: one elementwise launch on the current stream. The
// step's constants are read from the device table, so the launch needs no host data and a
// captured CUDA graph replays it unchanged.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "checks.h"
#include "denoise_step.h"

namespace dpa {
namespace {

template <typename scalar_t>
__global__ void denoise_step_kernel(const scalar_t* __restrict__ model_output,
                                    const scalar_t* __restrict__ sample,
                                    const scalar_t* __restrict__ noise,
                                    const float* __restrict__ row, scalar_t* __restrict__ out,
                                    int64_t numel, DenoiseConfig cfg) {
  float c[kNumStepColumns];
#pragma unroll
  for (int j = 0; j < kNumStepColumns; ++j) c[j] = row[j];
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < numel;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = denoise_element<scalar_t>(static_cast<float>(model_output[i]),
                                       static_cast<float>(sample[i]),
                                       noise ? static_cast<float>(noise[i]) : 0.f, c, cfg);
  }
}

at::Tensor denoise_step_cuda(const at::Tensor& model_output, const at::Tensor& sample,
                             const std::optional<at::Tensor>& noise, const at::Tensor& table,
                             int64_t step, int64_t scheduler, int64_t prediction_type,
                             std::optional<double> clip_sample_range,
                             bool use_clipped_model_output) {
  const DenoiseConfig cfg =
      check_denoise_step_args(model_output, sample, noise, table, step, scheduler,
                              prediction_type, clip_sample_range, use_clipped_model_output);
  const c10::cuda::CUDAGuard guard(sample.device());
  const at::Tensor m = model_output.contiguous(), s = sample.contiguous();
  const auto n = contiguous_or_none(noise);
  const at::Tensor t = table.contiguous();
  at::Tensor out = at::empty(s.sizes(), s.options());
  constexpr int kThreads = 256;
  const int64_t numel = s.numel();
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int blocks = static_cast<int>(std::min<int64_t>((numel + kThreads - 1) / kThreads, 8LL * sms));
  const float* row = t.data_ptr<float>() + step * kNumStepColumns;
  DPA_DISPATCH_FLOAT_TYPES(s.scalar_type(), "denoise_step", [&] {
    denoise_step_kernel<scalar_t><<<blocks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        m.data_ptr<scalar_t>(), s.data_ptr<scalar_t>(),
        n.has_value() ? n->data_ptr<scalar_t>() : nullptr, row, out.data_ptr<scalar_t>(),
        numel, cfg);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(dpa, CUDA, m) { m.impl("denoise_step", &denoise_step_cuda); }

}  // namespace dpa
