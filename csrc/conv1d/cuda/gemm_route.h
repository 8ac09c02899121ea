// The im2col + cuBLAS route of the conv ops (host side): a conv as one cuBLAS GEMM over
// every position, then an epilogue kernel (gemm_epilogue.cuh). Which convs take it, how the
// GEMM is cut and where a shortcut's runs: conv1d/conv_route.h, asked about the current
// device here.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "conv1d/conv1d.h"
#include "conv1d/cuda/conv_params.h"

namespace dpa {

// Whether a Conv1d weight [C_out, C_in, K] (K > 1) is stored taps-major, [C_out][K][C_in] in
// memory (ops.taps_major): then its rows c * K + k are a GEMM operand as it is, and the GEMM
// route multiplies them with x itself (GemmForm::kTapRows) instead of with im2col's K times
// larger columns. That GEMM, [C_out * K, C_in] x [C_in, B * L], has K times the output tiles
// and a K times shorter reduction, a shape cuBLAS runs faster (conv_route.h's taps_major_pays says where). Such a
// weight takes the GEMM route at any batch x length: its caller chose that layout for it, and
// the streaming kernels would read a contiguous copy made on every call.
bool taps_major(const at::Tensor& weight);

// The current device as the router sees it: its capability, the SM budget (sm_budget), the
// shared memory a block may opt into, and whether the kernels carry Hopper code.
RouteDevice route_device();

// The router's view of a conv op's problem with this weight.
ConvShape conv_shape(const ConvProblem& p, const at::Tensor& weight);

// Whether the conv takes the GEMM route on the current device (conv_route.h).
bool takes_gemm_route(const ConvProblem& p, const at::Tensor& weight);

// The form of a conv's GEMM on the GEMM route (gemm_route) or, if not, the streaming route's
// view of its weight (the same but for kTapRows, which the streaming kernels do not read).
GemmForm gemm_form(const ConvProblem& p, const at::Tensor& weight, bool gemm_route);

// StreamArgs' GEMM view [m, red] x [red, positions] of the form.
void set_gemm_view(StreamArgs& a, const ConvProblem& p, GemmForm form);

// The GEMM's B operand [red, positions]: im2col's columns, or, where taps are rows, x itself
// copied to [C_in, B * L_in]. narrow_next: the narrow GEMM reads them (takes_narrow_gemm),
// which under PDL im2col then lets launch at once (gemm_epilogue.cuh).
at::Tensor im2col(const StreamArgs& a, const at::Tensor& x, GemmForm form, bool narrow_next = false);

// Where taps are rows and x holds that operand already, a view of it (else undefined): x
// stored channels-last ([B][L][C_in], a previous block's channels_last output), or a batch of
// one, whose [C_in][L] is the operand row-major. The copy it saves was ~2.1 µs a conv, 26
// convs a step, at LeRobot's horizon 64, batch 1, in half precision (H100).
at::Tensor tap_rows_view(const StreamArgs& a, const at::Tensor& x, GemmForm form);

// The GEMM's B operand: tap_rows_view where it has one, else im2col.
at::Tensor gemm_columns(const StreamArgs& a, const at::Tensor& x, GemmForm form, bool narrow_next = false);

// How many slices of its reduction an fp32 conv's im2col GEMM is cut into on cuBLAS (1:
// none; conv_route.h's cublas_splits). The GEMM is then one strided-batched call, and the
// epilogue adds the partial sums as it reads them.
int gemm_splits(const StreamArgs& a, const at::Tensor& cols, GemmForm form);

// The slices of its reduction that narrow_gemm.cu cuts an fp32 conv's im2col GEMM into, or 0
// where cuBLAS runs it: conv_route.h's narrow_splits, for 16-byte aligned operands.
// `beside_cublas`: it runs concurrently with a cuBLAS GEMM on another stream (SideBranch).
int narrow_gemm_splits(const StreamArgs& a, const at::Tensor& rows, const at::Tensor& cols, GemmForm form,
                       bool beside_cublas);
// Whether gemm() runs this conv's GEMM on narrow_gemm.cu's kernel, given im2col's columns.
bool takes_narrow_gemm(const StreamArgs& a, const at::Tensor& weight, GemmForm form, bool beside_cublas);

// The conv's GEMM over every position: narrow_gemm.cu's where narrow_gemm_splits takes it,
// else one cuBLAS GEMM (tensor cores for fp16 / bf16; fp32 follows
// torch.backends.cuda.matmul.allow_tf32, off by default): the [m, positions] result without
// the bias, which the epilogue adds, or [splits, m, positions] partial sums.
// The weight is read in place (a transposed conv's [C_in, C_out * K] as the transposed
// operand). `beside_cublas`: it runs concurrently with a cuBLAS GEMM on another stream
// (narrow_gemm_splits).
at::Tensor gemm(const StreamArgs& a, const at::Tensor& weight, const at::Tensor& cols, GemmForm form,
                bool beside_cublas = false);
at::Tensor conv_as_gemm(const StreamArgs& a, const at::Tensor& x, const at::Tensor& weight, GemmForm form);

// x as the columns of a 1x1 conv's GEMM, [C_in, positions], within a conv's columns: all of
// them where the conv's taps are rows, else the centre tap's rows (tap k = pad reads
// x[b, c, l]), so that one im2col serves a residual block's first conv and its shortcut.
at::Tensor centre_columns(const StreamArgs& a, const at::Tensor& cols, GemmForm form);

// Whether conv_epilogue_kernel's 32-bit indices cover the problem (every form's GEMM view
// counted); past that the op falls back to ATen's convolution.
bool conv_epilogue_fits(const ConvProblem& p);

// The epilogues over `pre`, gemm()'s result of the form, for dtype `dtype`.
void launch_group_norm_epilogue(const StreamArgs& a, at::ScalarType dtype, const at::Tensor& pre, GemmForm form,
                                const GemmEpilogueIo& io = {});
void launch_conv_epilogue(const StreamArgs& a, at::ScalarType dtype, const at::Tensor& pre, GemmForm form);

// A GEMM-route op's work that does not depend on its main path (a shortcut's GEMM) runs on
// a side stream: at these sizes each GEMM fills a fraction of the GPU, so the two overlap.
// The side stream starts after what the caller's stream has queued, and the caller's stream
// waits for it at join(), so callers and CUDA graph capture (the side stream joins the
// capture through the first event) see one stream's order. Tensors the side stream reads are
// the caller's stream's, alive until join(). Constructed with fork false, the work runs on
// the caller's stream.
class SideBranch {
 public:
  explicit SideBranch(bool fork)
      : main_(at::cuda::getCurrentCUDAStream()), side_(fork ? side_stream(main_) : main_) {
    if (side_ == main_) return;
    forked_.record(main_);
    forked_.block(side_);
  }
  SideBranch(const SideBranch&) = delete;
  SideBranch& operator=(const SideBranch&) = delete;
  // An exception between fork and join must still leave the side stream inside the caller's
  // order; an error from the join itself is dropped there, the first exception is the one
  // that reaches the caller.
  ~SideBranch() {
    if (side_ == main_ || joined_.isCreated()) return;
    try {
      join();
    } catch (...) {
    }
  }

  // Whether work runs on a stream of its own, beside the caller's.
  bool forked() const { return side_ != main_; }

  template <typename F>
  void run(F&& work) {
    const c10::cuda::CUDAStreamGuard guard(side_);
    work();
  }

  void join() {
    if (side_ == main_) return;
    joined_.record(side_);
    joined_.block(main_);
  }

 private:
  // One side stream per caller's stream, not per device: two captures under way at once on
  // two streams (two threads, each with its own model copy) that shared one would merge, an
  // error. A side stream is kept for the process's life, as PyTorch's pool streams are, and
  // reused each time, so that cuBLAS keeps one workspace for it; callers use a handful of
  // streams (torch.cuda.Stream() hands out one of 32 per device).
  static at::cuda::CUDAStream side_stream(const at::cuda::CUDAStream& main);

  at::cuda::CUDAStream main_, side_;
  at::cuda::CUDAEvent forked_, joined_;
};


// Whether a GEMM-route op's 1x1 shortcut GEMM over `positions` columns runs on a side stream
// (SideBranch; conv_route.h).
bool shortcut_on_side_stream(at::ScalarType dtype, int64_t positions);

}  // namespace dpa
