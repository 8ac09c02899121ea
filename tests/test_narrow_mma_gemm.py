"""The GEMM route's half-precision tensor-core GEMM over few positions on Hopper
(KernelConfig.half_narrow_gemm; narrow_mma_gemm.cu, taken where gemm_route.cpp's
mma_gemm_plan says): each op with a taps-major weight on it and on cuBLAS's, against the
float64 references of the ops' own tests (their per-dtype tolerances: bf16 and fp16 there).
The shapes cover what the kernel masks and cuts: weight rows that are not a multiple of a
block's (C_out x K = 200), reductions shorter than a stage or not a multiple of one (C_in 48,
208), 8 to 64 positions (one to eight 8-position tiles, odd counts among them), two batch rows
(im2col's columns), LeRobot's layers at horizon 64, and a small layer whose plan cuts the
reduction into slices (a cluster adds them up) with several warps a 16-row tile. The
profiler shows that the kernel ran (bf16 outputs round away another summation order); the
GEMM's result block is poisoned with NaN first. A U-Net forward (Diffusion Policy's default
sizes) at LeRobot's horizon 64, batch 1, checks the whole chain against float64, and in a
CUDA graph with PDL on and off."""

import pytest
import torch

from diffusion_policy_accelerated.routing import kernel_config
from conftest import poison_allocator
import test_conv1d_gn_mish as gn_mish_tests
import test_conv1d_gn_mish_shortcut as shortcut_tests
import test_model as model_tests
from test_model import counted_ops, no_tf32  # noqa: F401 (fixtures)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                       reason="needs Hopper (bulk copies, clusters)"),
]
HALF = [torch.bfloat16, torch.float16]


def ran(run):
    """run()'s result, and whether the tensor-core GEMM's kernel ran in it (bf16 outputs hide
    another summation order's bits)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = run()
        torch.cuda.synchronize()
    return out, any("mma_gemm_kernel" in event.name for event in prof.events())


def both(run, gemm_elements):
    """run() with the tensor-core GEMM, then with cuBLAS's (its result poisoned first)."""
    outs = []
    for on in (True, False):
        with kernel_config(half_narrow_gemm=on):
            poison_allocator("cuda", gemm_elements, torch.float32)
            out, used = ran(run)
        assert used == on, f"half_narrow_gemm={on}, but the tensor-core GEMM {'did not run' if on else 'ran'}"
        outs.append(out)
    return outs


# (batch, C_in, C_out, length, kernel, groups).
SHAPES = [(1, 48, 40, 8, 5, 4), (1, 208, 40, 24, 5, 8), (1, 256, 64, 40, 5, 8), (1, 256, 64, 56, 3, 8),
          (2, 256, 64, 8, 5, 8), (2, 128, 96, 32, 5, 8), (1, 1024, 16, 16, 5, 4),
          (1, 2048, 2048, 16, 5, 8), (1, 1024, 1024, 32, 5, 8), (1, 512, 512, 64, 5, 8)]


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_conv1d_gn_mish(shape, dtype):
    batch, _, cout, length, k, _ = shape
    both(lambda: gn_mish_tests.check(shape, dtype, "cuda", taps_major=True), cout * k * batch * length)


@pytest.mark.parametrize("skip_from", [None, 1024], ids=["x", "x and skip"])
def test_conv1d_gn_mish_shortcut(skip_from):
    shape = (1, 2048, 512, 16, 5, 8)
    _, shortcuts = zip(*both(
        lambda: shortcut_tests.check(shape, torch.bfloat16, "cuda", skip_from=skip_from, taps_major=True),
        512 * 5 * 16))
    assert torch.equal(shortcuts[0], shortcuts[1]), "the 1x1 shortcut is cuBLAS's either way"


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
def test_unet_at_horizon_64(dtype, counted_ops, no_tf32):
    with kernel_config(half_narrow_gemm=True):
        _, used = ran(lambda: model_tests._check_fused("default", dtype, "cuda", counted_ops, batch=1, horizon=64))
    assert used


def test_graph_bits_with_and_without_pdl(no_tf32):
    """Launched while the epilogue before it still runs (PDL) or after it: the same bits, on
    every replay into a NaN-filled output."""
    ours = model_tests.pair("default")[1].to(device="cuda", dtype=torch.bfloat16)
    sample, timestep, _, kw = model_tests.make_inputs(model_tests.DEFAULT_CFG, 1, 64, "batch")
    sample, timestep = model_tests.cast(sample, torch.bfloat16, "cuda"), model_tests.cast(timestep, None, "cuda")
    kw = {k: model_tests.cast(v, torch.bfloat16, "cuda") for k, v in kw.items()}
    replays = []
    for pdl in (False, True):
        with kernel_config(half_narrow_gemm=True, pdl=pdl), torch.no_grad():
            ours(sample, timestep, **kw)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = ours(sample, timestep, **kw)
            for _ in range(3):
                out.fill_(float("nan"))
                graph.replay()
                replays.append(out.clone())
    assert torch.isfinite(replays[0]).all()
    for replay in replays[1:]:
        assert torch.equal(replay, replays[0])
