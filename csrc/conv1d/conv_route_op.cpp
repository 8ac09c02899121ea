// The route questions as ops, defined here with their one kernel (they take no tensors), so
// that Python asks conv_route.h instead of copying it: the model which weight layout and
// which block op to use, `explain` every conv's route and why. `device`: [] for the CPU,
// [index] for a CUDA device of this machine, or [major, SMs, shared memory a block may opt
// into, Hopper code 0/1] for a GPU described (one this machine lacks: `explain` without a GPU
// assumes an H100's).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>
#include <tuple>
#include <vector>

#include "conv1d/conv_route.h"
#ifdef DPA_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>

#include "conv1d/cuda/gemm_route.h"
#endif

namespace dpa {

namespace {

bool half(c10::ScalarType dtype) {
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
                    "conv_route: dtype must be float32, float16 or bfloat16, got ", dtype);
  return dtype != at::kFloat;
}

bool on_cpu(const std::vector<int64_t>& device) { return device.empty(); }

RouteDevice device_of(const std::vector<int64_t>& device) {
  TORCH_CHECK_VALUE(device.size() == 1 || device.size() == 4,
                    "conv_route: device must be [] (the CPU), [CUDA index] or [major, SMs, shared memory a block "
                    "may opt into, Hopper code 0/1], got ", device.size(), " values");
  if (device.size() == 4) {
    TORCH_CHECK_VALUE(device[0] >= 1 && device[1] >= 1 && device[2] >= 0 && (device[3] == 0 || device[3] == 1),
                      "conv_route: a described GPU needs a positive major and SM count, shared memory >= 0 and "
                      "Hopper code 0 or 1");
    const int64_t budget = kernel_config().sm_count;
    const int64_t sms = budget > 0 && budget < device[1] ? budget : device[1];
    return RouteDevice{static_cast<int>(device[0]), static_cast<int>(sms), device[2], device[3] == 1};
  }
  TORCH_CHECK_VALUE(device[0] >= 0, "conv_route: a CUDA device index must be >= 0, got ", device[0]);
#ifdef DPA_WITH_CUDA
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device[0]));
  return route_device();
#else
  TORCH_CHECK_VALUE(false, "conv_route: this build has no CUDA kernels; describe the GPU instead");
#endif
}

void check_sizes(const std::vector<int64_t>& sizes) {
  for (const int64_t v : sizes) TORCH_CHECK_VALUE(v >= 1, "conv_route: sizes must be positive, got ", v);
}

// A GroupNorm conv of a block ("same" padding, stride 1) over `length` positions.
ConvShape same_conv(int64_t batch, int64_t length, int64_t in_channels, int64_t out_channels, int64_t kernel_size,
                    bool half_precision) {
  return ConvShape{batch, in_channels, out_channels, length, length, kernel_size, false, half_precision, false};
}

bool taps_major_pays_op(int64_t batch, int64_t length, int64_t in_channels, int64_t out_channels, int64_t kernel_size,
                        c10::ScalarType dtype, std::vector<int64_t> device) {
  check_sizes({batch, length, in_channels, out_channels, kernel_size});
  const bool h = half(dtype);
  if (on_cpu(device)) return false;
  return taps_major_pays(same_conv(batch, length, in_channels, out_channels, kernel_size, h), kernel_config(),
                         device_of(device));
}

bool block_op_pays_op(int64_t batch, int64_t length, int64_t in_channels, int64_t out_channels, int64_t kernel_size,
                      int64_t groups, c10::ScalarType dtype, std::vector<int64_t> device) {
  check_sizes({batch, length, in_channels, out_channels, kernel_size, groups});
  const bool h = half(dtype);
  if (on_cpu(device)) return false;
  return block_op_pays(BlockShape{batch, in_channels, out_channels, length, kernel_size, groups, h}, kernel_config(),
                       device_of(device));
}

bool portable_launches_op(std::vector<int64_t> device) {
  if (on_cpu(device)) return false;
  return portable_launches(kernel_config(), device_of(device));
}

// block: empty (the conv stands alone) or [role (1 first, 2 second, 3 shortcut), in_channels,
// out_channels, kernel_size, groups] of its residual block.
std::tuple<std::string, std::string, int64_t, int64_t> conv_route_op(int64_t batch, int64_t length, int64_t in_channels,
                                                   int64_t out_channels, int64_t kernel_size, int64_t stride,
                                                   int64_t padding, bool transposed, int64_t groups,
                                                   std::vector<int64_t> block, c10::ScalarType dtype,
                                                   std::vector<int64_t> device) {
  check_sizes({batch, length, in_channels, out_channels, kernel_size, stride});
  TORCH_CHECK_VALUE(padding >= 0 && groups >= 0, "conv_route: padding and groups must be >= 0");
  TORCH_CHECK_VALUE(block.empty() || (block.size() == 5 && block[0] >= 1 && block[0] <= 3),
                    "conv_route: block must be [] or [role 1-3, in_channels, out_channels, kernel_size, groups]");
  const bool h = half(dtype);
  const int64_t out_length =
      transposed ? (length - 1) * stride - 2 * padding + kernel_size : (length + 2 * padding - kernel_size) / stride + 1;
  TORCH_CHECK_VALUE(out_length >= 1, "conv_route: the conv has no output positions");
  const ConvShape s{batch, in_channels, out_channels, length, out_length, kernel_size, transposed, h, false};
  BlockShape shape{batch, in_channels, out_channels, length, kernel_size, std::max<int64_t>(groups, 1), h};
  BlockRole role = BlockRole::kNone;
  if (!block.empty()) {
    check_sizes({block[1], block[2], block[3], block[4]});
    role = static_cast<BlockRole>(block[0]);
    shape = BlockShape{batch, block[1], block[2], length, block[3], block[4], h};
  }
  const bool cuda = !on_cpu(device);
  const RouteAnswer answer = describe_route(s, groups, role, shape, cuda, kernel_config(),
                                            cuda ? device_of(device) : RouteDevice{}, dtype == at::kBFloat16);
  return {answer.route, answer.why, answer.narrow_splits, answer.cublas_splits};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dpa, m) {
  m.def("conv_route(int batch, int length, int in_channels, int out_channels, int kernel_size, int stride, "
        "int padding, bool transposed, int groups, int[] block, ScalarType dtype, int[] device) -> (str route, str why, int narrow_splits, int cublas_splits)",
        &conv_route_op);
  m.def("taps_major_pays(int batch, int length, int in_channels, int out_channels, int kernel_size, "
        "ScalarType dtype, int[] device) -> bool",
        &taps_major_pays_op);
  m.def("block_op_pays(int batch, int length, int in_channels, int out_channels, int kernel_size, int groups, "
        "ScalarType dtype, int[] device) -> bool",
        &block_op_pays_op);
  m.def("portable_launches(int[] device) -> bool", &portable_launches_op);
}

}  // namespace dpa
