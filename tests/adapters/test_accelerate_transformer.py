"""accelerate(policy) on Diffusion Policy's transformer policies (dp_transformer.py, with
TransformerForDiffusion's module tree): the generic path, its actions against the policies' own
eager predict_action, what it leaves of the policy, and what it refuses."""
import copy
import re
import warnings

import pytest
import torch
import torch.nn as nn
from diffusers import DDIMScheduler, DDPMScheduler

from diffusion_policy_accelerated import accelerate
from diffusion_policy_accelerated.sampling.generic import GenericSampler
from tests.adapters.test_accelerate import ACTION_TOLERANCE, SCHEDULER_CONFIG, max_abs_difference, predict
from tests.support import DEVICES
from tests.support.dp_policies import TinyObsEncoder
from tests.support.dp_reference import randomize_
from tests.support.dp_transformer import TransformerForDiffusion, TransformerHybridImagePolicy, TransformerLowdimPolicy

HORIZON, N_OBS_STEPS, N_ACTION_STEPS, OBS_DIM, ACTION_DIM = 10, 2, 8, 5, 2
IMAGE_SHAPE, AGENT_POS_DIM, IMAGE_FEATURES = (3, 8, 8), 2, 4
OBS_FEATURE_DIM = IMAGE_FEATURES + AGENT_POS_DIM
# Diffusion Policy's Push-T transformer (8 layers, 4 heads, width 256), made small.
MODEL_SIZE = dict(n_layer=2, n_head=4, n_emb=32, p_drop_emb=0.0, p_drop_attn=0.3)

# name: (policy kind, obs_as_cond, pred_action_steps_only, TransformerForDiffusion options)
POLICIES = {
    "lowdim obs as cond, causal": ("lowdim", True, False, dict(causal_attn=True)),
    "lowdim obs as cond, cond encoder layers": ("lowdim", True, False, dict(causal_attn=True, n_cond_layers=2)),
    "lowdim action steps only": ("lowdim", True, True, dict(causal_attn=True)),
    "lowdim inpainting": ("lowdim", False, False, dict(causal_attn=True)),
    "lowdim inpainting, encoder only": ("lowdim", False, False, dict(causal_attn=True, time_as_cond=False)),
    "lowdim obs as cond, not causal": ("lowdim", True, False, dict(causal_attn=False)),
    "hybrid image obs as cond": ("image", True, False, dict(causal_attn=True)),
    "hybrid image inpainting": ("image", False, False, dict(causal_attn=True)),
}


def make_policy(name, device="cpu", scheduler="ddim", num_inference_steps=None, **step_kwargs):
    kind, obs_as_cond, action_steps_only, options = POLICIES[name]
    torch.manual_seed(0)
    feature_dim = OBS_DIM if kind == "lowdim" else OBS_FEATURE_DIM
    trajectory_dim = ACTION_DIM if obs_as_cond else ACTION_DIM + feature_dim
    model = TransformerForDiffusion(input_dim=trajectory_dim, output_dim=trajectory_dim,
                                    horizon=N_ACTION_STEPS if action_steps_only else HORIZON, n_obs_steps=N_OBS_STEPS,
                                    cond_dim=feature_dim if obs_as_cond else 0, **MODEL_SIZE, **options)
    model = randomize_(model, seed=1)
    noise_scheduler = (DDIMScheduler if scheduler == "ddim" else DDPMScheduler)(**SCHEDULER_CONFIG)
    steps = num_inference_steps or (8 if scheduler == "ddim" else 10)
    if kind == "lowdim":
        policy = TransformerLowdimPolicy(model, noise_scheduler, HORIZON, OBS_DIM, ACTION_DIM, N_ACTION_STEPS,
                                         N_OBS_STEPS, num_inference_steps=steps, obs_as_cond=obs_as_cond,
                                         pred_action_steps_only=action_steps_only, **step_kwargs)
    else:
        policy = TransformerHybridImagePolicy(model, noise_scheduler, TinyObsEncoder(IMAGE_SHAPE[0], IMAGE_FEATURES),
                                              OBS_FEATURE_DIM, {"image": IMAGE_SHAPE, "agent_pos": (AGENT_POS_DIM,)},
                                              HORIZON, ACTION_DIM, N_ACTION_STEPS, N_OBS_STEPS,
                                              num_inference_steps=steps, obs_as_cond=obs_as_cond, **step_kwargs)
    return policy.to(device).eval()


def make_obs(policy, batch, seed):
    generator = torch.Generator().manual_seed(seed)
    frames = lambda *shape: torch.randn(batch, N_OBS_STEPS, *shape, generator=generator)
    if isinstance(policy, TransformerLowdimPolicy):
        obs = {"obs": frames(OBS_DIM)}
    else:
        obs = {"image": frames(*IMAGE_SHAPE), "agent_pos": frames(AGENT_POS_DIM)}
    return {key: value.to(policy.device) for key, value in obs.items()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", POLICIES)
def test_ddim_actions_equal_the_policys_own(name, device):
    """DDIM (eta 0) draws only the initial trajectory, as Diffusion Policy does: the same seed
    gives the policy's own actions (fp32 rounding), for several batch sizes and fresh
    observations; on CUDA the whole predict_action is one graph per batch size."""
    reference = make_policy(name, device)
    accelerated = accelerate(copy.deepcopy(reference))
    assert isinstance(accelerated.conditional_sample.sampler, GenericSampler)
    previous = None
    for call, batch in enumerate([1, 3, 1, 4]):
        obs = make_obs(reference, batch, seed=call)
        expected, actual = predict(reference, obs, seed=call), predict(accelerated, obs, seed=call)
        assert max_abs_difference(actual, expected) <= ACTION_TOLERANCE
        if previous is not None and previous["action"].shape == actual["action"].shape:
            assert not torch.allclose(actual["action"], previous["action"])
        previous = actual
    if device == "cuda":
        whole = accelerated.predict_action
        assert whole.refused is None and len(whole._graphs) == 3
        assert accelerated.conditional_sample.sampler._graphs == {}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["lowdim obs as cond, causal", "hybrid image inpainting"])
def test_ddpm_actions_are_seeded_and_shaped_like_the_policys_own(name, device):
    """DDPM's step noise comes from one draw (diffusers draws per step): the same distribution,
    not the same numbers; seeded calls repeat, another seed differs."""
    reference = make_policy(name, device, scheduler="ddpm")
    accelerated = accelerate(copy.deepcopy(reference))
    for batch in [1, 3]:
        obs = make_obs(reference, batch, seed=batch)
        first = predict(accelerated, obs, seed=0)
        max_abs_difference(first, predict(reference, obs, seed=0))  # keys, shapes, dtypes and devices
        assert all(torch.isfinite(value).all() for value in first.values())
        again = predict(accelerated, obs, seed=0)
        assert all(torch.equal(again[key], first[key]) for key in first)
        assert not torch.allclose(predict(accelerated, obs, seed=1)["action"], first["action"])


def test_ddpm_one_step_adds_no_noise_and_equals_the_policys_own():
    reference = make_policy("lowdim obs as cond, causal", scheduler="ddpm", num_inference_steps=1)
    accelerated = accelerate(copy.deepcopy(reference))
    obs = make_obs(reference, 2, seed=0)
    assert max_abs_difference(predict(accelerated, obs, 0), predict(reference, obs, 0)) <= ACTION_TOLERANCE


@pytest.mark.parametrize("device", DEVICES)
def test_ddim_step_options_and_changes_after_accelerate_are_followed(device):
    """policy.kwargs reach the schedule; num_inference_steps and the device are read anew."""
    reference = make_policy("lowdim obs as cond, causal", eta=0.0, use_clipped_model_output=True)
    accelerated = accelerate(copy.deepcopy(reference))
    obs = make_obs(reference, 2, seed=0)
    assert max_abs_difference(predict(accelerated, obs, 0), predict(reference, obs, 0)) <= ACTION_TOLERANCE
    for policy in (reference, accelerated):
        policy.num_inference_steps = 4
        policy.to(device)
    obs = make_obs(reference, 2, seed=1)
    assert max_abs_difference(predict(accelerated, obs, 1), predict(reference, obs, 1)) <= ACTION_TOLERANCE
    assert accelerated.conditional_sample.sampler.num_steps == 4


def test_the_policy_keeps_its_model_and_state_dict():
    policy = make_policy("hybrid image obs as cond")
    model, keys = policy.model, list(policy.state_dict())
    assert accelerate(policy) is policy
    assert policy.model is model and policy._dpa_original_model is model
    assert list(policy.state_dict()) == keys
    with pytest.raises(ValueError, match="already accelerated"):
        accelerate(policy)


def test_conditional_sample_takes_the_conditioning_as_the_policys_own_does():
    """Positionally or by name, as the transformer policies' conditional_sample(condition_data,
    condition_mask, cond=None, generator=None, **kwargs) takes it."""
    policy = make_policy("lowdim obs as cond, causal")
    reference = copy.deepcopy(policy)
    accelerate(policy)
    data = torch.zeros(2, HORIZON, ACTION_DIM)
    mask = torch.zeros_like(data, dtype=torch.bool)
    cond = torch.randn(2, N_OBS_STEPS, OBS_DIM)
    expected = reference.conditional_sample(data, mask, cond, generator=torch.Generator().manual_seed(0))
    for args, kwargs in (((cond,), {}), ((), dict(cond=cond))):
        actual = policy.conditional_sample(data, mask, *args, generator=torch.Generator().manual_seed(0), **kwargs)
        assert (actual - expected).abs().max().item() <= ACTION_TOLERANCE
    with pytest.raises(TypeError, match="got multiple values for argument 'cond'"):
        policy.conditional_sample(data, mask, cond, cond=cond)
    with pytest.raises(TypeError, match=re.escape("takes 1 conditioning arguments after condition_mask (['cond']), "
                                                  "got 2 positional ones")):
        policy.conditional_sample(data, mask, cond, None)
    with pytest.raises(ValueError, match=re.escape("scheduler.step keyword arguments ['global_cond']")):
        policy.conditional_sample(data, mask, global_cond=cond)


class NotAModule:
    def __call__(self, sample, timestep, cond=None):
        return sample


class OddSampler:
    """A policy whose conditional_sample is not Diffusion Policy's shape (no generator)."""

    def conditional_sample(self, trajectory, cond):
        return trajectory


@pytest.mark.parametrize("change,options,error,text", [
    (None, dict(dtype=torch.bfloat16), ValueError,
     "dtype: policy.model is a TransformerForDiffusion, which accelerate() runs as it is"),
    (None, dict(parallel=True), ValueError, "parallel: Picard sampling needs Diffusion Policy's ConditionalUnet1D"),
    ("model", {}, TypeError, "policy.model is a NotAModule, not a torch.nn.Module"),
    ("conditional_sample", {}, TypeError, "TransformerLowdimPolicy.conditional_sample(trajectory, cond) is not "
                                          "shaped like Diffusion Policy's"),
    ("parameters", {}, ValueError, "policy.model (Mish) has no floating-point parameter"),
])
def test_what_the_generic_path_refuses_leaves_the_policy_alone(change, options, error, text):
    policy = make_policy("lowdim obs as cond, causal")
    if change == "model":
        vars(policy)["model"] = NotAModule()
    elif change == "conditional_sample":
        policy.conditional_sample = OddSampler().conditional_sample
    elif change == "parameters":
        policy.model = nn.Mish()
    model = policy.model
    with pytest.raises(error, match=re.escape(text)):
        accelerate(policy, **options)
    assert policy.model is model and "_dpa_original_model" not in vars(policy)
    assert "predict_action" not in vars(policy)


@pytest.mark.gpu
def test_unseeded_calls_draw_the_noise_the_eager_calls_draw():
    reference = make_policy("hybrid image obs as cond", "cuda")
    accelerated = accelerate(copy.deepcopy(reference))
    obs = make_obs(reference, 2, seed=0)
    actions = {}
    for name, policy in (("reference", reference), ("accelerated", accelerated)):
        torch.manual_seed(7)
        with torch.no_grad():
            actions[name] = [policy.predict_action(obs) for _ in range(3)]
    for actual, expected in zip(actions["accelerated"], actions["reference"]):
        assert max_abs_difference(actual, expected) <= ACTION_TOLERANCE
    assert accelerated.predict_action.refused is None


@pytest.mark.gpu
def test_whole_graph_off_runs_the_loop_as_the_samplers_own_graph():
    reference = make_policy("lowdim obs as cond, causal", "cuda")
    accelerated = accelerate(copy.deepcopy(reference), whole_graph=False)
    obs = make_obs(reference, 2, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert max_abs_difference(predict(accelerated, obs, 0), predict(reference, obs, 0)) <= ACTION_TOLERANCE
    sampler = accelerated.conditional_sample.sampler
    assert len(sampler._graphs) == 1 and sampler.refused is None
