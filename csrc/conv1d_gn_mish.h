// Conv1d (odd kernel, "same" padding, stride 1) -> GroupNorm -> Mish: Diffusion Policy's
// Conv1dBlock. Shared by the CPU (.cpp) and CUDA (.cu) implementations.
#pragma once

#include <ATen/ATen.h>

#include <atomic>
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

#ifdef DPA_WITH_CUDA
// The CUDA implementation switches from its weight-streaming kernel to im2col + cuBLAS GEMM
// when batch * length reaches this; adjustable (ops.set_gemm_path_min_positions) so the
// benchmark can time both paths on one GPU. 32: the crossover measured on an H100 over
// every Conv1dBlock shape of the lowdim and image U-Nets at batch 1, 8 and 64 (BENCHMARKS.md).
constexpr int64_t kDefaultGemmPathMinPositions = 32;
extern std::atomic<int64_t> gemm_path_min_positions;
#endif

}  // namespace dpa
