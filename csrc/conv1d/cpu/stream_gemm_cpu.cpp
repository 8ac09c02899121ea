#include "conv1d/cpu/stream_gemm_cpu.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>

#include "conv1d/cpu/lanes.h"

namespace dpa {
namespace cpu {

namespace {

// Rows and positions of a block: 16 accumulators, and with the 4 rows' and 4 positions' loads
// 24 vector registers (of AVX-512's 32; NEON has 32 too). 2 x 8 and 1 x 16 blocks, which read
// each weight fewer times from the caches past 4 positions, were 1.6-2.6x slower at every
// measured shape (more column loads a weight).
constexpr int kRows = 4, kPositions = 4;

template <typename T>
struct Job {
  const T* cols;    // [n][k]
  const T* weight;  // [m][k]
  const T* bias;    // [m] or null
  T* out;           // [n][m]
  int64_t m, k, n;
};

// W values from p as floats: bfloat16 is the top half of a float's bits.
template <int W, typename T>
DPA_INLINE typename Lanes<W>::F load_floats(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return load<W>(p);
  } else {
    typedef uint16_t Half __attribute__((vector_size(W * sizeof(uint16_t))));
    Half h;
    std::memcpy(&h, p, sizeof(h));
    const typename Lanes<W>::I bits = __builtin_convertvector(h, typename Lanes<W>::I) << 16;
    typename Lanes<W>::F v;
    std::memcpy(&v, &bits, sizeof(v));
    return v;
  }
}

// Rows m0 .. m0 + R - 1 times positions n0 .. n0 + np - 1 (np <= kPositions; the block's other
// columns read the last one again and are dropped): W-lane sums over the reduction, then each
// accumulator's lanes and the reduction's tail.
template <int W, typename T, int R>
DPA_INLINE void block(const Job<T>& j, int64_t m0, int64_t n0, int np) {
  using F = typename Lanes<W>::F;
  const int64_t K = j.k;  // a local: j's fields may alias the output's stores
  const T* w = j.weight + m0 * K;
  const T* x[kPositions];
  for (int p = 0; p < kPositions; ++p) x[p] = j.cols + (n0 + std::min(p, np - 1)) * K;
  F acc[R][kPositions];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < kPositions; ++p) acc[r][p] = F{};
  int64_t k = 0;
  for (; k + W <= K; k += W) {
    F wv[R], xv[kPositions];
    for (int r = 0; r < R; ++r) wv[r] = load_floats<W>(w + r * K + k);
    for (int p = 0; p < kPositions; ++p) xv[p] = load_floats<W>(x[p] + k);
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < kPositions; ++p) acc[r][p] += wv[r] * xv[p];
  }
  for (int r = 0; r < R; ++r) {
    const float bias = j.bias ? static_cast<float>(j.bias[m0 + r]) : 0.f;
    for (int p = 0; p < np; ++p) {
      float sum = 0.f;
      for (int i = 0; i < W; ++i) sum += acc[r][p][i];
      for (int64_t t = k; t < K; ++t) sum += static_cast<float>(w[r * K + t]) * static_cast<float>(x[p][t]);
      j.out[(n0 + p) * j.m + m0 + r] = static_cast<T>(sum + bias);
    }
  }
}

// Rows [lo, hi) at every position.
template <int W, typename T>
DPA_INLINE void rows_lanes(const Job<T>& j, int64_t lo, int64_t hi) {
  int64_t m = lo;
  for (; m + kRows <= hi; m += kRows)
    for (int64_t n0 = 0; n0 < j.n; n0 += kPositions) {
      block<W, T, kRows>(j, m, n0, static_cast<int>(std::min<int64_t>(kPositions, j.n - n0)));
    }
  for (; m < hi; ++m)
    for (int64_t n0 = 0; n0 < j.n; n0 += kPositions) {
      block<W, T, 1>(j, m, n0, static_cast<int>(std::min<int64_t>(kPositions, j.n - n0)));
    }
}

// The entry points for each vector width. AVX2 CPUs take the 4-lane one: on the Zen 4 above,
// 8 lanes (the same 4 x 4 block, or 2 x 4) streamed 11-16 GB/s against 26 for 4 lanes.
void rows_4(const Job<float>& j, int64_t lo, int64_t hi) { rows_lanes<4>(j, lo, hi); }
void rows_4(const Job<c10::BFloat16>& j, int64_t lo, int64_t hi) { rows_lanes<4>(j, lo, hi); }
#if defined(__x86_64__)
__attribute__((target("avx512f"))) void rows_16(const Job<float>& j, int64_t lo, int64_t hi) {
  rows_lanes<16>(j, lo, hi);
}
__attribute__((target("avx512f"))) void rows_16(const Job<c10::BFloat16>& j, int64_t lo, int64_t hi) {
  rows_lanes<16>(j, lo, hi);
}
#endif

template <typename T>
void run(const Job<T>& j) {
  // Each thread a range of whole row blocks, in order.
  at::parallel_for(0, (j.m + kRows - 1) / kRows, 1, [&](int64_t b0, int64_t b1) {
    const int64_t lo = b0 * kRows, hi = std::min(b1 * kRows, j.m);
#if defined(__x86_64__)
    if (widest_lanes() >= 16) return rows_16(j, lo, hi);
#endif
    rows_4(j, lo, hi);
  });
}

}  // namespace

at::Tensor stream_gemm(const at::Tensor& cols, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_INTERNAL_ASSERT(cols.is_contiguous() && weight.is_contiguous() && cols.dim() == 2 && weight.dim() == 2 &&
                        cols.size(1) == weight.size(1) && cols.scalar_type() == weight.scalar_type());
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  at::Tensor out = at::empty({cols.size(0), weight.size(0)}, cols.options());
  if (cols.scalar_type() == at::kFloat) {
    run(Job<float>{cols.data_ptr<float>(), weight.data_ptr<float>(), b.defined() ? b.data_ptr<float>() : nullptr,
                   out.data_ptr<float>(), weight.size(0), weight.size(1), cols.size(0)});
  } else {
    TORCH_INTERNAL_ASSERT(cols.scalar_type() == at::kBFloat16, "stream_gemm: float or bfloat16");
    using B = c10::BFloat16;
    run(Job<B>{cols.data_ptr<B>(), weight.data_ptr<B>(), b.defined() ? b.data_ptr<B>() : nullptr,
               out.data_ptr<B>(), weight.size(0), weight.size(1), cols.size(0)});
  }
  return out;
}

}  // namespace cpu
}  // namespace dpa
