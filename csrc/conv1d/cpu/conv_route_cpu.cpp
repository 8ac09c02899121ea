#include "conv1d/cpu/conv_route_cpu.h"

#include "conv1d/conv_route.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <map>
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <vector>

#include <c10/util/intrusive_ptr.h>

#include "common/kernel_config.h"
#include "conv1d/cpu/stream_gemm_cpu.h"

namespace dpa {
namespace cpu {

namespace {

at::Tensor aten_conv(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                     int64_t stride, int64_t padding) {
  return at::conv1d(x, weight, bias, stride, padding);
}

// cols[b * L_out + l][c * K + k] = x_padded[b][c][l * stride + k]: one copy of x's windows,
// [B * L_out, C_in * K], contiguous.
at::Tensor im2col(const at::Tensor& x, int64_t taps, int64_t stride, int64_t padding) {
  const int64_t batch = x.size(0), cin = x.size(1);
  const at::Tensor padded = padding > 0 ? at::constant_pad_nd(x, {padding, padding}) : x;
  const at::Tensor windows = padded.unfold(2, taps, stride);  // [B, C_in, L_out, K]
  return windows.permute({0, 2, 1, 3}).reshape({batch * windows.size(2), cin * taps}).contiguous();
}

// The GEMM's result [B * L_out, C_out], the output channels-last, as [B, C_out, L_out].
at::Tensor from_rows(const at::Tensor& rows, int64_t batch) {
  return rows.view({batch, rows.size(0) / batch, rows.size(1)}).permute({0, 2, 1});
}

// im2col, then one GEMM with the weight [C_in * K, C_out] (MKL's or oneDNN's).
at::Tensor gemm_conv(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                     int64_t stride, int64_t padding) {
  const at::Tensor cols = im2col(x, weight.size(2), stride, padding);
  const at::Tensor w = weight.reshape({weight.size(0), cols.size(1)}).t();
  return from_rows(bias.has_value() ? at::addmm(*bias, cols, w) : at::mm(cols, w), x.size(0));
}

// im2col, then stream_gemm_cpu.h's GEMM, which reads each weight once. A weight not stored
// [C_out][C_in][K] (a taps-major one, which the model makes only for CUDA) is copied on every
// call; the timing at the shape's first call counts that copy.
at::Tensor stream_conv(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                       int64_t stride, int64_t padding) {
  const at::Tensor cols = im2col(x, weight.size(2), stride, padding);
  return from_rows(stream_gemm(cols, weight.reshape({weight.size(0), cols.size(1)}).contiguous(), bias), x.size(0));
}

// A transposed conv as the k-major streaming GEMM of its weight [C_in, C_out * K] as stored
// (y[b * L_in + j][c * K + k] = sum over i of x[b][i][j] * weight[i][c][k], in fp32), then
// each tap's products added where they land: out[b][c][j * stride + k - padding].
at::Tensor stream_transposed(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                             int64_t stride, int64_t padding) {
  const int64_t batch = x.size(0), cin = x.size(1), lin = x.size(2), cout = weight.size(1), taps = weight.size(2);
  const int64_t lout = (lin - 1) * stride - 2 * padding + taps;
  const at::Tensor cols = x.transpose(1, 2).reshape({batch * lin, cin}).contiguous();
  const at::Tensor y = stream_gemm_k_major(cols, weight.reshape({cin, cout * taps}).contiguous())
                           .view({batch, lin, cout, taps});
  at::Tensor out = bias.has_value() ? bias->to(at::kFloat).view({1, cout, 1}).expand({batch, cout, lout}).contiguous()
                                    : at::zeros({batch, cout, lout}, x.options().dtype(at::kFloat));
  for (int64_t k = 0; k < taps; ++k) {
    // Input positions j whose tap k lands in [0, lout): j * stride + k - padding.
    const int64_t below = padding - k, above = lout - 1 + padding - k;
    if (above < 0) continue;
    const int64_t first = below > 0 ? (below + stride - 1) / stride : 0;
    const int64_t last = std::min<int64_t>(lin - 1, above / stride);
    if (last < first) continue;
    const int64_t start = first * stride + k - padding, count = last - first + 1;
    out.slice(2, start, start + (count - 1) * stride + 1, stride)
        .add_(y.select(3, k).narrow(1, first, count).permute({0, 2, 1}));
  }
  return out.to(x.scalar_type());
}

enum class Route { kAten, kGemm, kStream };

// A route, and whether a half-precision conv runs it on fp32 copies of its operands (its
// result then stays fp32; conv_route_cpu.h says when that pays).
struct Choice {
  Route route;
  bool in_float;
};

bool stream_dtype(at::ScalarType dtype) { return dtype == at::kFloat || dtype == at::kBFloat16; }

bool half_precision(const at::Tensor& x) { return x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16; }

// Where the streaming GEMM may be timed (conv_route.h's kCpuStreamMaxPositions).
bool few_positions(const at::Tensor& x, const at::Tensor& weight, int64_t stride, int64_t padding, bool transposed) {
  const int64_t length = transposed ? x.size(2) : (x.size(2) + 2 * padding - weight.size(2)) / stride + 1;
  return x.size(0) * length <= kCpuStreamMaxPositions;
}

// A transposed conv has ATen's route and the streaming one (kGemm is ATen's there).
at::Tensor run_route(Route route, const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                     int64_t stride, int64_t padding, bool transposed) {
  if (transposed) {
    return route == Route::kStream ? stream_transposed(x, weight, bias, stride, padding)
                                   : at::conv_transpose1d(x, weight, bias, stride, padding);
  }
  switch (route) {
    case Route::kGemm: return gemm_conv(x, weight, bias, stride, padding);
    case Route::kStream: return stream_conv(x, weight, bias, stride, padding);
    case Route::kAten: break;
  }
  return aten_conv(x, weight, bias, stride, padding);
}

// fp32 copies of half-precision weights, for the routes that run on them: converted on every
// call, they cost a quarter of the image U-Net's bf16 action at batch 1 (2-core AVX2 EPYC,
// DDIM-4: 397-434 ms against 311-360 with the copies kept). A copy is kept while its weight
// lives (a weak reference: no other tensor can take the weight's address meanwhile) and is
// unchanged (its version counter, which in-place ops bump, as optimisers' and
// load_state_dict's do; writes through `.data` do not, as for ConditionalUnet1D's taps-major
// copies). A changed weight's copy is replaced at its next call, a dead weight's dropped at the
// next conversion of any weight, and a weight's whose conv's route turns out not to run on
// fp32 copies at once (forget). Weights made under torch.inference_mode have no version
// counter: they are converted on every call.
class FloatCopies {
 public:
  at::Tensor get(const at::Tensor& weight) {
    if (weight.is_inference()) return weight.to(at::kFloat);
    const uint32_t version = weight.unsafeGetTensorImpl()->version_counter().current_version();
    const std::lock_guard<std::mutex> lock(mutex_);
    const auto it = entries_.find(weight.unsafeGetTensorImpl());
    if (it != entries_.end() && !it->second.source.expired() && it->second.data == weight.data_ptr() &&
        it->second.version == version && it->second.copy.sizes() == weight.sizes()) {
      return it->second.copy;
    }
    // Converted under the lock: two threads converting the same weight would hold two copies.
    at::Tensor copy = weight.to(at::kFloat);
    for (auto e = entries_.begin(); e != entries_.end();) e = e->second.source.expired() ? entries_.erase(e) : ++e;
    entries_.insert_or_assign(weight.unsafeGetTensorImpl(),
                              Entry{c10::weak_intrusive_ptr<c10::TensorImpl>(weight.getIntrusivePtr()),
                                    weight.data_ptr(), version, copy});
    return copy;
  }

  void forget(const at::Tensor& weight) {
    const std::lock_guard<std::mutex> lock(mutex_);
    entries_.erase(weight.unsafeGetTensorImpl());
  }

 private:
  struct Entry {
    c10::weak_intrusive_ptr<c10::TensorImpl> source;
    const void* data;
    uint32_t version;
    at::Tensor copy;
  };
  std::mutex mutex_;
  std::unordered_map<const c10::TensorImpl*, Entry> entries_;
};

FloatCopies& float_copies() {
  static FloatCopies copies;
  return copies;
}

at::Tensor run_choice(Choice choice, const at::Tensor& x, const at::Tensor& weight,
                      const std::optional<at::Tensor>& bias, int64_t stride, int64_t padding, bool transposed) {
  if (!choice.in_float || x.scalar_type() == at::kFloat) {
    return run_route(choice.route, x, weight, bias, stride, padding, transposed);
  }
  const std::optional<at::Tensor> float_bias =
      bias.has_value() ? std::optional<at::Tensor>(bias->to(at::kFloat)) : std::nullopt;
  return run_route(choice.route, x.to(at::kFloat), float_copies().get(weight), float_bias, stride, padding,
                   transposed);
}

// dtype, sizes (a transposed weight's C_out is its size(1)), stride, padding, bias, the
// operands' layouts (a channels-last input or a taps-major weight costs each route
// differently), threads, transposed.
using Key = std::tuple<int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool, bool, bool,
                       int, bool>;

// The median of 5 timed calls of each route, in turn, after one untimed call of each (oneDNN
// creates its primitive on the first). A route must be 15% faster than ATen's conv, and than
// the route chosen before it, to be chosen: timed alone, a route runs with its operands in
// cache, and on a shared CPU one call's time varies by ~10%; with a 5% margin, layers within
// a few percent of a tie went to the GEMM and made the lowdim U-Net's fp32 action at batch 8
// 7% slower than with ATen's conv throughout. A half-precision conv times each route also on
// fp32 copies (float_copies: the weights' copies are made by the first, untimed call).
Choice time_routes(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                   int64_t stride, int64_t padding, bool transposed) {
  using Clock = std::chrono::steady_clock;
  std::vector<Choice> routes;
  for (const bool in_float : {false, true}) {
    if (in_float && !half_precision(x)) break;
    routes.push_back({Route::kAten, in_float});
    if (!transposed) routes.push_back({Route::kGemm, in_float});
    const bool streams = stream_dtype(in_float ? at::kFloat : x.scalar_type());
    if (streams && few_positions(x, weight, stride, padding, transposed)) routes.push_back({Route::kStream, in_float});
  }
  if (routes.size() == 1) return routes[0];
  const auto run = [&](Choice route) { run_choice(route, x, weight, bias, stride, padding, transposed).contiguous(); };
  for (Choice route : routes) run(route);
  std::vector<std::array<double, 5>> times(routes.size());
  for (size_t i = 0; i < 5; ++i) {
    for (size_t r = 0; r < routes.size(); ++r) {
      const auto start = Clock::now();
      run(routes[r]);
      times[r][i] = std::chrono::duration<double>(Clock::now() - start).count();
    }
  }
  size_t best = 0;
  for (size_t r = 0; r < routes.size(); ++r) {
    std::sort(times[r].begin(), times[r].end());
    if (times[r][2] < 0.85 * times[best][2]) best = r;
  }
  return routes[best];
}

Choice choose(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
              int64_t stride, int64_t padding, bool transposed) {
  switch (kernel_config().cpu_conv) {
    case CpuConv::kAten: return {Route::kAten, false};
    case CpuConv::kGemm: return {Route::kGemm, false};
    // Forced where it has the dtype; else ATen's conv (fp16).
    case CpuConv::kStream: return {stream_dtype(x.scalar_type()) ? Route::kStream : Route::kAten, false};
    case CpuConv::kFloat: return {Route::kAten, true};
    case CpuConv::kAuto: break;
  }
  static std::mutex mutex;
  static std::map<Key, Choice> chosen;
  const Key key{static_cast<int>(x.scalar_type()), x.size(0), x.size(1), x.size(2), weight.size(0), weight.size(1),
                weight.size(2), stride, padding, bias.has_value(), x.is_contiguous(), weight.is_contiguous(),
                at::get_num_threads(), transposed};
  {
    const std::lock_guard<std::mutex> lock(mutex);
    if (const auto it = chosen.find(key); it != chosen.end()) return it->second;
  }
  // Timed outside the lock: another shape's first call need not wait. Two threads meeting the
  // same new shape both time it; the first to finish decides.
  const Choice route = time_routes(x, weight, bias, stride, padding, transposed);
  if (!route.in_float) float_copies().forget(weight);  // made for the timing only
  const std::lock_guard<std::mutex> lock(mutex);
  return chosen.emplace(key, route).first->second;
}

}  // namespace

at::Tensor conv1d(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                  int64_t stride, int64_t padding) {
  return run_choice(choose(x, weight, bias, stride, padding, false), x, weight, bias, stride, padding, false);
}

at::Tensor conv_transpose1d(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                            int64_t stride, int64_t padding) {
  return run_choice(choose(x, weight, bias, stride, padding, true), x, weight, bias, stride, padding, true);
}

}  // namespace cpu
}  // namespace dpa
