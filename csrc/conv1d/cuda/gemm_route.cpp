// The im2col + cuBLAS route's host side: the GEMM's operands and its one cuBLAS call, the
// epilogue launches (gemm_epilogue.cuh), and the side stream a shortcut's GEMM may take.
#include "conv1d/cuda/gemm_route.h"

#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/Exceptions.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <limits>
#include <map>
#include <mutex>

#include "common/checks.h"
#include "common/kernel_config.h"
#include "common/launch.h"
#include "conv1d/cuda/launch_plan.h"

namespace dpa {

namespace {

// The GEMM's result as the epilogue kernels read it: gemm() returns [splits, m, positions]
// where it split the reduction, else [m, positions].
GemmResult gemm_result(const at::Tensor& pre) {
  if (pre.dim() == 3) return GemmResult{pre.data_ptr(), static_cast<int>(pre.size(0)), pre.stride(0)};
  return GemmResult{pre.data_ptr(), 1, 0};
}

}  // namespace

bool taps_major(const at::Tensor& weight) {
  const int64_t cin = weight.size(1), taps = weight.size(2);
  return taps > 1 && weight.stride(0) == cin * taps && weight.stride(1) == 1 && weight.stride(2) == cin;
}

RouteDevice route_device() {
  const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
  return RouteDevice{props->major, sm_budget(), static_cast<int64_t>(props->sharedMemPerBlockOptin), hopper_code()};
}

ConvShape conv_shape(const ConvProblem& p, const at::Tensor& weight) {
  return ConvShape{p.batch,       p.in_channels, p.out_channels,          p.in_length,
                   p.out_length,  p.kernel_size, p.transposed, weight.scalar_type() != at::kFloat,
                   !p.transposed && taps_major(weight)};
}

bool takes_gemm_route(const ConvProblem& p, const at::Tensor& weight) {
  return takes_gemm_route(conv_shape(p, weight), kernel_config(), route_device());
}

GemmForm gemm_form(const ConvProblem& p, const at::Tensor& weight, bool gemm_route) {
  if (p.transposed) return GemmForm::kTransposed;
  return gemm_route && taps_major(weight) ? GemmForm::kTapRows : GemmForm::kIm2col;
}

void set_gemm_view(StreamArgs& a, const ConvProblem& p, GemmForm form) {
  const bool tap_rows = form != GemmForm::kIm2col;
  a.m = static_cast<int>(p.out_channels * (tap_rows ? p.kernel_size : 1));
  a.red = static_cast<int>(p.in_channels * (tap_rows ? 1 : p.kernel_size));
  a.positions = static_cast<int>(p.batch * (tap_rows ? p.in_length : p.out_length));
}

at::Tensor tap_rows_view(const StreamArgs& a, const at::Tensor& x, GemmForm form) {
  if (form != GemmForm::kTapRows || a.x2) return at::Tensor();
  if (x.size(0) == 1 && (x.stride(2) == 1 || x.stride(1) == 1)) return x.select(0, 0);
  if (x.transpose(1, 2).is_contiguous()) return x.transpose(1, 2).reshape({a.positions, a.red}).t();
  return at::Tensor();
}

at::Tensor gemm_columns(const StreamArgs& a, const at::Tensor& x, GemmForm form, bool narrow_next) {
  const at::Tensor view = tap_rows_view(a, x, form);
  return view.defined() ? view : im2col(a, x, form, narrow_next);
}

at::Tensor im2col(const StreamArgs& a, const at::Tensor& x, GemmForm form, bool narrow_next) {
  const Im2col cut = form == GemmForm::kIm2col ? Im2col{a.ksize, a.lout, a.stride, a.pad} : Im2col{1, a.lin, 1, 0};
  at::Tensor cols = at::empty({a.red, a.positions}, x.options());
  DPA_DISPATCH_FLOAT_TYPES(x.scalar_type(), "dpa im2col", [&] {
    launch_im2col<scalar_t>(a, cut, a.red, cols.data_ptr<scalar_t>(), narrow_next);
  });
  return cols;
}

int gemm_splits(const StreamArgs& a, const at::Tensor& cols, GemmForm form) {
  if (form != GemmForm::kIm2col || cols.scalar_type() != at::kFloat) return 1;
  return cublas_splits(a.m, a.red, a.positions, kernel_config(), route_device());
}

namespace {

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// narrow_gemm_splits for the weight's layout (im2col's columns always meet the rest): the
// router's rule, and 16-byte aligned rows.
int narrow_splits(const StreamArgs& a, const at::Tensor& rows, GemmForm form, bool beside_cublas) {
  if (form != GemmForm::kIm2col || rows.scalar_type() != at::kFloat || rows.stride(0) != a.red ||
      rows.stride(1) != 1 || !aligned16(rows)) {
    return 0;
  }
  return dpa::narrow_splits(a.m, a.red, a.positions, beside_cublas, kernel_config(), route_device());
}

}  // namespace

int narrow_gemm_splits(const StreamArgs& a, const at::Tensor& rows, const at::Tensor& cols, GemmForm form,
                       bool beside_cublas) {
  if (cols.scalar_type() != at::kFloat || cols.stride(1) != 1 || cols.stride(0) % 4 != 0 || !aligned16(cols)) {
    return 0;
  }
  return narrow_splits(a, rows, form, beside_cublas);
}

namespace {

// The GEMM's left operand [m, red], the weight read in place.
at::Tensor gemm_rows(const StreamArgs& a, const at::Tensor& weight, GemmForm form) {
  switch (form) {
    case GemmForm::kIm2col: return weight.reshape({a.m, a.red});
    case GemmForm::kTapRows: return weight.as_strided({a.m, a.red}, {a.red, 1});
    case GemmForm::kTransposed: return weight.reshape({a.red, a.m}).t();
  }
  TORCH_INTERNAL_ASSERT(false, "unknown GemmForm");
}

// rows [m, k] x cols [k, n], both in half precision, summed into an fp32 result: the one
// cuBLAS call (cublasGemmEx, fp32 compute, on torch's handle, stream and workspace) that
// at::mm(rows, cols, at::kFloat) makes from torch 2.8 on. Made here so that torch 2.4-2.7,
// which lack that overload, build the same op.
at::Tensor mm_float_out(at::Tensor rows, at::Tensor cols) {
  // An operand [r, c] is read in place as cuBLAS's column-major c x r ("N", leading dimension
  // stride(0)) or as the transpose of its r x c ("T", stride(1)) where the strides allow it
  // (a size-1 dimension's stride can be anything); else it is copied.
  const auto as_n = [](at::Tensor& t) {
    const bool n = t.stride(1) == 1 && t.stride(0) >= std::max<int64_t>(t.size(1), 1);
    const bool tr = t.stride(0) == 1 && t.stride(1) >= std::max<int64_t>(t.size(0), 1);
    if (!n && !tr) t = t.contiguous();
    return n || !tr;
  };
  const bool rows_n = as_n(rows), cols_n = as_n(cols);
  const int64_t m = rows.size(0), k = rows.size(1), n = cols.size(1);
  const int64_t lda = cols.stride(cols_n ? 0 : 1), ldb = rows.stride(rows_n ? 0 : 1);
  TORCH_CHECK(std::max({m, k, n, lda, ldb}) <= std::numeric_limits<int>::max(), "conv1d on the GEMM route: a GEMM of ",
              m, " x ", k, " x ", n, " is past cuBLAS's 32-bit sizes");
  at::Tensor out = at::empty({m, n}, cols.options().dtype(at::kFloat));
  const float alpha = 1.f, beta = 0.f;
  const cudaDataType_t type = rows.scalar_type() == at::kBFloat16 ? CUDA_R_16BF : CUDA_R_16F;
  // Column-major, out^T [n, m] = cols^T [n, k] x rows^T [k, m].
  TORCH_CUDABLAS_CHECK(cublasGemmEx(at::cuda::getCurrentCUDABlasHandle(), cols_n ? CUBLAS_OP_N : CUBLAS_OP_T,
                                    rows_n ? CUBLAS_OP_N : CUBLAS_OP_T, static_cast<int>(n), static_cast<int>(m),
                                    static_cast<int>(k), &alpha, cols.data_ptr(), type, static_cast<int>(lda),
                                    rows.data_ptr(), type, static_cast<int>(ldb), &beta, out.data_ptr(), CUDA_R_32F,
                                    static_cast<int>(n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT_TENSOR_OP));
  return out;
}

}  // namespace

bool takes_narrow_gemm(const StreamArgs& a, const at::Tensor& weight, GemmForm form, bool beside_cublas) {
  return narrow_splits(a, gemm_rows(a, weight, form), form, beside_cublas) > 0;
}

// Where taps are rows the result is fp32: an output adds up K of its elements, and each
// one's rounding to half precision would add an error of its own.
at::Tensor gemm(const StreamArgs& a, const at::Tensor& weight, const at::Tensor& cols, GemmForm form,
                bool beside_cublas) {
  const at::Tensor rows = gemm_rows(a, weight, form);
  if (const int splits = narrow_gemm_splits(a, rows, cols, form, beside_cublas); splits > 0) {
    at::Tensor out = at::empty({splits, a.m, a.positions}, cols.options());
    const NarrowGemm g{rows.data_ptr<float>(), cols.data_ptr<float>(), cols.stride(0), out.data_ptr<float>(),
                       a.m, a.red, a.positions, splits, ceil_div(ceil_div(a.red, kNarrowChunk), splits),
                       kernel_config().weights_evict_first};
    launch_narrow_gemm(g, narrow_stages(a.positions, route_device().smem_optin));
    return splits > 1 ? out : out.select(0, 0);
  }
  if (const int splits = gemm_splits(a, cols, form); splits > 1) {
    // [splits, m, red / splits] x [splits, red / splits, positions], both read in place.
    const int64_t depth = a.red / splits;
    return at::bmm(rows.unflatten(1, {splits, depth}).transpose(0, 1), cols.unflatten(0, {splits, depth}));
  }
  if (form == GemmForm::kIm2col || cols.scalar_type() == at::kFloat) return at::mm(rows, cols).contiguous();
  return mm_float_out(rows, cols);
}

at::Tensor conv_as_gemm(const StreamArgs& a, const at::Tensor& x, const at::Tensor& weight, GemmForm form) {
  return gemm(a, weight, gemm_columns(a, x, form, takes_narrow_gemm(a, weight, form, false)), form);
}

at::Tensor centre_columns(const StreamArgs& a, const at::Tensor& cols, GemmForm form) {
  if (form == GemmForm::kTapRows) return cols;
  return cols.as_strided({a.red / a.ksize, a.positions}, {a.ksize * a.positions, 1}, a.pad * a.positions);
}

bool conv_epilogue_fits(const ConvProblem& p) {
  const int64_t gemm_elements = p.out_channels * p.kernel_size * p.batch * std::max(p.in_length, p.out_length);
  return std::max({p.batch * p.out_channels * p.out_length, gemm_elements,
                   p.batch * p.in_channels * p.in_length}) <= std::numeric_limits<int>::max();
}

// How many slices each group's epilogue is cut into (GroupSlices): one where a block holds
// the group (group_held), which GemmEpilogueIo's columns of several taps need; else at least
// enough that each slice is held, and more where batch x groups blocks would leave SMs idle,
// until the blocks fill the SMs or each thread has one element; and at most a cluster's
// blocks where that leaves each slice held, on any GPU: the same slices, and bits, whichever
// kernel runs them. One block reading a whole large group pass after pass took ~26 µs a launch on
// LeRobot's U-Net at horizon 64, batch 1, bf16 (8 blocks of 4096 elements, every GroupNorm
// conv of that U-Net); sliced, its DDPM-100 action went from 109.2 to 60.2 ms in bf16 and
// from 151.2 to 137.2 ms in fp32 (H100, torch 2.11).
int group_slices(const StreamArgs& a) {
  const int64_t count = static_cast<int64_t>(a.cout / a.groups) * a.lout;
  if (group_held(a.cout / a.groups, a.lout)) return 1;
  const int64_t units = static_cast<int64_t>(a.batch) * a.groups;
  const int sms = sm_budget();
  const int64_t fewest = ceil_div(count, kHeldPerThread * kThreads), most = ceil_div(count, kThreads);
  return static_cast<int>(std::clamp<int64_t>(ceil_div(sms, units), fewest,
                                                std::max<int64_t>(fewest, std::min<int64_t>(most, kMaxClusterBlocks))));
}

void launch_group_norm_epilogue(const StreamArgs& a, at::ScalarType dtype, const at::Tensor& pre, GemmForm form,
                                const GemmEpilogueIo& io) {
  const int64_t count = static_cast<int64_t>(a.cout / a.groups) * a.lout;
  const int64_t units = static_cast<int64_t>(a.batch) * a.groups;
  GroupSlices slices{nullptr, nullptr, 1, static_cast<int>(count), false, false};
  at::Tensor pre_sums, moments;
  if (const int wanted = group_slices(a); wanted > 1) {
    TORCH_INTERNAL_ASSERT(!io.cols || io.taps == 1, "columns of several taps need a group held in registers");
    slices.slice_len = static_cast<int>(ceil_div(count, wanted));
    slices.slices = static_cast<int>(ceil_div(count, slices.slice_len));  // none empty
    // Clusters only where they are all resident at once, as the cooperative launch's blocks
    // are: LeRobot's U-Net at horizon 128, batch 8 (64 clusters of 8) took 4% longer in bf16.
    if (kernel_config().clusters && hopper_launches() && slices.slices <= kMaxClusterBlocks) {
      DPA_DISPATCH_FLOAT_TYPES(dtype, "conv1d_gn_mish", [&] {
        slices.cluster = group_slices_cluster_fit<scalar_t>(a, form, slices.slices, static_cast<int>(units));
      });
    }
    if (!slices.cluster) {
      moments = at::empty({units * slices.slices, 2}, pre.options().dtype(at::kFloat));
      slices.moments = reinterpret_cast<float2*>(moments.data_ptr<float>());
      // One launch needs a counter per (batch row, group): the op's counters hold out_channels.
      slices.cooperative = kernel_config().cooperative_group_norm && a.counters != nullptr && units <= a.cout;
      if (slices.cooperative) {
        DPA_DISPATCH_FLOAT_TYPES(dtype, "conv1d_gn_mish", [&] {
          slices.cooperative = group_slices_fit<scalar_t>(a, form, static_cast<int>(units * slices.slices));
        });
      }
      // The two launches' buffer, also where one was planned: the driver may refuse it.
      pre_sums = at::empty({units * count}, pre.options().dtype(at::kFloat));
      slices.pre = pre_sums.data_ptr<float>();
    }
  }
  // A group the one-block kernel does not hold would be left partly unwritten.
  TORCH_INTERNAL_ASSERT(slices.slices > 1 || group_held(a.cout / a.groups, a.lout),
                        "a GroupNorm group of ", count, " elements needs slices");
  DPA_DISPATCH_FLOAT_TYPES(dtype, "conv1d_gn_mish", [&] {
    launch_group_norm_epilogue<scalar_t>(a, gemm_result(pre), form, io, slices);
  });
}

void launch_conv_epilogue(const StreamArgs& a, at::ScalarType dtype, const at::Tensor& pre, GemmForm form) {
  DPA_DISPATCH_FLOAT_TYPES(dtype, "conv1d", [&] { launch_conv_epilogue<scalar_t>(a, gemm_result(pre), form); });
}

at::cuda::CUDAStream SideBranch::side_stream(const at::cuda::CUDAStream& main) {
  static std::mutex mutex;
  static std::map<std::pair<c10::DeviceIndex, c10::StreamId>, at::cuda::CUDAStream> streams;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(main.device_index(), main.id());
  auto it = streams.find(key);
  if (it == streams.end()) {
    const c10::cuda::CUDAGuard guard(main.device_index());
    cudaStream_t created = nullptr;
    C10_CUDA_CHECK(cudaStreamCreateWithFlags(&created, cudaStreamNonBlocking));
    it = streams.emplace(key, c10::cuda::getStreamFromExternal(created, main.device_index())).first;
  }
  return it->second;
}

bool shortcut_on_side_stream(at::ScalarType dtype, int64_t positions) {
  return shortcut_on_side_stream(dtype != at::kFloat, positions, kernel_config());
}

}  // namespace dpa
