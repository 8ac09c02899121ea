// Conv1d (odd kernel, "same" padding, stride 1) -> GroupNorm -> Mish: Diffusion Policy's
// Conv1dBlock. Shared by the CPU (.cpp) and CUDA (.cu) implementations.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace dpa {

struct ConvGnMishProblem {
  int64_t batch;
  int64_t in_channels;
  int64_t out_channels;
  int64_t length;
  int64_t kernel_size;
  int64_t groups;
};

// Validates every argument (raising a Python exception naming it) and returns the sizes.
ConvGnMishProblem check_conv1d_gn_mish_args(const at::Tensor& x, const at::Tensor& weight,
                                            const std::optional<at::Tensor>& bias,
                                            const std::optional<at::Tensor>& gn_weight,
                                            const std::optional<at::Tensor>& gn_bias,
                                            int64_t num_groups, double eps);

}  // namespace dpa
