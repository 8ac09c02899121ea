// The CPU conv ops' convolution: ATen's (oneDNN), im2col + one GEMM, or, over few positions,
// im2col + the package's weight-streaming GEMM (stream_gemm_cpu.h); a transposed conv ATen's
// or the streaming GEMM's.
//
// oneDNN's direct conv is far from the weights' bandwidth at the U-Nets' few positions, and
// its speed varies by shape without a pattern a rule could follow: on a 2-core AMD EPYC (Zen
// 4, torch 2.11) the GEMM (cols [B * L_out, C_in * K] times the weight [C_in * K, C_out], MKL
// or oneDNN's matmul) took 1.6-2.8x less time than ATen's conv at batch 1 from 512 input
// channels in fp32, and 1.0-9.7x less in bf16 (2048->2048 over 4 positions: 20.9 against
// 2.2 ms), but 1.2-2.2x more on the first layers at 16 positions and on most layers at batch
// 64. Other CPUs (AVX2, AMX, Arm) choose differently again. So with KernelConfig.cpu_conv
// "auto" the first call of each (shape, dtype, threads) times the routes on its own inputs and
// keeps the fastest for the process, as cuDNN's benchmark mode does; "aten", "gemm" and
// "stream" fix the route (they round differently, by ~1e-6 in fp32).
//
// A half-precision conv is also timed on fp32 copies of its operands: on CPUs without
// half-precision arithmetic (AVX2's, AVX-512's before its bf16 and fp16 extensions) ATen's
// half-precision GEMMs and convs run at a fraction of fp32's speed, and converting the
// operands costs less than that loses. On a 2-core AVX2 AMD EPYC (torch 2.11), ATen's bf16
// GEMM [256, 1280] x [1280, 1024] took 35-780 ms (by the layout of its operands) against 6.3 ms
// in fp32. "fp32" fixes that: ATen's conv of fp32 copies.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace dpa {
namespace cpu {

// x [B, C_in, L] conv weight [C_out, C_in, K] (+ bias) with stride and symmetric zero padding:
// [B, C_out, L_out], in x's dtype, or in fp32 where a half-precision conv ran on fp32 copies;
// not necessarily contiguous.
at::Tensor conv1d(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                  int64_t stride, int64_t padding);

// x [B, C_in, L_in] transposed-conv weight [C_in, C_out, K] (+ bias): [B, C_out, L_out], ATen's
// or the k-major streaming GEMM's, chosen alike (cpu_conv "gemm" is ATen's here), in x's
// dtype or fp32 as above.
at::Tensor conv_transpose1d(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                            int64_t stride, int64_t padding);

}  // namespace cpu
}  // namespace dpa
