"""DenoiseSchedule against diffusers' DDPMScheduler / DDIMScheduler.

The first part needs no compiled extension: schedule constants, timesteps and
`reference_step` must equal diffusers bit for bit. The second part runs the fused op
`ops.denoise_step` (through `DenoiseSchedule.step`) the same way.
"""
import numpy as np
import pytest
import torch
from diffusers import DDIMScheduler, DDPMScheduler

from tests.support import DEVICES
from diffusion_policy_accelerated.model.schedulers import (DenoiseSchedule, alphas_cumprod_from_config)

SCHEDULER_CLASSES = {"ddpm": DDPMScheduler, "ddim": DDIMScheduler}
# [batch, action_dim, horizon] as Diffusion Policy's U-Net sees it; big enough that every
# step clips some elements and takes both signs.
SHAPE = (4, 10, 16)

# Diffusion Policy's own scheduler settings (the DDPM one of its configs, and DDIM with the
# same schedule as used for fast sampling).
DP_DDPM = dict(num_train_timesteps=100, beta_schedule="squaredcos_cap_v2", clip_sample=True,
               prediction_type="epsilon", variance_type="fixed_small")
DP_DDIM = dict(num_train_timesteps=100, beta_schedule="squaredcos_cap_v2", clip_sample=True,
               prediction_type="epsilon", set_alpha_to_one=True, steps_offset=0)


def clip_config(clip_range):
    return dict(clip_sample=False) if clip_range is None else dict(clip_sample=True,
                                                                   clip_sample_range=clip_range)


# (kind, scheduler config, num_inference_steps, DDIM step kwargs)
DDPM_CASES = [
    pytest.param("ddpm", DP_DDPM, 100, {}, id="ddpm-diffusion-policy-100"),
    *[pytest.param("ddpm", dict(num_train_timesteps=100, beta_schedule="squaredcos_cap_v2",
                                prediction_type=prediction, variance_type=variance,
                                **clip_config(clip)), 10, {},
                   id=f"ddpm-{prediction}-{variance}-clip{clip}")
      for prediction in ("epsilon", "sample", "v_prediction")
      for variance in ("fixed_small", "fixed_small_log", "fixed_large")
      for clip in (None, 1.0, 0.5)],
    pytest.param("ddpm", dict(num_train_timesteps=1000, timestep_spacing="trailing"), 16, {},
                 id="ddpm-linear-trailing"),
    pytest.param("ddpm", dict(num_train_timesteps=1000, beta_schedule="scaled_linear",
                              beta_start=0.00085, beta_end=0.012, timestep_spacing="linspace",
                              prediction_type="v_prediction"), 10, {}, id="ddpm-scaled-linspace"),
    pytest.param("ddpm", dict(num_train_timesteps=100, beta_schedule="sigmoid", steps_offset=1,
                              variance_type="fixed_small_log"), 16, {}, id="ddpm-sigmoid-offset"),
    pytest.param("ddpm", dict(num_train_timesteps=20, trained_betas=np.linspace(1e-3, 0.3, 20).tolist(),
                              prediction_type="sample"), 20, {}, id="ddpm-trained-betas"),
]
DDIM_CASES = [
    pytest.param("ddim", DP_DDIM, 16, dict(eta=0.0), id="ddim-diffusion-policy-16"),
    *[pytest.param("ddim", dict(num_train_timesteps=100, beta_schedule="squaredcos_cap_v2",
                                prediction_type=prediction, **clip_config(clip)), 16,
                   dict(eta=eta, use_clipped_model_output=clipped_eps),
                   id=f"ddim-{prediction}-eta{eta}-clippedeps{clipped_eps}-clip{clip}")
      for prediction in ("epsilon", "sample", "v_prediction")
      for eta in (0.0, 0.5)
      for clipped_eps in (False, True)
      for clip in (None, 1.0, 0.5)],
    pytest.param("ddim", dict(num_train_timesteps=100, beta_schedule="squaredcos_cap_v2",
                              set_alpha_to_one=False), 10, dict(eta=0.5),
                 id="ddim-alpha-not-one"),
    pytest.param("ddim", dict(num_train_timesteps=1000, beta_schedule="scaled_linear",
                              timestep_spacing="trailing", prediction_type="v_prediction"), 16,
                 dict(eta=1.0), id="ddim-scaled-trailing"),
    pytest.param("ddim", dict(num_train_timesteps=1000, timestep_spacing="linspace",
                              set_alpha_to_one=False), 10, {}, id="ddim-linear-linspace"),
    pytest.param("ddim", dict(num_train_timesteps=1000, steps_offset=1), 100, dict(eta=0.5),
                 id="ddim-leading-offset-100"),
]
STEP_CASES = DDPM_CASES + DDIM_CASES
HALF_DTYPES = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")]
ALL_DTYPES = [pytest.param(torch.float32, id="fp32"), *HALF_DTYPES]


def make_pair(kind, config, num_inference_steps, step_kwargs, device="cpu"):
    scheduler = SCHEDULER_CLASSES[kind](**config)
    scheduler.set_timesteps(num_inference_steps)
    schedule = DenoiseSchedule.from_diffusers(scheduler, num_inference_steps, **step_kwargs)
    return scheduler, schedule.to(device)


def assert_bitwise_equal(actual, expected, what):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    differing = int((actual != expected).sum())
    assert differing == 0, (
        f"{what}: {differing}/{actual.numel()} elements differ, max |diff| "
        f"{(actual.double() - expected.double()).abs().max().item():.3g}")


def denoise_alongside_diffusers(scheduler, schedule, step_fn, step_kwargs, compare, *,
                                dtype=torch.float32, device="cpu", seed=0):
    """Runs diffusers' loop and `step_fn`'s on the same fresh random model outputs, comparing
    every step. Noise follows diffusers: DDPM draws it from its generator only where t > 0, so
    ours comes from an identically seeded generator at exactly those steps; DDIM gets it
    explicitly as variance_noise. Each loop feeds on its own output, so any difference would
    compound rather than hide."""
    new_generator = lambda s: torch.Generator(device).manual_seed(s)
    randn = lambda generator: torch.randn(SHAPE, generator=generator, device=device, dtype=dtype)
    inputs_generator = new_generator(seed)
    diffusers_noise_generator, our_noise_generator = new_generator(seed + 1), new_generator(seed + 1)
    expected = actual = randn(inputs_generator)
    for i, t in enumerate(scheduler.timesteps):
        model_output = randn(inputs_generator)
        noise = randn(our_noise_generator) if schedule.needs_noise(i) else None
        if schedule.kind == "ddpm":
            expected_next = scheduler.step(model_output, t, expected,
                                           generator=diffusers_noise_generator).prev_sample
        else:
            expected_next = scheduler.step(model_output, t, expected, variance_noise=noise,
                                           **step_kwargs).prev_sample
        actual = step_fn(model_output, i, actual, noise)
        compare(actual, expected_next, f"step {i} (t={int(t)})")
        expected = expected_next


# ---------------------------------------------------------------------------------------
# Schedule construction and the pure-torch reference: no compiled extension needed.
# ---------------------------------------------------------------------------------------

BETA_CONFIGS = {
    "linear": dict(beta_schedule="linear"),
    "scaled_linear": dict(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012),
    "squaredcos_cap_v2": dict(beta_schedule="squaredcos_cap_v2"),
    "sigmoid": dict(beta_schedule="sigmoid"),  # DDPMScheduler only
    "trained_betas": "trained",
}


@pytest.mark.parametrize("num_train_timesteps", [100, 1000])
@pytest.mark.parametrize("kind,beta_config", [
    pytest.param(kind, config, id=f"{kind}-{name}") for name, config in BETA_CONFIGS.items()
    for kind in ("ddpm", "ddim") if not (kind == "ddim" and name == "sigmoid")])
def test_alphas_cumprod_match_diffusers(kind, num_train_timesteps, beta_config):
    if beta_config == "trained":
        beta_config = dict(trained_betas=np.linspace(1e-4, 0.05, num_train_timesteps))
    scheduler = SCHEDULER_CLASSES[kind](num_train_timesteps=num_train_timesteps, **beta_config)
    ours = alphas_cumprod_from_config(scheduler.config, kind=kind)
    assert ours.dtype == torch.float32 and ours.device.type == "cpu"
    assert torch.equal(ours, scheduler.alphas_cumprod)


@pytest.mark.parametrize("kind", ["ddpm", "ddim"])
@pytest.mark.parametrize("spacing,steps_offset", [("leading", 0), ("leading", 1), ("trailing", 0),
                                                  ("linspace", 0)])
@pytest.mark.parametrize("num_train_timesteps,num_inference_steps",
                         [(100, 1), (100, 10), (100, 16), (100, 99), (1000, 1), (1000, 10),
                          (1000, 16), (1000, 100), (1000, 1000)])
def test_timesteps_match_diffusers(kind, spacing, steps_offset, num_train_timesteps,
                                   num_inference_steps):
    scheduler = SCHEDULER_CLASSES[kind](num_train_timesteps=num_train_timesteps,
                                        timestep_spacing=spacing, steps_offset=steps_offset)
    scheduler.set_timesteps(num_inference_steps)
    if scheduler.timesteps.max() >= num_train_timesteps:
        # diffusers would index past alphas_cumprod at the first step.
        with pytest.raises(ValueError, match="steps_offset"):
            DenoiseSchedule.from_diffusers(scheduler, num_inference_steps)
        return
    schedule = DenoiseSchedule.from_diffusers(scheduler, num_inference_steps)
    assert schedule.timesteps.dtype == torch.int64 and schedule.timesteps.device.type == "cpu"
    assert torch.equal(schedule.timesteps, scheduler.timesteps)
    assert schedule.table.shape == (num_inference_steps, 8)
    assert schedule.num_inference_steps == num_inference_steps


def test_reciprocal_columns_are_float32_reciprocals():
    table = DenoiseSchedule.from_diffusers(DDPMScheduler(**DP_DDPM), 100).table.numpy()
    assert table.dtype == np.float32
    np.testing.assert_array_equal(table[:, 2], np.float32(1) / table[:, 0])
    np.testing.assert_array_equal(table[:, 3], np.float32(1) / table[:, 1])


def test_config_mappings_and_defaults():
    scheduler = DDIMScheduler(**DP_DDIM)
    from_object = DenoiseSchedule.from_diffusers(scheduler, 16, eta=0.5)
    # A saved scheduler_config.json names its class; missing keys take DDIMScheduler's defaults.
    saved = {"_class_name": "DDIMScheduler", "_diffusers_version": "0.35.2",
             "num_train_timesteps": 100, "beta_schedule": "squaredcos_cap_v2"}
    for config, kind in [(scheduler.config, "ddim"), (dict(scheduler.config), "ddim"), (saved, None)]:
        schedule = DenoiseSchedule.from_diffusers(config, 16, eta=0.5, kind=kind)
        assert schedule.kind == "ddim"
        assert torch.equal(schedule.table, from_object.table)
        assert torch.equal(schedule.timesteps, from_object.timesteps)
    schedule = DenoiseSchedule.from_diffusers({"num_train_timesteps": 100}, 10, kind="ddpm")
    assert (schedule.prediction_type, schedule.clip_sample_range) == ("epsilon", 1.0)
    assert torch.equal(schedule.table,
                       DenoiseSchedule.from_diffusers(DDPMScheduler(num_train_timesteps=100), 10).table)


def test_attributes():
    ddim = DenoiseSchedule.from_diffusers(
        DDIMScheduler(**{**DP_DDIM, "prediction_type": "sample", "clip_sample": False}), 16,
        eta=0.25, use_clipped_model_output=True)
    assert (ddim.kind, ddim.prediction_type, ddim.clip_sample_range, ddim.eta,
            ddim.use_clipped_model_output, ddim.num_inference_steps) == \
        ("ddim", "sample", None, 0.25, True, 16)
    assert ddim.table.dtype == torch.float32 and ddim.table.shape == (16, 8)
    assert all(ddim.needs_noise(i) for i in range(16))
    assert not any(DenoiseSchedule.from_diffusers(DDIMScheduler(**DP_DDIM), 16).needs_noise(i)
                   for i in range(16))
    ddpm = DenoiseSchedule.from_diffusers(DDPMScheduler(**{**DP_DDPM, "clip_sample_range": 2}), 100)
    assert ddpm.clip_sample_range == 2.0 and isinstance(ddpm.clip_sample_range, float)
    assert [ddpm.needs_noise(i) for i in range(100)] == [True] * 99 + [False]


@pytest.mark.parametrize("device", DEVICES)
def test_to_returns_a_moved_copy(device):
    schedule = DenoiseSchedule.from_diffusers(DDPMScheduler(**DP_DDPM), 100)
    moved = schedule.to(device)
    assert moved is not schedule and moved.table.device.type == device
    assert schedule.table.device.type == "cpu"
    assert torch.equal(moved.table.cpu(), schedule.table)
    assert moved.timesteps.device.type == "cpu" and moved.needs_noise(0) and not moved.needs_noise(99)


UNSUPPORTED_CONFIGS = [
    ("ddpm", dict(rescale_betas_zero_snr=True), "rescale_betas_zero_snr"),
    ("ddim", dict(rescale_betas_zero_snr=True), "rescale_betas_zero_snr"),
    ("ddpm", dict(thresholding=True), "thresholding"),
    ("ddim", dict(thresholding=True), "thresholding"),
    ("ddpm", dict(beta_schedule="exponential"), "beta_schedule"),
    ("ddim", dict(beta_schedule="sigmoid"), "beta_schedule"),
    ("ddpm", dict(variance_type="learned"), "variance_type"),
    ("ddpm", dict(variance_type="learned_range"), "variance_type"),
    ("ddpm", dict(variance_type="fixed_large_log"), "variance_type"),
    ("ddpm", dict(prediction_type="flow"), "prediction_type"),
    ("ddim", dict(timestep_spacing="karras"), "timestep_spacing"),
]


@pytest.mark.parametrize("kind,options,option_name", UNSUPPORTED_CONFIGS)
def test_unsupported_config_options_raise(kind, options, option_name):
    config = dict(num_train_timesteps=100, **options)
    with pytest.raises(ValueError, match=option_name):
        DenoiseSchedule.from_diffusers(config, 10, kind=kind)
    if option_name not in ("beta_schedule", "prediction_type", "timestep_spacing"):
        # diffusers itself builds these; we must refuse them rather than compute something else.
        with pytest.raises(ValueError, match=option_name):
            DenoiseSchedule.from_diffusers(SCHEDULER_CLASSES[kind](**config), 10)
    with pytest.raises(ValueError, match=option_name):
        alphas_cumprod_from_config(config, kind=kind)


@pytest.mark.parametrize("config,num_inference_steps,match", [
    (dict(num_train_timesteps=100), 101, "num_inference_steps"),
    (dict(num_train_timesteps=100), 0, "num_inference_steps"),
    # diffusers' float arange gives timesteps [..., 2, -1] here.
    (dict(num_train_timesteps=100, timestep_spacing="trailing"), 29, "trailing"),
    (dict(num_train_timesteps=100, steps_offset=1), 100, "steps_offset"),
])
@pytest.mark.parametrize("kind", ["ddpm", "ddim"])
def test_invalid_step_counts_raise(kind, config, num_inference_steps, match):
    with pytest.raises(ValueError, match=match):
        DenoiseSchedule.from_diffusers(config, num_inference_steps, kind=kind)


@pytest.mark.parametrize("config,kwargs,match", [
    ({"_class_name": "EulerDiscreteScheduler"}, {}, "_class_name"),
    ({"_class_name": "DDPMScheduler"}, dict(kind="ddim"), "kind"),
    ({"num_train_timesteps": 100}, {}, "kind"),
    ({"num_train_timesteps": 100}, dict(kind="ddpm", eta=0.5), "eta"),
    ({"num_train_timesteps": 100}, dict(kind="ddpm", use_clipped_model_output=True),
     "use_clipped_model_output"),
    ({"num_train_timesteps": 100}, dict(kind="ddim", eta=float("nan")), "eta"),
])
def test_invalid_constructor_arguments_raise(config, kwargs, match):
    with pytest.raises(ValueError, match=match):
        DenoiseSchedule.from_diffusers(config, 10, **kwargs)


def test_non_scheduler_raises_type_error():
    with pytest.raises(TypeError, match="scheduler"):
        DenoiseSchedule.from_diffusers(object(), 10)


@pytest.mark.parametrize("method", ["step", "reference_step"])
def test_missing_noise_raises(method):
    # step() checks this before it loads the extension, so this needs none either.
    schedule = DenoiseSchedule.from_diffusers(DDPMScheduler(**DP_DDPM), 100)
    x = torch.zeros(SHAPE)
    with pytest.raises(ValueError, match="noise"):
        getattr(schedule, method)(x, 0, x)
    ddim = DenoiseSchedule.from_diffusers(DDIMScheduler(**DP_DDIM), 16, eta=0.5)
    with pytest.raises(ValueError, match="noise"):
        getattr(ddim, method)(x, 15, x)


@pytest.mark.parametrize("index", [-1, 100, 1000])
def test_bad_step_index_raises(index):
    schedule = DenoiseSchedule.from_diffusers(DDPMScheduler(**DP_DDPM), 100)
    x = torch.zeros(SHAPE)
    with pytest.raises(ValueError, match="step index"):
        schedule.needs_noise(index)
    with pytest.raises(ValueError, match="step index"):
        schedule.reference_step(x, index, x, x)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("implementation", ["reference_step", "step"])
@pytest.mark.parametrize("kind,config,num_inference_steps,step_kwargs", STEP_CASES)
def test_step_equals_diffusers(kind, config, num_inference_steps, step_kwargs, implementation,
                               dtype, device):
    """Bit for bit, step by step over whole loops, in every dtype on both devices, for the
    pure-torch reference and for the compiled op. The op follows each device's rules for a
    0-dim float32 scalar times a half-precision tensor: PyTorch's CPU kernels round a leading
    scalar to the tensor's dtype (`coeff * tensor`, how diffusers writes every product) and
    divide by a trailing one in float32; its CUDA kernels keep every scalar in float32 and
    divide through the float32 reciprocal."""
    scheduler, schedule = make_pair(kind, config, num_inference_steps, step_kwargs, device=device)
    denoise_alongside_diffusers(scheduler, schedule, getattr(schedule, implementation), step_kwargs,
                                assert_bitwise_equal, dtype=dtype, device=device)


def test_op_ignores_noise_where_diffusers_adds_none():
    from diffusion_policy_accelerated.kernels import ops

    schedule = DenoiseSchedule.from_diffusers(DDPMScheduler(**DP_DDPM), 100)
    generator = torch.Generator().manual_seed(0)
    model_output, sample, noise = (torch.randn(SHAPE, generator=generator) for _ in range(3))
    last = len(schedule.timesteps) - 1
    assert torch.equal(schedule.step(model_output, last, sample, noise),
                       schedule.step(model_output, last, sample))
    # Without noise the op returns the mean, as diffusers' step would with zero noise.
    mean = ops.denoise_step(model_output, sample, None, schedule.table, 0, scheduler="ddpm",
                            prediction_type="epsilon", clip_sample_range=1.0)
    assert torch.equal(mean, schedule.reference_step(model_output, 0, sample, torch.zeros(SHAPE)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("view", ["transpose(0, 2)", "transpose(1, 2)", "5-D"])
def test_op_handles_non_contiguous_inputs(view, device):
    """The CUDA kernel reads model_output through its strides (the U-Net hands it a
    transposed view) up to 4-D, and from a contiguous copy beyond."""
    schedule = DenoiseSchedule.from_diffusers(DDIMScheduler(**DP_DDIM), 16, eta=0.5).to(device)
    generator = torch.Generator().manual_seed(0)
    if view == "transpose(0, 2)":
        make = lambda: torch.randn(SHAPE[::-1], generator=generator).transpose(0, 2)
    elif view == "transpose(1, 2)":
        make = lambda: torch.randn(4, 16, 10, generator=generator).transpose(1, 2)
    else:
        make = lambda: torch.randn(2, 2, 16, 5, 2, generator=generator).transpose(1, 3)
    model_output, sample, noise = (make().to(device) for _ in range(3))
    assert not model_output.is_contiguous()
    assert_bitwise_equal(schedule.step(model_output, 3, sample, noise),
                         schedule.reference_step(model_output, 3, sample, noise), view)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_op_inpaints_in_the_same_pass(dtype, device):
    """With condition_data and condition_mask the op returns torch.where(mask, data, step):
    the masked elements bit for bit condition_data's, the others the plain step's."""
    schedule = DenoiseSchedule.from_diffusers(DDPMScheduler(**DP_DDPM), 100).to(device)
    generator = torch.Generator().manual_seed(1)
    model_output, sample, noise, data = (
        torch.randn(SHAPE, generator=generator).to(device, dtype) for _ in range(4))
    mask = (torch.rand(SHAPE, generator=generator) < 0.3).to(device)
    inpainted = schedule.step(model_output, 5, sample, noise, condition_data=data, condition_mask=mask)
    assert_bitwise_equal(inpainted, torch.where(mask, data, schedule.step(model_output, 5, sample, noise)),
                         "inpainted")
    assert 0 < int(mask.sum()) < mask.numel()


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    schedule = DenoiseSchedule.from_diffusers(DDPMScheduler(**DP_DDPM), 100).to(device)
    model_output, sample, noise, data = (torch.randn(SHAPE, device=device) for _ in range(4))
    mask = torch.rand(SHAPE, device=device) < 0.5
    args = (model_output.transpose(1, 2).contiguous().transpose(1, 2), sample, noise, schedule.table,
            3, 0, 0, 1.0, False)
    torch.library.opcheck(torch.ops.dpa.denoise_step.default, args)
    torch.library.opcheck(torch.ops.dpa.denoise_step.default, args,
                          dict(condition_data=data, condition_mask=mask))


@pytest.mark.parametrize("index", [-1, 16])
def test_op_rejects_bad_step_index(index):
    schedule = DenoiseSchedule.from_diffusers(DDIMScheduler(**DP_DDIM), 16)
    x = torch.zeros(SHAPE)
    # Passing noise skips the Python-side index check, so this reaches the op's own.
    with pytest.raises(ValueError, match="step"):
        schedule.step(x, index, x, x)


def call_op(**overrides):
    from diffusion_policy_accelerated.kernels import ops

    schedule = DenoiseSchedule.from_diffusers(DDPMScheduler(**DP_DDPM), 100)
    args = dict(model_output=torch.zeros(SHAPE), sample=torch.zeros(SHAPE),
                noise=torch.zeros(SHAPE), table=schedule.table, step=0, scheduler="ddpm",
                prediction_type="epsilon", clip_sample_range=1.0)
    args.update(overrides)
    return ops.denoise_step(args.pop("model_output"), args.pop("sample"), args.pop("noise"),
                            args.pop("table"), args.pop("step"), **args)


TABLE = DenoiseSchedule.from_diffusers(DDPMScheduler(**DP_DDPM), 100).table


@pytest.mark.parametrize("overrides,error,name", [
    (dict(table=TABLE[:, :7]), ValueError, "table"),
    (dict(table=TABLE[0]), ValueError, "table"),
    (dict(table=TABLE[:0]), ValueError, "table"),
    (dict(table=TABLE.double()), TypeError, "table"),
    (dict(table=TABLE.half()), TypeError, "table"),
    (dict(step=100), ValueError, "step"),
    (dict(step=-1), ValueError, "step"),
    (dict(model_output=torch.zeros(4, 10, 15)), ValueError, "model_output"),
    (dict(model_output=torch.zeros(4, 20, 16)), ValueError, "model_output"),
    (dict(model_output=torch.zeros(SHAPE, dtype=torch.float16)), TypeError, "model_output"),
    (dict(noise=torch.zeros(4, 10)), ValueError, "noise"),
    (dict(noise=torch.zeros(SHAPE, dtype=torch.bfloat16)), TypeError, "noise"),
    (dict(sample=torch.zeros(SHAPE, dtype=torch.float64),
          model_output=torch.zeros(SHAPE, dtype=torch.float64),
          noise=torch.zeros(SHAPE, dtype=torch.float64)), TypeError, "sample"),
    (dict(sample=torch.zeros(0, 10, 16), model_output=torch.zeros(0, 10, 16),
          noise=torch.zeros(0, 10, 16)), ValueError, "sample"),
    (dict(scheduler="euler"), ValueError, "scheduler"),
    (dict(prediction_type="flow"), ValueError, "prediction_type"),
    (dict(clip_sample_range=0.0), ValueError, "clip_sample_range"),
    (dict(clip_sample_range=float("inf")), ValueError, "clip_sample_range"),
    (dict(condition_data=torch.zeros(SHAPE)), ValueError, "condition_mask"),
    (dict(condition_mask=torch.zeros(SHAPE, dtype=torch.bool)), ValueError, "condition_data"),
    (dict(condition_data=torch.zeros(SHAPE), condition_mask=torch.zeros(SHAPE)), TypeError,
     "condition_mask"),
    (dict(condition_data=torch.zeros(SHAPE).half(), condition_mask=torch.zeros(SHAPE, dtype=torch.bool)),
     TypeError, "condition_data"),
    (dict(condition_data=torch.zeros(4, 10, 15), condition_mask=torch.zeros(4, 10, 15, dtype=torch.bool)),
     ValueError, "condition_data"),
])
def test_op_rejects_bad_arguments(overrides, error, name):
    with pytest.raises(error, match=name):
        call_op(**overrides)


def test_step_rejects_mismatched_tensors():
    schedule = DenoiseSchedule.from_diffusers(DDPMScheduler(**DP_DDPM), 100)
    x = torch.zeros(SHAPE)
    with pytest.raises(ValueError, match="model_output"):
        schedule.step(torch.zeros(4, 20, 16), 0, x, x)
    with pytest.raises(TypeError, match="noise"):
        schedule.step(x, 0, x, x.half())


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["table", "model_output", "noise", "condition_data", "condition_mask"])
def test_op_rejects_tensors_on_other_devices(name):
    on_cuda = dict(model_output=torch.zeros(SHAPE, device="cuda"),
                   sample=torch.zeros(SHAPE, device="cuda"),
                   noise=torch.zeros(SHAPE, device="cuda"), table=TABLE.cuda(),
                   condition_data=torch.zeros(SHAPE, device="cuda"),
                   condition_mask=torch.zeros(SHAPE, dtype=torch.bool, device="cuda"))
    on_cuda[name] = on_cuda[name].cpu()
    with pytest.raises(RuntimeError, match=name):
        call_op(**on_cuda)
