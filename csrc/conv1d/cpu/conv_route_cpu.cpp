#include "conv1d/cpu/conv_route_cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <map>
#include <mutex>
#include <tuple>

#include "common/kernel_config.h"

namespace dpa {
namespace cpu {

namespace {

at::Tensor aten_conv(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                     int64_t stride, int64_t padding) {
  return at::conv1d(x, weight, bias, stride, padding);
}

// cols[b * L_out + l][c * K + k] = x_padded[b][c][l * stride + k]: one copy of x's windows,
// then one GEMM whose result [B * L_out, C_out] is the output channels-last.
at::Tensor gemm_conv(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                     int64_t stride, int64_t padding) {
  const int64_t batch = x.size(0), cin = x.size(1), cout = weight.size(0), taps = weight.size(2);
  const at::Tensor padded = padding > 0 ? at::constant_pad_nd(x, {padding, padding}) : x;
  const at::Tensor windows = padded.unfold(2, taps, stride);  // [B, C_in, L_out, K]
  const int64_t lout = windows.size(2);
  const at::Tensor cols = windows.permute({0, 2, 1, 3}).reshape({batch * lout, cin * taps});
  const at::Tensor w = weight.reshape({cout, cin * taps}).t();
  const at::Tensor out = bias.has_value() ? at::addmm(*bias, cols, w) : at::mm(cols, w);
  return out.view({batch, lout, cout}).permute({0, 2, 1});
}

enum class Route { kAten, kGemm };

// dtype, sizes, stride, padding, bias, the operands' layouts (a channels-last input or a
// taps-major weight costs each route differently), threads.
using Key = std::tuple<int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool, bool, bool, int>;

// The median of 5 timed calls of each route, in turn, after one untimed call of each (oneDNN
// creates its primitive on the first). The GEMM must be 15% faster to be chosen: timed alone,
// a route runs with its operands in cache, and on a shared CPU one call's time varies by
// ~10%; with a 5% margin, layers within a few percent of a tie went to the GEMM and made the
// lowdim U-Net's fp32 action at batch 8 7% slower than with ATen's conv throughout.
Route time_routes(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                  int64_t stride, int64_t padding) {
  using Clock = std::chrono::steady_clock;
  const auto run = [&](Route route) {
    return route == Route::kGemm ? gemm_conv(x, weight, bias, stride, padding).contiguous()
                                 : aten_conv(x, weight, bias, stride, padding).contiguous();
  };
  run(Route::kAten);
  run(Route::kGemm);
  std::array<double, 5> aten{}, gemm{};
  for (size_t i = 0; i < aten.size(); ++i) {
    for (Route route : {Route::kAten, Route::kGemm}) {
      const auto start = Clock::now();
      run(route);
      (route == Route::kGemm ? gemm : aten)[i] = std::chrono::duration<double>(Clock::now() - start).count();
    }
  }
  std::sort(aten.begin(), aten.end());
  std::sort(gemm.begin(), gemm.end());
  return gemm[2] < 0.85 * aten[2] ? Route::kGemm : Route::kAten;
}

Route choose(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
             int64_t stride, int64_t padding) {
  switch (kernel_config().cpu_conv) {
    case CpuConv::kAten: return Route::kAten;
    case CpuConv::kGemm: return Route::kGemm;
    case CpuConv::kAuto: break;
  }
  static std::mutex mutex;
  static std::map<Key, Route> chosen;
  const Key key{static_cast<int>(x.scalar_type()), x.size(0), x.size(1), x.size(2), weight.size(0),
                weight.size(2), stride, padding, bias.has_value(), x.is_contiguous(), weight.is_contiguous(),
                at::get_num_threads()};
  {
    const std::lock_guard<std::mutex> lock(mutex);
    if (const auto it = chosen.find(key); it != chosen.end()) return it->second;
  }
  // Timed outside the lock: another shape's first call need not wait. Two threads meeting the
  // same new shape both time it; the first to finish decides.
  const Route route = time_routes(x, weight, bias, stride, padding);
  const std::lock_guard<std::mutex> lock(mutex);
  return chosen.emplace(key, route).first->second;
}

}  // namespace

at::Tensor conv1d(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                  int64_t stride, int64_t padding) {
  return choose(x, weight, bias, stride, padding) == Route::kGemm ? gemm_conv(x, weight, bias, stride, padding)
                                                                  : aten_conv(x, weight, bias, stride, padding);
}

}  // namespace cpu
}  // namespace dpa
