"""Load a Diffusion Policy workspace checkpoint (`.ckpt`) without the Diffusion Policy repo.

Diffusion Policy's `BaseWorkspace.save_checkpoint` writes

    torch.save({'cfg': <OmegaConf DictConfig of the whole training config>,
                'state_dicts': {'model': <policy state_dict>, 'ema_model': <policy state_dict>,
                                'optimizer': ...},
                'pickles': {'global_step': <dill bytes>, 'epoch': <dill bytes>, ...}},
               path, pickle_module=dill)

A U-Net policy's state_dict holds the noise predictor under `model.`, the `LinearNormalizer`
under `normalizer.params_dict.<field>.{scale, offset, input_stats.*}` and, for the image
policies, the observation encoder under `obs_encoder.`. `load_checkpoint` reads the weights
(the EMA copy when there is one), builds this package's `ConditionalUnet1D` (constructor
arguments read off the weight shapes), the `DenoiseSchedule` of `cfg.policy.noise_scheduler`
and a `GraphedSampler`, and returns them with the policy's settings and its normaliser as a
`DiffusionPolicyCheckpoint`.

What it runs (`DiffusionPolicyCheckpoint`):

- `sample(...)`: Diffusion Policy's `conditional_sample` for any U-Net policy: global
  conditioning, local conditioning, inpainting (`condition_data` / `condition_mask`).
- `predict_action_from_features(...)`: the rest of `predict_action` (condition construction,
  sampling, un-normalising, slicing the executed action steps) from NORMALISED observation
  features: for `DiffusionUnetLowdimPolicy` in all three observation modes, and for
  `DiffusionUnetImagePolicy` / `DiffusionUnetHybridImagePolicy` from the features their
  observation encoder produced (the caller runs the encoder).
- `predict_action(obs_dict)`: the whole `predict_action` of `DiffusionUnetLowdimPolicy`
  (raw observations in, actions out) and of `DiffusionUnetImagePolicy` and
  `DiffusionUnetHybridImagePolicy` (camera frames float in [0, 1] and low-dim observations
  in, actions out), whose observation encoders are rebuilt from the config with torchvision
  alone: `MultiImageObsEncoder` (ResNet backbones, dp_encoder.py) and the hybrid policy's
  robomimic `ObservationEncoder` (ResNet18 + SpatialSoftmax, dp_hybrid_encoder.py).

What it does not: an encoder its config does not describe (another backbone, weights that do
not fit) is not run; `obs_encoder_state_dict()` hands its weights to whoever runs it. Transformer policies
(`DiffusionTransformer*Policy`), the video policy, and schedulers other than diffusers'
`DDPMScheduler` / `DDIMScheduler` are refused with an error.

SECURITY: a `.ckpt` is a pickle, i.e. arbitrary code that runs when it is loaded (Diffusion
Policy's checkpoints cannot be read with `torch.load(weights_only=True)`: the config is an
OmegaConf object). Load only checkpoints from a source you trust.

Requires `omegaconf` (pure Python: `pip install omegaconf`, or this package's
`checkpoints` extra); `dill` (what Diffusion Policy pickled with) is used when installed,
plain `pickle` otherwise.
"""
import copy
import importlib
import pickle
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

import torch

from ..model.unet import ConditionalUnet1D, unet_config_from_state_dict
from ..sampling.finite import FiniteGuard, check_finite_option, named_arrays
from ..sampling.picard import Picard
from ..sampling.sampler import GraphedSampler
from ..model.schedulers import DDIM_STEP_OPTIONS, SCHEDULER_CLASS_KINDS, DenoiseSchedule
from .dp_encoder import build_obs_encoder, obs_keys
from .dp_hybrid_encoder import HYBRID_POLICY, build_hybrid_obs_encoder

__all__ = ["load_checkpoint", "DiffusionPolicyCheckpoint", "unet_config_from_state_dict"]

LOWDIM_POLICY = "DiffusionUnetLowdimPolicy"
IMAGE_POLICY = "DiffusionUnetImagePolicy"  # MultiImageObsEncoder (dp_encoder.py)
IMAGE_POLICIES = ("DiffusionUnetImagePolicy", "DiffusionUnetHybridImagePolicy")
SUPPORTED_POLICIES = (LOWDIM_POLICY,) + IMAGE_POLICIES
# The constructor parameters of each policy class; Diffusion Policy passes every other key of
# cfg.policy (its **kwargs) to scheduler.step on every step.
_COMMON_PARAMETERS = {"_target_", "noise_scheduler", "horizon", "n_action_steps", "n_obs_steps",
                      "num_inference_steps", "obs_as_global_cond"}
_IMAGE_UNET_PARAMETERS = {"shape_meta", "diffusion_step_embed_dim", "down_dims", "kernel_size",
                          "n_groups", "cond_predict_scale"}
POLICY_PARAMETERS = {
    LOWDIM_POLICY: _COMMON_PARAMETERS | {"model", "obs_dim", "action_dim", "obs_as_local_cond",
                                         "pred_action_steps_only", "oa_step_convention"},
    "DiffusionUnetImagePolicy": _COMMON_PARAMETERS | _IMAGE_UNET_PARAMETERS | {"obs_encoder"},
    "DiffusionUnetHybridImagePolicy": _COMMON_PARAMETERS | _IMAGE_UNET_PARAMETERS | {
        "crop_shape", "obs_encoder_group_norm", "eval_fixed_crop"},
}
# The policy constructors' defaults for the settings read here.
OBS_AS_GLOBAL_COND_DEFAULT = {LOWDIM_POLICY: False, "DiffusionUnetImagePolicy": True,
                              "DiffusionUnetHybridImagePolicy": True}
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
UNET_PREFIX = "model."
NORMALIZER_PREFIX = "normalizer.params_dict."
OBS_ENCODER_PREFIX = "obs_encoder."


# --------------------------------------------------------------------------------------
# Reading the payload.
# --------------------------------------------------------------------------------------

def _require_omegaconf():
    try:
        return importlib.import_module("omegaconf")
    except ImportError as error:
        raise ImportError(
            "loading a Diffusion Policy checkpoint needs omegaconf (its config is an OmegaConf "
            "DictConfig): pip install omegaconf  (pure Python; or pip install "
            "'diffusion_policy_accelerated[checkpoints]')") from error


def _pickle_module():
    try:
        return importlib.import_module("dill")
    except ImportError:
        return pickle


def _read_payload(path: Path) -> dict:
    _require_omegaconf()
    try:
        # weights_only=False: the payload holds an OmegaConf object (see the module docstring).
        payload = torch.load(path, map_location="cpu", pickle_module=_pickle_module(),
                             weights_only=False)
    except ModuleNotFoundError as error:
        raise ImportError(f"unpickling {path} needs the module {error.name!r}, which is not "
                          f"installed: {error}") from error
    except AttributeError as error:
        # "Can't get attribute ...": the pickle names a class the installed packages lack.
        raise ImportError(f"unpickling {path} needs a class the installed packages do not have "
                          f"(another version of them?): {error}") from error
    except (pickle.UnpicklingError, EOFError, RuntimeError, ValueError, IndexError) as error:
        # What torch.load raises for a file that is not a whole torch checkpoint: truncated,
        # corrupt, or another format (its zip reader's RuntimeError, the unpickler's errors).
        raise ValueError(f"path: {path} is not a readable Diffusion Policy checkpoint (a corrupt, "
                         f"truncated or foreign file?): {type(error).__name__}: {error}") from error
    if not isinstance(payload, Mapping) or not isinstance(payload.get("state_dicts"), Mapping):
        raise ValueError(f"{path} is not a Diffusion Policy workspace checkpoint: expected a dict "
                         f"with 'cfg' and 'state_dicts' (BaseWorkspace.save_checkpoint), got "
                         f"{type(payload).__name__}" + (
                             f" with keys {sorted(map(str, payload))}"
                             if isinstance(payload, Mapping) else ""))
    if "cfg" not in payload:
        raise ValueError(f"{path} has no 'cfg': not a Diffusion Policy workspace checkpoint")
    return payload


def _to_plain(cfg) -> dict:
    """The config as plain dicts and lists, interpolations resolved where possible.

    Diffusion Policy's configs use an `${eval:...}` resolver that its train.py registers; it is
    registered here for the duration of the conversion if nobody has (the checkpoint is
    trusted code already). Diffusion Policy resolves the config before training, so saved
    configs rarely hold interpolations at all."""
    if isinstance(cfg, Mapping) and not type(cfg).__module__.startswith("omegaconf"):
        return copy.deepcopy(dict(cfg))
    omegaconf = _require_omegaconf()
    OmegaConf = omegaconf.OmegaConf
    if not OmegaConf.is_config(cfg):
        raise ValueError(f"the checkpoint's 'cfg' is a {type(cfg).__name__}, not a config")
    registered = False
    if not OmegaConf.has_resolver("eval"):
        with warnings.catch_warnings():
            # omegaconf 2.4 renamed it register_resolver (and warns); 2.1-2.3 only have this.
            warnings.simplefilter("ignore")
            OmegaConf.register_new_resolver("eval", eval)
        registered = True
    try:
        try:
            return OmegaConf.to_container(cfg, resolve=True)
        except Exception:
            # Some key outside the policy (say a ${now:...} log name) does not resolve here:
            # keep the rest verbatim, but the policy must resolve.
            plain = OmegaConf.to_container(cfg, resolve=False)
            if "policy" in cfg:
                try:
                    plain["policy"] = OmegaConf.to_container(cfg.policy, resolve=True)
                except Exception as error:
                    raise ValueError(f"the checkpoint's cfg.policy does not resolve: {error}") from error
            return plain
    finally:
        if registered:
            OmegaConf.clear_resolver("eval")


def _policy_class(policy_cfg: Mapping) -> str:
    target = policy_cfg.get("_target_")
    if not isinstance(target, str):
        raise ValueError("cfg.policy has no _target_: cannot tell which policy was trained")
    return target.rsplit(".", 1)[-1]


def _schedule_kind(scheduler_cfg: Mapping) -> str:
    target = scheduler_cfg.get("_target_")
    name = target.rsplit(".", 1)[-1] if isinstance(target, str) else None
    if name not in SCHEDULER_CLASS_KINDS:
        raise ValueError(f"cfg.policy.noise_scheduler._target_ {target!r} is not supported; "
                         f"expected diffusers' {' or '.join(sorted(SCHEDULER_CLASS_KINDS))}")
    return SCHEDULER_CLASS_KINDS[name]


def _step_options(policy_class: str, policy_cfg: Mapping) -> Dict[str, Any]:
    """The keyword arguments Diffusion Policy passes to scheduler.step: cfg.policy's keys that
    are not constructor parameters."""
    extra = {k: v for k, v in policy_cfg.items() if k not in POLICY_PARAMETERS[policy_class]}
    unknown = sorted(set(extra) - set(DDIM_STEP_OPTIONS))
    if unknown:
        raise ValueError(f"cfg.policy has keys {unknown} that {policy_class} passes to "
                         f"scheduler.step; only DDIMScheduler's {list(DDIM_STEP_OPTIONS)} are "
                         f"supported")
    return dict(eta=float(extra.get("eta", 0.0)),
                use_clipped_model_output=bool(extra.get("use_clipped_model_output", False)))


def _normalizer_params(policy_state: Mapping) -> Dict[str, Dict[str, Any]]:
    """`normalizer.params_dict.<field>.<a>.<b>` -> {field: {a: {b: tensor}}}, split on dots
    as Diffusion Policy's DictOfTensorMixin does."""
    fields: Dict[str, Dict[str, Any]] = {}
    for key, value in policy_state.items():
        if not key.startswith(NORMALIZER_PREFIX):
            continue
        field, *path = key[len(NORMALIZER_PREFIX):].split(".")
        node = fields.setdefault(field, {})
        for part in path[:-1]:
            node = node.setdefault(part, {})
        if path:
            node[path[-1]] = value
    return fields


# --------------------------------------------------------------------------------------
# The loaded policy.
# --------------------------------------------------------------------------------------

class DiffusionPolicyCheckpoint:
    """A Diffusion Policy U-Net policy loaded from a workspace checkpoint: its U-Net
    (`unet`, this package's `ConditionalUnet1D`), `schedule`, `sampler` (`GraphedSampler`),
    normaliser and settings. Build it with `load_checkpoint`.

    Attributes read from `cfg.policy` (with the policy constructors' defaults):
    `policy_class`, `horizon`, `n_obs_steps`, `n_action_steps`, `num_inference_steps`,
    `action_dim`, `obs_dim` (lowdim only, else None), `obs_feature_dim` (the U-Net's
    conditioning feature size per observation step, see `predict_action_from_features`),
    `obs_as_global_cond`, `obs_as_local_cond`, `pred_action_steps_only`,
    `oa_step_convention`, `step_options` (eta, use_clipped_model_output); `unet_config` (the
    inferred constructor arguments), `cfg` (the whole training config, plain dicts),
    `weights` ('ema_model' or 'model'), `normalizer_params` ({field: {'scale', 'offset',
    'input_stats': {...}}}), `device`, `dtype` (the U-Net's).

    `check_finite` (load_checkpoint's, True by default; may be changed): `predict_action` and
    `predict_action_from_features` raise NonFiniteError instead of returning actions where
    the observations (features, noise) or the actions hold NaN or Inf, naming which and, for
    actions, the U-Net weights or normaliser parameters that are not finite. The flags are
    read with one small copy after the call, which waits for its actions to be computed
    (sampling/finite.py).
    """

    def __init__(self, *, cfg: dict, policy_class: str, policy_state: Mapping, weights: str,
                 device: torch.device, dtype: torch.dtype,
                 num_inference_steps: Optional[int], parallel: Optional[Picard] = None,
                 check_finite: bool = True):
        policy_cfg = cfg["policy"]
        required = ["horizon", "n_obs_steps", "n_action_steps", "noise_scheduler"] + (
            ["action_dim", "obs_dim"] if policy_class == LOWDIM_POLICY else ["shape_meta"])
        missing = [key for key in required if key not in policy_cfg]
        if missing:
            raise ValueError(f"the checkpoint's cfg.policy ({policy_class}) has no {missing}")
        self.cfg = cfg
        self.policy_class = policy_class
        self.weights = weights
        self._policy_state = policy_state
        self.device = torch.device(device)
        self.dtype = dtype

        is_lowdim = policy_class == LOWDIM_POLICY
        model_cfg = policy_cfg.get("model") if is_lowdim else policy_cfg
        n_groups = (model_cfg or {}).get("n_groups", 8)
        unet_state = {k[len(UNET_PREFIX):]: v for k, v in policy_state.items()
                      if k.startswith(UNET_PREFIX)}
        self.unet_config = unet_config_from_state_dict(unet_state, n_groups=n_groups)
        for dim in self.unet_config["down_dims"]:
            if dim % n_groups:
                raise ValueError(f"the config's n_groups={n_groups} does not divide the U-Net's "
                                 f"{dim} channels")

        self.horizon = _positive_int("cfg.policy.horizon", policy_cfg["horizon"])
        self.n_obs_steps = _positive_int("cfg.policy.n_obs_steps", policy_cfg["n_obs_steps"])
        self.n_action_steps = _positive_int("cfg.policy.n_action_steps",
                                            policy_cfg["n_action_steps"])
        self.obs_as_global_cond = bool(policy_cfg.get("obs_as_global_cond",
                                                      OBS_AS_GLOBAL_COND_DEFAULT[policy_class]))
        self.obs_as_local_cond = bool(policy_cfg.get("obs_as_local_cond", False))
        self.pred_action_steps_only = bool(policy_cfg.get("pred_action_steps_only", False))
        self.oa_step_convention = bool(policy_cfg.get("oa_step_convention", False))
        if is_lowdim:
            self.action_dim = int(policy_cfg["action_dim"])
            self.obs_dim = int(policy_cfg["obs_dim"])
        else:
            self.action_dim = int(policy_cfg["shape_meta"]["action"]["shape"][0])
            self.obs_dim = None
        self._check_against_unet()

        scheduler_cfg = dict(policy_cfg["noise_scheduler"])
        kind = _schedule_kind(scheduler_cfg)
        scheduler_cfg.pop("_target_")
        if num_inference_steps is None:
            num_inference_steps = policy_cfg.get("num_inference_steps")
        if num_inference_steps is None:  # Diffusion Policy's default: every training timestep
            num_inference_steps = scheduler_cfg.get("num_train_timesteps", 1000)
        self.num_inference_steps = _positive_int("num_inference_steps", num_inference_steps)
        self.step_options = _step_options(policy_class, policy_cfg)
        self.schedule = DenoiseSchedule.from_diffusers(scheduler_cfg, self.num_inference_steps,
                                                       kind=kind, **self.step_options)

        unet = ConditionalUnet1D(**self.unet_config)
        unet.load_state_dict(unet_state, strict=True)
        self.unet = unet.to(device=self.device, dtype=dtype).eval()
        self.sampler = GraphedSampler(self.unet, self.schedule, parallel=parallel)

        self.normalizer_params = _normalizer_params(policy_state)
        self.normalizer_params = {
            field: _map_tensors(params, lambda t: t.to(self.device))
            for field, params in self.normalizer_params.items()}
        self._obs_encoder: Optional[torch.nn.Module] = None
        self.check_finite = check_finite_option(check_finite)
        self._guards = {name: FiniteGuard(getattr(self, name), name, self._named_weights)
                        for name in ("predict_action", "predict_action_from_features")}

    def _named_weights(self):
        """The U-Net's weights and the normaliser's scales and offsets, by name: what a
        NonFiniteError about actions names where they are not finite."""
        yield from ((f"unet.{name}", tensor) for name, tensor in self.unet.named_parameters())
        if self._obs_encoder is not None:
            yield from ((f"obs_encoder.{name}", tensor) for name, tensor in self._obs_encoder.named_parameters())
        for field, params in self.normalizer_params.items():
            yield from ((f"normalizer.{field}.{key}", params[key]) for key in ("scale", "offset")
                        if torch.is_tensor(params.get(key)))

    def _guarded(self, name: str, call, **observations):
        """call(), with check_finite checked for NaN and Inf in its named `observations` (tensors
        or arrays, None where absent) and in its result."""
        if not self.check_finite:
            return call()
        given = [found for key, value in observations.items() if value is not None
                 for found in named_arrays(torch.as_tensor(value), key)]
        return self._guards[name].run(call, given)

    def _check_against_unet(self):
        config = self.unet_config
        if self.obs_as_global_cond and self.obs_as_local_cond:
            raise ValueError("cfg.policy sets both obs_as_global_cond and obs_as_local_cond")
        if (config["global_cond_dim"] is not None) != self.obs_as_global_cond:
            raise ValueError(f"cfg.policy.obs_as_global_cond={self.obs_as_global_cond} but the "
                             f"U-Net has global_cond_dim={config['global_cond_dim']}")
        if (config["local_cond_dim"] is not None) != self.obs_as_local_cond:
            raise ValueError(f"cfg.policy.obs_as_local_cond={self.obs_as_local_cond} but the "
                             f"U-Net has local_cond_dim={config['local_cond_dim']}")
        inpainting = not (self.obs_as_global_cond or self.obs_as_local_cond)
        if inpainting:
            # The trajectory is cat(action, observation features).
            self.obs_feature_dim = config["input_dim"] - self.action_dim
            ok = self.obs_feature_dim > 0 and self.obs_dim in (None, self.obs_feature_dim)
        else:
            self.obs_feature_dim = (config["global_cond_dim"] // self.n_obs_steps
                                    if self.obs_as_global_cond else config["local_cond_dim"])
            ok = config["input_dim"] == self.action_dim
        if self.obs_as_global_cond:
            ok = ok and config["global_cond_dim"] == self.obs_feature_dim * self.n_obs_steps
        if self.obs_dim is not None and not inpainting:
            ok = ok and self.obs_feature_dim == self.obs_dim
        if not ok:
            raise ValueError(f"the U-Net (input_dim {config['input_dim']}, global_cond_dim "
                             f"{config['global_cond_dim']}, local_cond_dim "
                             f"{config['local_cond_dim']}) does not fit cfg.policy's action_dim "
                             f"{self.action_dim}, obs_dim {self.obs_dim}, n_obs_steps "
                             f"{self.n_obs_steps}")
        if self.pred_action_steps_only and not self.obs_as_global_cond:
            raise ValueError("cfg.policy.pred_action_steps_only needs obs_as_global_cond")

    # ---------------------------------------------------------------- normaliser
    @property
    def fields(self) -> List[str]:
        """The normaliser's fields ('obs', 'action' for lowdim; the obs keys and 'action' for
        image policies)."""
        return list(self.normalizer_params)

    def _field(self, field: str) -> Dict[str, Any]:
        if field not in self.normalizer_params:
            raise KeyError(f"the checkpoint's normaliser has no field {field!r}; it has "
                           f"{self.fields}")
        params = self.normalizer_params[field]
        if "scale" not in params or "offset" not in params:
            raise ValueError(f"normaliser field {field!r} has no scale/offset")
        return params

    def _affine(self, field: str, x, forward: bool) -> torch.Tensor:
        # Diffusion Policy's normalizer._normalize, op for op: to the params' device and dtype,
        # flatten to [-1, scale.numel()], x * scale + offset (or its inverse).
        params = self._field(field)
        scale, offset = params["scale"], params["offset"]
        x = torch.as_tensor(x).to(device=scale.device, dtype=scale.dtype)
        shape = x.shape
        x = x.reshape(-1, scale.shape[0])
        x = x * scale + offset if forward else (x - offset) / scale
        return x.reshape(shape)

    def normalize(self, field: str, x) -> torch.Tensor:
        """`x * scale + offset` with field `field`'s parameters (Diffusion Policy's
        `normalizer[field].normalize(x)`); the result is in the params' dtype and device."""
        return self._affine(field, x, forward=True)

    def unnormalize(self, field: str, x) -> torch.Tensor:
        """`(x - offset) / scale`: Diffusion Policy's `normalizer[field].unnormalize(x)`."""
        return self._affine(field, x, forward=False)

    # ---------------------------------------------------------------- sampling
    @property
    def trajectory_length(self) -> int:
        """The sampled trajectory's length: n_action_steps with pred_action_steps_only, else
        horizon."""
        return self.n_action_steps if self.pred_action_steps_only else self.horizon

    def sample(self, global_cond: Optional[torch.Tensor] = None,
               local_cond: Optional[torch.Tensor] = None,
               condition_data: Optional[torch.Tensor] = None,
               condition_mask: Optional[torch.Tensor] = None,
               generator: Optional[torch.Generator] = None,
               noise: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Diffusion Policy's `conditional_sample`: the NORMALISED trajectory
        [B, trajectory_length, input_dim] (input_dim = action_dim, or action_dim + observation
        feature dim for inpainting policies, whose actions are `[..., :action_dim]`).

        `global_cond` [B, global_cond_dim] / `local_cond` [B, horizon, local_cond_dim] exactly
        when the U-Net has them; `condition_data` / `condition_mask` (bool) the inpainting
        condition, default zeros / all False (float32 on `device`: the initial noise is drawn
        there, so `generator` must live on `device`, as in Diffusion Policy). `noise`: see
        `GraphedSampler`.
        """
        if condition_mask is not None and condition_data is None:
            raise ValueError("condition_mask without condition_data")
        if condition_data is None:
            batch = next((t.shape[0] for t in (global_cond, local_cond) if t is not None), 1)
            condition_data = torch.zeros(batch, self.trajectory_length,
                                         self.unet_config["input_dim"], device=self.device)
        if condition_mask is None:
            condition_mask = torch.zeros_like(condition_data, dtype=torch.bool)
        return self.sampler(condition_data, condition_mask, local_cond=local_cond,
                            global_cond=global_cond, generator=generator, noise=noise)

    def _action_slice(self, action_pred: torch.Tensor) -> torch.Tensor:
        if self.pred_action_steps_only:
            return action_pred
        if self.policy_class == LOWDIM_POLICY and not self.oa_step_convention:
            start = self.n_obs_steps
        else:
            start = self.n_obs_steps - 1
        return action_pred[:, start:start + self.n_action_steps]

    def _predict(self, global_cond, obs_features, generator, noise) -> Dict[str, torch.Tensor]:
        To, T, Da = self.n_obs_steps, self.horizon, self.action_dim
        local_cond = None
        if self.obs_as_global_cond:
            if global_cond is None or obs_features is not None:
                raise ValueError(f"this policy conditions on global features: pass global_cond "
                                 f"[B, {self.unet_config['global_cond_dim']}] (n_obs_steps x "
                                 f"{self.obs_feature_dim}), not obs_features")
            nsample = self.sample(global_cond=global_cond, generator=generator, noise=noise)
        else:
            if obs_features is None or global_cond is not None:
                raise ValueError(f"this policy conditions on per-step observation features: pass "
                                 f"obs_features [B, >= {To}, {self.obs_feature_dim}], not "
                                 f"global_cond")
            obs_features = torch.as_tensor(obs_features, device=self.device)
            if (obs_features.dim() != 3 or obs_features.shape[1] < To
                    or obs_features.shape[2] != self.obs_feature_dim):
                raise ValueError(f"obs_features must be [B, >= {To}, {self.obs_feature_dim}], got "
                                 f"{list(obs_features.shape)}")
            B = obs_features.shape[0]
            features = obs_features[:, :To].float()
            if self.obs_as_local_cond:
                local_cond = torch.zeros(B, T, self.obs_feature_dim, device=self.device)
                local_cond[:, :To] = features
                nsample = self.sample(local_cond=local_cond, generator=generator, noise=noise)
            else:
                data = torch.zeros(B, T, Da + self.obs_feature_dim, device=self.device)
                mask = torch.zeros_like(data, dtype=torch.bool)
                data[:, :To, Da:] = features
                mask[:, :To, Da:] = True
                nsample = self.sample(condition_data=data, condition_mask=mask,
                                      generator=generator, noise=noise)
        action_pred = self.unnormalize("action", nsample[..., :Da])
        result = {"action": self._action_slice(action_pred), "action_pred": action_pred}
        if not (self.obs_as_global_cond or self.obs_as_local_cond) and "obs" in self.normalizer_params \
                and self.policy_class == LOWDIM_POLICY:
            result["obs_pred"] = self.unnormalize("obs", nsample[..., Da:])
            start = self.n_obs_steps - 1 if self.oa_step_convention else self.n_obs_steps
            result["action_obs_pred"] = result["obs_pred"][:, start:start + self.n_action_steps]
        return result

    def predict_action_from_features(self, global_cond: Optional[torch.Tensor] = None,
                                     generator: Optional[torch.Generator] = None, *,
                                     obs_features: Optional[torch.Tensor] = None,
                                     noise: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The un-normalised actions to execute, [B, n_action_steps, action_dim], from
        NORMALISED observation features: Diffusion Policy's `predict_action` after its
        normalisation (and, for image policies, after its observation encoder).

        - Global-conditioning policies (`obs_as_global_cond`, the image policies' default):
          `global_cond` [B, n_obs_steps * feature_dim], what DP passes to the U-Net: for lowdim
          `normalize('obs', obs)[:, :n_obs_steps].reshape(B, -1)`, for image policies the
          encoder's output on the first n_obs_steps normalised observations,
          `.reshape(B, -1)`.
        - Local-conditioning lowdim policies and inpainting policies (neither flag):
          `obs_features` [B, >= n_obs_steps, feature_dim], the normalised lowdim observations
          (or an image policy's per-step encoder features); the first n_obs_steps are used
          as DP uses them (local_cond zero after them; inpainted into the trajectory's
          observation channels).

        Slicing is DP's: steps [start, start + n_action_steps) of the horizon, start =
        n_obs_steps - 1 for the image policies and for lowdim with oa_step_convention,
        n_obs_steps for lowdim without it; the whole sample with pred_action_steps_only.
        """
        return self._guarded("predict_action_from_features",
                             lambda: self._predict(global_cond, obs_features, generator, noise)["action"],
                             global_cond=global_cond, obs_features=obs_features, noise=noise)

    def predict_action(self, obs_dict: Mapping, generator: Optional[torch.Generator] = None,
                       noise: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
        """Diffusion Policy's `predict_action`, raw observations in, un-normalised actions out:
        {'action', 'action_pred'} (+ 'obs_pred', 'action_obs_pred' for lowdim inpainting
        policies).

        - `DiffusionUnetLowdimPolicy`: {'obs': [B, T_obs >= n_obs_steps, obs_dim]}.
        - `DiffusionUnetImagePolicy`: every key of the config's shape_meta.obs, each
          [B, T_obs >= n_obs_steps, *shape]: cameras (`rgb`) float in [0, 1], [B, T, C, H, W],
          as Diffusion Policy's environments give them; low-dim keys as they are. The
          observation encoder runs in float32 on `device` (built on first use: `obs_encoder`).
        - `DiffusionUnetHybridImagePolicy`: the same inputs; its robomimic ObservationEncoder
          is rebuilt with torchvision alone (dp_hybrid_encoder.py). Where the checkpoint's
          encoder cannot be rebuilt, `obs_encoder` raises ValueError saying why: encode the
          observations yourself and call `predict_action_from_features`.
        """
        if self.policy_class == LOWDIM_POLICY:
            return self._predict_lowdim(obs_dict, generator, noise)
        if not isinstance(obs_dict, Mapping):
            raise TypeError(f"obs_dict must be a mapping of observation name to tensor, got {type(obs_dict).__name__}")
        encoder = self.obs_encoder
        expected = {**self.obs_shapes}
        missing, extra = sorted(set(expected) - set(obs_dict)), sorted(set(obs_dict) - set(expected))
        if missing or extra:
            raise ValueError(f"obs_dict must hold exactly shape_meta's observations {sorted(expected)}: "
                             + ", ".join(filter(None, [missing and f"missing {missing}",
                                                       extra and f"unexpected {extra}"])))
        To, batch, frames = self.n_obs_steps, None, {}
        for key, shape in expected.items():
            value = torch.as_tensor(obs_dict[key])
            if value.dim() != 2 + len(shape) or tuple(value.shape[2:]) != shape or value.shape[1] < To:
                raise ValueError(f"obs_dict[{key!r}] must be [B, >= {To}, {', '.join(map(str, shape))}], got "
                                 f"{list(value.shape)}")
            if not value.is_floating_point():
                raise TypeError(f"obs_dict[{key!r}] must be floating point (cameras in [0, 1]), got {value.dtype}")
            if batch is not None and value.shape[0] != batch:
                raise ValueError(f"obs_dict[{key!r}] holds {value.shape[0]} observations, another input {batch}")
            batch = value.shape[0]
            # DP's normalizer.normalize(obs_dict), then x[:, :To].reshape(-1, *shape) per key.
            frames[key] = self.normalize(key, value)[:, :To].reshape((-1,) + shape)

        def call():
            features = encoder(frames).float()
            if self.obs_as_global_cond:
                return self._predict(features.reshape(batch, -1), None, generator, noise)
            return self._predict(None, features.reshape(batch, To, -1), generator, noise)

        return self._guarded("predict_action", call, noise=noise,
                             **{f"obs_dict[{key!r}]": obs_dict[key] for key in expected})

    def _predict_lowdim(self, obs_dict, generator, noise):
        if "obs" not in obs_dict or "past_action" in obs_dict:
            raise ValueError("obs_dict must have 'obs' (and no 'past_action', which Diffusion "
                             "Policy does not implement either)")
        nobs = self.normalize("obs", obs_dict["obs"])
        if nobs.dim() != 3 or nobs.shape[2] != self.obs_dim or nobs.shape[1] < self.n_obs_steps:
            raise ValueError(f"obs must be [B, >= {self.n_obs_steps}, {self.obs_dim}], got "
                             f"{list(nobs.shape)}")
        if self.obs_as_global_cond:
            call = lambda: self._predict(nobs[:, :self.n_obs_steps].reshape(nobs.shape[0], -1), None, generator, noise)
        else:
            call = lambda: self._predict(None, nobs, generator, noise)
        return self._guarded("predict_action", call, **{"obs_dict['obs']": obs_dict["obs"], "noise": noise})

    @property
    def obs_shapes(self) -> Dict[str, tuple]:
        """The image policies' observations, {key: shape of one step}, cameras ([C, H, W])
        first, then the low-dim keys, each sorted (shape_meta.obs); {} for lowdim policies."""
        if self.policy_class == LOWDIM_POLICY:
            return {}
        rgb, low_dim = obs_keys(self.cfg["policy"]["shape_meta"])
        return {**rgb, **low_dim}

    @property
    def camera_keys(self) -> List[str]:
        """The image policies' camera inputs (shape_meta's `rgb` keys, sorted)."""
        if self.policy_class == LOWDIM_POLICY:
            return []
        return list(obs_keys(self.cfg["policy"]["shape_meta"])[0])

    @property
    def obs_encoder(self) -> torch.nn.Module:
        """The image policies' observation encoder, rebuilt from the config and the
        checkpoint's `obs_encoder.` weights (loaded strictly) on first use, float32 on `device`:
        `DiffusionUnetImagePolicy`'s MultiImageObsEncoder (dp_encoder.py),
        `DiffusionUnetHybridImagePolicy`'s robomimic ObservationEncoder (dp_hybrid_encoder.py).
        ValueError, saying why, where the checkpoint's encoder cannot be rebuilt."""
        if self.policy_class not in IMAGE_POLICIES:
            raise NotImplementedError(f"{self.policy_class} has no observation encoder")
        if self._obs_encoder is None:
            build = build_hybrid_obs_encoder if self.policy_class == HYBRID_POLICY else build_obs_encoder
            try:
                encoder = build(self.cfg["policy"], self.obs_encoder_state_dict())
            except ValueError as error:
                if self.policy_class != HYBRID_POLICY:
                    raise
                raise ValueError(f"{HYBRID_POLICY}'s robomimic observation encoder cannot be rebuilt from this "
                                 f"checkpoint: {error}; encode the normalised observations yourself (weights: "
                                 f"obs_encoder_state_dict()) and call predict_action_from_features") from error
            if encoder.feature_dim != self.obs_feature_dim:
                raise ValueError(f"the rebuilt obs_encoder gives {encoder.feature_dim} features per step, the "
                                 f"U-Net takes {self.obs_feature_dim}")
            self._obs_encoder = encoder.to(self.device)
        return self._obs_encoder

    def obs_encoder_state_dict(self) -> Dict[str, torch.Tensor]:
        """The image policies' observation encoder weights (keys without 'obs_encoder.'; CPU;
        empty for lowdim policies), for running the encoder yourself."""
        return {k[len(OBS_ENCODER_PREFIX):]: v for k, v in self._policy_state.items()
                if k.startswith(OBS_ENCODER_PREFIX)}

    def __repr__(self) -> str:
        mode = ("global cond" if self.obs_as_global_cond else
                "local cond" if self.obs_as_local_cond else "inpainting")
        return (f"DiffusionPolicyCheckpoint({self.policy_class}, {self.weights} weights, {mode}, "
                f"horizon={self.horizon}, n_obs_steps={self.n_obs_steps}, "
                f"n_action_steps={self.n_action_steps}, action_dim={self.action_dim}, "
                f"{self.schedule.kind.upper()} x {self.num_inference_steps}, device={self.device}, "
                f"dtype={self.dtype})")


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) \
            or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _map_tensors(tree, fn):
    if isinstance(tree, Mapping):
        return {k: _map_tensors(v, fn) for k, v in tree.items()}
    return fn(tree) if torch.is_tensor(tree) else tree


# How many of a directory's checkpoints the error for a directory names.
_LISTED_CHECKPOINTS = 3


def _directory_message(path: Path) -> str:
    """What `load_checkpoint(path)` says of a directory: what it takes, and what the
    directory holds that fits (its .ckpt files, Diffusion Policy's checkpoints/ folder among
    them, or a LeRobot folder)."""
    message = (f"path: {path} is a directory; load_checkpoint takes one Diffusion Policy workspace "
               f"checkpoint file (.ckpt, e.g. checkpoints/latest.ckpt of a training run)")
    found = [p for pattern in ("*.ckpt", "checkpoints/*.ckpt") for p in sorted(path.glob(pattern)) if p.is_file()]
    if found:
        names = ", ".join(str(p.relative_to(path)) for p in found[:_LISTED_CHECKPOINTS])
        more = len(found) - _LISTED_CHECKPOINTS
        return message + f"; this one holds {names}" + (f" (+{more} more)" if more > 0 else "")
    if (path / "config.json").is_file() and (path / "model.safetensors").is_file():
        return message + ("; this one looks like a LeRobot policy folder (config.json, model.safetensors): "
                          "load it with load_lerobot_pretrained(folder)")
    return message + "; this one holds no .ckpt file"


def load_checkpoint(path: Union[str, Path], *, device: Union[str, torch.device, None] = None,
                    dtype: Optional[torch.dtype] = None, use_ema: bool = True,
                    num_inference_steps: Optional[int] = None, parallel=None,
                    check_finite: bool = True) -> DiffusionPolicyCheckpoint:
    """Load a Diffusion Policy workspace checkpoint (`.ckpt` from `BaseWorkspace.save_checkpoint`)
    of a U-Net policy (`DiffusionUnetLowdimPolicy`, `DiffusionUnetImagePolicy`,
    `DiffusionUnetHybridImagePolicy`) without the Diffusion Policy repo.

    SECURITY: a checkpoint is a pickle: loading it runs arbitrary code it contains
    (`torch.load(weights_only=False)` is unavoidable for these files). Load only checkpoints
    from a source you trust.

    `device`: where the U-Net, sampler and normaliser live (default: CUDA when available,
    else the CPU); `dtype`: the U-Net's weights (float32, the default, float16 or bfloat16;
    inputs and outputs stay float32, as in Diffusion Policy); `use_ema`: use the EMA weights
    ('ema_model') when the checkpoint has them, else 'model'; `num_inference_steps`:
    overrides cfg.policy.num_inference_steps; `parallel`: sample by Picard iteration
    (GraphedSampler's `parallel`: True, or a Picard(window, tolerance)); `check_finite`:
    predict_action and predict_action_from_features raise NonFiniteError instead of returning
    NaN or Inf actions (DiffusionPolicyCheckpoint).

    Needs `omegaconf` (`pip install omegaconf`); uses `dill` when installed.
    """
    parallel = Picard.of(parallel)
    check_finite = check_finite_option(check_finite)
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(_directory_message(path))
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint file at {path}")
    if dtype not in (None,) + SUPPORTED_DTYPES:
        raise TypeError(f"dtype must be one of {SUPPORTED_DTYPES} (what the fused ops take) or "
                        f"None, got {dtype!r}")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    payload = _read_payload(path)
    cfg = _to_plain(payload["cfg"])
    policy_cfg = cfg.get("policy")
    if not isinstance(policy_cfg, Mapping):
        raise ValueError(f"{path}: the checkpoint's cfg has no 'policy' section")

    state_dicts = payload["state_dicts"]
    weights = "ema_model" if use_ema and state_dicts.get("ema_model") is not None else "model"
    if state_dicts.get(weights) is None:
        raise ValueError(f"{path}: state_dicts has no {weights!r} (it has "
                         f"{sorted(state_dicts)})")
    policy_state = state_dicts[weights]

    policy_class = _policy_class(policy_cfg)
    has_unet = f"{UNET_PREFIX}final_conv.1.weight" in policy_state
    if "Transformer" in policy_class or not has_unet:
        raise ValueError(
            f"{path}: {policy_class}'s weights have no U-Net ('model.final_conv...'): only "
            f"Diffusion Policy's U-Net (CNN) policies {list(SUPPORTED_POLICIES)} are supported, "
            f"transformer policies (TransformerForDiffusion) are not")
    if policy_class not in SUPPORTED_POLICIES:
        raise ValueError(f"{path}: policy {policy_cfg['_target_']!r} is not supported; expected "
                         f"one of {list(SUPPORTED_POLICIES)}")
    return DiffusionPolicyCheckpoint(
        cfg=cfg, policy_class=policy_class, policy_state=policy_state, weights=weights,
        device=torch.device(device), dtype=dtype or torch.float32,
        num_inference_steps=num_inference_steps, parallel=parallel, check_finite=check_finite)
