"""DDPM / DDIM denoising steps equal, bit for bit, to diffusers' `DDPMScheduler` and
`DDIMScheduler`, without depending on diffusers.

diffusers computes each step's scalars (`alpha_prod_t ** 0.5`, ...) as 0-dim float32 CPU
tensors and multiplies the sample by them. `DenoiseSchedule` computes the same scalars with
the same torch ops in the same order, once per inference step, and stores them as one row of
a float32 table. The fused op `ops.denoise_step` reads a row by index (so a CUDA graph can
bake one launch per step); `DenoiseSchedule.reference_step` replays diffusers' tensor ops
with the row's scalars and is the pure-torch fallback and test oracle.
"""
import copy
import math
from collections.abc import Mapping
from typing import Optional

import numpy as np
import torch

# Constructor defaults of diffusers' schedulers (0.35), for the options this module reads:
# a config missing a key gets what diffusers would give it.
DDPM_DEFAULTS = {
    "num_train_timesteps": 1000,
    "beta_start": 0.0001,
    "beta_end": 0.02,
    "beta_schedule": "linear",
    "trained_betas": None,
    "variance_type": "fixed_small",
    "clip_sample": True,
    "prediction_type": "epsilon",
    "thresholding": False,
    "clip_sample_range": 1.0,
    "timestep_spacing": "leading",
    "steps_offset": 0,
    "rescale_betas_zero_snr": False,
}
DDIM_DEFAULTS = {
    "num_train_timesteps": 1000,
    "beta_start": 0.0001,
    "beta_end": 0.02,
    "beta_schedule": "linear",
    "trained_betas": None,
    "clip_sample": True,
    "set_alpha_to_one": True,
    "steps_offset": 0,
    "prediction_type": "epsilon",
    "thresholding": False,
    "clip_sample_range": 1.0,
    "timestep_spacing": "leading",
    "rescale_betas_zero_snr": False,
}
SCHEDULER_DEFAULTS = {"ddpm": DDPM_DEFAULTS, "ddim": DDIM_DEFAULTS}
SCHEDULER_CLASS_KINDS = {"DDPMScheduler": "ddpm", "DDIMScheduler": "ddim"}
# The keyword arguments of DDIMScheduler.step that change its result; Diffusion Policy
# forwards `policy.kwargs` to `scheduler.step` on every step.
DDIM_STEP_OPTIONS = ("eta", "use_clipped_model_output")
PREDICTION_TYPES = ("epsilon", "sample", "v_prediction")
# learned / learned_range need a variance head in the model output, fixed_large_log returns
# a log-variance that DDPMScheduler.step would then square-root: neither is a fixed per-step
# noise scale.
DDPM_VARIANCE_TYPES = ("fixed_small", "fixed_small_log", "fixed_large")
TIMESTEP_SPACINGS = ("leading", "trailing", "linspace")

# Table columns; keep in step with ops.TABLE_COLUMNS and csrc/denoise_step/denoise_step.h.
SQRT_BETA_PROD, SQRT_ALPHA_PROD, INV_SQRT_BETA_PROD, INV_SQRT_ALPHA_PROD = 0, 1, 2, 3
X0_COEFF, SECOND_COEFF, NOISE_SCALE, ADD_NOISE = 4, 5, 6, 7
NUM_TABLE_COLUMNS = 8


def _scheduler_kind(config: Mapping, kind: Optional[str]) -> str:
    class_name = config.get("_class_name")
    if class_name is not None:
        if class_name not in SCHEDULER_CLASS_KINDS:
            raise ValueError(f"_class_name {class_name!r} is not supported; expected one of "
                             f"{sorted(SCHEDULER_CLASS_KINDS)}")
        if kind is not None and kind != SCHEDULER_CLASS_KINDS[class_name]:
            raise ValueError(f"kind={kind!r} contradicts the config's _class_name {class_name!r}")
        return SCHEDULER_CLASS_KINDS[class_name]
    if kind not in SCHEDULER_DEFAULTS:
        raise ValueError(f"kind must be 'ddpm' or 'ddim' when the config has no _class_name, "
                         f"got {kind!r}")
    return kind


def _with_defaults(config: Mapping, kind: str) -> dict:
    defaults = SCHEDULER_DEFAULTS[kind]
    # Keys the class does not take are dropped, as diffusers' from_config drops them.
    return {**defaults, **{key: value for key, value in config.items() if key in defaults}}


def _cosine_betas(num_train_timesteps: int, max_beta: float = 0.999) -> torch.Tensor:
    """diffusers' `betas_for_alpha_bar` with the cosine alpha_bar: Python float64 math, then
    one rounding to float32."""
    def alpha_bar(t):
        return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2

    betas = [min(1 - alpha_bar((i + 1) / num_train_timesteps) / alpha_bar(i / num_train_timesteps),
                 max_beta)
             for i in range(num_train_timesteps)]
    return torch.tensor(betas, dtype=torch.float32)


def _betas(config: dict, kind: str) -> torch.Tensor:
    num_train_timesteps = config["num_train_timesteps"]
    beta_start, beta_end = config["beta_start"], config["beta_end"]
    schedule = config["beta_schedule"]
    if config["trained_betas"] is not None:
        return torch.tensor(config["trained_betas"], dtype=torch.float32)
    if schedule == "linear":
        return torch.linspace(beta_start, beta_end, num_train_timesteps, dtype=torch.float32)
    if schedule == "scaled_linear":
        return torch.linspace(beta_start ** 0.5, beta_end ** 0.5, num_train_timesteps,
                              dtype=torch.float32) ** 2
    if schedule == "squaredcos_cap_v2":
        return _cosine_betas(num_train_timesteps)
    if schedule == "sigmoid" and kind == "ddpm":
        ramp = torch.linspace(-6, 6, num_train_timesteps, dtype=torch.float32)
        return torch.sigmoid(ramp) * (beta_end - beta_start) + beta_start
    raise ValueError(f"beta_schedule {schedule!r} is not supported by {kind.upper()}; expected one of "
                     f"'linear', 'scaled_linear', 'squaredcos_cap_v2'"
                     + (", 'sigmoid'" if kind == "ddpm" else "") + " or trained_betas")


def _check_supported(config: dict, kind: str) -> None:
    if config["rescale_betas_zero_snr"]:
        raise ValueError("rescale_betas_zero_snr=True is not supported")
    if config["thresholding"]:
        raise ValueError("thresholding=True (dynamic thresholding) is not supported; "
                         "use clip_sample instead")
    if config["prediction_type"] not in PREDICTION_TYPES:
        raise ValueError(f"prediction_type {config['prediction_type']!r} is not supported; "
                         f"expected one of {PREDICTION_TYPES}")
    if config["timestep_spacing"] not in TIMESTEP_SPACINGS:
        raise ValueError(f"timestep_spacing {config['timestep_spacing']!r} is not supported; "
                         f"expected one of {TIMESTEP_SPACINGS}")
    if kind == "ddpm" and config["variance_type"] not in DDPM_VARIANCE_TYPES:
        raise ValueError(f"variance_type {config['variance_type']!r} is not supported; "
                         f"expected one of {DDPM_VARIANCE_TYPES}")


def alphas_cumprod_from_config(config: Mapping, kind: Optional[str] = None) -> torch.Tensor:
    """`scheduler.alphas_cumprod` (float32, CPU) of the diffusers scheduler `config` describes.

    `kind` ('ddpm' / 'ddim') is taken from the config's `_class_name` when it has one; without
    either, the beta options take their defaults, which both classes share.
    """
    kind = _scheduler_kind(config, kind) if kind or "_class_name" in config else "ddpm"
    config = _with_defaults(config, kind)
    _check_supported(config, kind)
    return _alphas_cumprod(config, kind)


def _alphas_cumprod(config: dict, kind: str) -> torch.Tensor:
    alphas = 1.0 - _betas(config, kind)
    return torch.cumprod(alphas, dim=0)


def _timesteps(config: dict, num_inference_steps: int) -> torch.Tensor:
    num_train_timesteps = config["num_train_timesteps"]
    if not 1 <= num_inference_steps <= num_train_timesteps:
        raise ValueError(f"num_inference_steps must be in [1, num_train_timesteps="
                         f"{num_train_timesteps}], got {num_inference_steps}")
    spacing = config["timestep_spacing"]
    if spacing == "linspace":
        timesteps = np.linspace(0, num_train_timesteps - 1, num_inference_steps).round()[::-1]
    elif spacing == "leading":
        step_ratio = num_train_timesteps // num_inference_steps
        timesteps = np.arange(num_inference_steps)[::-1] * step_ratio + config["steps_offset"]
    else:
        # The float arange is what diffusers uses; it decides how many timesteps there are.
        step_ratio = num_train_timesteps / num_inference_steps
        timesteps = np.round(np.arange(num_train_timesteps, 0, -step_ratio)) - 1
    timesteps = torch.from_numpy(np.ascontiguousarray(timesteps).astype(np.int64))
    if timesteps.min() < 0:
        # np.arange's float step overshoots for some counts, and diffusers then indexes
        # alphas_cumprod[-1], i.e. the noisiest timestep, for the final step.
        raise ValueError(f"timestep_spacing='trailing' with num_inference_steps={num_inference_steps} "
                         f"of {num_train_timesteps} gives diffusers a timestep of -1; "
                         f"choose another num_inference_steps")
    if timesteps.max() >= num_train_timesteps:
        raise ValueError(f"steps_offset={config['steps_offset']} puts timestep {int(timesteps.max())} "
                         f"past num_train_timesteps={num_train_timesteps}")
    return timesteps


def _reciprocal(value: torch.Tensor) -> torch.Tensor:
    # PyTorch's CUDA division by a CPU scalar multiplies by this float32 reciprocal.
    return torch.tensor(1.0, dtype=torch.float32) / value


def _table_row(alpha_prod_t, x0_coeff, second_coeff, noise_scale, add_noise) -> torch.Tensor:
    beta_prod_t = 1 - alpha_prod_t
    sqrt_beta_prod = beta_prod_t ** 0.5
    sqrt_alpha_prod = alpha_prod_t ** 0.5
    return torch.stack([sqrt_beta_prod, sqrt_alpha_prod, _reciprocal(sqrt_beta_prod),
                        _reciprocal(sqrt_alpha_prod), x0_coeff, second_coeff, noise_scale,
                        torch.tensor(1.0 if add_noise else 0.0)])


def _ddpm_table(alphas_cumprod, timesteps, variance_type) -> torch.Tensor:
    one = torch.tensor(1.0)
    ts = timesteps.tolist()
    rows = []
    for i, t in enumerate(ts):
        # DDPMScheduler.previous_timestep: the next entry of the timesteps list.
        prev_t = ts[i + 1] if i + 1 < len(ts) else -1
        alpha_prod_t = alphas_cumprod[t]
        alpha_prod_t_prev = alphas_cumprod[prev_t] if prev_t >= 0 else one
        beta_prod_t = 1 - alpha_prod_t
        beta_prod_t_prev = 1 - alpha_prod_t_prev
        current_alpha_t = alpha_prod_t / alpha_prod_t_prev
        current_beta_t = 1 - current_alpha_t
        x0_coeff = (alpha_prod_t_prev ** 0.5 * current_beta_t) / beta_prod_t
        sample_coeff = current_alpha_t ** 0.5 * beta_prod_t_prev / beta_prod_t
        # DDPMScheduler._get_variance, then the power step() applies to it.
        variance = (1 - alpha_prod_t_prev) / (1 - alpha_prod_t) * current_beta_t
        variance = torch.clamp(variance, min=1e-20)
        if variance_type == "fixed_small":
            noise_scale = variance ** 0.5
        elif variance_type == "fixed_small_log":
            noise_scale = torch.exp(0.5 * torch.log(variance))
        else:
            noise_scale = current_beta_t ** 0.5
        rows.append(_table_row(alpha_prod_t, x0_coeff, sample_coeff, noise_scale, add_noise=t > 0))
    return torch.stack(rows)


def _ddim_table(alphas_cumprod, timesteps, num_train_timesteps, num_inference_steps,
                set_alpha_to_one, eta) -> torch.Tensor:
    final_alpha_cumprod = torch.tensor(1.0) if set_alpha_to_one else alphas_cumprod[0]
    # DDIMScheduler.step's previous timestep, whatever the spacing of the timesteps list.
    step_gap = num_train_timesteps // num_inference_steps
    rows = []
    for t in timesteps.tolist():
        prev_t = t - step_gap
        alpha_prod_t = alphas_cumprod[t]
        alpha_prod_t_prev = alphas_cumprod[prev_t] if prev_t >= 0 else final_alpha_cumprod
        beta_prod_t = 1 - alpha_prod_t
        beta_prod_t_prev = 1 - alpha_prod_t_prev
        variance = (beta_prod_t_prev / beta_prod_t) * (1 - alpha_prod_t / alpha_prod_t_prev)
        std_dev_t = eta * variance ** 0.5
        direction_coeff = (1 - alpha_prod_t_prev - std_dev_t ** 2) ** 0.5
        rows.append(_table_row(alpha_prod_t, alpha_prod_t_prev ** 0.5, direction_coeff, std_dev_t,
                               add_noise=eta > 0))
    return torch.stack(rows)


class DenoiseSchedule:
    """The per-step constants of a DDPM or DDIM sampling loop of `num_inference_steps` steps.

    Step `i` denoises at timestep `timesteps[i]` with row `i` of `table` (float32
    [len(timesteps), 8], columns named by `ops.TABLE_COLUMNS`). Build one with
    `from_diffusers`; `to(device)` moves the table next to the samples.
    """

    def __init__(self, kind: str, timesteps: torch.Tensor, table: torch.Tensor, *,
                 prediction_type: str, clip_sample_range: Optional[float],
                 num_inference_steps: int, use_clipped_model_output: bool = False,
                 eta: float = 0.0):
        if kind not in SCHEDULER_DEFAULTS:
            raise ValueError(f"kind must be 'ddpm' or 'ddim', got {kind!r}")
        if prediction_type not in PREDICTION_TYPES:
            raise ValueError(f"prediction_type must be one of {PREDICTION_TYPES}, got {prediction_type!r}")
        if table.dtype != torch.float32 or table.shape != (len(timesteps), NUM_TABLE_COLUMNS):
            raise ValueError(f"table must be float32 [{len(timesteps)}, {NUM_TABLE_COLUMNS}], got "
                             f"{table.dtype} {list(table.shape)}")
        self.kind = kind
        self.timesteps = timesteps
        self.table = table
        self.prediction_type = prediction_type
        self.clip_sample_range = clip_sample_range
        self.use_clipped_model_output = use_clipped_model_output
        self.eta = eta
        self.num_inference_steps = num_inference_steps
        # reference_step needs the scalars as CPU tensors whatever device `table` is on, and
        # needs_noise must answer without a device sync.
        self._host_table = table.detach().to("cpu", copy=True)
        self._adds_noise = tuple(bool(flag) for flag in self._host_table[:, ADD_NOISE].tolist())

    @classmethod
    def from_diffusers(cls, scheduler_or_config, num_inference_steps: int, *, eta: float = 0.0,
                       use_clipped_model_output: bool = False,
                       kind: Optional[str] = None) -> "DenoiseSchedule":
        """The schedule `scheduler.set_timesteps(num_inference_steps)` then `step(...)` follow.

        `scheduler_or_config` is a `DDPMScheduler` / `DDIMScheduler`, or its config as a mapping
        (e.g. a loaded scheduler_config.json): the kind comes from the class name or the
        config's `_class_name`, else from `kind`. `eta` and `use_clipped_model_output` are the
        arguments of `DDIMScheduler.step`.
        """
        if isinstance(scheduler_or_config, Mapping):
            config = scheduler_or_config
        else:
            config = getattr(scheduler_or_config, "config", None)
            if not isinstance(config, Mapping):
                raise TypeError(f"expected a diffusers scheduler or a config mapping, got "
                                f"{type(scheduler_or_config).__name__}")
            config = {**config, "_class_name": type(scheduler_or_config).__name__}
        kind = _scheduler_kind(config, kind)
        config = _with_defaults(config, kind)
        _check_supported(config, kind)
        eta = float(eta)
        if kind == "ddpm" and (eta != 0.0 or use_clipped_model_output):
            raise ValueError("eta and use_clipped_model_output are DDIM options; DDPM takes neither")
        if not math.isfinite(eta):
            raise ValueError(f"eta must be finite, got {eta}")
        num_inference_steps = int(num_inference_steps)
        alphas_cumprod = _alphas_cumprod(config, kind)
        timesteps = _timesteps(config, num_inference_steps)
        if kind == "ddpm":
            table = _ddpm_table(alphas_cumprod, timesteps, config["variance_type"])
        else:
            table = _ddim_table(alphas_cumprod, timesteps, config["num_train_timesteps"],
                                num_inference_steps, config["set_alpha_to_one"], eta)
        return cls(kind, timesteps, table,
                   prediction_type=config["prediction_type"],
                   clip_sample_range=float(config["clip_sample_range"]) if config["clip_sample"] else None,
                   num_inference_steps=num_inference_steps,
                   use_clipped_model_output=bool(use_clipped_model_output),
                   eta=eta)

    def to(self, device) -> "DenoiseSchedule":
        """A copy whose table lives on `device` (timesteps and host copies stay on the CPU)."""
        moved = copy.copy(self)
        moved.table = self.table.to(device)
        return moved

    def noise_variance(self) -> torch.Tensor:
        """Each step's noise variance, float32 [num_steps] on the CPU: DDPM's posterior variance
        as its table has it (noise_scale squared), for DDIM the variance of its eta = 1 step
        (it adds none itself). The parallel sampler scales its tolerance by it."""
        host = self._host_table
        if self.kind == "ddpm":
            return host[:, NOISE_SCALE].square()
        alpha_prod, alpha_prod_prev = host[:, SQRT_ALPHA_PROD].square(), host[:, X0_COEFF].square()
        return ((1 - alpha_prod_prev) / (1 - alpha_prod) * (1 - alpha_prod / alpha_prod_prev)).clamp(min=0)

    def _check_index(self, i) -> int:
        i = int(i)
        if not 0 <= i < len(self._adds_noise):
            raise ValueError(f"step index i must be in [0, {len(self._adds_noise)}), got {i}")
        return i

    def needs_noise(self, i: int) -> bool:
        """Whether step `i` adds noise (diffusers: DDPM at t > 0, DDIM with eta > 0)."""
        return self._adds_noise[self._check_index(i)]

    def _check_noise(self, i: int, noise: Optional[torch.Tensor]) -> None:
        if noise is None and self.needs_noise(i):
            raise ValueError(f"step {i} (timestep {int(self.timesteps[i])}) adds noise: pass noise, "
                             f"a standard normal tensor shaped like sample")

    def step(self, model_output: torch.Tensor, i: int, sample: torch.Tensor,
             noise: Optional[torch.Tensor] = None, *,
             condition_data: Optional[torch.Tensor] = None,
             condition_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Step `i` (`x_t -> x_{t-1}`, t = timesteps[i]) with the fused op; `noise` is diffusers'
        variance noise and is required where `needs_noise(i)`. With `condition_data` and
        `condition_mask`, the result's masked elements are `condition_data`'s (inpainting,
        in the same pass)."""
        self._check_noise(i, noise)
        from ..kernels import ops  # loads the compiled extension on first use

        return ops.denoise_step(model_output, sample, noise, self.table, i, scheduler=self.kind,
                                prediction_type=self.prediction_type,
                                clip_sample_range=self.clip_sample_range,
                                use_clipped_model_output=self.use_clipped_model_output,
                                condition_data=condition_data, condition_mask=condition_mask)

    def reference_step(self, model_output: torch.Tensor, i: int, sample: torch.Tensor,
                       noise: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`step` in plain torch ops: diffusers' `step(...).prev_sample`, op for op, with the
        scalars as 0-dim float32 CPU tensors as diffusers has them, so it equals diffusers in
        every dtype and on every device."""
        i = self._check_index(i)
        self._check_noise(i, noise)
        (sqrt_beta_prod, sqrt_alpha_prod, _, _, x0_coeff, second_coeff, noise_scale,
         _) = self._host_table[i].unbind()
        if self.prediction_type == "epsilon":
            pred_x0 = (sample - sqrt_beta_prod * model_output) / sqrt_alpha_prod
        elif self.prediction_type == "sample":
            pred_x0 = model_output
        else:
            pred_x0 = sqrt_alpha_prod * sample - sqrt_beta_prod * model_output
        if self.clip_sample_range is not None:
            pred_x0 = pred_x0.clamp(-self.clip_sample_range, self.clip_sample_range)
        if self.kind == "ddpm":
            prev_sample = x0_coeff * pred_x0 + second_coeff * sample
        else:
            if self.use_clipped_model_output:
                pred_eps = (sample - sqrt_alpha_prod * pred_x0) / sqrt_beta_prod
            elif self.prediction_type == "epsilon":
                pred_eps = model_output
            elif self.prediction_type == "sample":
                # From x0 before clipping (= model_output), as diffusers derives it.
                pred_eps = (sample - sqrt_alpha_prod * model_output) / sqrt_beta_prod
            else:
                pred_eps = sqrt_alpha_prod * model_output + sqrt_beta_prod * sample
            prev_sample = x0_coeff * pred_x0 + second_coeff * pred_eps
        if self._adds_noise[i] and noise is not None:
            prev_sample = prev_sample + noise_scale * noise
        return prev_sample
