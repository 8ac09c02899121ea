// splitk_conv.cuh's kernels for float: one translation unit per family and dtype, so that a build
// compiles them in parallel.
#include "conv1d/cuda/splitk_conv.cuh"

namespace dpa {
DPA_INSTANTIATE_SPLITK_CONV(float)
}  // namespace dpa
