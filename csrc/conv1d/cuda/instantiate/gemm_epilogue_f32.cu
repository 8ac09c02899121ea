// gemm_epilogue.cuh's kernels for float: one translation unit per family and dtype, so that a build
// compiles them in parallel.
#include "conv1d/cuda/gemm_epilogue.cuh"

namespace dpa {
DPA_INSTANTIATE_GEMM_EPILOGUE(float)
}  // namespace dpa
