// The op schemas (one TORCH_LIBRARY for the `dpa` namespace) and the Python module that
// loads them. Implementations register per device in the op files (CPU in .cpp, CUDA in .cu);
// fake implementations for torch.compile live in diffusion_policy_accelerated/ops.py.
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

#include "conv1d.h"
#include "dependent_launch.h"

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
  }, "Sets batch * length from which the conv ops' CUDA path uses im2col + cuBLAS; returns the old value.");
  m.def("gemm_path_min_positions", [] { return dpa::gemm_path_min_positions.load(); },
        "Batch * length from which the conv ops' CUDA path uses im2col + cuBLAS.");
  m.def("set_pdl", [](bool enabled) { return dpa::use_pdl.exchange(enabled); },
        "Switches programmatic dependent launch of the streaming conv kernels and the denoise step; returns the old setting.");
  m.def("set_weights_evict_first", [](bool enabled) { return dpa::weights_evict_first.exchange(enabled); },
        "Sets whether the streaming kernels' weight loads are evict-first in L2; returns the old setting.");
  m.def("set_clusters", [](bool enabled) { return dpa::use_clusters.exchange(enabled); },
        "Sets whether streaming convs may run as thread-block clusters; returns the old setting.");
  m.def("set_side_stream", [](bool enabled) { return dpa::use_side_stream.exchange(enabled); },
        "Sets whether GEMM-route ops run a 1x1 shortcut's GEMM on a side stream; returns the old setting.");
  m.def("set_program_options", [](int options) {
    constexpr int kAll = dpa::kProgramRelaxedPoll | dpa::kProgramNoPrefetch;
    TORCH_CHECK_VALUE((options & ~kAll) == 0, "set_program_options: options must be a mask of bits ",
                      kAll, " (see conv1d.h), got ", options);
    return dpa::program_options.exchange(options);
  },
        "Sets StreamProgram's measurement variants (bit mask, see conv1d.h); returns the old value.");
  m.def("start_launch_trace", &dpa::start_launch_trace,
        "Traces the streaming conv launches from now on into a CUDA int64 tensor [rows, 9] (conv1d.h).");
  m.def("stop_launch_trace", &dpa::stop_launch_trace,
        "Stops tracing launches; returns the blocks (rows) of each launch traced.");
  // Used by GraphedSampler (sampler._UNetProgram); see dpa::StreamProgram in conv1d.h.
  pybind11::class_<dpa::StreamProgram>(m, "StreamProgram",
                                       "Streaming conv launches recorded and run as one persistent kernel.")
      .def(pybind11::init<>())
      .def("begin", &dpa::StreamProgram::begin)
      .def("add_input", &dpa::StreamProgram::add_input)
      .def("end", &dpa::StreamProgram::end)
      .def("produced", &dpa::StreamProgram::produced)
      .def("run", &dpa::StreamProgram::run)
      .def("run_traced", &dpa::StreamProgram::run_traced)
      .def("stage_names", &dpa::StreamProgram::stage_names)
      .def_property_readonly("num_stages", &dpa::StreamProgram::num_stages)
      .def_property_readonly("failure", &dpa::StreamProgram::failure);
#endif
}
