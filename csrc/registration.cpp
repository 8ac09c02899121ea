// The op schemas (one TORCH_LIBRARY for the `dpa` namespace) and the Python module that
// loads them. Implementations register per device beside their kernels (<op>/cpu/,
// <op>/cuda/); fake implementations for torch.compile live in
// diffusion_policy_accelerated/kernels/ops.py. The route questions, which take no tensors,
// are defined with their one kernel in conv1d/conv_route_op.cpp.
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

#include <algorithm>
#include <string>
#include <vector>

#include "common/kernel_config.h"
#ifdef DPA_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>

#include "common/launch.h"
#include "conv1d/cuda/streaming.h"
#include "picard/cuda/graph_loop.h"
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
  // Parallel sampling (picard/picard.h): a Picard iteration's window, then its update of the
  // trajectory, the windows' starts and the loop state, in place.
  m.def("picard_window(Tensor trajectory, Tensor start, int window, Tensor film_table, "
        "Tensor? film_observation) -> (Tensor, Tensor)",
        {at::Tag::pt2_compliant_tag});
  m.def(
      "picard_update(Tensor(a!) trajectory, Tensor(b!) start, Tensor(c!) state, Tensor model_output, "
      "Tensor? noise, Tensor table, Tensor thresholds, int scheduler, int prediction_type, "
      "float? clip_sample_range, bool use_clipped_model_output, *, Tensor? condition_data=None, "
      "Tensor? condition_mask=None, int conditional_handle=0) -> ()",
      {at::Tag::pt2_compliant_tag});
}

namespace {

// KernelConfig from the Python dataclass's fields by name (kernels/config.py, which validates
// their values): exactly kernel_config_fields() and cpu_conv.
dpa::KernelConfig kernel_config_of(const py::dict& values) {
  dpa::KernelConfig config{};
  size_t used = 0;
  const auto value = [&](const char* name) {
    TORCH_CHECK_VALUE(values.contains(name), "set_kernel_config: no field ", name);
    ++used;
    return values[name];
  };
  for (const dpa::KernelConfigField& field : dpa::kernel_config_fields()) {
    if (field.flag != nullptr) {
      config.*field.flag = value(field.name).cast<bool>();
    } else {
      const py::object v = value(field.name);
      config.*field.integer = v.is_none() ? 0 : v.cast<int64_t>();  // sm_count None: the device's
    }
  }
  const std::string cpu_conv = value("cpu_conv").cast<std::string>();
  const auto& names = dpa::cpu_conv_names();
  const auto found = std::find(names.begin(), names.end(), cpu_conv);
  TORCH_CHECK_VALUE(found != names.end(), "set_kernel_config: unknown cpu_conv ", cpu_conv);
  config.cpu_conv = static_cast<dpa::CpuConv>(found - names.begin());
  TORCH_CHECK_VALUE(used == values.size(), "set_kernel_config: ", values.size() - used, " unknown fields");
  TORCH_CHECK_VALUE(config.sm_count >= 0, "sm_count must be None (the device's) or positive");
  return config;
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
  // Used by diffusion_policy_accelerated.kernels.config, which owns the configuration's defaults.
  m.def("kernel_config_fields", [] {
    std::vector<std::string> names;
    for (const dpa::KernelConfigField& field : dpa::kernel_config_fields()) names.emplace_back(field.name);
    names.emplace_back("cpu_conv");
    return names;
  }, "The names of the kernel configuration's fields.");
  m.def("cpu_conv_names", &dpa::cpu_conv_names, "The values KernelConfig.cpu_conv takes.");
  m.def("set_kernel_config", [](const py::dict& values, bool process_default) {
    const dpa::KernelConfig config = kernel_config_of(values);
    if (process_default) {
      dpa::set_default_kernel_config(config);
    } else {
      dpa::set_thread_kernel_config(&config);
    }
  }, "Sets the kernel configuration from its fields by name: the process default, or the calling thread's "
     "override.");
  m.def("clear_thread_kernel_config", [] { dpa::set_thread_kernel_config(nullptr); },
        "Drops the calling thread's override: the process default applies again.");
#ifdef DPA_WITH_CUDA
  m.def("start_launch_trace", &dpa::start_launch_trace,
        "Traces the streaming conv launches from now on into a CUDA int64 tensor [rows, 9] "
        "(conv1d/cuda/streaming.h).");
  m.def("stop_launch_trace", &dpa::stop_launch_trace,
        "Stops tracing launches; returns the blocks (rows) of each launch traced.");
  m.def("graph_loops_supported", &dpa::graph_loops_supported,
        "Whether CUDA graphs can hold loops here (conditional WHILE nodes: CUDA 12.4+ runtime and driver).");
  m.def("begin_graph_loop", &dpa::begin_graph_loop,
        "Opens a loop in the CUDA graph being captured on the current stream (picard/cuda/graph_loop.h); "
        "returns its condition handle.");
  m.def("end_graph_loop", &dpa::end_graph_loop, "Ends the open graph loop's body.");
  m.def("release_graph_pool", &dpa::release_graph_pool, "Gives a graph loop body's memory pool back.");
  m.def("hopper_launches", [](int64_t device) {
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    return dpa::hopper_launches();
  }, "Whether the ops may launch with Hopper's clusters and programmatic dependent launch on "
     "this CUDA device: a Hopper or newer GPU and kernels compiled for it (common/launch.h).");
#endif
}
