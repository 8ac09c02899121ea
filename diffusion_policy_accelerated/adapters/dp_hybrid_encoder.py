"""Diffusion Policy's hybrid observation encoder (robomimic's), rebuilt from a checkpoint's
config with torchvision alone (neither robomimic nor the Diffusion Policy repo is needed).

`DiffusionUnetHybridImagePolicy` (diffusion_policy/policy/diffusion_unet_hybrid_image_policy.py)
builds robomimic's bc_rnn image config (`get_robomimic_config('bc_rnn', 'image', 'square',
'ph')`) with shape_meta's keys as its observations, and keeps the policy's
`ObservationEncoder` (robomimic/models/obs_nets.py). Its settings are fixed by that config, not
by the checkpoint's: per camera (an `rgb` key) a randomizer CropRandomizer(crop_shape) and a
VisualCore (robomimic/models/obs_core.py):

    ResNet18Conv (torchvision's resnet18 without avgpool and fc; conv1 for input_channel != 3)
    -> SpatialSoftmax(num_kp=32, temperature=1, not learnable, noise_std=0): keypoints [B, 32, 2]
    -> Flatten -> Linear(64, 64)

followed by the encoder's ReLU (feature_activation); low-dim keys pass through flattened. The
features are concatenated in robomimic's order: shape_meta['obs']'s own order (NOT sorted).
DP then replaces every BatchNorm2d by GroupNorm(num_features // 16) (obs_encoder_group_norm)
and robomimic's CropRandomizer by its own (eval_fixed_crop), which crops the centre in eval
mode (torchvision's center_crop); crop_shape None: no crop.

`HybridObsEncoder` is that module at inference, with robomimic's submodule names, so that the
checkpoint's `obs_encoder.` weights load strictly (the VisualCore's backbone and pool appear
twice, as `backbone.` / `pool.` and as `nets.0.` / `nets.1.`, as in robomimic's state_dict).
Without eval_fixed_crop, robomimic 0.2's CropRandomizer (DP's pinned version) crops at random
even in eval mode: this module crops the centre there too, and build_hybrid_obs_encoder warns.
"""
import math
import warnings
from collections.abc import Mapping
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .dp_encoder import _group_norm, load_encoder_weights, obs_keys

__all__ = ["HybridObsEncoder", "build_hybrid_obs_encoder"]

HYBRID_POLICY = "DiffusionUnetHybridImagePolicy"
# DiffusionUnetHybridImagePolicy's defaults for the encoder's settings.
HYBRID_DEFAULTS = dict(crop_shape=(76, 76), obs_encoder_group_norm=False, eval_fixed_crop=False)
# robomimic's image config (modify_config_for_default_image_exp).
NUM_KP, FEATURE_DIMENSION, TEMPERATURE = 32, 64, 1.0


class ResNet18Conv(nn.Module):
    """robomimic's ResNet18Conv: `nets` = torchvision resnet18's children but avgpool and fc."""

    def __init__(self, input_channel: int = 3):
        import torchvision

        super().__init__()
        net = torchvision.models.resnet18(weights=None)
        if input_channel != 3:
            net.conv1 = nn.Conv2d(input_channel, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.nets = nn.Sequential(*(list(net.children())[:-2]))

    def forward(self, x):
        return self.nets(x)


class SpatialSoftmax(nn.Module):
    """robomimic's SpatialSoftmax at inference (num_kp keypoints, no variance, no noise):
    [B, C, H, W] -> [B, num_kp, 2]. pos_x, pos_y and temperature are buffers (loaded)."""

    def __init__(self, input_shape, num_kp: int = NUM_KP, temperature: float = TEMPERATURE):
        super().__init__()
        self._in_c, self._in_h, self._in_w = input_shape
        self._num_kp = num_kp
        self.nets = nn.Conv2d(self._in_c, num_kp, kernel_size=1)
        self.register_buffer("temperature", torch.ones(1) * temperature)
        pos_x, pos_y = torch.meshgrid(torch.linspace(-1.0, 1.0, self._in_w, dtype=torch.float64),
                                      torch.linspace(-1.0, 1.0, self._in_h, dtype=torch.float64), indexing="xy")
        self.register_buffer("pos_x", pos_x.reshape(1, -1).float())
        self.register_buffer("pos_y", pos_y.reshape(1, -1).float())

    def forward(self, feature):
        feature = self.nets(feature).reshape(-1, self._in_h * self._in_w)
        attention = F.softmax(feature / self.temperature, dim=-1)
        expected_x = torch.sum(self.pos_x * attention, dim=1, keepdim=True)
        expected_y = torch.sum(self.pos_y * attention, dim=1, keepdim=True)
        return torch.cat([expected_x, expected_y], 1).view(-1, self._num_kp, 2)


class VisualCore(nn.Module):
    """robomimic's VisualCore of DP's config: ResNet18Conv -> SpatialSoftmax -> Flatten -> Linear."""

    def __init__(self, input_shape):
        super().__init__()
        c, h, w = input_shape
        self.backbone = ResNet18Conv(input_channel=c)
        self.pool = SpatialSoftmax((512, int(math.ceil(h / 32.0)), int(math.ceil(w / 32.0))))
        self.nets = nn.Sequential(self.backbone, self.pool, nn.Flatten(start_dim=1, end_dim=-1),
                                  nn.Linear(NUM_KP * 2, FEATURE_DIMENSION))

    def forward(self, x):
        return self.nets(x)


class CenterCrop(nn.Module):
    """DP's CropRandomizer in eval mode (one crop): torchvision's center_crop."""

    def __init__(self, crop_height: int, crop_width: int):
        super().__init__()
        self.size = (crop_height, crop_width)

    def forward(self, x):
        import torchvision.transforms.functional as ttf

        return ttf.center_crop(x, self.size)


class HybridObsEncoder(nn.Module):
    """robomimic's ObservationEncoder as DP's hybrid policy builds it, at inference (see the
    module doc): `forward({key: [N, *shape]})` -> [N, feature_dim], N frames of normalised
    observations. `keys` is the feature order; `rgb_keys`, `low_dim_keys`, `key_shape_map`."""

    def __init__(self, shape_meta: Mapping, crop_shape=HYBRID_DEFAULTS["crop_shape"],
                 obs_encoder_group_norm: bool = False):
        super().__init__()
        rgb, low_dim = obs_keys(shape_meta, sort=False)
        if not rgb:
            raise ValueError("cfg.policy.shape_meta.obs has no rgb input: nothing for the image encoder to encode")
        self.obs_nets = nn.ModuleDict()
        self.obs_randomizers = nn.ModuleDict()
        self.crops: Dict[str, Optional[Tuple[int, int]]] = {}
        for key, shape in rgb.items():
            size = shape
            if crop_shape is not None:
                ch, cw = (int(d) for d in crop_shape)
                if not (ch < shape[1] and cw < shape[2]):
                    raise ValueError(f"cfg.policy.crop_shape {[ch, cw]} must be smaller than camera {key!r}'s "
                                     f"{list(shape[1:])} frames (robomimic's CropRandomizer)")
                self.obs_randomizers[key] = CenterCrop(ch, cw)
                size = (shape[0], ch, cw)
            core = VisualCore(size)
            self.obs_nets[key] = _group_norm(core) if obs_encoder_group_norm else core
        self.activation = nn.ReLU()
        self.rgb_keys, self.low_dim_keys = list(rgb), list(low_dim)
        self.keys = [k for k in shape_meta["obs"] if k in rgb or k in low_dim]
        self.key_shape_map = {**rgb, **low_dim}
        self.feature_dim = len(rgb) * FEATURE_DIMENSION + sum(math.prod(s) for s in low_dim.values())

    def forward(self, obs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        features: List[torch.Tensor] = []
        for key in self.keys:
            x = obs[key]
            if key in self.obs_nets:
                if key in self.obs_randomizers:
                    x = self.obs_randomizers[key](x)
                x = self.activation(self.obs_nets[key](x))
            features.append(x.reshape(x.shape[0], -1))
        return torch.cat(features, dim=-1)


def build_hybrid_obs_encoder(policy_cfg: Mapping, state: Mapping[str, torch.Tensor]) -> HybridObsEncoder:
    """The `HybridObsEncoder` of a DiffusionUnetHybridImagePolicy's cfg.policy, its weights
    (`state`: the policy's `obs_encoder.` weights without the prefix) loaded strictly, in eval
    mode, on the CPU in float32."""
    options = {k: policy_cfg.get(k, default) for k, default in HYBRID_DEFAULTS.items()}
    crop = options["crop_shape"]
    if crop is not None and (isinstance(crop, (str, Mapping)) or len(crop) != 2):
        raise ValueError(f"cfg.policy.crop_shape must be [h, w] or null, got {crop!r}")
    if crop is not None and not options["eval_fixed_crop"]:
        warnings.warn("cfg.policy.eval_fixed_crop is false: Diffusion Policy (robomimic 0.2's CropRandomizer) "
                      "crops its camera frames at random even at inference; the rebuilt encoder crops the centre",
                      stacklevel=2)
    encoder = HybridObsEncoder(policy_cfg.get("shape_meta"), crop_shape=crop,
                               obs_encoder_group_norm=bool(options["obs_encoder_group_norm"]))
    return load_encoder_weights(encoder, state, f"robomimic's ObservationEncoder of {HYBRID_POLICY}, {options}")
