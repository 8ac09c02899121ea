// The CPU conv ops' epilogue: GroupNorm -> Mish -> FiLM -> residual over one (batch row,
// group) of a conv's fp32 result, in one pass after the statistics.
//
// Written once with the compiler's vector extensions over W floats and a branch-free exp
// (no libm calls, which do not vectorise), then compiled for the widest vectors the CPU has,
// chosen at run time: AVX-512 (16), AVX2 (8), or the 4 of SSE2 / NEON that every x86-64 and
// aarch64 CPU has. With scalar std::exp / log1p / tanh this pass cost more than ATen's
// vectorised GroupNorm, Mish and elementwise kernels one after the other, and at 4 lanes
// it still lost to ATen's AVX-512 Mish at batch 64.
#pragma once

#include <cstdint>

namespace dpa {
namespace cpu {

// One group's epilogue: for channel c and position l,
//   out[c][l] = mish((y[c][l] - mean) * rstd * gamma[c] + beta[c]) * scale[c] + shift[c]
//               + residual[c][l]
// with rows `length` apart; scale, shift and residual may be null (1, 0, 0).
struct GroupEpilogue {
  const float* y;
  int64_t channels, length;
  float mean, rstd;
  const float *gamma, *beta, *scale, *shift, *residual;
  float* out;
  float* scratch;  // scratch_floats(channels) floats
};

int64_t scratch_floats(int64_t channels);

// The sum of y[0..n) and, with `mean`, of (y - mean)^2, accumulated in float lanes over
// blocks of 1024 elements, each block's total added in double: long groups lose no precision.
double group_sum(const float* y, int64_t n, const float* mean = nullptr);

void apply_group(const GroupEpilogue& g);

}  // namespace cpu
}  // namespace dpa
