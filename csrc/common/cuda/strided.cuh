// A tensor read through its strides inside a kernel, element by element in row-major order of
// its sizes: how the ops read a U-Net output they get as a view (a transposed [B, T, C] of a
// [B, C, T] result), where a contiguous copy would be one more launch on the chain of steps.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace dpa {

// Up to this many dimensions a tensor is read in place; beyond, from a contiguous copy read as
// one dimension (strided_of makes it).
constexpr int kMaxStridedDims = 4;

struct StridedLayout {
  int dims;
  int64_t size[kMaxStridedDims];
  int64_t stride[kMaxStridedDims];
};

// The storage offset of element i (in row-major order of the sizes).
__device__ __forceinline__ int64_t offset_of(const StridedLayout& t, int64_t i) {
  int64_t offset = 0;
#pragma unroll
  for (int d = kMaxStridedDims - 1; d >= 0; --d) {
    if (d < t.dims) {
      offset += (i % t.size[d]) * t.stride[d];
      i /= t.size[d];
    }
  }
  return offset;
}

// t as a kernel reads it: itself up to kMaxStridedDims dimensions, else a contiguous copy
// (returned in `held`, which must outlive the launch).
inline StridedLayout strided_of(const at::Tensor& t, at::Tensor& held) {
  held = t.dim() > kMaxStridedDims ? t.contiguous().view(-1) : t;
  StridedLayout layout{};
  layout.dims = static_cast<int>(held.dim());
  for (int d = 0; d < layout.dims; ++d) layout.size[d] = held.size(d), layout.stride[d] = held.stride(d);
  return layout;
}

}  // namespace dpa
