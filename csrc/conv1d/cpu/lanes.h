// Vectors of W floats for the CPU kernels (epilogue_cpu.cpp, stream_gemm_cpu.cpp), written
// once with the compiler's vector extensions and compiled for each width in per-ISA entry
// points (functions with __attribute__((target(...))) that inline these helpers), one of
// which is chosen at run time: the widest the CPU has.
#pragma once

#include <cstdint>
#include <cstring>

#if !defined(__GNUC__)
#error "the CPU kernels need GCC or Clang vector extensions"
#endif

// The vector types are passed only between functions inlined into one entry point: the ABI
// they would have across a call does not matter (for every file that includes this one).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

namespace dpa {
namespace cpu {

template <int W>
struct Lanes {
  typedef float F __attribute__((vector_size(W * sizeof(float))));
  typedef int32_t I __attribute__((vector_size(W * sizeof(int32_t))));
  typedef uint32_t U __attribute__((vector_size(W * sizeof(uint32_t))));
  typedef uint16_t H __attribute__((vector_size(W * sizeof(uint16_t))));  // bfloat16 bits
};

#define DPA_INLINE inline __attribute__((always_inline))

template <int W>
DPA_INLINE typename Lanes<W>::F splat(float v) {
  return typename Lanes<W>::F{} + v;
}

template <int W>
DPA_INLINE typename Lanes<W>::F load(const float* p) {
  typename Lanes<W>::F v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <int W>
DPA_INLINE void store(float* p, typename Lanes<W>::F v) {
  std::memcpy(p, &v, sizeof(v));
}

// The widest vectors the CPU runs: 16 (AVX-512), 8 (AVX2) or the 4 of SSE2 / NEON that every
// x86-64 and aarch64 CPU has; or fewer where DPA_CPU_VECTOR_LANES asks for them (4 or 8: what
// other CPUs take, for tests on this one). Read once.
int widest_lanes();

// Whether bfloat16 GEMMs multiply pairs of bfloat16 into fp32 sums (AVX-512's vdpbf16ps: Zen 4,
// Sapphire Rapids, Cooper Lake), where the CPU has it and DPA_CPU_VECTOR_LANES does not ask
// for 16 lanes or fewer (16: AVX-512 without it, what other AVX-512 CPUs take). Read once.
bool bf16_dot_product();

}  // namespace cpu
}  // namespace dpa
