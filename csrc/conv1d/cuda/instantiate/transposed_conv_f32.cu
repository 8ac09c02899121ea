// transposed_conv.cuh's kernels for float: one translation unit per family and dtype, so that a build
// compiles them in parallel.
#include "conv1d/cuda/transposed_conv.cuh"

namespace dpa {
DPA_INSTANTIATE_TRANSPOSED_CONV(float)
}  // namespace dpa
