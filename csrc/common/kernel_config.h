// The kernels' configuration: which routes and launch features the ops may use. Its fields
// and defaults are the Python dataclass diffusion_policy_accelerated/kernels/config.py's
// KernelConfig, which reaches C++ by field name (kernel_config_fields); the package's loader
// sets the process default from it, and `with kernel_config(...)` overrides it for the calling
// thread. The ops read it when they launch a kernel or a CUDA graph captures them; the route
// rules that read it are conv1d/conv_route.h.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dpa {

// How the CPU ops run a convolution: timed on first use of each shape, or fixed
// (conv1d/cpu/conv_route_cpu.h).
enum class CpuConv : int { kAuto = 0, kAten = 1, kGemm = 2, kStream = 3, kFloat = 4 };
// Its names, in that order, as KernelConfig.cpu_conv takes them.
const std::vector<std::string>& cpu_conv_names();

struct KernelConfig {
  // batch x length from which a conv takes the im2col + cuBLAS route instead of streaming
  // its weights (a taps-major weight takes that route at any size).
  int64_t gemm_min_positions;
  // ... and below it, from gemm_min_work_positions on, a conv whose multiply-adds (weight
  // elements x positions) reach gemm_min_work.
  int64_t gemm_min_work;
  int64_t gemm_min_work_positions;
  // ... and for a transposed conv, from gemm_min_work_positions on where its weight elements x
  // positions (its input's) reach this.
  int64_t transposed_gemm_min_work;
  // ... and in half precision, where no launch uses clusters or PDL (before Hopper, or both
  // switched off), from this many positions.
  int64_t portable_half_gemm_min_positions;
  // On the GEMM route, a residual block's 1x1 shortcut GEMM runs on a side stream, in fp32
  // only below this many positions (half precision: always).
  int64_t side_stream_fp32_max_positions;
  // The most slices an fp32 conv's im2col GEMM is cut into along its reduction (1: never cut;
  // conv_route.h's cublas_splits).
  int64_t fp32_gemm_max_splits;
  // fp32 convs on the GEMM route over up to 32 positions: the package's own GEMM
  // (narrow_gemm.cu) instead of cuBLAS's, where conv_route.h's narrow_splits takes it.
  bool narrow_gemm;
  bool side_stream;
  // Streaming convs, and the GEMM route's sliced GroupNorm epilogue, as thread-block clusters
  // (Hopper) where their plan fits.
  bool clusters;
  // Programmatic dependent launch (Hopper): a kernel starts while the previous one ends.
  bool pdl;
  // The GEMM route's sliced GroupNorm epilogue in one cooperative launch where it fits.
  bool cooperative_group_norm;
  // Streamed weights loaded with an evict-first L2 policy.
  bool weights_evict_first;
  // Half-precision GroupNorm convs take a taps-major weight (conv_route.h's taps_major_pays)
  // from this many input channels, and below the GEMM route's size where C_in x C_out x
  // positions reaches taps_major_min_work (taps_major_min_work_batch_1 at batch 1 from 8
  // positions).
  int64_t taps_major_min_in_channels;
  int64_t taps_major_min_work;
  int64_t taps_major_min_work_batch_1;
  CpuConv cpu_conv;
  // SMs the CUDA launch plans fill (0: the device's): a process confined to fewer (a CUDA
  // green context, an MPS share) sets it, or its waves would be planned for the whole GPU.
  int64_t sm_count;
};

// KernelConfig's fields by name: an integer or a flag (cpu_conv, a name of cpu_conv_names(), is
// the one other). The Python dataclass must have exactly these and cpu_conv.
struct KernelConfigField {
  const char* name;
  int64_t KernelConfig::*integer;  // null for a flag
  bool KernelConfig::*flag;        // null for an integer
};
const std::vector<KernelConfigField>& kernel_config_fields();

// The calling thread's configuration: its override if it has one, else the process
// default. Raises if the loader has not set the default (the extension was imported
// without diffusion_policy_accelerated.ops).
const KernelConfig& kernel_config();
void set_default_kernel_config(const KernelConfig& config);
// The calling thread's override (nullptr: none, the default applies).
void set_thread_kernel_config(const KernelConfig* config);

}  // namespace dpa
