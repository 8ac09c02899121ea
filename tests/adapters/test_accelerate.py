"""accelerate(policy) on stand-ins for Diffusion Policy's U-Net policies (dp_policies.py),
whose U-Net is `dp_reference.RefUnet`, Diffusion Policy's module tree."""
import copy

import pytest
import torch
import torch.nn as nn
from diffusers import DDIMScheduler, DDPMScheduler, DPMSolverMultistepScheduler

from tests.support import DEVICES
from diffusion_policy_accelerated import ConditionalUnet1D, Picard, accelerate
from diffusion_policy_accelerated.adapters.diffusion_policy import unet_from_diffusion_policy
from tests.support.dp_policies import ImagePolicy, LowdimPolicy, Sizes, TinyObsEncoder
from tests.support.dp_reference import RefUnet, randomize_

SCHEDULER_CONFIG = dict(num_train_timesteps=100, beta_schedule="squaredcos_cap_v2", clip_sample=True,
                        prediction_type="epsilon")
UNET_SIZE = dict(diffusion_step_embed_dim=32, down_dims=[32, 64, 128], kernel_size=5)
HORIZON, N_OBS_STEPS, N_ACTION_STEPS = 16, 2, 8
OBS_DIM, ACTION_DIM = 5, 2
IMAGE_SHAPE, AGENT_POS_DIM, IMAGE_FEATURES = (3, 8, 8), 2, 4
# fp32: the accelerated loop differs from the reference by fp32 rounding only (fused ops, the
# split FiLM sum, float32 vs float64 timestep sinusoids), ~1e-6 after a few steps.
ACTION_TOLERANCE = 1e-4


OBS_FEATURE_DIM = IMAGE_FEATURES + AGENT_POS_DIM
SIZES = Sizes(HORIZON, N_OBS_STEPS, N_ACTION_STEPS, ACTION_DIM, OBS_DIM)


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
    if policy_class is LowdimPolicy:
        policy = LowdimPolicy(model, noise_scheduler, mode, num_inference_steps or steps, SIZES, **step_kwargs)
    else:
        policy = ImagePolicy(model, noise_scheduler, mode, num_inference_steps or steps, SIZES,
                             TinyObsEncoder(IMAGE_SHAPE[0], IMAGE_FEATURES), OBS_FEATURE_DIM,
                             {"image": IMAGE_SHAPE, "agent_pos": (AGENT_POS_DIM,)}, **step_kwargs)
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
@pytest.mark.parametrize("name", ["lowdim global cond", "image inpainting"])
def test_parallel_sampling_with_tolerance_zero_gives_the_policys_actions(name, device):
    """accelerate(policy, parallel=Picard(window, 0)) samples the sequential trajectory (DDIM: the
    policy's own actions for the same seed), with the whole predict_action in a graph on CUDA."""
    reference = make_policy(name, device)
    accelerated = accelerate(copy.deepcopy(reference), parallel=Picard(window=3, tolerance=0))
    assert accelerated.conditional_sample.sampler_now().parallel == Picard(window=3, tolerance=0)
    for call, batch in enumerate([1, 2]):
        obs = make_obs(reference, batch, seed=call)
        assert max_abs_difference(predict(accelerated, obs, seed=call), predict(reference, obs, seed=call)) \
            <= ACTION_TOLERANCE
    with pytest.raises(ValueError, match="Picard.window must be a positive int"):
        accelerate(copy.deepcopy(reference), parallel=dict(window=0))


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

def test_training_mode_is_refused():
    policy = make_policy("lowdim global cond").train()
    with pytest.raises(ValueError, match=r"policy.eval\(\)"):
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
