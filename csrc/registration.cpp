// The op schemas (one TORCH_LIBRARY for the `dpa` namespace) and the Python module that
// loads them. Implementations register per device in the op files (CPU in .cpp, CUDA in .cu);
// fake implementations for torch.compile live in diffusion_policy_accelerated/ops.py.
#include <torch/extension.h>
#include <torch/library.h>

#include "conv1d_gn_mish.h"

TORCH_LIBRARY(dpa, m) {
  m.def(
      "conv1d_gn_mish(Tensor x, Tensor weight, Tensor? bias, Tensor? gn_weight, "
      "Tensor? gn_bias, int num_groups, float eps) -> Tensor",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "denoise_step(Tensor model_output, Tensor sample, Tensor? noise, Tensor table, int step, "
      "int scheduler, int prediction_type, float? clip_sample_range, "
      "bool use_clipped_model_output) -> Tensor",
      {at::Tag::pt2_compliant_tag});
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("built_with_cuda", [] {
#ifdef DPA_WITH_CUDA
    return true;
#else
    return false;
#endif
  }, "Whether this build contains the CUDA implementations.");
#ifdef DPA_WITH_CUDA
  m.def("set_gemm_path_min_positions", [](int64_t n) {
    TORCH_CHECK_VALUE(n >= 1, "set_gemm_path_min_positions: n must be >= 1, got ", n);
    return dpa::gemm_path_min_positions.exchange(n);
  }, "Sets batch * length from which conv1d_gn_mish's CUDA path uses the GEMM route; returns the old value.");
#endif
}
