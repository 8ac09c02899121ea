// Whether the library's kernels carry Hopper code for the current GPU (launch.h's
// hopper_launches). On a Hopper GPU a library built without compute_90 (an arch list of
// 8.0+PTX, say, JIT-compiled there) has kernels whose griddepcontrol waits and cluster code
// were compiled out: launched as programmatic dependents or clusters they would read their
// producers' outputs before those are written. Every translation unit is compiled for the same
// arch list, so one empty kernel's PTX version speaks for all.
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <atomic>

#include "common/launch.h"

namespace dpa {

namespace {

__global__ void probe_kernel() {}

}  // namespace

bool hopper_code() {
  constexpr int kDevices = 64;
  static std::atomic<int> known[kDevices];  // 0: not asked yet, 1: no, 2: yes
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  std::atomic<int>& slot = known[device < kDevices ? device : 0];
  int state = slot.load(std::memory_order_relaxed);
  if (state == 0) {
    cudaFuncAttributes attributes{};
    C10_CUDA_CHECK(cudaFuncGetAttributes(&attributes, probe_kernel));
    state = attributes.ptxVersion >= 90 ? 2 : 1;
    slot.store(state, std::memory_order_relaxed);
  }
  return state == 2;
}

}  // namespace dpa
