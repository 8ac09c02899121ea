// The op schemas (one TORCH_LIBRARY for the `dpa` namespace) and the Python module that
// loads them. Implementations register per device beside their kernels (<op>/cpu/,
// <op>/cuda/); fake implementations for torch.compile live in
// diffusion_policy_accelerated/ops.py.
//
// `counters` (optional, CUDA): an int32 tensor of >= out_channels zeros on x's device (for
// conv1d_gn_mish_shortcut >= out_channels + shortcut channels: the conv's, then the shortcut's;
// for residual_block the same with its shortcut, else >= out_channels),
// which the CUDA kernels use to find the last block of each output tile and leave all zero again.
// Passing one (ConditionalUnet1D keeps one per module) saves a memset per call; without it the
// op allocates zeroed counters itself. A counters tensor must not serve two ops running at the
// same time (on two streams).
#include <torch/extension.h>
#include <torch/library.h>

#include "common/kernel_config.h"
#ifdef DPA_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>

#include "common/launch.h"
#include "conv1d/cuda/streaming.h"
#endif

TORCH_LIBRARY(dpa, m) {
  m.def(
      "conv1d_gn_mish(Tensor x, Tensor weight, Tensor? bias, Tensor? gn_weight, "
      "Tensor? gn_bias, int num_groups, float eps, *, Tensor? film=None, "
      "Tensor? residual=None, Tensor? counters=None) -> Tensor",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "conv1d(Tensor x, Tensor weight, Tensor? bias, int stride, int padding, bool transposed, "
      "*, Tensor? residual=None, Tensor? counters=None) -> Tensor",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "conv1d_gn_mish_shortcut(Tensor x, Tensor weight, Tensor? bias, Tensor? gn_weight, "
      "Tensor? gn_bias, int num_groups, float eps, Tensor shortcut_weight, "
      "Tensor? shortcut_bias, *, Tensor? film=None, Tensor? counters=None, Tensor? skip=None) "
      "-> (Tensor, Tensor)",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "residual_block(Tensor x, Tensor weight, Tensor? bias, Tensor? gn_weight, "
      "Tensor? gn_bias, Tensor weight2, Tensor? bias2, Tensor? gn_weight2, Tensor? gn_bias2, "
      "int num_groups, float eps, Tensor? shortcut_weight, Tensor? shortcut_bias, *, "
      "Tensor? film=None, Tensor? counters=None, Tensor? skip=None, bool channels_last=False) -> Tensor",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "denoise_step(Tensor model_output, Tensor sample, Tensor? noise, Tensor table, int step, "
      "int scheduler, int prediction_type, float? clip_sample_range, "
      "bool use_clipped_model_output, *, Tensor? condition_data=None, "
      "Tensor? condition_mask=None) -> Tensor",
      {at::Tag::pt2_compliant_tag});
}

namespace {

// KernelConfig from the Python dataclass's fields (routing.KernelConfig, which validates them).
dpa::KernelConfig kernel_config_of(int64_t gemm_min_positions, int64_t gemm_min_work,
                                   int64_t gemm_min_work_positions, int64_t transposed_gemm_min_work,
                                   int64_t portable_half_gemm_min_positions, int64_t side_stream_fp32_max_positions,
                                   int64_t fp32_gemm_max_splits, bool narrow_gemm, bool side_stream, bool clusters,
                                   bool pdl, bool cooperative_group_norm,
                                   bool weights_evict_first, int64_t cpu_conv, int64_t sm_count) {
  TORCH_CHECK(cpu_conv >= 0 && cpu_conv <= 4,
              "cpu_conv must be 0 (auto), 1 (aten), 2 (gemm), 3 (stream) or 4 (fp32), got ", cpu_conv);
  TORCH_CHECK(sm_count >= 0, "sm_count must be 0 (the device's) or more, got ", sm_count);
  return dpa::KernelConfig{gemm_min_positions, gemm_min_work, gemm_min_work_positions, transposed_gemm_min_work,
                           portable_half_gemm_min_positions, side_stream_fp32_max_positions, fp32_gemm_max_splits,
                           narrow_gemm, side_stream, clusters, pdl,
                           cooperative_group_norm, weights_evict_first, static_cast<dpa::CpuConv>(cpu_conv),
                           sm_count};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("built_with_cuda", [] {
#ifdef DPA_WITH_CUDA
    return true;
#else
    return false;
#endif
  }, "Whether this build contains the CUDA implementations.");
  // Used by diffusion_policy_accelerated.routing, which owns the configuration's fields.
  m.def("set_kernel_config", [](int64_t gemm_min_positions, int64_t gemm_min_work,
                                int64_t gemm_min_work_positions, int64_t transposed_gemm_min_work,
                                int64_t portable_half_gemm_min_positions, int64_t side_stream_fp32_max_positions,
                                int64_t fp32_gemm_max_splits, bool narrow_gemm, bool side_stream, bool clusters,
                                bool pdl, bool cooperative_group_norm,
                                bool weights_evict_first, int64_t cpu_conv, int64_t sm_count, bool process_default) {
    const dpa::KernelConfig config = kernel_config_of(
        gemm_min_positions, gemm_min_work, gemm_min_work_positions, transposed_gemm_min_work,
        portable_half_gemm_min_positions, side_stream_fp32_max_positions, fp32_gemm_max_splits, narrow_gemm,
        side_stream, clusters, pdl, cooperative_group_norm, weights_evict_first,
        cpu_conv, sm_count);
    if (process_default) {
      dpa::set_default_kernel_config(config);
    } else {
      dpa::set_thread_kernel_config(&config);
    }
  }, "Sets the kernel configuration: the process default, or the calling thread's override.");
  m.def("clear_thread_kernel_config", [] { dpa::set_thread_kernel_config(nullptr); },
        "Drops the calling thread's override: the process default applies again.");
#ifdef DPA_WITH_CUDA
  m.def("start_launch_trace", &dpa::start_launch_trace,
        "Traces the streaming conv launches from now on into a CUDA int64 tensor [rows, 9] "
        "(conv1d/cuda/streaming.h).");
  m.def("stop_launch_trace", &dpa::stop_launch_trace,
        "Stops tracing launches; returns the blocks (rows) of each launch traced.");
  m.def("hopper_launches", [](int64_t device) {
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    return dpa::hopper_launches();
  }, "Whether the ops may launch with Hopper's clusters and programmatic dependent launch on "
     "this CUDA device: a Hopper or newer GPU and kernels compiled for it (common/launch.h).");
#endif
}
