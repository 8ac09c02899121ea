// Which route a conv takes, and why: the one place that decides it. Pure functions of the
// conv's sizes, its dtype and weight layout, the kernel configuration and what the device
// offers (RouteDevice): no tensors, no device queries, so that the CUDA ops (cuda/), the
// model (through the `dpa::conv_route` op: which weight layout, which block op) and
// `explain` (through the same op, for shapes nothing has run at) ask the same functions.
//
// The routes of a conv on CUDA:
//   streaming  the weight-streaming kernels, which read every weight once at close to HBM
//              bandwidth (a robot's batch 1); on Hopper as thread-block clusters where the
//              launch plan fits (cuda/launch_plan.cpp), else split-K with a finishing block.
//   GEMM       im2col + one GEMM + an epilogue kernel (takes_gemm_route): cuBLAS's, or in
//              fp32 over few positions the package's narrow GEMM (narrow_splits), or cuBLAS's
//              cut into slices of its reduction (cublas_splits). A half-precision GroupNorm
//              conv's weight may be taps-major (taps_major_pays): the GEMM then multiplies x
//              itself and the epilogue adds up the taps.
//   block op   on the GEMM route, a whole residual block as one op (block_op_pays), its
//              epilogues writing the next GEMM's operand (block_fused).
// On the CPU every conv is timed at its shape's first call (cpu/conv_route_cpu.h).
// The measurements behind each threshold are rows of docs/tried.md.
#pragma once

#include <cstdint>
#include <string>

#include "common/kernel_config.h"

namespace dpa {

// The CUDA kernels' block size, and the largest GroupNorm group the GEMM route's epilogue
// holds in registers (kHeldPerThread elements a thread): past it a group is cut into slices.
constexpr int kThreads = 256;
constexpr int kHeldPerThread = 4;
inline bool group_held(int64_t channels_per_group, int64_t length) {
  return channels_per_group * length <= kHeldPerThread * kThreads;
}

// The narrow GEMM (cuda/narrow_gemm.cu): positions a block holds at most, reduction elements
// per stage of its ring, weight rows a block streams, and over 16 positions the most weight
// elements it takes (there it is bound by its multiply-adds, and loses to cuBLAS on large
// layers).
constexpr int kNarrowMaxPositions = 32;
constexpr int kNarrowChunk = 128;
constexpr int kNarrowRows = 32;
constexpr int64_t kNarrowWideMaxWeights = int64_t{1} << 23;
// Positions a narrow GEMM block holds (16 or 32), and the stages of its ring that `smem_optin`
// bytes of shared memory hold (3 or 4; 0: the kernel is not taken there).
int narrow_block_positions(int64_t positions);
int narrow_stages(int64_t positions, int64_t smem_optin);

// The CPU times each conv's candidate routes at its shape's first call (cpu/conv_route_cpu.h):
// ATen's conv, im2col + one GEMM, and up to this many positions (batch x output length; a
// transposed conv's input length) the weight-streaming GEMM, whose 4 x 4 blocks re-read the
// weights from the caches for every 4 positions and lose past it.
constexpr int64_t kCpuStreamMaxPositions = 32;

// What the routes depend on of a CUDA device.
struct RouteDevice {
  int major = 0;             // compute capability
  int sms = 0;               // the SMs the plans fill: KernelConfig.sm_count where fewer
  int64_t smem_optin = 0;    // shared memory a block may opt into
  bool hopper_code = false;  // the library's kernels were compiled for Hopper (or newer)
};
// A conv as the router sees it.
struct ConvShape {
  int64_t batch, in_channels, out_channels, in_length, out_length, kernel_size;
  bool transposed = false;
  bool half = false;        // fp16 / bf16 (else fp32)
  bool taps_major = false;  // a Conv1d weight stored [C_out][K][C_in] (K > 1)
};

// The GEMM's N: output positions, or a transposed conv's input positions.
int64_t gemm_positions(const ConvShape& s);

// Whether no launch uses Hopper's clusters or programmatic dependent launch: a GPU before
// Hopper, kernels built without Hopper code, or the configuration turning both off. Those
// launches are split-K with a finishing block, which loses to cuBLAS's tensor cores sooner.
bool portable_launches(const KernelConfig& c, const RouteDevice& d);

// Whether a conv takes the GEMM route: from gemm_min_positions; from gemm_min_work_positions
// where its multiply-adds reach gemm_min_work (transposed_gemm_min_work); in half precision
// with portable launches from portable_half_gemm_min_positions; or with a taps-major weight,
// whose caller chose that layout for it. `why` (optional) gets the reason, or why it streams.
bool takes_gemm_route(const ConvShape& s, const KernelConfig& c, const RouteDevice& d, std::string* why = nullptr);

// Whether a GroupNorm conv (stride 1, "same" padding) runs faster with a taps-major weight:
// half precision, K > 1, taps_major_min_in_channels or more inputs, and the GEMM route by
// size, or below it enough work (taps_major_min_work from 8 positions at batch 2+, 16 at
// batch 1; taps_major_min_work_batch_1 from 8 at batch 1). In fp32 cuBLAS's GEMMs over C_in
// are SIMT and were slower. `s.taps_major` is ignored: this decides it.
bool taps_major_pays(const ConvShape& s, const KernelConfig& c, const RouteDevice& d);

// What the rows of a GEMM-route conv's result are. kIm2col: output channels (the weight as
// [C_out, C_in * K] times im2col's columns), in x's dtype. kTapRows: (output channel, tap),
// c * K + k, over every input position, in fp32 (a taps-major Conv1d weight times x itself);
// kTransposed: the same for a transposed conv (its weight read transposed in place). Where
// taps are rows, each output adds up the taps that land on it (col2im), in tap order. Only
// kIm2col is cut into slices or taken by the narrow GEMM.
enum class GemmForm { kIm2col, kTapRows, kTransposed };
GemmForm gemm_form(const ConvShape& s);

// The slices of its reduction an fp32 im2col GEMM [m, red] x [red, positions] is cut into on
// cuBLAS (1: whole): its SIMT SGEMM tiles [m, positions] by 128 x 32, so a batch-1 layer of a
// long horizon is a few tiles each with a long reduction. As many slices as fill the SMs
// twice, or 8 where that is fewer and 8 fill them four times at most; a power of two, none
// shorter than 128, fp32_gemm_max_splits at most, 8 or more or none.
int cublas_splits(int64_t m, int64_t red, int64_t positions, const KernelConfig& c, const RouteDevice& d);

// The slices of its reduction the narrow GEMM cuts an fp32 im2col GEMM into, or 0 where
// cuBLAS runs it: narrow_gemm on, up to 32 positions (over 16: at most kNarrowWideMaxWeights
// weight elements and not `beside_cublas`, a cuBLAS GEMM on another stream, since such a block
// takes all of an SM's registers), reduction and positions multiples of 4, a GPU since Ampere
// whose shared memory holds the ring; one block per SM. The ops also need 16-byte aligned
// operands, which the model's always are.
int narrow_splits(int64_t m, int64_t red, int64_t positions, bool beside_cublas, const KernelConfig& c,
                  const RouteDevice& d);

// Whether a GEMM-route residual block's 1x1 shortcut GEMM runs on a side stream, beside its
// first conv's: side_stream, in fp32 only below side_stream_fp32_max_positions (from there
// fp32's SIMT GEMMs fill the GPU).
bool shortcut_on_side_stream(bool half, int64_t positions, const KernelConfig& c);

// A ConditionalResidualBlock1D: conv (in -> out, K, GroupNorm of `groups`), conv (out -> out,
// K), and a 1x1 shortcut where in != out, over `length` positions of `batch` rows.
struct BlockShape {
  int64_t batch, in_channels, out_channels, length, kernel_size, groups;
  bool half = false;
  ConvShape first() const;
  ConvShape second() const;
  ConvShape shortcut() const;
};

// Whether the model runs the block as one dpa::residual_block: where both convs take the
// GEMM route, by size or with the taps-major weights the model then passes (taps_major_pays).
// Its launches saved pay there; on the streaming route each conv is one launch already.
bool block_op_pays(const BlockShape& b, const KernelConfig& c, const RouteDevice& d);

// Whether dpa::residual_block fuses its two GroupNorm convs (the first epilogue writes the
// second GEMM's operand), their weights' layouts as given: both convs on the GEMM route, and
// the first's GroupNorm group (of `groups`) held in registers, or a taps-major second weight
// at batch 2+ (at batch 1 the taps-major GEMMs read [C][L] in place, and fusing was slower).
// Else it runs its convs one by one.
bool block_fused(const ConvShape& first, const ConvShape& second, int64_t groups, const KernelConfig& c,
                 const RouteDevice& d);

// Which conv of a residual block a route question is about.
enum class BlockRole { kNone, kFirst, kSecond, kShortcut };

// A conv's route in words, and why: what `explain` prints for one conv of a forward, given the
// weight layout the model gives it (taps_major_pays, block_op_pays). `s` describes a
// contiguous weight; `groups`: its GroupNorm's (0: a plain conv); `block` (role kNone: the
// conv stands alone) is its residual block; `cuda` false: the CPU's route; `bf16`: s.half is
// bf16, not fp16 (the CPU's streaming GEMM has bf16 only).
struct RouteAnswer {
  std::string route, why;
  int narrow_splits = 0;  // the GEMM route's narrow GEMM's slices (0: not taken)
  int cublas_splits = 1;  // cuBLAS's GEMM's slices where the narrow GEMM is not taken
};
RouteAnswer describe_route(const ConvShape& s, int64_t groups, BlockRole role, const BlockShape& block, bool cuda,
                           const KernelConfig& c, const RouteDevice& d, bool bf16);

}  // namespace dpa
