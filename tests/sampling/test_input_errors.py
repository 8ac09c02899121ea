"""Inputs the package must answer in its own words, naming the argument, rather than with
PyTorch's ("mat1 and mat2 must have the same dtype", "normal_kernel_cpu not implemented for
'Long'"): dtypes, meta tensors and non-tensors into the U-Net and the sampler, and a directory
given to load_checkpoint. Valid inputs keep their results bit for bit."""
import re

import pytest
import torch

from diffusion_policy_accelerated import ConditionalUnet1D, DenoiseSchedule, load_checkpoint
from diffusion_policy_accelerated.model.configs import SCHEDULER_CONFIG
from diffusion_policy_accelerated.sampling.sampler import GraphedSampler

UNET = dict(input_dim=2, global_cond_dim=6, local_cond_dim=3, down_dims=[16, 32], kernel_size=3, n_groups=4)
STEPS = 3


@pytest.fixture(scope="module")
def unet():
    torch.manual_seed(0)
    return ConditionalUnet1D(**UNET).eval()


@pytest.fixture(scope="module")
def sampler(unet):
    schedule = DenoiseSchedule.from_diffusers(SCHEDULER_CONFIG, STEPS, kind="ddpm")
    return GraphedSampler(unet, schedule)


def unet_inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    return dict(sample=torch.randn(2, 8, 2, generator=g).to(dtype),
                local_cond=torch.randn(2, 8, 3, generator=g).to(dtype),
                global_cond=torch.randn(2, 6, generator=g).to(dtype))


def sampler_inputs():
    g = torch.Generator().manual_seed(2)
    return dict(condition_data=torch.randn(2, 8, 2, generator=g), condition_mask=torch.zeros(2, 8, 2, dtype=torch.bool),
                local_cond=torch.randn(2, 8, 3, generator=g), global_cond=torch.randn(2, 6, generator=g),
                noise=torch.randn(STEPS + 1, 2, 8, 2, generator=g))


# --------------------------------------------------------------------------------- U-Net

@pytest.mark.parametrize("name", ["sample", "local_cond", "global_cond"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_unet_names_an_input_of_another_dtype(unet, name, dtype):
    args = unet_inputs()
    args[name] = args[name].to(dtype)
    wanted = f"{name} must be float32, the U-Net's dtype, got {str(dtype).removeprefix('torch.')}: convert it"
    with pytest.raises(TypeError, match=re.escape(wanted)):
        unet(args["sample"], 3, local_cond=args["local_cond"], global_cond=args["global_cond"])


@pytest.mark.parametrize("change,error,text", [
    (dict(sample=torch.zeros(2, 8, 2, dtype=torch.long)), TypeError,
     "sample must be a floating-point tensor (float32, the U-Net's dtype), got int64"),
    (dict(global_cond=torch.zeros(2, 6, dtype=torch.bool)), TypeError, "global_cond must be a floating-point tensor"),
    (dict(sample=torch.zeros(2, 8, 2, device="meta")), ValueError,
     "sample is a meta tensor (a shape without data); the U-Net on cpu needs values there"),
    (dict(local_cond=torch.zeros(2, 8, 3, device="meta")), ValueError, "local_cond is a meta tensor"),
    (dict(sample=[[0.0, 0.0]] * 8), TypeError, "sample must be a torch.Tensor, got list"),
    (dict(global_cond=[0.0] * 6), TypeError, "global_cond must be a torch.Tensor or None, got list"),
])
def test_unet_rejects_what_it_cannot_compute(unet, change, error, text):
    args = {**unet_inputs(), **change}
    with torch.profiler.profile() as prof, pytest.raises(error, match=re.escape(text)):
        unet(args["sample"], 3, local_cond=args["local_cond"], global_cond=args["global_cond"])
    assert not [e.name for e in prof.events() if e.name.startswith(("dpa::", "aten::conv", "aten::linear"))]


@pytest.mark.gpu
def test_unet_names_an_input_on_another_device():
    args = unet_inputs()
    on_gpu = ConditionalUnet1D(**UNET).cuda().eval()
    with pytest.raises(ValueError, match=re.escape("global_cond is on cpu, the U-Net on cuda:0: pass "
                                                   "global_cond.to('cuda:0')")):
        on_gpu(args["sample"].cuda(), 3, local_cond=args["local_cond"].cuda(), global_cond=args["global_cond"])


def test_float64_unet_stays_a_reference(unet):
    """A float64 U-Net takes float64 inputs (the numerical reference of the tests), and under
    autocast PyTorch decides the dtypes, as for its own layers."""
    reference = ConditionalUnet1D(**UNET).double().eval()
    reference.load_state_dict(unet.state_dict())
    args64 = unet_inputs(torch.float64)
    with torch.no_grad():
        out = reference(args64["sample"], 3, local_cond=args64["local_cond"], global_cond=args64["global_cond"])
        assert out.dtype == torch.float64
        args = unet_inputs()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            mixed = unet(args["sample"].bfloat16(), 3, local_cond=args["local_cond"], global_cond=args["global_cond"])
        assert mixed.dtype == torch.bfloat16


# --------------------------------------------------------------------------------- sampler

@pytest.mark.parametrize("change,error,text", [
    (dict(condition_data=torch.zeros(2, 8, 2, dtype=torch.long)), TypeError,
     "condition_data must be a floating-point tensor (of any floating dtype: the loop computes in the U-Net's "
     "float32), got int64"),
    (dict(condition_data=torch.zeros(2, 8, 2, dtype=torch.bool)), TypeError, "condition_data must be a floating-point"),
    (dict(global_cond=torch.zeros(2, 6, dtype=torch.int32)), TypeError, "global_cond must be a floating-point"),
    (dict(local_cond=torch.zeros(2, 8, 3, dtype=torch.uint8)), TypeError, "local_cond must be a floating-point"),
    (dict(noise=torch.zeros(STEPS + 1, 2, 8, 2, dtype=torch.long)), TypeError, "noise must be a floating-point"),
    (dict(noise=None, initial_noise=torch.zeros(2, 8, 2, dtype=torch.long)), TypeError,
     "initial_noise must be a floating-point"),
    (dict(condition_data=torch.zeros(2, 8, 2, device="meta")), ValueError,
     "condition_data is a meta tensor (a shape without data); the sampler needs values"),
    (dict(condition_mask=torch.zeros(2, 8, 2, dtype=torch.bool, device="meta")), ValueError,
     "condition_mask is a meta tensor"),
    (dict(global_cond=torch.zeros(2, 6, device="meta")), ValueError, "global_cond is a meta tensor"),
    (dict(condition_data=[[0.0]]), TypeError, "condition_data must be a torch.Tensor, got list"),
    (dict(condition_mask=None), TypeError, "condition_mask must be a torch.Tensor, got NoneType"),
])
def test_sampler_rejects_what_it_cannot_convert(sampler, change, error, text):
    with pytest.raises(error, match=re.escape(text)):
        sampler(**{**sampler_inputs(), **change})


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_sampler_converts_floating_inputs(sampler, dtype):
    """Floating inputs of another dtype are converted to the U-Net's: the loop computes what it
    computes for float32 inputs holding the same values, returned in condition_data's dtype."""
    inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in sampler_inputs().items()}
    as_float32 = {k: v.float() if v.is_floating_point() else v for k, v in inputs.items()}
    with torch.no_grad():
        got = sampler(**inputs)
        expected = sampler(**as_float32)
    assert got.dtype == dtype
    assert torch.equal(got, expected.to(dtype))


def test_sampler_draws_noise_for_float64_data(sampler):
    """Without `noise`, a float64 condition_data gets its noise drawn as before (in float64,
    then converted): the same trajectory for the same generator state."""
    inputs = {**sampler_inputs(), "noise": None}
    inputs["condition_data"] = inputs["condition_data"].double()
    with torch.no_grad():
        first = sampler(**inputs, generator=torch.Generator().manual_seed(5))
        second = sampler(**inputs, generator=torch.Generator().manual_seed(5))
    assert first.dtype == torch.float64 and torch.equal(first, second) and torch.isfinite(first).all()


# --------------------------------------------------------------------------------- checkpoints

def test_load_checkpoint_of_a_directory_lists_its_checkpoints(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    for name in ("epoch=0100.ckpt", "epoch=0200.ckpt", "latest.ckpt"):
        (tmp_path / "checkpoints" / name).write_bytes(b"")
    (tmp_path / "a.ckpt").write_bytes(b"")
    with pytest.raises(IsADirectoryError) as caught:
        load_checkpoint(tmp_path)
    message = str(caught.value)
    assert f"path: {tmp_path} is a directory; load_checkpoint takes one Diffusion Policy workspace checkpoint file " \
           "(.ckpt" in message
    assert message.endswith("this one holds a.ckpt, checkpoints/epoch=0100.ckpt, checkpoints/epoch=0200.ckpt "
                            "(+1 more)"), message


def test_load_checkpoint_of_a_lerobot_folder_points_to_its_loader(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(IsADirectoryError, match=re.escape("looks like a LeRobot policy folder (config.json, "
                                                          "model.safetensors): load it with load_lerobot_pretrained")):
        load_checkpoint(str(tmp_path))


def test_load_checkpoint_of_an_empty_directory(tmp_path):
    with pytest.raises(IsADirectoryError, match="is a directory; .*; this one holds no .ckpt file"):
        load_checkpoint(tmp_path)
