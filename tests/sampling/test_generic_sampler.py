"""GenericSampler (generic.py): the denoising loop around a denoiser the U-Net kernels do not
cover, run as it is: Diffusion Policy's own U-Net module tree (dp_reference.RefUnet) and
transformer (dp_transformer.TransformerForDiffusion) against Diffusion Policy's loop with
diffusers' schedulers, noise given or drawn, bad inputs, and on CUDA the loop as one graph."""
import re
import warnings

import pytest
import torch
import torch.nn as nn
from diffusers import DDIMScheduler, DDPMScheduler

from diffusion_policy_accelerated import DenoiseSchedule
from diffusion_policy_accelerated.sampling.generic import GenericSampler
from tests.support import DEVICES
from tests.support.dp_policies import UnetPolicy
from tests.support.dp_reference import RefUnet, randomize_
from tests.support.dp_transformer import TransformerForDiffusion, TransformerPolicy

SCHEDULER_CONFIG = dict(num_train_timesteps=100, beta_schedule="squaredcos_cap_v2", clip_sample=True,
                        prediction_type="epsilon")
BATCH, HORIZON, ACTION_DIM, OBS_STEPS, OBS_DIM = 3, 8, 2, 2, 5
# fp32: the fused step differs from diffusers' by rounding only.
TOLERANCE = 1e-4


def transformer(device, causal_attn=True):
    torch.manual_seed(0)
    model = TransformerForDiffusion(input_dim=ACTION_DIM, output_dim=ACTION_DIM, horizon=HORIZON, n_obs_steps=OBS_STEPS,
                                    cond_dim=OBS_DIM, n_layer=2, n_head=2, n_emb=16, causal_attn=causal_attn,
                                    n_cond_layers=1)
    return randomize_(model, seed=1).to(device).eval()


def unet(device):
    torch.manual_seed(0)
    model = RefUnet(ACTION_DIM + OBS_DIM, local_cond_dim=OBS_DIM, global_cond_dim=OBS_DIM * OBS_STEPS,
                    diffusion_step_embed_dim=16, down_dims=[16, 32], kernel_size=3, n_groups=4)
    return randomize_(model, seed=1).to(device).eval()


def inputs(device, dim=ACTION_DIM, batch=BATCH, seed=0):
    """Condition data with the first observation steps' last columns known (inpainted)."""
    generator = torch.Generator().manual_seed(seed)
    data = torch.randn(batch, HORIZON, dim, generator=generator)
    mask = torch.zeros_like(data, dtype=torch.bool)
    mask[:, :OBS_STEPS, ACTION_DIM:] = True
    return data.to(device), mask.to(device)


def dp_loop(model, scheduler, steps, conditioning, data, mask, seed, **step_kwargs):
    """Diffusion Policy's conditional_sample with the model's own call convention."""
    policy = (TransformerPolicy if isinstance(model, TransformerForDiffusion) else UnetPolicy)(
        model, scheduler, steps, step_kwargs)
    generator = torch.Generator(data.device).manual_seed(seed)
    with torch.no_grad():
        return policy.conditional_sample(data, mask, **conditioning, generator=generator, **step_kwargs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("denoiser", ["unet", "transformer"])
def test_ddim_trajectory_equals_diffusion_policys_loop(denoiser, device):
    """DDIM (eta 0) draws only the initial trajectory, so the same generator gives Diffusion
    Policy's trajectory; several batch sizes through one sampler (on CUDA, one graph each)."""
    model = unet(device) if denoiser == "unet" else transformer(device)
    sampler = GenericSampler(model, DenoiseSchedule.from_diffusers(DDIMScheduler(**SCHEDULER_CONFIG), 8))
    dim = ACTION_DIM + OBS_DIM if denoiser == "unet" else ACTION_DIM
    for call, batch in enumerate([BATCH, 1, BATCH]):
        data, mask = inputs(device, dim, batch, seed=call)
        generator = torch.Generator().manual_seed(call)
        if denoiser == "unet":
            conditioning = dict(local_cond=torch.randn(batch, HORIZON, OBS_DIM, generator=generator).to(device),
                                global_cond=torch.randn(batch, OBS_DIM * OBS_STEPS, generator=generator).to(device))
        else:
            conditioning = dict(cond=torch.randn(batch, OBS_STEPS, OBS_DIM, generator=generator).to(device))
        expected = dp_loop(model, DDIMScheduler(**SCHEDULER_CONFIG), 8, conditioning, data, mask, seed=call)
        actual = sampler(data, mask, generator=torch.Generator(device).manual_seed(call), **conditioning)
        assert actual.shape == expected.shape and actual.dtype == expected.dtype
        assert (actual - expected).abs().max().item() <= TOLERANCE
        assert torch.equal(actual[mask], data[mask])
    if device == "cuda":
        assert len(sampler._graphs) == 2 and sampler.refused is None


@pytest.mark.parametrize("device", DEVICES)
def test_ddpm_with_given_noise_is_diffusers_step_for_step(device):
    """DDPM's step noise comes from one draw, not diffusers' per-step draws: with the noise
    given, the loop is diffusers' update (DenoiseSchedule.reference_step) step for step."""
    model = transformer(device)
    schedule = DenoiseSchedule.from_diffusers(DDPMScheduler(**SCHEDULER_CONFIG), 10)
    sampler = GenericSampler(model, schedule)
    data, mask = inputs(device)
    cond = torch.randn(BATCH, OBS_STEPS, OBS_DIM, device=device)
    noise = torch.randn(11, *data.shape, device=device)
    trajectory = torch.where(mask, data, noise[0])
    with torch.no_grad():
        for i, t in enumerate(schedule.timesteps):
            model_output = model(trajectory, t, cond)
            trajectory = schedule.reference_step(model_output, i, trajectory,
                                                 noise[i + 1] if schedule.needs_noise(i) else None)
            trajectory = torch.where(mask, data, trajectory)
    assert (sampler(data, mask, noise=noise, cond=cond) - trajectory).abs().max().item() <= TOLERANCE


def test_noise_draws_follow_the_generator():
    """DDPM: seeded draws repeat and another seed differs; DDIM (eta 0) draws the initial
    trajectory only, as Diffusion Policy does (the generator ends where one draw leaves it)."""
    model = transformer("cpu")
    data, mask = inputs("cpu")
    cond = torch.randn(BATCH, OBS_STEPS, OBS_DIM)
    ddpm = GenericSampler(model, DenoiseSchedule.from_diffusers(DDPMScheduler(**SCHEDULER_CONFIG), 5))
    first = ddpm(data, mask, generator=torch.Generator().manual_seed(0), cond=cond)
    assert torch.equal(ddpm(data, mask, generator=torch.Generator().manual_seed(0), cond=cond), first)
    assert not torch.allclose(ddpm(data, mask, generator=torch.Generator().manual_seed(1), cond=cond), first)
    ddim = GenericSampler(model, DenoiseSchedule.from_diffusers(DDIMScheduler(**SCHEDULER_CONFIG), 5))
    generator, once = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    ddim(data, mask, generator=generator, cond=cond)
    torch.randn(data.shape, generator=once)
    assert torch.equal(generator.get_state(), once.get_state())


class WrongOutput(nn.Module):
    def __init__(self, output):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))
        self.output = output

    def forward(self, sample, timestep, **conditioning):
        return self.output(sample)


def schedule():
    return DenoiseSchedule.from_diffusers(DDIMScheduler(**SCHEDULER_CONFIG), 4)


@pytest.mark.parametrize("make,error,text", [
    (lambda: GenericSampler(lambda x, t: x, schedule()), TypeError, "denoiser must be a torch.nn.Module, got function"),
    (lambda: GenericSampler(transformer("cpu"), DDIMScheduler()), TypeError,
     "schedule must be a DenoiseSchedule, got DDIMScheduler"),
    (lambda: GenericSampler(nn.ReLU(), schedule()), ValueError, "denoiser (ReLU) has no floating-point parameter"),
    (lambda: GenericSampler(transformer("cpu"), schedule(), use_cuda_graph=True), ValueError,
     "use_cuda_graph needs the denoiser on a CUDA device, it is on cpu"),
])
def test_bad_construction_is_refused(make, error, text):
    with pytest.raises(error, match=re.escape(text)):
        make()


DATA, MASK = inputs("cpu")
COND = torch.randn(BATCH, OBS_STEPS, OBS_DIM)


@pytest.mark.parametrize("change,error,text", [
    (dict(condition_data=DATA.int()), TypeError, "condition_data must be a floating-point tensor (of any floating "
                                                 "dtype: the loop computes in the denoiser's float32), got int32"),
    (dict(condition_data=DATA.numpy()), TypeError, "condition_data must be a torch.Tensor, got ndarray"),
    (dict(condition_mask=MASK.float()), ValueError, "condition_mask must be a bool tensor shaped like condition_data"),
    (dict(condition_mask=MASK[:1]), ValueError, "condition_mask must be a bool tensor shaped like condition_data"),
    (dict(cond=COND.tolist()), TypeError, "cond must be a torch.Tensor, got list"),
    (dict(cond=torch.empty(BATCH, OBS_STEPS, OBS_DIM, device="meta")), ValueError, "cond is a meta tensor"),
    (dict(noise=torch.randn(4, *DATA.shape)), ValueError, "noise must be [5, *condition_data.shape], got"),
    (dict(initial_noise=torch.randn(1, HORIZON, ACTION_DIM)), ValueError,
     "initial_noise must be shaped like condition_data"),
])
def test_bad_inputs_are_refused_naming_the_argument(change, error, text):
    arguments = {**dict(condition_data=DATA, condition_mask=MASK, cond=COND), **change}
    with pytest.raises(error, match=re.escape(text)):
        GenericSampler(transformer("cpu"), schedule())(**arguments)


@pytest.mark.parametrize("output,text", [
    (lambda sample: sample[:, :-1], "float32 [3, 7, 2]"),
    (lambda sample: sample.double(), "float64 [3, 8, 2]"),
    (lambda sample: (sample,), "a tuple"),
])
def test_a_denoiser_output_unlike_the_trajectory_is_refused(output, text):
    with pytest.raises(ValueError, match=re.escape(f"the denoiser (WrongOutput) must return a model output shaped "
                                                   f"like the trajectory, float32 [3, 8, 2]; it returned {text}")):
        GenericSampler(WrongOutput(output), schedule())(DATA, MASK)


def test_inputs_of_other_dtypes_are_converted_and_the_result_comes_back_in_condition_datas():
    sampler = GenericSampler(transformer("cpu"), schedule())
    noise = torch.randn(5, *DATA.shape)
    expected = sampler(DATA, MASK, noise=noise, cond=COND)
    actual = sampler(DATA.double(), MASK, noise=noise.double(), cond=COND.double())
    assert actual.dtype == torch.float64
    assert (actual - expected).abs().max().item() <= TOLERANCE


@pytest.mark.gpu
def test_a_callers_capture_holds_the_loop():
    """Inside a CUDA graph the caller captures, the loop joins it (no graph of its own)."""
    sampler = GenericSampler(transformer("cuda"), schedule())
    data, mask = inputs("cuda")
    cond, noise = torch.randn(BATCH, OBS_STEPS, OBS_DIM, device="cuda"), torch.randn(5, *data.shape, device="cuda")
    expected = sampler(data, mask, noise=noise, cond=cond)
    sampler._graphs.clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = sampler(data, mask, noise=noise, cond=cond)
    graph.replay()
    assert sampler._graphs == {}
    assert (output - expected).abs().max().item() <= TOLERANCE


class ReadsBack(nn.Module):
    def forward(self, x):
        if x.abs().max().item() > 1e9:  # a host read: no graph can hold it
            return x * 0
        return x


class SynchronisingDenoiser(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model, self.check = model, ReadsBack()

    def forward(self, sample, timestep, cond=None):
        return self.check(self.model(sample, timestep, cond))


@pytest.mark.gpu
def test_a_denoiser_that_cannot_be_captured_warns_once_naming_it_and_runs_eagerly():
    model = transformer("cuda")
    sampler = GenericSampler(SynchronisingDenoiser(model), schedule())
    reference = GenericSampler(model, schedule(), use_cuda_graph=False)
    data, mask = inputs("cuda")
    cond, noise = torch.randn(BATCH, OBS_STEPS, OBS_DIM, device="cuda"), torch.randn(5, *data.shape, device="cuda")
    caller = torch.cuda.current_stream()
    with pytest.warns(RuntimeWarning, match=r"denoising loop of SynchronisingDenoiser cannot run as a CUDA graph "
                                            r"\(capture failed: .*in module check \(.*ReadsBack\), at .*"
                                            r"test_generic_sampler.py:\d+: `if x.abs\(\).max\(\).item\(\) > 1e9:"):
        actual = sampler(data, mask, noise=noise, cond=cond)
    assert torch.cuda.current_stream() == caller
    torch.randn(1, device="cuda")  # the generator is usable again
    assert not sampler.use_cuda_graph and "ReadsBack" in sampler.refused
    assert torch.equal(actual, reference(data, mask, noise=noise, cond=cond))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(sampler(data, mask, noise=noise, cond=cond), actual)
