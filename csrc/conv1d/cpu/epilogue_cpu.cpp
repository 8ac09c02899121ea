#include "conv1d/cpu/epilogue_cpu.h"

#include "conv1d/cpu/lanes.h"

namespace dpa {
namespace cpu {

namespace {

// exp(x) in every lane: Cephes' expf (range reduction by ln 2, a degree-6 polynomial, the
// exponent added as bits), within 2 ulp of expf on [-87, 88]; clamped outside (no inf).
template <int W>
DPA_INLINE typename Lanes<W>::F exp_lanes(typename Lanes<W>::F x) {
  using F = typename Lanes<W>::F;
  using I = typename Lanes<W>::I;
  x = x < -87.f ? splat<W>(-87.f) : x;
  x = x > 88.f ? splat<W>(88.f) : x;
  const F fx = x * 1.44269504088896341f + 0.5f;
  F n = __builtin_convertvector(__builtin_convertvector(fx, I), F);  // truncated
  n = n > fx ? n - 1.f : n;                                          // floor
  const F r = x - n * 0.693359375f + n * 2.12194440e-4f;
  F p = splat<W>(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const I bits = (__builtin_convertvector(n, I) + 127) << 23;
  F scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// Mish, v * tanh(softplus(v)), as v * m / (m + 2) with m = e (e + 2), e = exp(v): the same
// function without log1p and tanh. Past v = 20, tanh(softplus(v)) is 1 in float.
template <int W>
DPA_INLINE typename Lanes<W>::F mish_lanes(typename Lanes<W>::F v) {
  const typename Lanes<W>::F e = exp_lanes<W>(v < 20.f ? v : splat<W>(20.f));
  const typename Lanes<W>::F m = e * (e + 2.f);
  // Below -87, where exp_lanes clamps, mish(v) is under 1e-36 in magnitude: 0.
  return v < -87.f ? splat<W>(0.f) : v * (m / (m + 2.f));
}

template <int W>
DPA_INLINE double group_sum_lanes(const float* y, int64_t n, const float* mean) {
  using F = typename Lanes<W>::F;
  constexpr int64_t kBlock = 1024;
  const float m = mean ? *mean : 0.f;
  double total = 0;
  for (int64_t b0 = 0; b0 < n; b0 += kBlock) {
    const int64_t b1 = b0 + kBlock < n ? b0 + kBlock : n;
    F acc = {};
    int64_t i = b0;
    for (; i + W <= b1; i += W) {
      const F d = load<W>(y + i) - m;
      acc += mean ? d * d : d;
    }
    float partial = 0;
    for (int k = 0; k < W; ++k) partial += acc[k];
    for (; i < b1; ++i) {
      const float d = y[i] - m;
      partial += mean ? d * d : d;
    }
    total += partial;
  }
  return total;
}

// The group's per-channel factors: mish(y * a + b) * scale + shift (+ residual), into
// `factors` (4 rows of channels + W floats; the padding is read, never used).
template <int W>
DPA_INLINE void channel_factors(const GroupEpilogue& g, float* factors) {
  const int64_t stride = g.channels + W;
  float *a = factors, *b = a + stride, *scale = b + stride, *shift = scale + stride;
  for (int64_t c = 0; c < g.channels; ++c) {
    a[c] = g.rstd * g.gamma[c];
    b[c] = g.beta[c] - g.mean * a[c];
    scale[c] = g.scale ? g.scale[c] : 1.f;
    shift[c] = g.shift ? g.shift[c] : 0.f;
  }
  for (int64_t c = g.channels; c < stride; ++c) a[c] = b[c] = scale[c] = shift[c] = 0.f;
}

// One row (channel c, `length` outputs), W at a time, its tail through a zero-padded vector.
template <int W>
DPA_INLINE void apply_row(const GroupEpilogue& g, const float* factors, int64_t c) {
  using F = typename Lanes<W>::F;
  const int64_t stride = g.channels + W, length = g.length;
  const F a = splat<W>(factors[c]), b = splat<W>(factors[stride + c]);
  const F scale = splat<W>(factors[2 * stride + c]), shift = splat<W>(factors[3 * stride + c]);
  const float* y = g.y + c * length;
  const float* residual = g.residual ? g.residual + c * length : nullptr;
  float* out = g.out + c * length;
  int64_t l = 0;
  for (; l + W <= length; l += W) {
    F v = mish_lanes<W>(load<W>(y + l) * a + b) * scale + shift;
    if (residual) v += load<W>(residual + l);
    store<W>(out + l, v);
  }
  if (l < length) {
    float in[W] = {}, res[W] = {}, result[W];
    std::memcpy(in, y + l, (length - l) * sizeof(float));
    if (residual) std::memcpy(res, residual + l, (length - l) * sizeof(float));
    store<W>(result, mish_lanes<W>(load<W>(in) * a + b) * scale + shift + load<W>(res));
    std::memcpy(out + l, result, (length - l) * sizeof(float));
  }
}

// The group as one run of channels x length elements, W at a time, where rows are shorter than
// W and divide it (the U-Nets' lengths 4 and 8): each vector spans W / length channels, whose
// factors a permutation spreads over their lanes.
template <int W>
DPA_INLINE typename Lanes<W>::F spread_lanes(const float* factors, typename Lanes<W>::I spread) {
#if defined(__clang__)
  typename Lanes<W>::F v;
  for (int k = 0; k < W; ++k) v[k] = factors[spread[k]];
  return v;
#else
  return __builtin_shuffle(load<W>(factors), spread);
#endif
}

template <int W>
DPA_INLINE void apply_packed(const GroupEpilogue& g, const float* factors) {
  using F = typename Lanes<W>::F;
  using I = typename Lanes<W>::I;
  const int64_t stride = g.channels + W, length = g.length, per_vector = W / length;
  I spread;
  for (int k = 0; k < W; ++k) spread[k] = static_cast<int32_t>(k / length);
  int64_t c = 0;
  for (; c + per_vector <= g.channels; c += per_vector) {
    const F a = spread_lanes<W>(factors + c, spread);
    const F b = spread_lanes<W>(factors + stride + c, spread);
    const F scale = spread_lanes<W>(factors + 2 * stride + c, spread);
    const F shift = spread_lanes<W>(factors + 3 * stride + c, spread);
    const int64_t at = c * length;
    F v = mish_lanes<W>(load<W>(g.y + at) * a + b) * scale + shift;
    if (g.residual) v += load<W>(g.residual + at);
    store<W>(g.out + at, v);
  }
  for (; c < g.channels; ++c) apply_row<W>(g, factors, c);
}

template <int W>
DPA_INLINE void apply_group_lanes(const GroupEpilogue& g) {
  float* factors = g.scratch;
  channel_factors<W>(g, factors);
  if (g.length < W && W % g.length == 0) return apply_packed<W>(g, factors);
  for (int64_t c = 0; c < g.channels; ++c) apply_row<W>(g, factors, c);
}

// The entry points for each vector width.
double group_sum_4(const float* y, int64_t n, const float* mean) { return group_sum_lanes<4>(y, n, mean); }
void apply_group_4(const GroupEpilogue& g) { apply_group_lanes<4>(g); }

#if defined(__x86_64__)
__attribute__((target("avx2"))) double group_sum_8(const float* y, int64_t n, const float* mean) {
  return group_sum_lanes<8>(y, n, mean);
}
__attribute__((target("avx2"))) void apply_group_8(const GroupEpilogue& g) { apply_group_lanes<8>(g); }
__attribute__((target("avx512f"))) double group_sum_16(const float* y, int64_t n, const float* mean) {
  return group_sum_lanes<16>(y, n, mean);
}
__attribute__((target("avx512f"))) void apply_group_16(const GroupEpilogue& g) { apply_group_lanes<16>(g); }
#endif

// The entry points of the widest vectors the CPU runs (widest_lanes).
struct Kernels {
  double (*group_sum)(const float*, int64_t, const float*) = group_sum_4;
  void (*apply_group)(const GroupEpilogue&) = apply_group_4;
  int lanes = 4;
};

Kernels widest() {
#if defined(__x86_64__)
  if (widest_lanes() >= 16) return {group_sum_16, apply_group_16, 16};
  if (widest_lanes() >= 8) return {group_sum_8, apply_group_8, 8};
#endif
  return {};
}

const Kernels& kernels() {
  static const Kernels chosen = widest();
  return chosen;
}

}  // namespace

double group_sum(const float* y, int64_t n, const float* mean) { return kernels().group_sum(y, n, mean); }

void apply_group(const GroupEpilogue& g) { kernels().apply_group(g); }

int64_t scratch_floats(int64_t channels) { return 4 * (channels + kernels().lanes); }

}  // namespace cpu
}  // namespace dpa
