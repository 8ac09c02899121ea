// One DDPM / DDIM denoising update, written once for the CPU and CUDA implementations.
//
// "Bit for bit the math of diffusers" means reproducing what PyTorch does when diffusers
// evaluates `(sample - beta_prod_t ** 0.5 * model_output) / alpha_prod_t ** 0.5` and so on:
// every elementwise op is computed in fp32 and rounded to the tensor dtype before the next
// one, products are rounded before sums (no FMA contraction), and on CUDA a division by a
// scalar is a multiplication by its fp32 reciprocal. The per-step scalars themselves are
// computed in Python with the same torch ops as diffusers (schedulers.py) and arrive as
// one row of a float32 table, so a CUDA graph can bake a different row index per step.
#pragma once

#include <ATen/ATen.h>
#include <c10/macros/Macros.h>

#include <cmath>
#include <optional>

namespace dpa {

enum SchedulerKind : int { kDDPM = 0, kDDIM = 1 };
enum PredictionType : int { kEpsilon = 0, kSample = 1, kVPrediction = 2 };
// Columns of a table row; diffusion_policy_accelerated/ops.py TABLE_COLUMNS names them.
enum StepColumn : int {
  kSqrtBetaProd,
  kSqrtAlphaProd,
  kInvSqrtBetaProd,
  kInvSqrtAlphaProd,
  kX0Coeff,      // DDPM: pred_original_sample_coeff; DDIM: alpha_prod_t_prev ** 0.5
  kSecondCoeff,  // DDPM: current_sample_coeff (times sample); DDIM: direction coeff (times eps)
  kNoiseScale,   // DDPM: sigma_t for the variance type; DDIM: std_dev_t = eta * sigma_t
  kAddNoise,     // 1 where diffusers adds noise at this step, else 0
  kNumStepColumns
};

struct DenoiseConfig {
  int scheduler;
  int prediction;
  bool clip;
  float clip_range;
  bool use_clipped_model_output;
  bool has_noise;
};

// `scale(coeff, v)` is diffusers' `coeff * tensor`, `div(v, b, 1/b)` its `tensor / coeff`.
template <typename scalar_t>
struct RoundedArith {
  static C10_HOST_DEVICE float round(float v) { return static_cast<float>(static_cast<scalar_t>(v)); }
#ifdef __CUDA_ARCH__
  static __device__ float scale(float coeff, float v) { return round(__fmul_rn(coeff, v)); }
  static __device__ float add(float a, float b) { return round(__fadd_rn(a, b)); }
  static __device__ float sub(float a, float b) { return round(__fsub_rn(a, b)); }
  static __device__ float div(float a, float, float inv_b) { return scale(inv_b, a); }
#else
  // PyTorch's CPU kernels round a leading 0-dim scalar to the tensor's dtype before
  // multiplying, but divide by a trailing one in fp32. The CPU build uses
  // -ffp-contract=off, so each line is one IEEE operation.
  static float scale(float coeff, float v) { return round(round(coeff) * v); }
  static float add(float a, float b) { return round(a + b); }
  static float sub(float a, float b) { return round(a - b); }
  static float div(float a, float b, float) { return round(a / b); }
#endif
};

template <typename scalar_t>
C10_HOST_DEVICE scalar_t denoise_element(float m, float s, float noise, const float* c,
                                         const DenoiseConfig& cfg) {
  using A = RoundedArith<scalar_t>;
  float x0;
  if (cfg.prediction == kEpsilon) {
    x0 = A::div(A::sub(s, A::scale(c[kSqrtBetaProd], m)), c[kSqrtAlphaProd], c[kInvSqrtAlphaProd]);
  } else if (cfg.prediction == kSample) {
    x0 = m;
  } else {
    x0 = A::sub(A::scale(c[kSqrtAlphaProd], s), A::scale(c[kSqrtBetaProd], m));
  }
  // diffusers derives DDIM's epsilon from the x0 before clipping, unless told to use the
  // clipped one (use_clipped_model_output).
  const auto epsilon_from = [&](float x0_used) {
    return A::div(A::sub(s, A::scale(c[kSqrtAlphaProd], x0_used)), c[kSqrtBetaProd],
                  c[kInvSqrtBetaProd]);
  };
  float epsilon = 0.f;
  if (cfg.scheduler == kDDIM && !cfg.use_clipped_model_output) {
    epsilon = cfg.prediction == kEpsilon ? m
              : cfg.prediction == kSample
                  ? epsilon_from(x0)
                  : A::add(A::scale(c[kSqrtAlphaProd], m), A::scale(c[kSqrtBetaProd], s));
  }
  if (cfg.clip && !(x0 != x0)) {  // torch.clamp propagates NaN
    const float hi = A::round(cfg.clip_range);
    x0 = x0 < -hi ? -hi : (x0 > hi ? hi : x0);
  }
  if (cfg.scheduler == kDDIM && cfg.use_clipped_model_output) epsilon = epsilon_from(x0);
  const float second = cfg.scheduler == kDDPM ? s : epsilon;
  float prev = A::add(A::scale(c[kX0Coeff], x0), A::scale(c[kSecondCoeff], second));
  if (cfg.has_noise && c[kAddNoise] != 0.f) prev = A::add(prev, A::scale(c[kNoiseScale], noise));
  return static_cast<scalar_t>(prev);
}

// Validates every argument (raising a Python exception naming it); returns the config.
// condition_data and condition_mask (bool), given together and shaped like sample, make the
// op return where(condition_mask, condition_data, prev_sample): Diffusion Policy's inpainting
// of the known part of the trajectory, which every next step (and the loop's end) applies
// to this step's result anyway.
DenoiseConfig check_denoise_step_args(const at::Tensor& model_output, const at::Tensor& sample,
                                      const std::optional<at::Tensor>& noise,
                                      const at::Tensor& table, int64_t step, int64_t scheduler,
                                      int64_t prediction_type,
                                      std::optional<double> clip_sample_range,
                                      bool use_clipped_model_output,
                                      const std::optional<at::Tensor>& condition_data,
                                      const std::optional<at::Tensor>& condition_mask);

}  // namespace dpa
