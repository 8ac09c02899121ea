"""LeRobot's `DiffusionPolicy`, sampled through this package.

LeRobot's diffusion policy (lerobot.policies.diffusion.modeling_diffusion) keeps its noise
predictor in `policy.diffusion.unet`, a `DiffusionConditionalUnet1d` that is Diffusion Policy's
`ConditionalUnet1D` without local conditioning and with some submodules renamed, its diffusers
scheduler in `policy.diffusion.noise_scheduler`, and the denoising loop in
`policy.diffusion.conditional_sample(batch_size, global_cond, generator, noise)`, which
`generate_actions` calls after building the global condition (state, image features and
environment state over the observation steps). `accelerate_lerobot` replaces that loop with a
`GraphedSampler` over this package's U-Net, which shares LeRobot's weight tensors; the queues,
the vision encoder and the normalisation (LeRobot's processors) stay LeRobot's own code. The
policy's module tree and `state_dict` are left as they are, so `save_pretrained` writes what
stock LeRobot reads. LeRobot is recognised by those attributes and never imported.

`load_lerobot_pretrained(folder)` reads a folder `save_pretrained` wrote (config.json and
model.safetensors) into this package's U-Net and schedule without LeRobot.
"""
import json
import re
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Tuple

import torch
import torch.nn as nn

from ..model.unet import ConditionalUnet1D, unet_config_from_state_dict
from ..sampling.finite import FiniteGuard, check_finite_option
from ..sampling.policy_graph import GraphedPolicyCall, check_encoder_options, set_encoder_precision
from ..sampling.picard import Picard
from ..sampling.sampler import FollowingSampler, GraphedSampler
from ..model.schedulers import DenoiseSchedule

__all__ = ["is_lerobot_policy", "accelerate_lerobot", "dpa_state_dict", "load_lerobot_pretrained",
           "LeRobotPretrained"]

MODEL_ATTRIBUTES = ("unet", "noise_scheduler", "num_inference_steps", "conditional_sample")
UNET_ATTRIBUTES = ("diffusion_step_encoder", "down_modules", "mid_modules", "up_modules", "final_conv")


def is_lerobot_policy(policy) -> bool:
    """Whether `policy` has the layout of LeRobot's DiffusionPolicy (`policy.diffusion` holding
    the U-Net, scheduler and loop)."""
    model = getattr(policy, "diffusion", None)
    return model is not None and all(hasattr(model, name) for name in MODEL_ATTRIBUTES)


def dpa_state_dict(lerobot_unet_state: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """LeRobot's U-Net state_dict under Diffusion Policy's (and this package's) keys: a
    residual block's `conv1` / `conv2` are `blocks.0` / `blocks.1`, and the bare down- and
    upsampling convs at index 2 of each level are wrapped (`.conv`)."""
    out = {}
    for key, value in lerobot_unet_state.items():
        key = key.replace(".conv1.", ".blocks.0.").replace(".conv2.", ".blocks.1.")
        out[re.sub(r"^(down_modules|up_modules)\.(\d+)\.2\.(weight|bias)$", r"\1.\2.2.conv.\3", key)] = value
    return out


def _unwrap(unet: nn.Module) -> nn.Module:
    """LeRobot's U-Net itself where `compile_model` wrapped it in torch.compile."""
    return getattr(unet, "_orig_mod", unet)


def unet_from_lerobot(lerobot_unet: nn.Module, dtype: Optional[torch.dtype] = None) -> ConditionalUnet1D:
    """This package's ConditionalUnet1D computing LeRobot's U-Net: built with the arguments its
    weights imply and holding the very same parameter tensors (so a later `policy.to(...)`
    moves both), or, with a `dtype` other than theirs, a converted copy."""
    lerobot_unet = _unwrap(lerobot_unet)
    missing = [name for name in UNET_ATTRIBUTES if not hasattr(lerobot_unet, name)]
    if missing:
        raise TypeError(f"policy.diffusion.unet is a {type(lerobot_unet).__name__} without {missing}, not "
                        f"LeRobot's DiffusionConditionalUnet1d")
    try:
        n_groups = lerobot_unet.down_modules[0][0].conv1.block[1].num_groups
        state = dpa_state_dict(lerobot_unet.state_dict(keep_vars=True))
        config = unet_config_from_state_dict(state, n_groups=n_groups)
    except (AttributeError, IndexError, ValueError) as error:
        raise TypeError(f"policy.diffusion.unet ({type(lerobot_unet).__name__}) does not have the layout of "
                        f"LeRobot's DiffusionConditionalUnet1d: {error}") from error
    parameter = next(lerobot_unet.parameters())
    if dtype is not None and dtype != parameter.dtype:
        unet = ConditionalUnet1D(**config)
        unet.load_state_dict({k: v.detach() for k, v in state.items()}, strict=True)
        return unet.to(device=parameter.device, dtype=dtype).eval()
    with torch.device("meta"):
        unet = ConditionalUnet1D(**config)
    expected = set(unet.state_dict().keys())
    if set(state) != expected:
        raise TypeError(f"LeRobot's U-Net does not map onto ConditionalUnet1D: unexpected keys "
                        f"{sorted(set(state) - expected)[:5]}, missing {sorted(expected - set(state))[:5]}")
    for key, tensor in state.items():
        path, _, name = key.rpartition(".")
        owner = unet.get_submodule(path)
        if not isinstance(tensor, nn.Parameter):
            raise TypeError(f"LeRobot's U-Net holds {key} as a buffer, not a parameter")
        setattr(owner, name, tensor)
    # The counters the CUDA kernels synchronise through: real tensors, on the weights' device.
    for module in unet.modules():
        if "op_counters" in module._buffers:
            module.op_counters = torch.zeros(module.op_counters.shape, dtype=torch.int32, device=parameter.device)
    return unet.eval()


def _sample(sampler: GraphedSampler, shape: Tuple[int, int, int], like: Dict[str, Any],
            global_cond: Optional[torch.Tensor], generator: Optional[torch.Generator],
            noise: Optional[torch.Tensor]) -> torch.Tensor:
    """LeRobot's loop: no inpainting (zero condition, nothing masked). `noise` is the initial
    trajectory (`shape`), or all the noise ([steps + 1, *shape], GraphedSampler's `noise`), or
    None: drawn by the sampler from `generator`."""
    every_step = (sampler.num_steps + 1,) + tuple(shape)
    if noise is not None and tuple(noise.shape) not in (tuple(shape), every_step):
        raise ValueError(f"noise must be the initial trajectory [batch_size, horizon, action_dim] = {list(shape)} or "
                         f"all the noise {list(every_step)}, got {list(noise.shape)}")
    full = noise is not None and noise.dim() == 4
    return sampler(torch.zeros(shape, **like), torch.zeros(shape, dtype=torch.bool, device=like["device"]),
                   global_cond=global_cond, generator=generator, noise=noise if full else None,
                   initial_noise=None if full else noise)


class _LeRobotConditionalSample:
    """Stands in for `policy.diffusion.conditional_sample(batch_size, global_cond, generator,
    noise)`: LeRobot's initial trajectory (drawn from `generator`, in the dtype and on the
    device of the model's first parameter, as LeRobot draws it; or `noise`), denoised by a
    GraphedSampler. The sampler follows `num_inference_steps`, the scheduler, the device and
    the weights (FollowingSampler); the per-step noise of DDPM has LeRobot's distribution,
    from one draw."""

    def __init__(self, model: nn.Module, unet: ConditionalUnet1D, horizon: int, action_dim: int, parallel=None):
        self.model = model
        self.following = FollowingSampler(unet, parallel)
        self.horizon, self.action_dim = horizon, action_dim

    @property
    def sampler(self) -> Optional[GraphedSampler]:
        return self.following.sampler

    def sampler_now(self) -> GraphedSampler:
        """The sampler the next call will use (built anew where the model changed)."""
        model = self.model
        return self.following.get(
            (model.num_inference_steps, id(model.noise_scheduler)),
            lambda: DenoiseSchedule.from_diffusers(model.noise_scheduler, model.num_inference_steps),
            next(_unwrap(model.unet).parameters()).device)

    def __call__(self, batch_size: int, global_cond: Optional[torch.Tensor] = None,
                 generator: Optional[torch.Generator] = None, noise: Optional[torch.Tensor] = None) -> torch.Tensor:
        model = self.model
        sampler = self.sampler_now()
        parameter = next(model.parameters())
        like = dict(device=parameter.device, dtype=parameter.dtype)
        shape = (int(batch_size), self.horizon, self.action_dim)
        initial = noise if noise is not None else torch.randn(shape, generator=generator, **like)
        return _sample(sampler, shape, like, global_cond, generator, initial)


def accelerate_lerobot(policy, dtype: Optional[torch.dtype] = None, *, whole_graph: bool = True,
                       encoder_dtype: Optional[torch.dtype] = None, encoder_channels_last: Optional[bool] = None,
                       parallel=None, check_finite: bool = True):
    """`accelerate(policy)` for LeRobot's DiffusionPolicy (see the module doc); returns it.
    With `whole_graph`, `policy.diffusion.generate_actions` (image encoders, global condition,
    denoising loop, slicing) runs as one CUDA graph per input shape (policy_graph.py);
    `encoder_dtype` and `encoder_channels_last` (default: on where there are images) apply to
    `policy.diffusion.rgb_encoder`; `parallel`: GraphedSampler's. With `check_finite`,
    `generate_actions` raises NonFiniteError where its batch or its actions hold NaN or Inf
    (accelerate's doc); LeRobot's queues then hold the observation but no actions
    (`policy.reset()` empties them)."""
    parallel = Picard.of(parallel)
    check_finite = check_finite_option(check_finite)
    model = policy.diffusion
    if "_dpa_sample" in vars(model):
        raise ValueError("this policy is already accelerated; accelerate a fresh policy instead")
    if policy.training:
        raise ValueError("the policy is in training mode: call policy.eval() before accelerate(), which is for "
                         "inference")
    config = getattr(policy, "config", None)
    try:
        horizon, action_dim = int(config.horizon), int(config.action_feature.shape[0])
    except AttributeError as error:
        raise TypeError(f"policy.config ({type(config).__name__}) lacks LeRobot DiffusionConfig's horizon or "
                        f"action_feature: {error}") from error
    encoder = getattr(model, "rgb_encoder", None)
    channels_last = check_encoder_options(encoder, "policy.diffusion.rgb_encoder", encoder_dtype, encoder_channels_last)
    unet = unet_from_lerobot(model.unet, dtype)
    sample = _LeRobotConditionalSample(model, unet, horizon, action_dim, parallel)
    # Instance attributes, not submodules: the policy's state_dict and .to() see only LeRobot's
    # own modules, and `conditional_sample` shadows the class's method, which generate_actions
    # calls.
    vars(model)["_dpa_sample"] = sample
    vars(model)["conditional_sample"] = sample
    if isinstance(encoder, nn.Module):
        set_encoder_precision(encoder, encoder_dtype, channels_last)
    if whole_graph:
        vars(model)["generate_actions"] = GraphedPolicyCall(model.generate_actions, model, sample.sampler_now,
                                                            "generate_actions", check_finite)
    elif check_finite:
        vars(model)["generate_actions"] = FiniteGuard(model.generate_actions, "generate_actions", model)
    return policy


# --------------------------------------------------------------------------------------
# A folder LeRobot's save_pretrained wrote, without LeRobot.

# The U-Net's weights in model.safetensors (torch.compile adds `_orig_mod.`).
UNET_PREFIXES = ("diffusion.unet._orig_mod.", "diffusion.unet.")


class LeRobotPretrained:
    """A LeRobot diffusion policy's U-Net, schedule and settings, loaded by
    `load_lerobot_pretrained`. It works in LeRobot's normalised space: `global_cond` is what
    LeRobot's `_prepare_global_conditioning` builds from normalised observations (and image
    features), and actions come back normalised, for LeRobot's postprocessor to undo. With
    `check_finite`, `predict_action_chunk` raises NonFiniteError where global_cond, the noise
    or the actions hold NaN or Inf (sampling/finite.py; the attribute `check_finite` may be
    changed later)."""

    def __init__(self, config: Dict[str, Any], unet: ConditionalUnet1D, schedule: DenoiseSchedule, parallel=None,
                 check_finite: bool = True):
        self.config = config
        self.unet = unet
        self.schedule = schedule
        self.sampler = GraphedSampler(unet, schedule, parallel=parallel)
        self.horizon = int(config["horizon"])
        self.n_obs_steps = int(config["n_obs_steps"])
        self.n_action_steps = int(config["n_action_steps"])
        self.action_dim = unet.input_dim
        self.global_cond_dim = unet.global_cond_dim
        self.check_finite = check_finite_option(check_finite)
        self._guard = FiniteGuard(self.predict_action_chunk, "predict_action_chunk", unet)

    @property
    def device(self) -> torch.device:
        return next(self.unet.parameters()).device

    def sample(self, global_cond: torch.Tensor, generator: Optional[torch.Generator] = None,
               noise: Optional[torch.Tensor] = None) -> torch.Tensor:
        """LeRobot's `conditional_sample`: the whole normalised trajectory [B, horizon,
        action_dim] for global_cond [B, global_cond_dim]; `noise` is the initial trajectory
        [B, horizon, action_dim] or all the noise [steps + 1, B, horizon, action_dim] (see
        GraphedSampler)."""
        if not isinstance(global_cond, torch.Tensor) or global_cond.dim() != 2:
            raise ValueError(f"global_cond must be a [batch, {self.global_cond_dim}] tensor, got "
                             f"{getattr(global_cond, 'shape', type(global_cond).__name__)}")
        like = dict(device=self.device, dtype=torch.float32)
        return _sample(self.sampler, (global_cond.shape[0], self.horizon, self.action_dim), like,
                       global_cond.to(**like), generator, noise)

    def predict_action_chunk(self, global_cond: torch.Tensor, generator: Optional[torch.Generator] = None,
                             noise: Optional[torch.Tensor] = None) -> torch.Tensor:
        """LeRobot's `generate_actions` after the global condition: the n_action_steps
        normalised actions [B, n_action_steps, action_dim] from the last observation step on."""
        start = self.n_obs_steps - 1
        chunk = lambda: self.sample(global_cond, generator, noise)[:, start:start + self.n_action_steps]
        if not self.check_finite:
            return chunk()
        return self._guard.run(chunk, self._guard.observations((global_cond, generator, noise), {}))


def _schedule_config(config: Mapping[str, Any]) -> Tuple[str, Dict[str, Any], int]:
    kind = str(config.get("noise_scheduler_type", "")).lower()
    if kind not in ("ddpm", "ddim"):
        raise ValueError(f"config.json's noise_scheduler_type must be 'DDPM' or 'DDIM', got "
                         f"{config.get('noise_scheduler_type')!r}")
    keys = ("num_train_timesteps", "beta_start", "beta_end", "beta_schedule", "clip_sample", "clip_sample_range",
            "prediction_type")
    missing = [key for key in keys if key not in config]
    if missing:
        raise ValueError(f"config.json has no {missing}: not a LeRobot diffusion policy's config")
    steps = config.get("num_inference_steps") or config["num_train_timesteps"]
    return kind, {key: config[key] for key in keys}, int(steps)


def load_lerobot_pretrained(path, device: Optional[str] = None, dtype: Optional[torch.dtype] = None,
                            num_inference_steps: Optional[int] = None, parallel=None,
                            check_finite: bool = True) -> LeRobotPretrained:
    """A LeRobot DiffusionPolicy folder (`save_pretrained`: config.json, model.safetensors) as
    this package's U-Net and DDPM/DDIM schedule, on `device` (default: CUDA where there is
    one) in `dtype` (default float32), with the config's number of denoising steps or
    `num_inference_steps`; `parallel`: GraphedSampler's; `check_finite`: predict_action_chunk
    raises NonFiniteError instead of returning NaN or Inf (LeRobotPretrained). Needs
    `safetensors`, not LeRobot."""
    parallel = Picard.of(parallel)
    check_finite = check_finite_option(check_finite)
    folder = Path(path)
    config_path, weights_path = folder / "config.json", folder / "model.safetensors"
    for file in (config_path, weights_path):
        if not file.is_file():
            raise FileNotFoundError(f"path: {folder} has no {file.name}; expected a folder LeRobot's "
                                    f"DiffusionPolicy.save_pretrained wrote")
    try:
        config = json.loads(config_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"path: {config_path} is not a JSON config: {error}") from error
    if not isinstance(config, dict) or config.get("type") != "diffusion":
        raise ValueError(f"path: {config_path} is not a LeRobot diffusion policy's config (its \"type\" is "
                         f"{config.get('type') if isinstance(config, dict) else None!r}, not \"diffusion\")")
    for key in ("horizon", "n_obs_steps", "n_action_steps", "n_groups"):
        if not isinstance(config.get(key), int):
            raise ValueError(f"config.json's {key} must be an int, got {config.get(key)!r}")
    kind, scheduler_config, steps = _schedule_config(config)
    try:
        from safetensors import SafetensorError
        from safetensors.torch import load_file
    except ImportError as error:
        raise ImportError("load_lerobot_pretrained needs safetensors: pip install safetensors") from error
    try:
        weights = load_file(str(weights_path))
    except (SafetensorError, OSError, ValueError) as error:
        raise ValueError(f"path: {weights_path} is not a readable safetensors file: {error}") from error
    prefix = next((p for p in UNET_PREFIXES if any(k.startswith(p) for k in weights)), None)
    if prefix is None:
        raise ValueError(f"path: {weights_path} holds no diffusion.unet.* weights: not a LeRobot DiffusionPolicy")
    state = dpa_state_dict({k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)})
    unet = ConditionalUnet1D(**unet_config_from_state_dict(state, n_groups=config["n_groups"]))
    unet.load_state_dict(state, strict=True)
    device = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    unet = unet.to(device=device, dtype=dtype or torch.float32).eval()
    if unet.horizon_multiple > 1 and config["horizon"] % unet.horizon_multiple:
        raise ValueError(f"config.json's horizon {config['horizon']} is not a multiple of {unet.horizon_multiple}, "
                         f"which the U-Net's {len(unet.down_dims)} levels need")
    if num_inference_steps is not None:
        if isinstance(num_inference_steps, bool) or not isinstance(num_inference_steps, int) or num_inference_steps < 1:
            raise ValueError(f"num_inference_steps must be a positive integer or None, got {num_inference_steps!r}")
        steps = num_inference_steps
    schedule = DenoiseSchedule.from_diffusers(scheduler_config, steps, kind=kind)
    return LeRobotPretrained(config, unet, schedule, parallel, check_finite)
