"""Diffusion Policy's image observation encoder, rebuilt from a checkpoint's config with
torchvision alone (the Diffusion Policy repo is not needed).

`DiffusionUnetImagePolicy` encodes its observations with `MultiImageObsEncoder`
(diffusion_policy/model/vision/multi_image_obs_encoder.py), configured under
`cfg.policy.obs_encoder`:

    obs_encoder:
      _target_: diffusion_policy.model.vision.multi_image_obs_encoder.MultiImageObsEncoder
      shape_meta: ${shape_meta}
      rgb_model: {_target_: diffusion_policy.model.vision.model_getter.get_resnet,
                  name: resnet18, weights: null}
      resize_shape: null        # or [h, w], or {camera: [h, w]}
      crop_shape: [76, 76]      # or {camera: [h, w]}
      random_crop: True
      use_group_norm: True
      share_rgb_model: False
      imagenet_norm: True

`ObsEncoder` is that module at inference, with the same submodule names (so the checkpoint's
`obs_encoder.` weights load strictly): per camera (the `rgb` keys of shape_meta, sorted) a
transform of torchvision's Resize (resize_shape), a centre crop (crop_shape with random_crop:
DP's CropRandomizer, which crops the centre in eval mode; without random_crop DP's code builds
no crop at all, and neither does this) and torchvision's ImageNet Normalize (imagenet_norm),
then the camera's torchvision ResNet (fc = Identity; BatchNorm replaced by
GroupNorm(channels // 16) with use_group_norm, except for a shared model, as in DP), or one
model shared by every camera (share_rgb_model); then the low-dim keys (sorted) appended as
they are. Its input is DP's: the NORMALISED observations, one frame per batch element.

The hybrid policy's robomimic encoder is rebuilt in dp_hybrid_encoder.py.
"""
import copy
from collections.abc import Mapping
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn

__all__ = ["ObsEncoder", "build_obs_encoder", "obs_keys"]

ENCODER_CLASS = "MultiImageObsEncoder"
RGB_MODEL_GETTER = "get_resnet"
RESNETS = ("resnet18", "resnet34", "resnet50")
IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
# MultiImageObsEncoder's constructor arguments, with its defaults.
ENCODER_DEFAULTS = dict(resize_shape=None, crop_shape=None, random_crop=True, use_group_norm=False,
                        share_rgb_model=False, imagenet_norm=False)


def obs_keys(shape_meta: Mapping, sort: bool = True) -> Tuple[Dict[str, Tuple[int, ...]], Dict[str, Tuple[int, ...]]]:
    """({rgb key: (C, H, W)}, {low-dim key: shape}) of shape_meta['obs'], each sorted by key
    (MultiImageObsEncoder's order of the features) or, `sort=False`, in shape_meta's own order
    (robomimic's, the hybrid policy's)."""
    obs = shape_meta.get("obs") if isinstance(shape_meta, Mapping) else None
    if not isinstance(obs, Mapping) or not obs:
        raise ValueError("cfg.policy.shape_meta has no 'obs' entries")
    rgb, low_dim = {}, {}
    for key in sorted(obs) if sort else obs:
        attr = obs[key]
        if not isinstance(attr, Mapping) or not isinstance(attr.get("shape"), (list, tuple)) or \
                not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in attr["shape"]):
            raise ValueError(f"shape_meta.obs.{key} must be a mapping with a 'shape' of positive ints, got {attr!r}")
        shape = tuple(int(d) for d in attr["shape"])
        kind = attr.get("type", "low_dim")
        if kind == "rgb":
            if len(shape) != 3:
                raise ValueError(f"shape_meta.obs.{key}: an rgb input must be [C, H, W], got {list(shape)}")
            rgb[key] = shape
        elif kind == "low_dim":
            low_dim[key] = shape
        else:
            raise ValueError(f"shape_meta.obs.{key}: type {kind!r} is neither 'rgb' nor 'low_dim'")
    return rgb, low_dim


def _per_key(value, key: str, what: str) -> Optional[Tuple[int, int]]:
    if value is None:
        return None
    if isinstance(value, Mapping):
        if key not in value:
            raise ValueError(f"cfg.policy.obs_encoder.{what} has no entry for camera {key!r}")
        value = value[key]
    if not isinstance(value, (list, tuple)) or len(value) != 2 or \
            not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in value):
        raise ValueError(f"cfg.policy.obs_encoder.{what} must be [h, w], positive ints, got {value!r}")
    return int(value[0]), int(value[1])


def _resnet(rgb_cfg: Mapping) -> nn.Module:
    """model_getter.get_resnet(name, weights): torchvision's ResNet, its classifier removed.
    Untrained: the checkpoint's weights replace whatever `weights` named."""
    import torchvision

    target = rgb_cfg.get("_target_") if isinstance(rgb_cfg, Mapping) else None
    name = rgb_cfg.get("name") if isinstance(rgb_cfg, Mapping) else None
    if not isinstance(target, str) or target.rsplit(".", 1)[-1] != RGB_MODEL_GETTER or name not in RESNETS:
        raise ValueError(f"cfg.policy.obs_encoder.rgb_model must be Diffusion Policy's {RGB_MODEL_GETTER} with "
                         f"name in {list(RESNETS)}, got {dict(rgb_cfg) if isinstance(rgb_cfg, Mapping) else rgb_cfg!r}"
                         f" (R3M and other backbones are not rebuilt)")
    kwargs = {k: v for k, v in rgb_cfg.items() if k not in ("_target_", "name", "weights")}
    model = getattr(torchvision.models, name)(weights=None, **kwargs)
    model.fc = nn.Identity()
    return model


def _group_norm(model: nn.Module) -> nn.Module:
    """DP's replace_submodules(BatchNorm2d -> GroupNorm(num_features // 16, num_features))."""
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.BatchNorm2d):
            owner, _, attribute = name.rpartition(".")
            setattr(model.get_submodule(owner) if owner else model, attribute,
                    nn.GroupNorm(module.num_features // 16, module.num_features))
    return model


class ObsEncoder(nn.Module):
    """MultiImageObsEncoder at inference (see the module doc): `forward({key: [N, *shape]})`
    -> [N, feature_dim], N frames of normalised observations. `rgb_keys` / `low_dim_keys`
    (sorted) and `key_shape_map` are DP's; `feature_dim` the output width."""

    def __init__(self, shape_meta: Mapping, rgb_cfg: Mapping, resize_shape=None, crop_shape=None,
                 random_crop: bool = True, use_group_norm: bool = False, share_rgb_model: bool = False,
                 imagenet_norm: bool = False):
        import torchvision

        super().__init__()
        rgb, low_dim = obs_keys(shape_meta)
        if not rgb:
            raise ValueError("cfg.policy.shape_meta.obs has no rgb input: nothing for the image encoder to encode")
        rgb_model = _resnet(rgb_cfg)
        self.key_model_map = nn.ModuleDict()
        self.key_transform_map = nn.ModuleDict()
        if share_rgb_model:
            self.key_model_map["rgb"] = rgb_model  # DP keeps a shared model's BatchNorm
        for key, shape in rgb.items():
            if not share_rgb_model:
                model = copy.deepcopy(rgb_model)
                self.key_model_map[key] = _group_norm(model) if use_group_norm else model
            resizer, cropper, normalizer = nn.Identity(), nn.Identity(), nn.Identity()
            size = shape[1:]
            resize = _per_key(resize_shape, key, "resize_shape")
            if resize is not None:
                resizer = torchvision.transforms.Resize(size=resize)
                size = resize
            crop = _per_key(crop_shape, key, "crop_shape")
            if crop is not None and random_crop:
                if not (crop[0] < size[0] and crop[1] < size[1]):
                    raise ValueError(f"cfg.policy.obs_encoder.crop_shape {list(crop)} of camera {key!r} must be "
                                     f"smaller than its {list(size)} frames (DP's CropRandomizer)")
                cropper = torchvision.transforms.CenterCrop(size=crop)
            if imagenet_norm:
                normalizer = torchvision.transforms.Normalize(mean=IMAGENET_MEAN, std=IMAGENET_STD)
            self.key_transform_map[key] = nn.Sequential(resizer, cropper, normalizer)
        self.share_rgb_model = bool(share_rgb_model)
        self.rgb_keys, self.low_dim_keys = list(rgb), list(low_dim)
        self.key_shape_map = {**rgb, **low_dim}
        self.feature_dim = self._output_width()

    def _output_width(self) -> int:
        with torch.no_grad():
            probe = {k: torch.zeros((1,) + s) for k, s in self.key_shape_map.items()}
            return int(self.eval()(probe).shape[-1])

    def forward(self, obs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        features: List[torch.Tensor] = []
        if self.share_rgb_model:
            batch = obs[self.rgb_keys[0]].shape[0]
            images = torch.cat([self.key_transform_map[k](obs[k]) for k in self.rgb_keys], dim=0)
            feature = self.key_model_map["rgb"](images)
            feature = torch.moveaxis(feature.reshape(-1, batch, *feature.shape[1:]), 0, 1)
            features.append(feature.reshape(batch, -1))
        else:
            features.extend(self.key_model_map[k](self.key_transform_map[k](obs[k])) for k in self.rgb_keys)
        features.extend(obs[k] for k in self.low_dim_keys)
        return torch.cat(features, dim=-1)


def build_obs_encoder(policy_cfg: Mapping, state: Mapping[str, torch.Tensor]) -> ObsEncoder:
    """The `ObsEncoder` of a DiffusionUnetImagePolicy's cfg.policy, its weights (`state`: the
    policy's `obs_encoder.` weights without the prefix) loaded strictly, in eval mode, on the
    CPU in float32."""
    cfg = policy_cfg.get("obs_encoder")
    target = cfg.get("_target_") if isinstance(cfg, Mapping) else None
    if not isinstance(target, str) or target.rsplit(".", 1)[-1] != ENCODER_CLASS:
        raise ValueError(f"cfg.policy.obs_encoder must be Diffusion Policy's {ENCODER_CLASS}, got _target_ "
                         f"{target!r}")
    if "rgb_model" not in cfg:
        raise ValueError("cfg.policy.obs_encoder has no rgb_model: cannot tell which backbone was trained")
    unknown = sorted(set(cfg) - set(ENCODER_DEFAULTS) - {"_target_", "shape_meta", "rgb_model"})
    if unknown:
        raise ValueError(f"cfg.policy.obs_encoder has arguments {unknown} that {ENCODER_CLASS} does not take")
    options = {k: cfg.get(k, default) for k, default in ENCODER_DEFAULTS.items()}
    shape_meta = cfg["shape_meta"] if "shape_meta" in cfg else policy_cfg.get("shape_meta")
    return load_encoder_weights(ObsEncoder(shape_meta, cfg["rgb_model"], **options), state,
                                f"{ENCODER_CLASS}, {options}")


def load_encoder_weights(encoder: nn.Module, state: Mapping[str, torch.Tensor], what: str) -> nn.Module:
    """`encoder` with the checkpoint's obs_encoder weights loaded strictly, in eval mode; a
    ValueError naming `what` (the encoder the config describes) where they do not fit."""
    try:
        result = encoder.load_state_dict(dict(state), strict=False)
    except RuntimeError as error:  # a weight of another shape
        raise ValueError(f"the checkpoint's obs_encoder weights do not fit the encoder its config describes "
                         f"({what}): {error}") from error
    if result.missing_keys or result.unexpected_keys:
        raise ValueError(f"the checkpoint's obs_encoder weights do not fit the encoder its config describes "
                         f"({what}): missing {_listed(result.missing_keys)}, unexpected "
                         f"{_listed(result.unexpected_keys)}")
    return encoder.eval()


def _listed(keys: List[str], limit: int = 4) -> str:
    return "[" + ", ".join(keys[:limit]) + (f", ... ({len(keys)} in all)" if len(keys) > limit else "") + "]"
