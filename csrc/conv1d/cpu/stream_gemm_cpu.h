// The CPU conv route for few positions (conv_route_cpu.h's "stream"): a GEMM that reads every
// weight once, straight from memory, at batch x length positions small enough that the weights'
// bytes, not the multiply-adds, set its time.
//
// At a batch-1 layer of a horizon-16 U-Net (4-16 positions) MKL's GEMM reads its operands at
// a fraction of the memory bandwidth, whichever side the weights are on: on a 2-core AMD EPYC
// (Zen 4, torch 2.11), 1024 x 5120 weights times 4 positions took 1.9-3.3 ms (6-11 GB/s of
// weights) against 0.68 ms here (31 GB/s, what a sum over the same bytes reads). Each block
// of 4 weight rows is multiplied with 4 positions' columns at a time, 16 vector accumulators
// (lanes.h) over the reduction, each weight loaded once per 4 positions: past 4 positions the
// weights are re-read from the caches, not memory. In bfloat16, on CPUs with AVX-512's bf16
// dot product, both sides stay bfloat16 and each instruction multiplies 32 pairs.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace dpa {
namespace cpu {

// out[n][m] = bias[m] + sum over k of cols[n][k] * weight[m][k], with fp32 sums, in cols'
// dtype (float or bfloat16, as weight's and bias'): cols [N, K] and weight [M, K] contiguous.
at::Tensor stream_gemm(const at::Tensor& cols, const at::Tensor& weight, const std::optional<at::Tensor>& bias);

// The same with the weight stored k-major, weight [K, M] (a transposed conv's [C_in, C_out * K]
// as it is), no bias, and the output in fp32: out[n][m] = sum over k of cols[n][k] *
// weight[k][m], blocks of 4 vectors of output columns times 4 positions, each weight row read
// in runs of 4 vectors.
at::Tensor stream_gemm_k_major(const at::Tensor& cols, const at::Tensor& weight);

}  // namespace cpu
}  // namespace dpa
