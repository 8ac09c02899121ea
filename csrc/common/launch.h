// Launching the CUDA ops' kernels: programmatic dependent launch (Hopper and newer),
// thread-block clusters, cooperative launches. A kernel launched as a programmatic dependent
// may start while the kernel before it in the stream is still running, and waits
// (griddepcontrol.wait) only where it reads that kernel's results. Under a CUDA graph this
// takes a launch's latency off every edge of the denoising loop's chain of kernels. The
// device half is for .cu files, the host half (LaunchConfig) for any CUDA source.
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include <iterator>

#include "common/kernel_config.h"

namespace dpa {

#ifdef __CUDACC__
// Returns once the previous kernel in the stream has completed and its writes are visible
// (immediately for a kernel not launched as a programmatic dependent).
__device__ __forceinline__ void wait_for_producer() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the next kernel in the stream launch now (it still waits for this one's results).
__device__ __forceinline__ void allow_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
#endif

// Whether the library's kernels were compiled with Hopper code (compute_90 or newer) for the
// current GPU (common/cuda/hopper_code.cu). Asked once a device.
bool hopper_code();

// Whether launches may use Hopper's programmatic dependent launch and thread-block clusters: a
// Hopper or newer GPU, and kernels compiled for it (hopper_code); else the portable launches.
inline bool hopper_launches() {
  return at::cuda::getCurrentDeviceProperties()->major >= 9 && hopper_code();
}

// Whether kernels launch as programmatic dependents: hopper_launches and KernelConfig.pdl.
inline bool pdl_launches() { return kernel_config().pdl && hopper_launches(); }

// SMs the launch plans fill: KernelConfig.sm_count where set (at most the device's), else
// the device's. The planners read this, never multiProcessorCount.
inline int sm_budget() {
  const int device = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t budget = kernel_config().sm_count;
  return budget > 0 && budget < device ? static_cast<int>(budget) : device;
}

// A launch on the current stream with the attributes it asks for. config.attrs points into
// the object, so it is not copied.
class LaunchConfig {
 public:
  LaunchConfig(dim3 grid, dim3 block, size_t shared_bytes) {
    config_.gridDim = grid;
    config_.blockDim = block;
    config_.dynamicSmemBytes = shared_bytes;
    config_.stream = at::cuda::getCurrentCUDAStream();
    config_.attrs = attributes_;
  }
  LaunchConfig(const LaunchConfig&) = delete;
  LaunchConfig& operator=(const LaunchConfig&) = delete;

  // Clusters of `blocks` blocks (0: not a cluster launch).
  void clusters(int blocks) {
    if (blocks == 0) return;
    cudaLaunchAttribute& attribute = next();
    attribute.id = cudaLaunchAttributeClusterDimension;
    attribute.val.clusterDim = {static_cast<unsigned>(blocks), 1, 1};
  }
  // As a programmatic dependent of the previous kernel, where the GPU has it and the kernel
  // configuration allows it.
  void programmatic_dependent() {
    if (!pdl_launches()) return;
    cudaLaunchAttribute& attribute = next();
    attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute.val.programmaticStreamSerializationAllowed = 1;
  }
  // Every block resident at once (or the launch fails), so that blocks may wait for each
  // other.
  void cooperative() {
    cudaLaunchAttribute& attribute = next();
    attribute.id = cudaLaunchAttributeCooperative;
    attribute.val.cooperative = 1;
  }
  const cudaLaunchConfig_t* get() const { return &config_; }

 private:
  cudaLaunchAttribute& next() {
    TORCH_INTERNAL_ASSERT(config_.numAttrs < std::size(attributes_));
    return attributes_[config_.numAttrs++];
  }
  cudaLaunchConfig_t config_ = {};
  cudaLaunchAttribute attributes_[3];
};

}  // namespace dpa
