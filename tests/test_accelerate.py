"""accelerate(policy) on stand-ins for Diffusion Policy's U-Net policies.

`LowdimPolicy` and `ImagePolicy` reproduce what real-stanford/diffusion_policy's
`DiffusionUnetLowdimPolicy` and `DiffusionUnetImagePolicy` / `DiffusionUnetHybridImagePolicy`
do at inference (the attributes accelerate() reads, `conditional_sample` with diffusers'
scheduler, `predict_action` with its mask and condition construction for every way of
passing observations), written independently: the diffusion_policy package is not a
dependency. Their U-Net is `dp_reference.RefUnet`, Diffusion Policy's module tree.
"""
import copy

import pytest
import torch
import torch.nn as nn
from diffusers import DDIMScheduler, DDPMScheduler, DPMSolverMultistepScheduler

from conftest import DEVICES
from diffusion_policy_accelerated import ConditionalUnet1D, accelerate
from diffusion_policy_accelerated.integration import unet_from_diffusion_policy
from dp_reference import RefUnet, randomize_

SCHEDULER_CONFIG = dict(num_train_timesteps=100, beta_schedule="squaredcos_cap_v2", clip_sample=True,
                        prediction_type="epsilon")
UNET_SIZE = dict(diffusion_step_embed_dim=32, down_dims=[32, 64, 128], kernel_size=5)
HORIZON, N_OBS_STEPS, N_ACTION_STEPS = 16, 2, 8
OBS_DIM, ACTION_DIM = 5, 2
IMAGE_SHAPE, AGENT_POS_DIM, IMAGE_FEATURES = (3, 8, 8), 2, 4
# fp32: the accelerated loop differs from the reference by fp32 rounding only (fused ops, the
# split FiLM sum, float32 vs float64 timestep sinusoids), ~1e-6 after a few steps.
ACTION_TOLERANCE = 1e-4


# --------------------------------------------------------------------------------------
# Stand-ins for Diffusion Policy's policies.
# --------------------------------------------------------------------------------------

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

    def __init__(self, model, noise_scheduler, mode, num_inference_steps, **kwargs):
        super().__init__(model, noise_scheduler, num_inference_steps, kwargs)
        self.obs_as_global_cond = mode in ("global", "global_action_steps")
        self.obs_as_local_cond = mode == "local"
        self.pred_action_steps_only = mode == "global_action_steps"
        self.horizon = N_ACTION_STEPS if self.pred_action_steps_only else HORIZON
        self.obs_dim, self.action_dim = OBS_DIM, ACTION_DIM
        self.n_obs_steps, self.n_action_steps = N_OBS_STEPS, N_ACTION_STEPS
        self.oa_step_convention = False
        self.normalizer = Normalizer({"obs": [OBS_DIM], "action": [ACTION_DIM]})

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
    observations [N, ...] to features [N, IMAGE_FEATURES + AGENT_POS_DIM]."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(IMAGE_SHAPE[0], IMAGE_FEATURES, 3, padding=1)

    def forward(self, obs):
        image_features = torch.relu(self.conv(obs["image"])).mean(dim=(2, 3))
        return torch.cat([image_features, obs["agent_pos"]], dim=-1)


OBS_FEATURE_DIM = IMAGE_FEATURES + AGENT_POS_DIM


class ImagePolicy(UnetPolicy):
    """DiffusionUnetImagePolicy / DiffusionUnetHybridImagePolicy at inference (they differ in
    the encoder only); `mode` is 'global' (obs_as_global_cond) or 'inpaint'."""

    def __init__(self, model, noise_scheduler, mode, num_inference_steps, **kwargs):
        super().__init__(model, noise_scheduler, num_inference_steps, kwargs)
        self.obs_encoder = TinyObsEncoder()
        self.obs_as_global_cond = mode == "global"
        self.horizon, self.action_dim, self.obs_feature_dim = HORIZON, ACTION_DIM, OBS_FEATURE_DIM
        self.n_obs_steps, self.n_action_steps = N_OBS_STEPS, N_ACTION_STEPS
        self.normalizer = Normalizer({"image": [IMAGE_SHAPE[0], 1, 1], "agent_pos": [AGENT_POS_DIM],
                                      "action": [ACTION_DIM]})

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


# (policy class, mode, U-Net constructor arguments beyond UNET_SIZE)
POLICIES = {
    "lowdim global cond": (LowdimPolicy, "global", dict(
        input_dim=ACTION_DIM, global_cond_dim=OBS_DIM * N_OBS_STEPS, cond_predict_scale=True)),
    "lowdim global cond, action steps only": (LowdimPolicy, "global_action_steps", dict(
        input_dim=ACTION_DIM, global_cond_dim=OBS_DIM * N_OBS_STEPS, cond_predict_scale=True)),
    "lowdim local cond": (LowdimPolicy, "local", dict(
        input_dim=ACTION_DIM, local_cond_dim=OBS_DIM, n_groups=4)),
    "lowdim inpainting": (LowdimPolicy, "inpaint", dict(input_dim=ACTION_DIM + OBS_DIM)),
    "image global cond": (ImagePolicy, "global", dict(
        input_dim=ACTION_DIM, global_cond_dim=OBS_FEATURE_DIM * N_OBS_STEPS, cond_predict_scale=True)),
    "image inpainting": (ImagePolicy, "inpaint", dict(input_dim=ACTION_DIM + OBS_FEATURE_DIM)),
}


def make_policy(name, device="cpu", scheduler="ddim", num_inference_steps=None, **step_kwargs):
    policy_class, mode, unet_config = POLICIES[name]
    torch.manual_seed(0)
    model = randomize_(RefUnet(**UNET_SIZE, **unet_config), seed=1)
    if scheduler == "ddim":
        noise_scheduler, steps = DDIMScheduler(**SCHEDULER_CONFIG), 8
    else:
        noise_scheduler, steps = DDPMScheduler(**SCHEDULER_CONFIG), 10
    policy = policy_class(model, noise_scheduler, mode, num_inference_steps or steps, **step_kwargs)
    return policy.to(device).eval()


def make_obs(policy, batch, seed):
    generator = torch.Generator().manual_seed(seed)
    frames = lambda *shape: torch.randn(batch, N_OBS_STEPS, *shape, generator=generator)
    if isinstance(policy, LowdimPolicy):
        obs = {"obs": frames(OBS_DIM)}
    else:
        obs = {"image": frames(*IMAGE_SHAPE), "agent_pos": frames(AGENT_POS_DIM)}
    return {key: value.to(policy.device) for key, value in obs.items()}


def predict(policy, obs, seed):
    """predict_action as Diffusion Policy's env runners call it, from a seeded global RNG."""
    torch.manual_seed(seed)
    with torch.no_grad():
        return policy.predict_action(obs)


def max_abs_difference(actual, expected):
    assert actual.keys() == expected.keys()
    for key in expected:
        assert actual[key].shape == expected[key].shape, key
        assert actual[key].dtype == expected[key].dtype, key
        assert actual[key].device == expected[key].device, key
    return max((actual[key] - expected[key]).abs().max().item() for key in expected)


# --------------------------------------------------------------------------------------
# Same actions as the policy itself.
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", POLICIES)
def test_ddim_actions_equal_the_policys_own(name, device):
    """DDIM with eta = 0 draws only the initial trajectory, as Diffusion Policy does, so the
    same seed gives the same actions; several batch sizes and fresh observations per call go
    through one accelerated policy (one CUDA graph per batch size)."""
    reference = make_policy(name, device)
    accelerated = accelerate(copy.deepcopy(reference))
    assert isinstance(accelerated.model, ConditionalUnet1D)
    previous = None
    for call, batch in enumerate([1, 3, 1, 4]):
        obs = make_obs(reference, batch, seed=call)
        expected = predict(reference, obs, seed=call)
        actual = predict(accelerated, obs, seed=call)
        assert max_abs_difference(actual, expected) <= ACTION_TOLERANCE
        if previous is not None and previous["action"].shape == actual["action"].shape:
            assert not torch.allclose(actual["action"], previous["action"])
        previous = actual


@pytest.mark.parametrize("device", DEVICES)
def test_ddim_step_options_reach_the_schedule(device):
    """policy.kwargs (DDIM's eta and use_clipped_model_output) shape the steps as in DP."""
    reference = make_policy("lowdim global cond", device, eta=0.0, use_clipped_model_output=True)
    accelerated = accelerate(copy.deepcopy(reference))
    obs = make_obs(reference, 2, seed=0)
    assert max_abs_difference(predict(accelerated, obs, 0), predict(reference, obs, 0)) <= ACTION_TOLERANCE


@pytest.mark.parametrize("device", DEVICES)
def test_changes_after_accelerate_are_followed(device):
    """Diffusion Policy reads num_inference_steps on every call, and checkpoints are often
    loaded (and accelerated) on the CPU before the policy moves to the GPU."""
    reference = make_policy("image global cond")
    accelerated = accelerate(copy.deepcopy(reference))
    obs = make_obs(reference, 2, seed=0)
    predict(accelerated, obs, 0)
    for policy in (reference, accelerated):
        policy.num_inference_steps = 4
        policy.to(device)
    obs = make_obs(reference, 2, seed=0)
    assert max_abs_difference(predict(accelerated, obs, 0), predict(reference, obs, 0)) <= ACTION_TOLERANCE


def test_ddpm_one_step_adds_no_noise_and_equals_the_policys_own():
    """DDPM adds noise at every timestep but 0; its per-step noise is drawn differently from
    diffusers' (same distribution), so only a single-step loop (timestep 0) compares exactly."""
    reference = make_policy("lowdim global cond", scheduler="ddpm", num_inference_steps=1)
    accelerated = accelerate(copy.deepcopy(reference))
    obs = make_obs(reference, 2, seed=0)
    assert max_abs_difference(predict(accelerated, obs, 0), predict(reference, obs, 0)) <= ACTION_TOLERANCE


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["lowdim local cond", "image inpainting"])
def test_ddpm_actions_are_seeded_and_shaped_like_the_policys_own(name, device):
    reference = make_policy(name, device, scheduler="ddpm")
    accelerated = accelerate(copy.deepcopy(reference))
    for batch in [1, 3]:
        obs = make_obs(reference, batch, seed=batch)
        expected = predict(reference, obs, seed=0)
        first = predict(accelerated, obs, seed=0)
        max_abs_difference(first, expected)  # keys, shapes, dtypes and devices
        assert all(torch.isfinite(value).all() for value in first.values())
        again = predict(accelerated, obs, seed=0)
        assert all(torch.equal(again[key], first[key]) for key in first)
        reseeded = predict(accelerated, obs, seed=1)
        assert not torch.allclose(reseeded["action"], first["action"])


@pytest.mark.parametrize("device", DEVICES)
def test_half_precision_unet_keeps_the_policys_dtype(device):
    reference = make_policy("lowdim global cond", device)
    accelerated = accelerate(copy.deepcopy(reference), dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in accelerated.model.parameters())
    assert accelerated.dtype == torch.float32  # ModuleAttrMixin reads the dummy parameter
    obs = make_obs(reference, 2, seed=0)
    actual, expected = predict(accelerated, obs, 0), predict(reference, obs, 0)
    # bf16 keeps 8 significant bits: measured 0.04 on actions of size ~1, which another seed
    # moves by ~1.
    assert max_abs_difference(actual, expected) < 0.1


# --------------------------------------------------------------------------------------
# What accelerate() does to the policy.
# --------------------------------------------------------------------------------------

def test_policy_keeps_its_state_dict_and_the_original_unet():
    policy = make_policy("lowdim local cond")
    original = policy.model
    keys = list(policy.state_dict())
    assert accelerate(policy) is policy
    assert policy._dpa_original_model is original
    assert list(policy.state_dict()) == keys
    assert not any(p is q for p in policy.parameters() for q in original.parameters())
    for key, value in original.state_dict().items():
        assert torch.equal(policy.model.state_dict()[key], value), key


@pytest.mark.parametrize("name", POLICIES)
def test_unet_constructor_arguments_are_inferred(name):
    _, _, unet_config = POLICIES[name]
    dp_model = randomize_(RefUnet(**UNET_SIZE, **unet_config), seed=2).eval()
    unet = unet_from_diffusion_policy(dp_model)
    expected = ConditionalUnet1D(**UNET_SIZE, **unet_config)
    assert [(k, v.shape) for k, v in unet.state_dict().items()] == \
        [(k, v.shape) for k, v in expected.state_dict().items()]
    assert unet.final_conv[0].block[1].num_groups == 8
    assert unet.down_modules[0][0].blocks[0].block[1].num_groups == unet_config.get("n_groups", 8)
    assert not unet.training


# --------------------------------------------------------------------------------------
# What accelerate() refuses.
# --------------------------------------------------------------------------------------

class TransformerForDiffusion(nn.Module):
    """The shape of Diffusion Policy's transformer noise predictor, as far as accelerate sees."""

    def __init__(self):
        super().__init__()
        self.input_emb = nn.Linear(2, 16)
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, batch_first=True), 1)
        self.head = nn.Linear(16, 2)


def test_training_mode_is_refused():
    policy = make_policy("lowdim global cond").train()
    with pytest.raises(ValueError, match=r"policy.eval\(\)"):
        accelerate(policy)


def test_transformer_policy_is_refused():
    policy = make_policy("lowdim global cond")
    policy.model = TransformerForDiffusion().eval()
    with pytest.raises(TypeError, match="transformer policies"):
        accelerate(policy)


def test_non_policy_is_refused():
    with pytest.raises(TypeError, match="noise_scheduler"):
        accelerate(nn.Linear(2, 2))


@pytest.mark.parametrize("scheduler,step_kwargs,match", [
    ("ddim", dict(variance_noise=None), r"\['variance_noise'\]"),
    ("ddpm", dict(eta=0.5), "DDPM takes neither"),
])
def test_unsupported_step_options_are_refused_and_leave_the_policy_alone(scheduler, step_kwargs, match):
    policy = make_policy("lowdim global cond", scheduler=scheduler, **step_kwargs)
    original = policy.model
    with pytest.raises(ValueError, match=match):
        accelerate(policy)
    assert policy.model is original and "conditional_sample" not in vars(policy)


def test_unsupported_scheduler_is_refused():
    policy = make_policy("lowdim global cond")
    policy.noise_scheduler = DPMSolverMultistepScheduler(num_train_timesteps=100,
                                                         beta_schedule="squaredcos_cap_v2")
    with pytest.raises(ValueError, match="DPMSolverMultistepScheduler"):
        accelerate(policy)


def test_second_accelerate_is_refused():
    policy = accelerate(make_policy("lowdim global cond"))
    with pytest.raises(ValueError, match="already accelerated"):
        accelerate(policy)
