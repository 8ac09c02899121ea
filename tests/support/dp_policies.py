"""Stand-ins for Diffusion Policy's U-Net policies at inference, for the tests and
scripts/benchmark_policy.py.

`LowdimPolicy` and `ImagePolicy` reproduce what real-stanford/diffusion_policy's
`DiffusionUnetLowdimPolicy` and `DiffusionUnetImagePolicy` / `DiffusionUnetHybridImagePolicy`
do at inference (the attributes accelerate() reads, `conditional_sample` with diffusers'
scheduler, `predict_action` with its mask and condition construction for every way of
passing observations), written independently: the diffusion_policy package is not a
dependency (nor on PyPI). Their noise predictor is any module with DP's U-Net interface:
`dp_reference.RefUnet` in the tests. `ResNetObsEncoder` is the image policies' encoder at
Push-T's settings, on torchvision's ResNet18; `MultiImageObsEncoder` is DP's own encoder
module tree (torchvision's Resize and Normalize, DP's CropRandomizer), which its real-robot
configuration builds with ImageNet normalisation, a resize and a crop (`real_robot_encoder`).
"""
from typing import NamedTuple

import torch
import torch.nn as nn


class Sizes(NamedTuple):
    horizon: int
    n_obs_steps: int
    n_action_steps: int
    action_dim: int
    obs_dim: int = 0  # lowdim policies' observation width


class AffineField(nn.Module):
    """One field of Diffusion Policy's LinearNormalizer: x * scale + offset."""

    def __init__(self, shape, generator):
        super().__init__()
        self.register_buffer("scale", 1 + torch.rand(shape, generator=generator))
        self.register_buffer("offset", torch.randn(shape, generator=generator))

    def normalize(self, x):
        return x * self.scale + self.offset

    def unnormalize(self, x):
        return (x - self.offset) / self.scale


class Normalizer(nn.Module):
    """LinearNormalizer's inference interface: `normalizer[key]` and `normalize(obs_dict)`."""

    def __init__(self, field_shapes, seed=0):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.fields = nn.ModuleDict({key: AffineField(shape, generator)
                                     for key, shape in field_shapes.items()})

    def __getitem__(self, key):
        return self.fields[key]

    def normalize(self, data):
        return {key: self.fields[key].normalize(value) for key, value in data.items()}


class UnetPolicy(nn.Module):
    """What the U-Net policies share: ModuleAttrMixin's device/dtype (a dummy parameter,
    registered first) and the sampling loop."""

    def __init__(self, model, noise_scheduler, num_inference_steps, kwargs):
        super().__init__()
        self._dummy_variable = nn.Parameter()
        self.model = model
        self.noise_scheduler = noise_scheduler
        self.num_inference_steps = num_inference_steps
        # Diffusion Policy passes these to scheduler.step.
        self.kwargs = kwargs

    @property
    def device(self):
        return next(iter(self.parameters())).device

    @property
    def dtype(self):
        return next(iter(self.parameters())).dtype

    def conditional_sample(self, condition_data, condition_mask, local_cond=None, global_cond=None,
                           generator=None, **kwargs):
        trajectory = torch.randn(condition_data.shape, dtype=condition_data.dtype,
                                 device=condition_data.device, generator=generator)
        self.noise_scheduler.set_timesteps(self.num_inference_steps)
        for t in self.noise_scheduler.timesteps:
            trajectory[condition_mask] = condition_data[condition_mask]
            model_output = self.model(trajectory, t, local_cond=local_cond, global_cond=global_cond)
            trajectory = self.noise_scheduler.step(model_output, t, trajectory, generator=generator,
                                                   **kwargs).prev_sample
        trajectory[condition_mask] = condition_data[condition_mask]
        return trajectory


class LowdimPolicy(UnetPolicy):
    """DiffusionUnetLowdimPolicy at inference; `mode` is how observations reach the U-Net:
    'global' (obs_as_global_cond), 'global_action_steps' (the same with
    pred_action_steps_only), 'local' (obs_as_local_cond) or 'inpaint' (neither)."""

    def __init__(self, model, noise_scheduler, mode, num_inference_steps, sizes, **kwargs):
        super().__init__(model, noise_scheduler, num_inference_steps, kwargs)
        self.obs_as_global_cond = mode in ("global", "global_action_steps")
        self.obs_as_local_cond = mode == "local"
        self.pred_action_steps_only = mode == "global_action_steps"
        self.horizon = sizes.n_action_steps if self.pred_action_steps_only else sizes.horizon
        self.obs_dim, self.action_dim = sizes.obs_dim, sizes.action_dim
        self.n_obs_steps, self.n_action_steps = sizes.n_obs_steps, sizes.n_action_steps
        self.oa_step_convention = False
        self.normalizer = Normalizer({"obs": [sizes.obs_dim], "action": [sizes.action_dim]})

    def predict_action(self, obs_dict):
        nobs = self.normalizer["obs"].normalize(obs_dict["obs"])
        batch, n_obs, action_dim = nobs.shape[0], self.n_obs_steps, self.action_dim
        like = dict(device=self.device, dtype=self.dtype)
        local_cond = global_cond = None
        if self.obs_as_local_cond:
            # The observed steps, zero elsewhere, alongside the trajectory.
            local_cond = torch.zeros(batch, self.horizon, self.obs_dim, **like)
            local_cond[:, :n_obs] = nobs[:, :n_obs]
            cond_data = torch.zeros(batch, self.horizon, action_dim, **like)
            cond_mask = torch.zeros_like(cond_data, dtype=torch.bool)
        elif self.obs_as_global_cond:
            global_cond = nobs[:, :n_obs].reshape(batch, -1)
            length = self.n_action_steps if self.pred_action_steps_only else self.horizon
            cond_data = torch.zeros(batch, length, action_dim, **like)
            cond_mask = torch.zeros_like(cond_data, dtype=torch.bool)
        else:
            # Inpainting: the trajectory holds actions and observations, the observed ones fixed.
            cond_data = torch.zeros(batch, self.horizon, action_dim + self.obs_dim, **like)
            cond_mask = torch.zeros_like(cond_data, dtype=torch.bool)
            cond_data[:, :n_obs, action_dim:] = nobs[:, :n_obs]
            cond_mask[:, :n_obs, action_dim:] = True
        nsample = self.conditional_sample(cond_data, cond_mask, local_cond=local_cond,
                                          global_cond=global_cond, **self.kwargs)
        action_pred = self.normalizer["action"].unnormalize(nsample[..., :action_dim])
        start = n_obs - 1 if self.oa_step_convention else n_obs
        end = start + self.n_action_steps
        result = {"action": action_pred if self.pred_action_steps_only else action_pred[:, start:end],
                  "action_pred": action_pred}
        if not (self.obs_as_local_cond or self.obs_as_global_cond):
            obs_pred = self.normalizer["obs"].unnormalize(nsample[..., action_dim:])
            result["obs_pred"] = obs_pred
            result["action_obs_pred"] = obs_pred[:, start:end]
        return result


class TinyObsEncoder(nn.Module):
    """Stands in for the image policies' observation encoder: a dict of per-frame
    observations [N, ...] to features [N, features + agent_pos_dim]."""

    def __init__(self, image_channels, features):
        super().__init__()
        self.conv = nn.Conv2d(image_channels, features, 3, padding=1)

    def forward(self, obs):
        image_features = torch.relu(self.conv(obs["image"])).mean(dim=(2, 3))
        return torch.cat([image_features, obs["agent_pos"]], dim=-1)


def resnet18_group_norm():
    """Diffusion Policy's image backbone: torchvision's ResNet18 (untrained) without its
    classifier, every BatchNorm replaced by a GroupNorm of channels // 16 groups
    (diffusion_policy/model/vision/model_getter.py and replace_bn_with_gn): [N, 3, H, W] to
    [N, 512]."""
    return batch_norm_to_group_norm(get_resnet18())


def get_resnet18():
    """model_getter.get_resnet('resnet18', weights=None): untrained, its classifier removed."""
    import torchvision

    model = torchvision.models.resnet18(weights=None)
    model.fc = nn.Identity()
    return model


def replace_submodules(root_module, predicate, func):
    """Diffusion Policy's diffusion_policy/common/pytorch_util.py replace_submodules."""
    if predicate(root_module):
        return func(root_module)
    bn_list = [k.split('.') for k, m in root_module.named_modules(remove_duplicate=True) if predicate(m)]
    for *parent, k in bn_list:
        parent_module = root_module
        if len(parent) > 0:
            parent_module = root_module.get_submodule('.'.join(parent))
        if isinstance(parent_module, nn.Sequential):
            src_module = parent_module[int(k)]
        else:
            src_module = getattr(parent_module, k)
        tgt_module = func(src_module)
        if isinstance(parent_module, nn.Sequential):
            parent_module[int(k)] = tgt_module
        else:
            setattr(parent_module, k, tgt_module)
    return root_module


def batch_norm_to_group_norm(model):
    """Every BatchNorm2d of `model` replaced by a GroupNorm of channels // 16 groups, in place
    (Diffusion Policy's use_group_norm)."""
    return replace_submodules(model, lambda x: isinstance(x, nn.BatchNorm2d),
                              lambda x: nn.GroupNorm(num_groups=x.num_features // 16, num_channels=x.num_features))


class CropRandomizer(nn.Module):
    """Diffusion Policy's CropRandomizer (diffusion_policy/model/vision/crop_randomizer.py) at
    inference: torchvision's center_crop to (crop_height, crop_width), repeated num_crops
    times. Its training-time random crops are not copied."""

    def __init__(self, input_shape, crop_height, crop_width, num_crops=1, pos_enc=False):
        super().__init__()
        assert len(input_shape) == 3 and crop_height < input_shape[1] and crop_width < input_shape[2]
        self.input_shape, self.crop_height, self.crop_width = input_shape, crop_height, crop_width
        self.num_crops, self.pos_enc = num_crops, pos_enc

    def forward(self, inputs):
        import torchvision.transforms.functional as ttf

        assert len(inputs.shape) >= 3
        if self.training:
            raise NotImplementedError("the stand-in's CropRandomizer is for inference (eval mode)")
        out = ttf.center_crop(img=inputs, output_size=(self.crop_height, self.crop_width))
        if self.num_crops > 1:
            B, C, H, W = out.shape
            out = out.unsqueeze(1).expand(B, self.num_crops, C, H, W).reshape(-1, C, H, W)
        return out


class MultiImageObsEncoder(nn.Module):
    """Diffusion Policy's MultiImageObsEncoder (diffusion_policy/model/vision/
    multi_image_obs_encoder.py): per camera (`rgb` keys of shape_meta, sorted) a transform of
    torchvision's Resize, DP's CropRandomizer (random_crop; a centre crop in eval mode) and
    torchvision's ImageNet Normalize (imagenet_norm), then its own copy of `rgb_model` (or one
    shared model), then the low-dim keys (sorted) appended as they are."""

    def __init__(self, shape_meta, rgb_model, resize_shape=None, crop_shape=None, random_crop=True,
                 use_group_norm=False, share_rgb_model=False, imagenet_norm=False):
        import copy

        import torchvision

        super().__init__()
        rgb_keys, low_dim_keys = [], []
        key_model_map, key_transform_map, key_shape_map = nn.ModuleDict(), nn.ModuleDict(), {}
        if share_rgb_model:
            key_model_map["rgb"] = rgb_model
        for key, attr in shape_meta["obs"].items():
            shape = tuple(attr["shape"])
            key_shape_map[key] = shape
            if attr.get("type", "low_dim") == "low_dim":
                low_dim_keys.append(key)
                continue
            rgb_keys.append(key)
            if not share_rgb_model:
                this_model = rgb_model[key] if isinstance(rgb_model, dict) else copy.deepcopy(rgb_model)
                key_model_map[key] = batch_norm_to_group_norm(this_model) if use_group_norm else this_model
            input_shape, this_resizer, this_randomizer = shape, nn.Identity(), nn.Identity()
            if resize_shape is not None:
                h, w = resize_shape[key] if isinstance(resize_shape, dict) else resize_shape
                this_resizer = torchvision.transforms.Resize(size=(h, w))
                input_shape = (shape[0], h, w)
            if crop_shape is not None:
                h, w = crop_shape[key] if isinstance(crop_shape, dict) else crop_shape
                if random_crop:
                    this_randomizer = CropRandomizer(input_shape=input_shape, crop_height=h, crop_width=w)
                # DP builds a CenterCrop here without random_crop and then overwrites it with the
                # normaliser below: that configuration does not crop.
            this_normalizer = nn.Identity()
            if imagenet_norm:
                this_normalizer = torchvision.transforms.Normalize(mean=[0.485, 0.456, 0.406],
                                                                   std=[0.229, 0.224, 0.225])
            key_transform_map[key] = nn.Sequential(this_resizer, this_randomizer, this_normalizer)
        self.shape_meta = shape_meta
        self.key_model_map, self.key_transform_map = key_model_map, key_transform_map
        self.share_rgb_model = share_rgb_model
        self.rgb_keys, self.low_dim_keys = sorted(rgb_keys), sorted(low_dim_keys)
        self.key_shape_map = key_shape_map

    def forward(self, obs_dict):
        batch_size, features = None, []
        if self.share_rgb_model:
            imgs = []
            for key in self.rgb_keys:
                img = obs_dict[key]
                batch_size = img.shape[0] if batch_size is None else batch_size
                assert batch_size == img.shape[0] and img.shape[1:] == self.key_shape_map[key]
                imgs.append(self.key_transform_map[key](img))
            feature = self.key_model_map["rgb"](torch.cat(imgs, dim=0))
            feature = torch.moveaxis(feature.reshape(-1, batch_size, *feature.shape[1:]), 0, 1)
            features.append(feature.reshape(batch_size, -1))
        else:
            for key in self.rgb_keys:
                img = obs_dict[key]
                batch_size = img.shape[0] if batch_size is None else batch_size
                assert batch_size == img.shape[0] and img.shape[1:] == self.key_shape_map[key]
                features.append(self.key_model_map[key](self.key_transform_map[key](img)))
        for key in self.low_dim_keys:
            data = obs_dict[key]
            batch_size = data.shape[0] if batch_size is None else batch_size
            assert batch_size == data.shape[0] and data.shape[1:] == self.key_shape_map[key]
            features.append(data)
        return torch.cat(features, dim=-1)


def real_robot_encoder(cameras, camera_shape=(3, 240, 320), resize_shape=(240, 320), crop_shape=(216, 288),
                       low_dim_dim=2):
    """The observation encoder of Diffusion Policy's real-robot image configuration
    (train_diffusion_unet_real_image_workspace.yaml: one untrained ResNet18 with GroupNorm per
    camera, imagenet_norm, resize_shape [240, 320], crop_shape [216, 288], random_crop) for
    `cameras` cameras `camera_0`... of `camera_shape` and a low-dim `robot_eef_pose`; returns
    (encoder, feature width, observation shapes)."""
    obs = {f"camera_{i}": {"shape": list(camera_shape), "type": "rgb"} for i in range(cameras)}
    obs["robot_eef_pose"] = {"shape": [low_dim_dim], "type": "low_dim"}
    encoder = MultiImageObsEncoder({"obs": obs}, get_resnet18(), resize_shape=list(resize_shape),
                                   crop_shape=list(crop_shape), random_crop=True, use_group_norm=True,
                                   share_rgb_model=False, imagenet_norm=True)
    return encoder, 512 * cameras + low_dim_dim, {key: tuple(value["shape"]) for key, value in obs.items()}


class ResNetObsEncoder(nn.Module):
    """Diffusion Policy's MultiImageObsEncoder at inference with one ResNet18-GroupNorm per
    camera (share_rgb_model False): each camera's frames centre-cropped to `crop`, normalised
    with ImageNet's statistics, encoded to 512 features; then the low-dim keys appended as
    they are, in DP's order (cameras, then low-dim keys)."""

    def __init__(self, cameras, crop, low_dim_keys=("agent_pos",)):
        super().__init__()
        self.cameras, self.crop, self.low_dim_keys = list(cameras), crop, list(low_dim_keys)
        self.backbones = nn.ModuleDict({key: resnet18_group_norm() for key in self.cameras})
        self.register_buffer("mean", torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1))

    def forward(self, obs):
        features = []
        for key in self.cameras:
            image = obs[key]
            top, left = (image.shape[-2] - self.crop) // 2, (image.shape[-1] - self.crop) // 2
            image = image[..., top:top + self.crop, left:left + self.crop]
            features.append(self.backbones[key]((image - self.mean) / self.std))
        return torch.cat(features + [obs[key] for key in self.low_dim_keys], dim=-1)


class ImagePolicy(UnetPolicy):
    """DiffusionUnetImagePolicy / DiffusionUnetHybridImagePolicy at inference (they differ in
    the encoder only); `mode` is 'global' (obs_as_global_cond) or 'inpaint'."""

    def __init__(self, model, noise_scheduler, mode, num_inference_steps, sizes, obs_encoder, obs_feature_dim,
                 obs_shapes, **kwargs):
        super().__init__(model, noise_scheduler, num_inference_steps, kwargs)
        self.obs_encoder = obs_encoder
        self.obs_as_global_cond = mode == "global"
        self.horizon, self.action_dim, self.obs_feature_dim = sizes.horizon, sizes.action_dim, obs_feature_dim
        self.n_obs_steps, self.n_action_steps = sizes.n_obs_steps, sizes.n_action_steps
        # LinearNormalizer's fields: per channel for images, per element for vectors.
        fields = {key: [shape[0], 1, 1] if len(shape) == 3 else list(shape) for key, shape in obs_shapes.items()}
        self.normalizer = Normalizer({**fields, "action": [sizes.action_dim]})

    def predict_action(self, obs_dict):
        nobs = self.normalizer.normalize(obs_dict)
        batch = next(iter(nobs.values())).shape[0]
        n_obs, action_dim = self.n_obs_steps, self.action_dim
        like = dict(device=self.device, dtype=self.dtype)
        # Every observed frame goes through the encoder as its own batch element.
        frames = {key: value[:, :n_obs].flatten(0, 1) for key, value in nobs.items()}
        features = self.obs_encoder(frames)
        global_cond = None
        if self.obs_as_global_cond:
            global_cond = features.reshape(batch, -1)
            cond_data = torch.zeros(batch, self.horizon, action_dim, **like)
            cond_mask = torch.zeros_like(cond_data, dtype=torch.bool)
        else:
            cond_data = torch.zeros(batch, self.horizon, action_dim + self.obs_feature_dim, **like)
            cond_mask = torch.zeros_like(cond_data, dtype=torch.bool)
            cond_data[:, :n_obs, action_dim:] = features.reshape(batch, n_obs, -1)
            cond_mask[:, :n_obs, action_dim:] = True
        nsample = self.conditional_sample(cond_data, cond_mask, global_cond=global_cond, **self.kwargs)
        action_pred = self.normalizer["action"].unnormalize(nsample[..., :action_dim])
        start = n_obs - 1
        return {"action": action_pred[:, start:start + self.n_action_steps], "action_pred": action_pred}
