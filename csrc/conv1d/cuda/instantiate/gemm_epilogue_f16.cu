// gemm_epilogue.cuh's kernels for c10::Half: one translation unit per family and dtype, so that a build
// compiles them in parallel.
#include "conv1d/cuda/gemm_epilogue.cuh"

namespace dpa {
DPA_INSTANTIATE_GEMM_EPILOGUE(c10::Half)
}  // namespace dpa
