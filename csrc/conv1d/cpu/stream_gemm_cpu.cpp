#include "conv1d/cpu/stream_gemm_cpu.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "conv1d/cpu/lanes.h"

namespace dpa {
namespace cpu {

namespace {

// Rows and positions of a block: 16 accumulators, and with the 4 rows' and 4 positions' loads
// 24 vector registers (of AVX-512's and NEON's 32; SSE2's 16 spill some, and still streamed
// 26 GB/s on the Zen 4 of stream_gemm_cpu.h). 2 x 8 and 1 x 16 blocks, which read each weight fewer times
// from the caches past 4 positions, were 1.6-2.6x slower at every measured shape (more column
// loads a weight).
constexpr int kRows = 4, kPositions = 4;

template <typename T>
struct Job {
  const float* cols;  // [n][k], in fp32: converted once, not once a row block
  const T* pairs;     // [n][k] as given, for bf16_dot_product (cols is then null)
  const T* weight;  // [m][k], or k-major [k][m]
  const T* bias;    // [m] or null
  void* out;        // [n][m], T or (float_out) float
  int64_t m, k, n;
  bool float_out;
  void put(int64_t n, int64_t m, float v) const {
    if (float_out) {
      static_cast<float*>(out)[n * this->m + m] = v;
    } else {
      static_cast<T*>(out)[n * this->m + m] = static_cast<T>(v);
    }
  }
};

// W values from p as floats: bfloat16 is the top half of a float's bits.
template <int W, typename T>
DPA_INLINE typename Lanes<W>::F load_floats(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return load<W>(p);
  } else {
    typename Lanes<W>::H h;
    std::memcpy(&h, p, sizeof(h));
    const typename Lanes<W>::U bits = __builtin_convertvector(h, typename Lanes<W>::U) << 16;
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
  const float* x[kPositions];
  for (int p = 0; p < kPositions; ++p) x[p] = j.cols + (n0 + std::min(p, np - 1)) * K;
  F acc[R][kPositions];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < kPositions; ++p) acc[r][p] = F{};
  int64_t k = 0;
  for (; k + W <= K; k += W) {
    F wv[R], xv[kPositions];
    for (int r = 0; r < R; ++r) wv[r] = load_floats<W>(w + r * K + k);
    for (int p = 0; p < kPositions; ++p) xv[p] = load<W>(x[p] + k);
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < kPositions; ++p) acc[r][p] += wv[r] * xv[p];
  }
  for (int r = 0; r < R; ++r) {
    const float bias = j.bias ? static_cast<float>(j.bias[m0 + r]) : 0.f;
    for (int p = 0; p < np; ++p) {
      float sum = 0.f;
      for (int i = 0; i < W; ++i) sum += acc[r][p][i];
      for (int64_t t = k; t < K; ++t) sum += static_cast<float>(w[r * K + t]) * x[p][t];
      j.put(n0 + p, m0 + r, sum + bias);
    }
  }
}

// The k-major form (a transposed conv's weight, [C_in][C_out * K]): output columns m0 .. m0 +
// 4W - 1 (C columns a vector) times positions n0 .. n0 + np - 1; each reduction step loads a
// 4W-float run of one weight row and broadcasts each position's input element.
template <int W, typename T, int C>
DPA_INLINE void block_k_major(const Job<T>& j, int64_t m0, int64_t n0, int np) {
  using F = typename Lanes<W>::F;
  const int64_t K = j.k, M = j.m;
  const float* x[kPositions];
  for (int p = 0; p < kPositions; ++p) x[p] = j.cols + (n0 + std::min(p, np - 1)) * K;
  F acc[C][kPositions];
  for (int c = 0; c < C; ++c)
    for (int p = 0; p < kPositions; ++p) acc[c][p] = F{};
  for (int64_t k = 0; k < K; ++k) {
    F wv[C], xv[kPositions];
    for (int c = 0; c < C; ++c) wv[c] = load_floats<W>(j.weight + k * M + m0 + c * W);
    for (int p = 0; p < kPositions; ++p) xv[p] = splat<W>(x[p][k]);
    for (int c = 0; c < C; ++c)
      for (int p = 0; p < kPositions; ++p) acc[c][p] += wv[c] * xv[p];
  }
  for (int p = 0; p < np; ++p)
    for (int c = 0; c < C; ++c)
      for (int i = 0; i < W; ++i) {
        const int64_t m = m0 + c * W + i;
        j.put(n0 + p, m, acc[c][p][i] + (j.bias ? static_cast<float>(j.bias[m]) : 0.f));
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

// Columns [lo, hi) of the k-major form at every position: blocks of 4 vectors, then single
// vectors, then (past the last whole vector) one lane at a time, each at every group of 4
// positions before the next (its weights, 4 vectors a reduction step, stay in L2 for the
// next positions). (No lambdas here: a lambda's body is not compiled for its enclosing entry
// point's instruction set.)
template <int W, typename T, int C>
DPA_INLINE void column_block(const Job<T>& j, int64_t m) {
  for (int64_t n0 = 0; n0 < j.n; n0 += kPositions) {
    block_k_major<W, T, C>(j, m, n0, static_cast<int>(std::min<int64_t>(kPositions, j.n - n0)));
  }
}

template <int W, typename T>
DPA_INLINE void columns_lanes(const Job<T>& j, int64_t lo, int64_t hi) {
  int64_t m = lo;
  for (; m + kRows * W <= hi; m += kRows * W) column_block<W, T, kRows>(j, m);
  for (; m + W <= hi; m += W) column_block<W, T, 1>(j, m);
  for (; m < hi; ++m) column_block<1, T, 1>(j, m);
}

#if defined(__x86_64__)
// bfloat16 rows on AVX-512's bf16 dot product (lanes.h's bf16_dot_product): each vdpbf16ps
// multiplies 32 bf16 weights by 32 bf16 inputs, adds pairs of the exact products and the
// pairs to 16 fp32 sums. The same 4 x 4 block as `block`, half the instructions a weight and
// no conversion of either side. (Helpers carry the target too: an intrinsic is inlined only
// into a function compiled for its instruction set.)
#define DPA_BF16_DOT __attribute__((target("avx512f,avx512bw,avx512bf16")))

// The first `count` (< 32) bfloat16 from p, then zeros.
DPA_BF16_DOT DPA_INLINE __m512bh load_tail(const c10::BFloat16* p, int64_t count) {
  return reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16((__mmask32{1} << count) - 1, p));
}

template <int R>
DPA_BF16_DOT DPA_INLINE void block_pairs(const Job<c10::BFloat16>& j, int64_t m0, int64_t n0, int np) {
  const int64_t K = j.k;
  const c10::BFloat16* w = j.weight + m0 * K;
  const c10::BFloat16* x[kPositions];
  for (int p = 0; p < kPositions; ++p) x[p] = j.pairs + (n0 + std::min(p, np - 1)) * K;
  __m512 acc[R][kPositions];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < kPositions; ++p) acc[r][p] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512bh wv[R], xv[kPositions];
    for (int r = 0; r < R; ++r) wv[r] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + r * K + k));
    for (int p = 0; p < kPositions; ++p) xv[p] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(x[p] + k));
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < kPositions; ++p) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], wv[r], xv[p]);
  }
  if (k < K) {  // the tail: the missing elements load as zeros
    __m512bh wv[R], xv[kPositions];
    for (int r = 0; r < R; ++r) wv[r] = load_tail(w + r * K + k, K - k);
    for (int p = 0; p < kPositions; ++p) xv[p] = load_tail(x[p] + k, K - k);
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < kPositions; ++p) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], wv[r], xv[p]);
  }
  for (int r = 0; r < R; ++r) {
    const float bias = j.bias ? static_cast<float>(j.bias[m0 + r]) : 0.f;
    for (int p = 0; p < np; ++p) {
      alignas(64) float lanes[16];
      _mm512_store_ps(lanes, acc[r][p]);
      float sum = 0.f;
      for (int i = 0; i < 16; ++i) sum += lanes[i];
      j.put(n0 + p, m0 + r, sum + bias);
    }
  }
}

DPA_BF16_DOT void stream_pairs(const Job<c10::BFloat16>& j, int64_t lo, int64_t hi) {
  int64_t m = lo;
  for (; m + kRows <= hi; m += kRows)
    for (int64_t n0 = 0; n0 < j.n; n0 += kPositions) {
      block_pairs<kRows>(j, m, n0, static_cast<int>(std::min<int64_t>(kPositions, j.n - n0)));
    }
  for (; m < hi; ++m)
    for (int64_t n0 = 0; n0 < j.n; n0 += kPositions) {
      block_pairs<1>(j, m, n0, static_cast<int>(std::min<int64_t>(kPositions, j.n - n0)));
    }
}
#endif

// The entry points for each vector width: rows [lo, hi), or k-major columns. AVX2 CPUs take
// the 4-lane one: on the Zen 4 of stream_gemm_cpu.h, 8 lanes (the same 4 x 4 block, or 2 x 4)
// streamed 11-16 GB/s against 26 for 4 lanes (not measured on a CPU without AVX-512).
template <typename T>
void stream_4(const Job<T>& j, int64_t lo, int64_t hi, bool k_major) {
  k_major ? columns_lanes<4>(j, lo, hi) : rows_lanes<4>(j, lo, hi);
}
#if defined(__x86_64__)
template <typename T>
__attribute__((target("avx512f"))) void stream_16(const Job<T>& j, int64_t lo, int64_t hi, bool k_major) {
  k_major ? columns_lanes<16>(j, lo, hi) : rows_lanes<16>(j, lo, hi);
}
#endif

// Each thread a range of whole row blocks (k-major: of whole 4-vector column blocks), in order.
template <typename T>
void run(const Job<T>& j, bool k_major) {
#if defined(__x86_64__)
  const int lanes = widest_lanes() >= 16 ? 16 : 4;
#else
  const int lanes = 4;
#endif
  const int64_t unit = k_major ? kRows * lanes : kRows;
  at::parallel_for(0, (j.m + unit - 1) / unit, 1, [&](int64_t b0, int64_t b1) {
    const int64_t lo = b0 * unit, hi = std::min(b1 * unit, j.m);
#if defined(__x86_64__)
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      if (j.pairs) return stream_pairs(j, lo, hi);
    }
    if (lanes == 16) return stream_16(j, lo, hi, k_major);
#endif
    stream_4(j, lo, hi, k_major);
  });
}

// k-major: the output in fp32 (a transposed conv adds its taps' products before rounding).
template <typename T>
at::Tensor stream(const at::Tensor& cols, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                  bool k_major) {
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  const bool pairs = std::is_same_v<T, c10::BFloat16> && !k_major && bf16_dot_product();
  const at::Tensor x = pairs ? cols : cols.to(at::kFloat);  // exact for bfloat16
  const int64_t m = weight.size(k_major ? 1 : 0);
  at::Tensor out = at::empty({cols.size(0), m}, cols.options().dtype(k_major ? at::kFloat : cols.scalar_type()));
  run(Job<T>{pairs ? nullptr : x.data_ptr<float>(), pairs ? x.data_ptr<T>() : nullptr, weight.data_ptr<T>(),
             b.defined() ? b.data_ptr<T>() : nullptr, out.data_ptr(), m, cols.size(1), cols.size(0), k_major},
      k_major);
  return out;
}

at::Tensor stream_of(const at::Tensor& cols, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                     bool k_major) {
  TORCH_INTERNAL_ASSERT(cols.is_contiguous() && weight.is_contiguous() && cols.dim() == 2 && weight.dim() == 2 &&
                        cols.size(1) == weight.size(k_major ? 0 : 1) && cols.scalar_type() == weight.scalar_type());
  if (cols.scalar_type() == at::kFloat) return stream<float>(cols, weight, bias, k_major);
  TORCH_INTERNAL_ASSERT(cols.scalar_type() == at::kBFloat16, "stream_gemm: float or bfloat16");
  return stream<c10::BFloat16>(cols, weight, bias, k_major);
}

}  // namespace

at::Tensor stream_gemm(const at::Tensor& cols, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  return stream_of(cols, weight, bias, false);
}

at::Tensor stream_gemm_k_major(const at::Tensor& cols, const at::Tensor& weight) {
  return stream_of(cols, weight, std::nullopt, true);
}

}  // namespace cpu
}  // namespace dpa
