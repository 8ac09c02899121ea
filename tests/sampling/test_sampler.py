"""GraphedSampler: the hoisted (and, on CUDA, graph-captured) loop against Diffusion Policy's
eager loop with the plain-PyTorch U-Net."""
import re

import pytest
import torch
from diffusers import DDIMScheduler, DDPMScheduler

from diffusion_policy_accelerated import ConditionalUnet1D, DenoiseSchedule
from diffusion_policy_accelerated.sampling.sampler import GraphedSampler
from tests.support import DEVICES

SCHEDULER_CONFIG = dict(num_train_timesteps=100, beta_schedule="squaredcos_cap_v2", clip_sample=True,
                        prediction_type="epsilon")
SMALL_UNET = dict(input_dim=2, global_cond_dim=6, down_dims=[32, 64, 128], kernel_size=5,
                  cond_predict_scale=True)
# fp32 over a whole loop: the fused ops and the split FiLM sum each differ from plain PyTorch
# by fp32 rounding (~1e-7 relative per layer); through 8-10 steps that stays well below 1e-4.
TOLERANCE = dict(atol=1e-4, rtol=1e-4)


def reference_loop(unet, schedule, condition_data, condition_mask, noise, local_cond=None,
                   global_cond=None):
    """Diffusion Policy's conditional_sample with the plain U-Net and diffusers' step math
    (`reference_step` equals diffusers' `step` bit for bit, see test_schedulers.py)."""
    unet.use_fused_ops = False
    try:
        trajectory = noise[0].clone()
        for i, t in enumerate(schedule.timesteps):
            trajectory[condition_mask] = condition_data[condition_mask]
            model_output = unet(trajectory, t.to(trajectory.device), local_cond=local_cond,
                                global_cond=global_cond)
            trajectory = schedule.reference_step(model_output, i, trajectory,
                                                 noise[i + 1] if schedule.needs_noise(i) else None)
        trajectory[condition_mask] = condition_data[condition_mask]
        return trajectory
    finally:
        unet.use_fused_ops = True


def build(device, scheduler="ddim", steps=8, eta=0.0, **unet_changes):
    torch.manual_seed(0)
    unet = ConditionalUnet1D(**{**SMALL_UNET, **unet_changes}).to(device).eval()
    if scheduler == "ddim":
        schedule = DenoiseSchedule.from_diffusers(DDIMScheduler(**SCHEDULER_CONFIG), steps, eta=eta)
    else:
        schedule = DenoiseSchedule.from_diffusers(DDPMScheduler(**SCHEDULER_CONFIG), steps)
    return unet, schedule, GraphedSampler(unet, schedule)


def make_inputs(batch, device, seed, steps, global_dim=6, local_dim=None, horizon=16, action_dim=2):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(device)
    return dict(
        condition_data=rand(batch, horizon, action_dim),
        condition_mask=(torch.rand(batch, horizon, action_dim, generator=g) < 0.25).to(device),
        global_cond=rand(batch, global_dim) if global_dim else None,
        local_cond=rand(batch, horizon, local_dim) if local_dim else None,
        noise=rand(steps + 1, batch, horizon, action_dim))


CASES = {
    "ddim global cond": dict(scheduler="ddim"),
    "ddim eta 0.5": dict(scheduler="ddim", eta=0.5),
    "ddpm global cond": dict(scheduler="ddpm", steps=10),
    "ddpm local + global cond, no FiLM scale": dict(scheduler="ddpm", steps=10, local_cond_dim=3,
                                                    cond_predict_scale=False),
    "ddim local cond only": dict(scheduler="ddim", local_cond_dim=3, global_cond_dim=None),
    "ddim no cond (inpainting)": dict(scheduler="ddim", global_cond_dim=None),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES)
def test_matches_eager_reference_loop(case, device):
    unet, schedule, sampler = build(device, **CASES[case])
    local_dim = CASES[case].get("local_cond_dim")
    global_dim = CASES[case].get("global_cond_dim", SMALL_UNET["global_cond_dim"])
    # Several batch sizes through one sampler (one graph each on CUDA), fresh inputs per call.
    for call, batch in enumerate([1, 3, 1, 8]):
        kwargs = make_inputs(batch, device, seed=call, steps=len(schedule.timesteps),
                             global_dim=global_dim, local_dim=local_dim)
        expected = reference_loop(unet, schedule, **kwargs)
        actual = sampler(**kwargs)
        assert actual.shape == expected.shape and actual.dtype == expected.dtype
        torch.testing.assert_close(actual, expected, **TOLERANCE)


@pytest.mark.parametrize("device", DEVICES)
def test_ddim_equals_diffusion_policy_with_same_rng(device):
    """Without explicit noise the initial trajectory is Diffusion Policy's own first draw, so
    a DDIM (eta = 0) action equals the one DP's loop with diffusers computes from the same
    generator state."""
    unet, schedule, sampler = build(device)
    scheduler = DDIMScheduler(**SCHEDULER_CONFIG)
    scheduler.set_timesteps(len(schedule.timesteps))
    kwargs = make_inputs(2, device, seed=5, steps=len(schedule.timesteps))
    kwargs.pop("noise")
    unet.use_fused_ops = False
    trajectory = torch.randn(kwargs["condition_data"].shape, device=device,
                             generator=torch.Generator(device).manual_seed(7))
    for t in scheduler.timesteps:
        trajectory[kwargs["condition_mask"]] = kwargs["condition_data"][kwargs["condition_mask"]]
        eps = unet(trajectory, t, global_cond=kwargs["global_cond"])
        trajectory = scheduler.step(eps, t, trajectory).prev_sample
    trajectory[kwargs["condition_mask"]] = kwargs["condition_data"][kwargs["condition_mask"]]
    unet.use_fused_ops = True
    actual = sampler(**kwargs, generator=torch.Generator(device).manual_seed(7))
    torch.testing.assert_close(actual, trajectory, **TOLERANCE)


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_calls_are_reproducible_and_fresh_inputs_give_fresh_answers(device):
    _, schedule, sampler = build(device, scheduler="ddpm", steps=10)
    kwargs = make_inputs(2, device, seed=0, steps=10)
    kwargs.pop("noise")
    first = sampler(**kwargs, generator=torch.Generator(device).manual_seed(1))
    again = sampler(**kwargs, generator=torch.Generator(device).manual_seed(1))
    other = sampler(**kwargs, generator=torch.Generator(device).manual_seed(2))
    assert torch.equal(first, again)
    assert not torch.allclose(first, other)
    kwargs["global_cond"] = kwargs["global_cond"] + 1
    moved = sampler(**kwargs, generator=torch.Generator(device).manual_seed(1))
    assert not torch.allclose(first, moved)


@pytest.mark.gpu
def test_cuda_call_is_one_graph_replay():
    _, schedule, sampler = build("cuda")
    kwargs = make_inputs(1, "cuda", seed=0, steps=len(schedule.timesteps))
    sampler(**kwargs)  # captures
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        sampler(**kwargs)
    names = [e.name for e in prof.events()]
    assert not any("dpa::" in n for n in names), "ops launched from the host during a call"
    assert sum("cudaGraphLaunch" in n for n in names) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_long_horizon_graph_replays_match_the_eager_loop(dtype):
    """At horizon 64 the default-width U-Net's 64- and 32-position levels have GroupNorm groups
    of 2048 elements, which the GEMM route cuts into slices and normalises in one cooperative
    launch whose blocks wait on the layer's counters: captured in the loop's graph and replayed
    three times (the counters must be zero again after each), it matches the same loop run
    without a graph (to fp32 rounding, or bf16's: cuBLAS may choose other kernels in a capture),
    and in fp32 the eager plain-PyTorch loop."""
    unet, schedule, _ = build("cuda", down_dims=[256, 512, 1024])
    unet.to(dtype)
    sampler, ungraphed = GraphedSampler(unet, schedule), GraphedSampler(unet, schedule, use_cuda_graph=False)
    for call in range(3):
        kwargs = make_inputs(1, "cuda", seed=call, steps=len(schedule.timesteps), horizon=64)
        kwargs = {k: v.to(dtype) if v is not None and v.is_floating_point() else v for k, v in kwargs.items()}
        actual = sampler(**kwargs)
        torch.testing.assert_close(actual, ungraphed(**kwargs), rtol=0,
                                   atol=1e-5 if dtype == torch.float32 else 3e-2)
        if dtype == torch.float32:
            torch.testing.assert_close(actual, reference_loop(unet, schedule, **kwargs), **TOLERANCE)


@pytest.mark.parametrize("bad,error,text", [
    (dict(condition_data=torch.zeros(16, 2)), ValueError, "condition_data must be"),
    (dict(condition_mask=torch.zeros(1, 16, 2)), ValueError, "condition_mask must be a bool"),
    (dict(condition_data=torch.zeros(1, 16, 3), condition_mask=torch.zeros(1, 16, 3, dtype=torch.bool)),
     ValueError, re.escape("condition_data must be [batch, horizon, input_dim=2], got [1, 16, 3]")),
    (dict(condition_data=torch.zeros(1, 14, 2), condition_mask=torch.zeros(1, 14, 2, dtype=torch.bool)),
     ValueError, re.escape("the horizon (condition_data.shape[1]) must be a positive multiple of 4")),
    (dict(global_cond=None), ValueError, "global_cond is required: this U-Net was built with global_cond_dim="),
    (dict(global_cond=torch.zeros(1, 5)), ValueError, r"global_cond must be \[1, \d+\] \(global_cond_dim="),
    (dict(local_cond=torch.zeros(1, 16, 3)), ValueError,
     "local_cond was given, but this U-Net was built without local_cond_dim"),
    (dict(noise=torch.zeros(3, 1, 16, 2)), ValueError, "noise must be"),
])
def test_bad_input_raises(bad, error, text):
    _, schedule, sampler = build("cpu")
    kwargs = make_inputs(1, "cpu", seed=0, steps=len(schedule.timesteps))
    kwargs.update(bad)
    with pytest.raises(error, match=text):
        sampler(**kwargs)


def test_following_sampler_rebuilds_once_per_change():
    """A FollowingSampler keeps its sampler while nothing changed, and builds one new sampler
    (not one per call) after a weight update in place and after a conversion and back, which
    keeps versions but not storage."""
    from diffusion_policy_accelerated.sampling.sampler import FollowingSampler

    unet, schedule, _ = build("cpu")
    following = FollowingSampler(unet)
    get = lambda: following.get("key", lambda: schedule, torch.device("cpu"))
    first = get()
    assert get() is first
    with torch.no_grad():
        unet.final_conv[1].weight.mul_(2)
    updated = get()
    assert updated is not first and get() is updated
    unet.double().float()
    converted = get()
    assert converted is not updated and get() is converted
