"""Diffusion Policy `DiffusionUnetHybridImagePolicy` workspace checkpoints whose observation
encoder is robomimic's own (robomimic 0.3's ObservationEncoder, VisualCore, CropRandomizer),
with DP's GroupNorm and CropRandomizer replacements applied as DP applies them
(diffusion_unet_hybrid_image_policy.py), for tests/adapters/test_dp_hybrid_encoder.py and
tests/serving. Needs robomimic (`pip install --no-deps robomimic==0.3.0 termcolor`)."""
import torch
import torch.nn as nn

from tests.adapters.test_checkpoint import ACTION_DIM, SMALL_UNET, save_workspace, scheduler_cfg
from tests.support.dp_image_checkpoint import unet_and_state
from tests.support.dp_policies import replace_submodules

POLICY_TARGET = "diffusion_policy.policy.diffusion_unet_hybrid_image_policy.DiffusionUnetHybridImagePolicy"
CAMERA_SHAPE = (3, 40, 48)
CROP_SHAPE = (33, 41)  # odd margins: torchvision's centre rounds where robomimic's would floor


def hybrid_shape_meta(cameras, camera_shape=CAMERA_SHAPE):
    """Low-dim and camera keys interleaved, not sorted (robomimic keeps shape_meta's order)."""
    obs = {"robot_eef_pos": {"shape": [3], "type": "low_dim"}}
    for i in range(cameras):
        obs[f"view_{cameras - i}_image"] = {"shape": list(camera_shape), "type": "rgb"}
        if i == 0:
            obs["gripper_qpos"] = {"shape": [2]}  # type defaults to low_dim
    return {"obs": obs, "action": {"shape": [ACTION_DIM]}}


class DPCropRandomizer(nn.Module):
    """Diffusion Policy's CropRandomizer (diffusion_policy/model/vision/crop_randomizer.py),
    its eval path: forward_in crops the centre with torchvision, forward_out averages crops."""

    def __init__(self, input_shape, crop_height, crop_width, num_crops=1, pos_enc=False):
        super().__init__()
        assert len(input_shape) == 3 and crop_height < input_shape[1] and crop_width < input_shape[2]
        self.input_shape, self.crop_height, self.crop_width = input_shape, crop_height, crop_width
        self.num_crops, self.pos_enc = num_crops, pos_enc

    def output_shape_in(self, input_shape=None):
        return [self.input_shape[0] + 2 if self.pos_enc else self.input_shape[0], self.crop_height, self.crop_width]

    def output_shape_out(self, input_shape=None):
        return list(input_shape)

    def forward_in(self, inputs):
        import torchvision.transforms.functional as ttf

        assert not self.training
        out = ttf.center_crop(img=inputs, output_size=(self.crop_height, self.crop_width))
        if self.num_crops > 1:
            B, C, H, W = out.shape
            out = out.unsqueeze(1).expand(B, self.num_crops, C, H, W).reshape(-1, C, H, W)
        return out

    def forward_out(self, inputs):
        if self.num_crops <= 1:
            return inputs
        return inputs.reshape(inputs.shape[0] // self.num_crops, self.num_crops, *inputs.shape[1:]).mean(dim=1)


# robomimic's image config as DP gets it (generate_paper_configs.modify_config_for_default_image_exp).
VISUAL_CORE_KWARGS = dict(feature_dimension=64, flatten=True, backbone_class="ResNet18Conv",
                          backbone_kwargs=dict(pretrained=False, input_coord_conv=False), pool_class="SpatialSoftmax",
                          pool_kwargs=dict(num_kp=32, learnable_temperature=False, temperature=1.0, noise_std=0.0))


def robomimic_encoder(shape_meta, crop_shape=CROP_SHAPE, obs_encoder_group_norm=True, eval_fixed_crop=True,
                      seed=0):
    """robomimic's ObservationEncoder as robomimic's obs_encoder_factory builds it for DP's
    hybrid policy (keys in shape_meta's order; ReLU feature activation), then DP's GroupNorm
    and CropRandomizer replacements; GroupNorm affine weights drawn from `seed`; eval mode."""
    from robomimic.models.obs_core import CropRandomizer
    from robomimic.models.obs_nets import ObservationEncoder

    torch.manual_seed(seed)
    encoder = ObservationEncoder(feature_activation=nn.ReLU)
    for key, attr in shape_meta["obs"].items():
        shape = list(attr["shape"])
        if attr.get("type", "low_dim") == "rgb":
            randomizer = None if crop_shape is None else CropRandomizer(
                input_shape=shape, crop_height=crop_shape[0], crop_width=crop_shape[1], num_crops=1, pos_enc=False)
            encoder.register_obs_key(name=key, shape=shape, net_class="VisualCore",
                                     net_kwargs=dict(input_shape=shape, **VISUAL_CORE_KWARGS), randomizer=randomizer)
        else:
            encoder.register_obs_key(name=key, shape=shape)
    encoder.make()
    if obs_encoder_group_norm:
        replace_submodules(encoder, lambda x: isinstance(x, nn.BatchNorm2d),
                           lambda x: nn.GroupNorm(num_groups=x.num_features // 16, num_channels=x.num_features))
    if eval_fixed_crop:
        replace_submodules(encoder, lambda x: isinstance(x, CropRandomizer),
                           lambda x: DPCropRandomizer(input_shape=x.input_shape, crop_height=x.crop_height,
                                                      crop_width=x.crop_width, num_crops=x.num_crops,
                                                      pos_enc=x.pos_enc))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for module in encoder.modules():
            if isinstance(module, (nn.GroupNorm, nn.BatchNorm2d)):
                module.weight.copy_(1 + 0.2 * torch.randn(module.weight.shape, generator=g))
                module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=g))
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.copy_(0.1 * torch.randn(module.running_mean.shape, generator=g))
                module.running_var.copy_(1 + 0.2 * torch.rand(module.running_var.shape, generator=g))
    return encoder.eval()


def make_hybrid_checkpoint(tmp_path, cameras=1, name="hybrid.ckpt", obs_mode="global", scheduler="ddpm", steps=3,
                           crop_shape=CROP_SHAPE, obs_encoder_group_norm=True, eval_fixed_crop=True):
    """(path, cfg (resolved), robomimic encoder, reference U-Net, policy state) of a
    DiffusionUnetHybridImagePolicy checkpoint; n_obs_steps 2, horizon 16, n_action_steps 8."""
    shape_meta = hybrid_shape_meta(cameras)
    encoder = robomimic_encoder(shape_meta, crop_shape, obs_encoder_group_norm, eval_fixed_crop)
    features = encoder.output_shape()[0]
    glob = obs_mode == "global"
    fields = {k: None if a.get("type") == "rgb" else a["shape"][0] for k, a in shape_meta["obs"].items()}
    ref, state = unet_and_state(encoder, features, {**fields, "action": ACTION_DIM}, glob)
    cfg = dict(name="train_diffusion_unet_hybrid", horizon=16, n_obs_steps=2, n_action_steps=8, shape_meta=shape_meta,
               policy=dict(_target_=POLICY_TARGET, shape_meta="${shape_meta}", noise_scheduler=scheduler_cfg(scheduler),
                           horizon="${horizon}", n_action_steps="${n_action_steps}", n_obs_steps="${n_obs_steps}",
                           num_inference_steps=steps, obs_as_global_cond=glob,
                           crop_shape=None if crop_shape is None else list(crop_shape),
                           obs_encoder_group_norm=obs_encoder_group_norm, eval_fixed_crop=eval_fixed_crop,
                           **SMALL_UNET))
    path = save_workspace(tmp_path / name, cfg, {"model": state})
    resolved = {**cfg, "policy": {**cfg["policy"], "horizon": 16, "n_action_steps": 8, "n_obs_steps": 2,
                                  "shape_meta": shape_meta, "oa_step_convention": True}}
    return path, resolved, encoder, ref, state


def hybrid_frames(shape_meta, batch, steps=2, seed=0):
    """{camera: uint8 [batch, steps, C, H, W], low-dim key: float32 [batch, steps, dim]} (numpy)."""
    import numpy as np

    g = np.random.default_rng(seed)
    return {k: g.integers(0, 256, (batch, steps, *a["shape"]), dtype=np.uint8) if a.get("type") == "rgb"
            else g.standard_normal((batch, steps, *a["shape"])).astype(np.float32)
            for k, a in shape_meta["obs"].items()}
