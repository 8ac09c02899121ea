// The kernels' configuration: which routes and launch features the CUDA ops may use. It is
// defined, with the measurements behind each default, in one place, the Python module
// diffusion_policy_accelerated/routing.py (KernelConfig); the package's loader sets the
// process default from it, and `with routing.kernel_config(...)` overrides it for the
// calling thread. The ops read it when they launch a kernel or a CUDA graph captures them.
#pragma once

#include <cstdint>

namespace dpa {

// How the CPU ops run a convolution: timed on first use of each shape, or fixed
// (conv1d/cpu/conv_route_cpu.h).
enum class CpuConv : int { kAuto = 0, kAten = 1, kGemm = 2, kStream = 3, kFloat = 4 };

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
  // gemm_route.h's gemm_splits).
  int64_t fp32_gemm_max_splits;
  // fp32 convs on the GEMM route over up to 32 positions: the package's own GEMM
  // (narrow_gemm.cu) instead of cuBLAS's, where gemm_route.h's narrow_gemm_splits takes it.
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
  CpuConv cpu_conv;
  // SMs the CUDA launch plans fill (0: the device's): a process confined to fewer (a CUDA
  // green context, an MPS share) sets it, or its waves would be planned for the whole GPU.
  int64_t sm_count;
};

// The calling thread's configuration: its override if it has one, else the process
// default. Raises if the loader has not set the default (the extension was imported
// without diffusion_policy_accelerated.ops).
const KernelConfig& kernel_config();
void set_default_kernel_config(const KernelConfig& config);
// The calling thread's override (nullptr: none, the default applies).
void set_thread_kernel_config(const KernelConfig* config);

}  // namespace dpa
