"""LeRobot DiffusionPolicy folders with cameras, saved as LeRobot saves them (the policy and
its pre- and postprocessor pipelines with normalisation statistics), for tests/serving and the
load test's LeRobot rows. Needs LeRobot (the callers skip or stop without it)."""
import torch
from lerobot.configs.types import FeatureType, PolicyFeature
from lerobot.policies.diffusion.configuration_diffusion import DiffusionConfig
from lerobot.policies.diffusion.modeling_diffusion import DiffusionPolicy
from lerobot.policies.diffusion.processor_diffusion import make_diffusion_pre_post_processors

STEPS = 3
FRAME = (3, 96, 96)  # the crop (84 x 84) leaves ResNet18 3 x 3 positions for spatial softmax
TO, HORIZON, ACTION_DIM = 2, 16, 2
# The tests' policy: a small U-Net whose every layer matters (its weights tripled), DDIM-3.
SMALL = dict(down_dims=(16, 32), diffusion_step_embed_dim=16, noise_scheduler_type="DDIM", num_inference_steps=STEPS,
             spatial_softmax_num_keypoints=4)


def camera_names(cameras):
    return [f"observation.images.cam_{i}" for i in range(cameras)]


def make_folder(path, cameras=1, env_state=False, seed=0, small=True):
    """A LeRobot image policy of `cameras` cameras ([3, 96, 96] frames, crop 84 x 84) and a 2-dim
    state, random weights from `seed`, saved in `path`: the tests' small one, or, with
    small=False, LeRobot's Push-T configuration as 0.4 defaults it (U-Net 512/1024/2048, 32
    keypoints, DDPM-100, horizon 16, one ResNet18 with GroupNorm for the cameras)."""
    inputs = {"observation.state": PolicyFeature(type=FeatureType.STATE, shape=(2,))}
    for name in camera_names(cameras):
        inputs[name] = PolicyFeature(type=FeatureType.VISUAL, shape=FRAME)
    if env_state:
        inputs["observation.environment_state"] = PolicyFeature(type=FeatureType.ENV, shape=(3,))
    config = DiffusionConfig(input_features=inputs,
                             output_features={"action": PolicyFeature(type=FeatureType.ACTION, shape=(ACTION_DIM,))},
                             n_groups=8, pretrained_backbone_weights=None, use_group_norm=True, crop_shape=(84, 84),
                             horizon=HORIZON, n_action_steps=8, n_obs_steps=TO, device="cpu",
                             **(SMALL if small else {}))
    torch.manual_seed(seed)
    policy = DiffusionPolicy(config).eval()
    if small:
        with torch.no_grad():
            for parameter in policy.diffusion.unet.parameters():
                parameter.mul_(3.0)  # every layer matters
    stats = {"observation.state": {"min": torch.tensor([-1.0, -2.0]), "max": torch.tensor([1.0, 3.0])},
             "action": {"min": torch.tensor([-5.0, 0.0]), "max": torch.tensor([5.0, 10.0])}}
    for i, name in enumerate(camera_names(cameras)):
        stats[name] = {"mean": torch.tensor([0.4, 0.5, 0.6 - 0.1 * i]).view(3, 1, 1),
                       "std": torch.tensor([0.2, 0.25, 0.3]).view(3, 1, 1)}
    if env_state:
        stats["observation.environment_state"] = {"min": -torch.ones(3), "max": torch.ones(3)}
    pre, post = make_diffusion_pre_post_processors(config, dataset_stats=stats)
    for thing in (policy, pre, post):
        thing.save_pretrained(path)
    return path
