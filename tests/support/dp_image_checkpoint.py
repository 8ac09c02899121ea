"""Diffusion Policy `DiffusionUnetImagePolicy` workspace checkpoints with a real observation
encoder (dp_policies.MultiImageObsEncoder, DP's module tree on torchvision's ResNet18), and
Diffusion Policy's own predict_action on them, for tests/adapters/test_dp_encoder.py and
tests/serving. Small frames, so that the ResNets run quickly on a CPU."""
import torch

from tests.adapters.test_checkpoint import (ACTION_DIM, SMALL_UNET, dp_expected_actions, dp_normalize,
                                            save_workspace, scheduler_cfg)
from tests.support.dp_policies import MultiImageObsEncoder, get_resnet18
from tests.support.dp_reference import RefUnet, randomize_

CAMERA_SHAPE = (3, 32, 40)
LOW_DIM = 2
ENCODER_TARGET = "diffusion_policy.model.vision.multi_image_obs_encoder.MultiImageObsEncoder"
POLICY_TARGET = "diffusion_policy.policy.diffusion_unet_image_policy.DiffusionUnetImagePolicy"


def image_shape_meta(cameras, camera_shape=CAMERA_SHAPE):
    obs = {f"camera_{i}": {"shape": list(camera_shape), "type": "rgb"} for i in range(cameras)}
    obs["robot_eef_pose"] = {"shape": [LOW_DIM], "type": "low_dim"}
    return {"obs": obs, "action": {"shape": [ACTION_DIM]}}


def encoder_cfg(resize_shape=(24, 32), crop_shape=(20, 28), random_crop=True, use_group_norm=True,
                share_rgb_model=False, imagenet_norm=True):
    """cfg.policy.obs_encoder as DP's train_diffusion_unet_real_image_workspace.yaml writes it."""
    return dict(_target_=ENCODER_TARGET, shape_meta="${shape_meta}",
                rgb_model=dict(_target_="diffusion_policy.model.vision.model_getter.get_resnet", name="resnet18",
                               weights=None),
                resize_shape=None if resize_shape is None else list(resize_shape),
                crop_shape=None if crop_shape is None else list(crop_shape), random_crop=random_crop,
                use_group_norm=use_group_norm, share_rgb_model=share_rgb_model, imagenet_norm=imagenet_norm)


def reference_encoder(shape_meta, cfg, seed=0):
    """DP's MultiImageObsEncoder (the tests' faithful copy) for `cfg`, weights drawn from `seed`
    (GroupNorm's affine parameters too, so that they matter)."""
    torch.manual_seed(seed)
    options = {k: v for k, v in cfg.items() if k not in ("_target_", "shape_meta", "rgb_model")}
    encoder = MultiImageObsEncoder(shape_meta, get_resnet18(), **options)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for module in encoder.modules():
            if isinstance(module, torch.nn.GroupNorm):
                module.weight.copy_(1 + 0.2 * torch.randn(module.weight.shape, generator=g))
                module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=g))
    return encoder.eval()


def unet_and_state(encoder, features, fields, glob, unet=None):
    """A random reference U-Net (SMALL_UNET's widths, or `unet`'s) for `features` encoder
    features per observation step (global conditioning, or inpainting where not `glob`) and
    the policy's state: the U-Net's weights, the encoder's, and a normaliser of `fields`
    ({name: width, or None for a camera: DP's image range normaliser, [0, 1] -> [-1, 1]})."""
    unet_kwargs = dict(input_dim=ACTION_DIM if glob else ACTION_DIM + features, local_cond_dim=None,
                       global_cond_dim=2 * features if glob else None, **(unet or SMALL_UNET))
    ref = randomize_(RefUnet(**unet_kwargs), 3).eval()
    state = {"_dummy_variable": torch.empty(0)}
    state.update({"model." + k: v.clone() for k, v in ref.state_dict().items()})
    state.update({"obs_encoder." + k: v.clone() for k, v in encoder.state_dict().items()})
    g = torch.Generator().manual_seed(7)
    for field, dim in fields.items():
        prefix = f"normalizer.params_dict.{field}."
        if dim is None:
            state[prefix + "scale"], state[prefix + "offset"] = torch.tensor([2.0]), torch.tensor([-1.0])
            dim = 1
        else:
            state[prefix + "scale"] = 0.5 + torch.rand(dim, generator=g)
            state[prefix + "offset"] = torch.randn(dim, generator=g)
        for stat in ("min", "max", "mean", "std"):
            state[prefix + "input_stats." + stat] = torch.randn(dim, generator=g)
    return ref, state


def make_image_checkpoint(tmp_path, cameras=1, name="image.ckpt", obs_mode="global", scheduler="ddpm", steps=3,
                          camera_shape=CAMERA_SHAPE, unet=None, **encoder_options):
    """(path, cfg (resolved), reference encoder, reference U-Net, policy state) of a
    DiffusionUnetImagePolicy checkpoint with `cameras` cameras camera_0... and a low-dim
    robot_eef_pose; n_obs_steps 2, horizon 16, n_action_steps 8; no EMA copy. `unet`: the
    U-Net's widths and options (default SMALL_UNET)."""
    shape_meta = image_shape_meta(cameras, camera_shape)
    enc_cfg = encoder_cfg(**encoder_options)
    encoder = reference_encoder(shape_meta, enc_cfg)
    with torch.no_grad():
        features = encoder({k: torch.zeros((1,) + tuple(v["shape"])) for k, v in shape_meta["obs"].items()}).shape[-1]
    glob = obs_mode == "global"
    fields = {**{f"camera_{i}": None for i in range(cameras)}, "robot_eef_pose": LOW_DIM, "action": ACTION_DIM}
    unet = unet or SMALL_UNET
    ref, state = unet_and_state(encoder, features, fields, glob, unet)
    cfg = dict(name="train_diffusion_unet_image", horizon=16, n_obs_steps=2, n_action_steps=8, shape_meta=shape_meta,
               policy=dict(_target_=POLICY_TARGET, shape_meta="${shape_meta}", noise_scheduler=scheduler_cfg(scheduler),
                           obs_encoder=enc_cfg, horizon="${horizon}", n_action_steps="${n_action_steps}",
                           n_obs_steps="${n_obs_steps}", num_inference_steps=steps, obs_as_global_cond=glob,
                           **unet))
    path = save_workspace(tmp_path / name, cfg, {"model": state})
    resolved = {**cfg, "policy": {**cfg["policy"], "horizon": 16, "n_action_steps": 8, "n_obs_steps": 2,
                                  "shape_meta": shape_meta, "oa_step_convention": True}}
    return path, resolved, encoder, ref, state


def frames(cameras, batch, steps=2, seed=0, camera_shape=CAMERA_SHAPE):
    """{camera: uint8 [batch, steps, C, H, W], robot_eef_pose: float32 [batch, steps, 2]} (numpy)."""
    import numpy as np

    g = np.random.default_rng(seed)
    obs = {f"camera_{i}": g.integers(0, 256, (batch, steps) + tuple(camera_shape), dtype=np.uint8)
           for i in range(cameras)}
    obs["robot_eef_pose"] = g.standard_normal((batch, steps, LOW_DIM)).astype(np.float32)
    return obs


def as_float_obs(obs):
    """The frames as Diffusion Policy's environments give them: float in [0, 1]."""
    return {k: torch.from_numpy(v).float() / 255 if v.dtype.name == "uint8" else torch.from_numpy(v)
            for k, v in obs.items()}


@torch.no_grad()
def dp_predict_action(ck, cfg, encoder, ref, state, obs, seed):
    """Diffusion Policy's DiffusionUnetImagePolicy.predict_action on float observations `obs`,
    with the reference encoder and U-Net, its noise drawn from torch.Generator().manual_seed(seed)."""
    To = 2
    nobs = {k: dp_normalize(state, k, v) for k, v in obs.items()}
    B = next(iter(nobs.values())).shape[0]
    features = encoder({k: v[:, :To].reshape(-1, *v.shape[2:]) for k, v in nobs.items()})
    if cfg["policy"]["obs_as_global_cond"]:
        return dp_expected_actions(ck, ref, cfg, state, global_cond=features.reshape(B, -1), seed=seed)
    return dp_expected_actions(ck, ref, cfg, state, nobs=features.reshape(B, To, -1), seed=seed)
