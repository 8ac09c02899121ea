// Argument checks shared by every op. Each failure raises a Python exception that names
// the op and the argument: TypeError for dtypes, ValueError for shapes and values,
// RuntimeError (plain TORCH_CHECK) for devices. The kernels rely on these checks for
// memory safety, so every op runs them before touching a data pointer.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/util/Exception.h>

#include <optional>
#include <string>

// The dtypes every op supports (fp32 plus the two half types); no double instantiations.
#define DPA_DISPATCH_FLOAT_TYPES(TYPE, NAME, ...)              \
  AT_DISPATCH_SWITCH(TYPE, NAME,                               \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)  \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

namespace dpa {

inline bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

inline void check_float_tensor(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK_TYPE(is_supported_float(t.scalar_type()), op, ": ", name,
                   " must be float32, float16 or bfloat16, got ", t.scalar_type());
}

inline void check_dim(const at::Tensor& t, int64_t dim, const char* op, const char* name,
                      const char* layout) {
  TORCH_CHECK_VALUE(t.dim() == dim, op, ": ", name, " must be ", dim, "-D ", layout,
                    ", got shape ", t.sizes());
}

inline void check_same_dtype(const at::Tensor& t, const at::Tensor& ref, const char* op,
                             const char* name, const char* ref_name) {
  TORCH_CHECK_TYPE(t.scalar_type() == ref.scalar_type(), op, ": ", name, " has dtype ",
                   t.scalar_type(), " but ", ref_name, " has dtype ", ref.scalar_type(),
                   "; they must match");
}

inline void check_same_device(const at::Tensor& t, const at::Tensor& ref, const char* op,
                              const char* name, const char* ref_name) {
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " is on ", t.device(), " but ",
              ref_name, " is on ", ref.device(), "; all tensors must be on one device");
}

// A per-channel parameter (bias, GroupNorm affine) of an op whose main tensor is `ref`.
inline void check_channel_vector(const std::optional<at::Tensor>& t, int64_t channels,
                                 const at::Tensor& ref, const char* op, const char* name) {
  if (!t.has_value()) return;
  check_same_device(*t, ref, op, name, "x");
  check_same_dtype(*t, ref, op, name, "x");
  TORCH_CHECK_VALUE(t->dim() == 1 && t->size(0) == channels, op, ": ", name,
                    " must have shape [", channels, "], got ", t->sizes());
}

inline const void* optional_data(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr() : nullptr;
}

inline std::optional<at::Tensor> contiguous_or_none(const std::optional<at::Tensor>& t) {
  if (!t.has_value()) return std::nullopt;
  return t->contiguous();
}

}  // namespace dpa
