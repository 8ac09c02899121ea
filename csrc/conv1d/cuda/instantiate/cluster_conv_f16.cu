// cluster_conv.cuh's kernels for c10::Half: one translation unit per family and dtype, so that a build
// compiles them in parallel.
#include "conv1d/cuda/cluster_conv.cuh"

namespace dpa {
DPA_INSTANTIATE_CLUSTER_CONV(c10::Half)
}  // namespace dpa
