"""conv1d_gn_mish against a float64 PyTorch reference, on CPU and (where present) CUDA."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from diffusion_policy_accelerated.kernels import ops
from diffusion_policy_accelerated.kernels.config import kernel_config
from diffusion_policy_accelerated.model.unet import ConditionalUnet1D, conv1d_block_shapes
from tests.support import DEVICES, check_bad_input, check_mixed_devices, clusters_enabled, poison_allocator

# Tolerances per dtype (compared after the output is rounded to that dtype):
#  fp32: fp32 accumulation of up to ~20k products, then normalisation: ~1e-5, margin x10.
#  fp16 / bf16: the output's own rounding dominates (2^-11 and 2^-8 relative), plus the
#  rounding of GroupNorm's output before Mish in the reference vs ours: a few ulps.
TOLERANCES = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=4e-3, rtol=4e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=2e-2),
}



def unet_block_shapes(down_dims, input_dim):
    """Every distinct Conv1dBlock shape of a Diffusion Policy U-Net at horizon 16, batch 1,
    read off a forward pass on the meta device (no weights allocated)."""
    with torch.device("meta"):
        unet = ConditionalUnet1D(input_dim, global_cond_dim=8, down_dims=down_dims, kernel_size=5)
    return sorted(set(conv1d_block_shapes(unet, horizon=16)))


# (batch, in_channels, out_channels, length, kernel_size, groups): the lowdim and image U-Nets
# (action dims 2 and 10), then odd sizes around them.
UNET_SHAPES = unet_block_shapes([256, 512, 1024], 2) + unet_block_shapes([512, 1024, 2048], 10)
ODD_SHAPES = [
    (3, 2, 2, 1, 1, 1), (3, 7, 6, 3, 3, 3), (1, 3, 12, 2, 3, 4), (3, 33, 40, 17, 5, 5),
    (2, 5, 64, 64, 7, 16), (1, 16, 32, 20, 9, 8), (3, 64, 96, 5, 3, 32), (1, 64, 8, 33, 5, 8),
    (2, 4096, 16, 2, 3, 4), (1, 8, 4096, 1, 5, 64), (1, 17, 23, 16, 3, 1), (3, 9, 24, 12, 5, 24),
    (1, 4, 8, 5, 13, 2), (2, 3, 6, 4, 31, 3),
]
BATCH64_SHAPES = [(64, 256, 256, 16, 5, 8), (64, 1024, 512, 8, 5, 8), (64, 2048, 1024, 4, 5, 8)]


def reference(x, w, b, gamma, beta, groups, film=None, residual=None):
    """float64 Conv1d -> GroupNorm -> Mish (-> FiLM -> + residual) on the CPU, from the
    (already rounded) inputs."""
    d = lambda t: None if t is None else t.detach().double().cpu()
    y = F.mish(F.group_norm(F.conv1d(d(x), d(w), d(b), padding=w.shape[2] // 2), groups,
                            d(gamma), d(beta), eps=1e-5))
    if film is not None:
        channels = w.shape[0]
        f = d(film)[:, :, None]
        y = f[:, :channels] * y + f[:, channels:] if film.shape[1] == 2 * channels else y + f
    return y if residual is None else y + d(residual)


def make_inputs(shape, dtype, device, generator):
    batch, cin, cout, length, k, groups = shape
    rand = lambda *s, scale=1.0: (torch.randn(*s, generator=generator) * scale).to(device, dtype)
    # Weight scale as PyTorch's default init, so activations stay O(1) through the block.
    x = rand(batch, cin, length)
    w = rand(cout, cin, k, scale=(cin * k) ** -0.5)
    return x, w, rand(cout, scale=0.1), 1 + rand(cout, scale=0.1), rand(cout, scale=0.1)


def check(shape, dtype, device, seed=0, taps_major=False):
    g = torch.Generator().manual_seed(seed)
    x, w, b, gamma, beta = make_inputs(shape, dtype, device, g)
    if taps_major:
        w = ops.taps_major(w)
    batch, _, cout, length, _, groups = shape
    poison_allocator(device, batch * cout * length, dtype)
    out = ops.conv1d_gn_mish(x, w, b, gamma, beta, groups)
    assert out.shape == (batch, cout, length) and out.dtype == dtype and out.device == x.device
    assert not out.isnan().any(), "unwritten (poisoned) or NaN outputs"
    torch.testing.assert_close(out.cpu().double(), reference(x, w, b, gamma, beta, groups),
                               **TOLERANCES[dtype])
    return out


def cpu_cost(shape):
    batch, cin, cout, length, k, _ = shape
    return batch * cin * cout * length * k


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", UNET_SHAPES + ODD_SHAPES, ids=str)
def test_matches_float64_reference(shape, dtype, device):
    check(shape, dtype, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", BATCH64_SHAPES, ids=str)
def test_batch_64(shape, device):
    if device == "cpu" and cpu_cost(shape) > 2e9:
        shape = (64, shape[1] // 4, shape[2] // 4) + shape[3:]  # keep CI's 2-core run short
    check(shape, torch.float32, device)


# Weights stored taps-major (ops.taps_major): the CUDA GEMM route multiplies their rows
# (output channel, tap) with x itself; the streaming route and the CPU read a contiguous copy.
# U-Net layers at batch 8 and 64, then odd ones on both CUDA routes (batch x length 20 < 32).
TAPS_MAJOR_SHAPES = [(64, 256, 256, 16, 5, 8), (8, 1024, 512, 8, 5, 8), (3, 33, 40, 17, 5, 5),
                     (2, 5, 64, 64, 7, 16), (1, 16, 32, 20, 9, 8), (11, 64, 8, 3, 3, 8), (2, 8, 16, 200, 3, 2)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", TAPS_MAJOR_SHAPES, ids=str)
def test_taps_major_weight(shape, dtype, device):
    check(shape, dtype, device, taps_major=True)


# At batch 1 the taps-major GEMM reads x in place where x's [C_in][L] is a matrix with one
# unit stride (gemm_route.h, tap_rows_view), and copies it otherwise. x's layouts: contiguous,
# a slice of wider rows, stored channels-last, every other position (no unit stride: copied);
# a short and a long length, the latter's group past what one block holds.
def _batch_1_layout(x, layout):
    if layout == "slice of wider rows":
        return torch.cat([x, x], dim=2)[:, :, 3:3 + x.shape[2]]
    if layout == "channels-last":
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "every other position":
        return torch.stack([x, torch.full_like(x, float("nan"))], dim=3).flatten(2)[:, :, ::2]
    return x


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["contiguous", "slice of wider rows", "channels-last", "every other position"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1, 96, 64, 20, 5, 8), (1, 64, 512, 64, 5, 8)], ids=str)
def test_taps_major_reads_x_in_place_at_batch_1(shape, dtype, layout):
    g = torch.Generator().manual_seed(12)
    x, w, b, gamma, beta = make_inputs(shape, dtype, "cuda", g)
    x = _batch_1_layout(x, layout)
    assert layout == "every other position" or x.stride(1) == 1 or x.stride(2) == 1
    batch, _, cout, length, _, groups = shape
    poison_allocator("cuda", batch * cout * length, dtype)
    out = ops.conv1d_gn_mish(x, ops.taps_major(w), b, gamma, beta, groups)
    assert not out.isnan().any(), "unwritten (poisoned) or NaN outputs"
    torch.testing.assert_close(out.cpu().double(), reference(x, w, b, gamma, beta, groups), **TOLERANCES[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_portable_launches_take_half_precision_gemms_from_8_positions(dtype):
    """Without clusters and PDL (a GPU before Hopper; here both switched off) half-precision
    convs take the GEMM route from portable_half_gemm_min_positions (8) positions; fp32 and
    4 positions stream. Either way the output matches float64."""
    from torch.profiler import ProfilerActivity, profile
    g = torch.Generator().manual_seed(13)
    for shape, gemm in [((1, 256, 256, 8, 5, 8), dtype != torch.float32), ((1, 256, 256, 4, 5, 8), False)]:
        x, w, b, gamma, beta = make_inputs(shape, dtype, "cuda", g)
        with kernel_config(clusters=False, pdl=False), profile(activities=[ProfilerActivity.CUDA]) as prof:
            out = ops.conv1d_gn_mish(x, w, b, gamma, beta, shape[5])
            torch.cuda.synchronize()
        kernels = " ".join(e.key for e in prof.key_averages())
        assert ("group_norm_epilogue" in kernels) == gemm and ("stream_conv" in kernels) != gemm, (shape, kernels)
        torch.testing.assert_close(out.cpu().double(), reference(x, w, b, gamma, beta, shape[5]), **TOLERANCES[dtype])


def test_taps_major_keeps_shape_and_values():
    w = torch.randn(6, 4, 3)
    t = ops.taps_major(w)
    assert t.shape == w.shape and t.stride() == (12, 1, 4) and torch.equal(t, w)


@pytest.mark.parametrize("weight", [torch.randn(6, 4), torch.randn(2, 6, 4, 3), [[1.0]]],
                         ids=["2-d", "4-d", "a list"])
def test_taps_major_rejects_what_is_no_conv1d_weight(weight):
    with pytest.raises(ValueError, match=r"taps_major: weight must be a Conv1d weight \[C_out, C_in, K\]"):
        ops.taps_major(weight)


@pytest.mark.parametrize("device", DEVICES)
def test_fresh_random_inputs_every_call(device):
    for seed in range(4):
        check((3, 48, 64, 16, 5, 8), torch.float32, device, seed=seed)


@pytest.mark.parametrize("device", DEVICES)
def test_no_bias_no_affine_and_non_contiguous_inputs(device):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 3, 24, generator=g).to(device).transpose(0, 2)  # [24, 3, 16], strided
    w = torch.randn(3, 8, 3, generator=g).to(device).transpose(0, 1)  # [8, 3, 3], strided
    assert not x.is_contiguous() and not w.is_contiguous()
    out = ops.conv1d_gn_mish(x, w, None, None, None, 2, 1e-5)
    torch.testing.assert_close(out.cpu().double(), reference(x, w, None, None, None, 2),
                               **TOLERANCES[torch.float32])


def film_and_residual(shape, dtype, device, generator, film_layout):
    batch, _, cout, length, _, _ = shape
    rand = lambda *s: torch.randn(*s, generator=generator).to(device, dtype)
    if film_layout == "scale+bias":
        film = rand(batch, 2 * cout)
    elif film_layout == "bias":
        film = rand(batch, cout)
    elif film_layout == "slice of a wider row":  # how the sampler hands each block its FiLM
        film = rand(batch, 5 * cout)[:, cout:3 * cout]
    else:  # "one row for the batch": the same FiLM broadcast, row stride 0
        film = rand(1, 2 * cout).expand(batch, -1)
    return film, rand(batch, cout, length)


FILM_LAYOUTS = ["scale+bias", "bias", "slice of a wider row", "one row for the batch"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("film_layout", FILM_LAYOUTS)
@pytest.mark.parametrize("shape", [(1, 256, 256, 16, 5, 8), (1, 1024, 1024, 4, 5, 8),
                                   (3, 64, 48, 7, 3, 4), (8, 512, 512, 8, 5, 8)], ids=str)
def test_film_and_residual_epilogue(shape, film_layout, dtype, device):
    """What ConditionalResidualBlock1D does to its Conv1dBlocks' outputs, fused."""
    g = torch.Generator().manual_seed(6)
    x, w, b, gamma, beta = make_inputs(shape, dtype, device, g)
    film, residual = film_and_residual(shape, dtype, device, g, film_layout)
    batch, _, cout, length, _, groups = shape
    for kwargs in (dict(film=film), dict(residual=residual), dict(film=film, residual=residual)):
        poison_allocator(device, batch * cout * length, dtype)
        out = ops.conv1d_gn_mish(x, w, b, gamma, beta, groups, **kwargs)
        torch.testing.assert_close(out.cpu().double(), reference(x, w, b, gamma, beta, groups, **kwargs),
                                   **TOLERANCES[dtype])


@pytest.mark.parametrize("route", ["aten", "gemm", "stream", "fp32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_every_cpu_route(route, dtype):
    """The CPU's conv routes, each forced (KernelConfig.cpu_conv; "auto" picks one by timing;
    "stream" has fp32 and bf16, fp16 takes ATen's conv there; "fp32" is ATen's conv of fp32
    copies of half-precision operands), on the U-Nets' shapes and odd ones, with FiLM and a
    residual."""
    g = torch.Generator().manual_seed(11)
    with kernel_config(cpu_conv=route):
        for i, shape in enumerate(UNET_SHAPES + ODD_SHAPES):
            x, w, b, gamma, beta = make_inputs(shape, dtype, "cpu", g)
            film, residual = film_and_residual(shape, dtype, "cpu", g, FILM_LAYOUTS[i % len(FILM_LAYOUTS)])
            batch, _, cout, length, _, groups = shape
            poison_allocator("cpu", batch * cout * length, dtype)
            out = ops.conv1d_gn_mish(x, w, b, gamma, beta, groups, film=film, residual=residual)
            assert out.dtype == dtype and not out.isnan().any(), "unwritten (poisoned) or NaN outputs"
            torch.testing.assert_close(out.double(), reference(x, w, b, gamma, beta, groups, film, residual),
                                       **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_cpu_fp32_copies_follow_the_weight(dtype):
    """The CPU's "fp32" route keeps an fp32 copy of a half-precision weight across calls
    (conv_route_cpu.cpp, FloatCopies): a weight changed in place, replaced by another tensor,
    or made under torch.inference_mode (no version counter) must still be the one convolved."""
    shape = (1, 64, 32, 16, 5, 4)
    g = torch.Generator().manual_seed(12)
    x, w, b, gamma, beta = make_inputs(shape, dtype, "cpu", g)

    def check_with(weight):
        out = ops.conv1d_gn_mish(x, weight, b, gamma, beta, 4)
        torch.testing.assert_close(out.double(), reference(x, weight, b, gamma, beta, 4), **TOLERANCES[dtype])
        return out

    with kernel_config(cpu_conv="fp32"):
        first = check_with(w)
        assert torch.equal(check_with(w), first), "the same weight gave other bits"
        w.mul_(-1.5)  # in place: its version counter moves
        assert not torch.equal(check_with(w), first)
        check_with(torch.randn(w.shape, generator=g).to(dtype))  # another tensor
        with torch.inference_mode():
            inference_w = torch.randn(w.shape, generator=g).to(dtype)
        check_with(inference_w)
        with torch.inference_mode():
            inference_w.mul_(-2.0)
        check_with(inference_w)


@pytest.mark.parametrize("device", DEVICES)
def test_counters_are_left_zero_and_reusable(device):
    g = torch.Generator().manual_seed(7)
    counters = torch.zeros(4096, dtype=torch.int32, device=device)
    for shape in [(1, 256, 512, 8, 5, 8), (2, 1024, 1024, 4, 5, 8), (1, 2, 256, 16, 5, 8)]:
        x, w, b, gamma, beta = make_inputs(shape, torch.float32, device, g)
        out = ops.conv1d_gn_mish(x, w, b, gamma, beta, shape[5], counters=counters)
        assert int(counters.abs().sum()) == 0
        torch.testing.assert_close(out.cpu().double(), reference(x, w, b, gamma, beta, shape[5]),
                                   **TOLERANCES[torch.float32])


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    g = torch.Generator().manual_seed(2)
    for shape in [(1, 8, 16, 16, 5, 8), (3, 5, 6, 3, 3, 3), (2, 4, 8, 7, 7, 2)]:
        x, w, b, gamma, beta = make_inputs(shape, torch.float32, device, g)
        torch.library.opcheck(torch.ops.dpa.conv1d_gn_mish.default, (x, w, b, gamma, beta, shape[5], 1e-5))
    torch.library.opcheck(torch.ops.dpa.conv1d_gn_mish.default, (x, w, None, None, None, 2, 1e-5))
    film, residual = film_and_residual(shape, torch.float32, device, g, "scale+bias")
    torch.library.opcheck(torch.ops.dpa.conv1d_gn_mish.default, (x, w, b, gamma, beta, 2, 1e-5),
                          dict(film=film, residual=residual))


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile(device):
    g = torch.Generator().manual_seed(3)
    x, w, b, gamma, beta = make_inputs((2, 8, 16, 16, 5, 8), torch.float32, device, g)
    fn = torch.compile(lambda *a: ops.conv1d_gn_mish(*a, 8) * 2, fullgraph=True)
    torch.testing.assert_close(fn(x, w, b, gamma, beta),
                               ops.conv1d_gn_mish(x, w, b, gamma, beta, 8) * 2)


def good_args(device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(4)
    x, w, b, gamma, beta = make_inputs((2, 4, 8, 6, 3, 4), dtype, device, g)
    return dict(x=x, weight=w, bias=b, gn_weight=gamma, gn_bias=beta, num_groups=4, eps=1e-5)


BAD_INPUTS = [
    # (what to change, expected exception, text the message must contain)
    (dict(x=torch.randn(2, 4, 6, dtype=torch.float64)), TypeError, "x must be float32"),
    (dict(x=torch.randint(0, 3, (2, 4, 6))), TypeError, "x must be float32"),
    (dict(weight=torch.randn(8, 4, 3, dtype=torch.float16)), TypeError, "weight has dtype"),
    (dict(bias=torch.randn(8, dtype=torch.bfloat16)), TypeError, "bias has dtype"),
    (dict(x=torch.randn(4, 6)), ValueError, "x must be 3-D"),
    (dict(x=torch.randn(1, 2, 4, 6)), ValueError, "x must be 3-D"),
    (dict(weight=torch.randn(8, 12)), ValueError, "weight must be 3-D"),
    (dict(weight=torch.randn(8, 5, 3)), ValueError, "weight has in_channels 5"),
    (dict(weight=torch.randn(8, 4, 4)), ValueError, "kernel_size"),
    (dict(weight=torch.randn(0, 4, 3)), ValueError, "out_channels >= 1"),
    (dict(bias=torch.randn(7)), ValueError, "bias must have shape [8]"),
    (dict(gn_weight=torch.randn(8, 1)), ValueError, "gn_weight must have shape [8]"),
    (dict(gn_bias=torch.randn(9)), ValueError, "gn_bias must have shape [8]"),
    (dict(num_groups=3), ValueError, "num_groups must be >= 1 and divide"),
    (dict(num_groups=0), ValueError, "num_groups must be >= 1 and divide"),
    (dict(eps=-1.0), ValueError, "eps must be finite"),
    (dict(eps=float("nan")), ValueError, "eps must be finite"),
    (dict(x=torch.randn(0, 4, 6)), ValueError, "x must be non-empty"),
    (dict(x=torch.randn(2, 4, 0)), ValueError, "x must be non-empty"),
    (dict(film=torch.randn(2, 7)), ValueError, "film must be [2, 8] (a bias) or [2, 16]"),
    (dict(film=torch.randn(3, 16)), ValueError, "film must be [2, 8]"),
    (dict(film=torch.randn(2, 16, 1)), ValueError, "film must be [2, 8]"),
    (dict(film=torch.randn(2, 16, dtype=torch.float16)), TypeError, "film has dtype"),
    (dict(residual=torch.randn(2, 8, 5)), ValueError, "residual must have the output's shape [2, 8, 6]"),
    (dict(residual=torch.randn(2, 8, 6, dtype=torch.bfloat16)), TypeError, "residual has dtype"),
    (dict(counters=torch.zeros(8)), TypeError, "counters must be int32"),
    (dict(counters=torch.zeros(7, dtype=torch.int32)), ValueError, "counters must be a contiguous 1-D"),
    (dict(counters=torch.zeros(8, 2, dtype=torch.int32)), ValueError, "counters must be a contiguous 1-D"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("change,error,text", BAD_INPUTS, ids=lambda v: v if isinstance(v, str) else "")
def test_bad_input_raises(change, error, text, device):
    check_bad_input(ops.conv1d_gn_mish, good_args(device), change, error, text, device)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["x", "weight", "bias", "gn_weight", "gn_bias", "film", "residual",
                                  "counters"])
def test_mixed_devices_raise(name):
    args = good_args("cuda")
    args.update(film=torch.randn(2, 16, device="cuda"), residual=torch.randn(2, 8, 6, device="cuda"),
                counters=torch.zeros(8, dtype=torch.int32, device="cuda"))
    check_mixed_devices(ops.conv1d_gn_mish, args, name)


@pytest.mark.gpu
@pytest.mark.parametrize("route,threshold", [("streaming kernel", 1 << 62), ("im2col + GEMM", 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_both_cuda_routes(route, threshold, dtype):
    """The op picks its CUDA route by batch * length; each route must be right on every shape
    (the GEMM route's epilogue holds a group of up to 1024 elements in registers; 8 x 200 is
    past that)."""
    with kernel_config(gemm_min_positions=threshold, gemm_min_work=threshold):
        g = torch.Generator().manual_seed(8)
        for shape in [(1, 2, 256, 16, 5, 8), (3, 7, 6, 3, 3, 3), (64, 64, 96, 4, 5, 8),
                      (5, 33, 40, 17, 7, 5), (2, 9, 24, 1, 5, 24), (2, 8, 16, 200, 3, 2)]:
            check(shape, dtype, "cuda")
            x, w, b, gamma, beta = make_inputs(shape, dtype, "cuda", g)
            film, residual = film_and_residual(shape, dtype, "cuda", g, "slice of a wider row")
            out = ops.conv1d_gn_mish(x, w, b, gamma, beta, shape[5], film=film, residual=residual)
            torch.testing.assert_close(
                out.cpu().double(), reference(x, w, b, gamma, beta, shape[5], film, residual),
                **TOLERANCES[dtype])


# The GEMM route's GroupNorm epilogue: one block per (batch row, group) holding a group of up
# to 1024 elements (channels per group x length) in registers, or larger groups cut into
# slices, as many as fill the SMs where batch x groups is small, and as few as hold each slice
# where it is not. Groups on both sides of the bound, few and many blocks, odd batches, a last
# slice shorter than the others, a group of more than 256 slices (the merge reads their
# moments in several rounds), FiLM and a residual, im2col's and taps-major weights. Slices
# take one cooperative launch where the op has counters (the model's), a counter per batch
# row and group, and all blocks fit at once (here all but (160, 8, 8, 1025, 5, 1), whose 160
# units outnumber its 8 counters); else two.
GROUP_SHAPES = [(1, 64, 512, 16, 5, 8), (3, 32, 520, 16, 5, 8), (1, 64, 2048, 16, 5, 8),
                (2, 16, 264, 125, 3, 8), (1, 16, 512, 128, 5, 8), (3, 8, 8, 1025, 5, 1),
                (20, 32, 520, 16, 5, 8), (160, 8, 8, 1025, 5, 1), (1, 8, 256, 1100, 3, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("counters", [False, True], ids=["no-counters", "counters"])
@pytest.mark.parametrize("taps_major", [False, True], ids=["im2col", "taps-major"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", GROUP_SHAPES, ids=str)
def test_gemm_route_group_sizes(shape, dtype, taps_major, counters):
    g = torch.Generator().manual_seed(9)
    x, w, b, gamma, beta = make_inputs(shape, dtype, "cuda", g)
    film, residual = film_and_residual(shape, dtype, "cuda", g, "slice of a wider row")
    if taps_major:
        w = ops.taps_major(w)
    batch, _, cout, length, _, groups = shape
    op_counters = torch.zeros(cout, dtype=torch.int32, device="cuda") if counters else None
    with kernel_config(gemm_min_positions=1):
        for _ in range(2):  # the counters are zero again for the second call
            poison_allocator("cuda", batch * cout * length, dtype)
            out = ops.conv1d_gn_mish(x, w, b, gamma, beta, groups, film=film, residual=residual,
                                     counters=op_counters)
            assert not out.isnan().any(), "unwritten (poisoned) or NaN outputs"
            torch.testing.assert_close(out.cpu().double(), reference(x, w, b, gamma, beta, groups, film, residual),
                                       **TOLERANCES[dtype])
    if counters:
        assert not op_counters.any(), "counters left non-zero"


# The sliced GroupNorm epilogue's three kernels, the KernelConfig that picks each, and the
# kernel names the profiler shows for it.
SLICED_WAYS = {"cluster": (dict(), "group_slices_cluster_kernel"),
               "cooperative": (dict(clusters=False), "group_slices_kernel"),
               "two launches": (dict(clusters=False, cooperative_group_norm=False), "group_slice_moments_kernel")}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sliced_group_norm_ways_give_the_same_bits(dtype):
    """The cluster (Hopper), the one cooperative launch and the two launches merge the same
    slice moments in the same order: the same bits, at LeRobot's horizon-64 group size (8
    groups of 4096 elements at batch 1, 16 slices each), at batch 3 (4 slices), and at horizon
    128 (8192 elements: 16 slices of 512, a cluster's most, on every path). The profiler's
    kernel names say which ran; the counters are zero again after each."""
    hopper = torch.cuda.get_device_capability()[0] >= 9
    g = torch.Generator().manual_seed(10)
    for shape in [(1, 64, 512, 64, 5, 8), (3, 64, 512, 64, 5, 8), (1, 64, 512, 128, 5, 8)]:
        x, w, b, gamma, beta = make_inputs(shape, dtype, "cuda", g)
        film, residual = film_and_residual(shape, dtype, "cuda", g, "scale+bias")
        op_counters = torch.zeros(shape[2], dtype=torch.int32, device="cuda")
        outs = {}
        for way, (config, kernel) in SLICED_WAYS.items():
            if way == "cluster" and not hopper:
                continue
            with kernel_config(gemm_min_positions=1, **config), \
                    torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                outs[way] = ops.conv1d_gn_mish(x, w, b, gamma, beta, shape[5], film=film, residual=residual,
                                               counters=op_counters)
                torch.cuda.synchronize()
            names = [event.name for event in prof.events()]
            ran = [name for _, name in SLICED_WAYS.values() if any(name + "<" in n for n in names)]
            assert ran == [kernel], f"{way}: ran {ran}"
            assert not op_counters.any(), f"{way}: counters left non-zero"
        torch.testing.assert_close(outs["two launches"].cpu().double(),
                                   reference(x, w, b, gamma, beta, shape[5], film, residual), **TOLERANCES[dtype])
        for way, out in outs.items():
            assert torch.equal(out, outs["two launches"]), f"{way} differs from the two launches"


# Streaming-route shapes for the two GroupNorm kernels: U-Net layers (1024->1024 L4 streams
# through the cluster's weight ring; 2048->2048 L4's slice is too long for a cluster, so
# split-K either way), a group of 16 row tiles and no split, groups
# narrower than a row tile or than the cluster, odd batches up to 31 positions, a group too
# small for a cluster of two.
CLUSTER_SHAPES = [(1, 256, 256, 16, 5, 8), (1, 1024, 1024, 4, 5, 8), (1, 2048, 2048, 4, 5, 8),
                  (1, 64, 1024, 2, 3, 2), (7, 64, 96, 4, 5, 8), (3, 9, 24, 5, 5, 24),
                  (31, 16, 32, 1, 3, 2), (2, 33, 40, 7, 5, 5), (1, 8, 4096, 1, 5, 64),
                  (3, 7, 6, 3, 3, 3),
                  # Long slices, which the cluster kernel streams through its shared-memory ring:
                  # full and partial warps of rows, a partial last chunk, batch 2, length 8.
                  (1, 1304, 200, 4, 5, 8), (2, 1024, 512, 2, 5, 8), (1, 512, 1024, 8, 5, 8),
                  # Slices longer than the ring (96 KB a block on an H100), so that its stages are
                  # refilled: two of eight warps holding rows (2432 or 2560 of 37000 per block:
                  # 19 chunks and 3 stages in fp32, 10 and 3 in half precision); in half
                  # precision (fp32 takes split-K there) 1792 of 28000 at 8 positions (7 chunks,
                  # 2 stages) and 1280 at 16 (5 chunks, 2 stages). fp32 refills in the
                  # 1024-wide shapes too.
                  (1, 7400, 16, 4, 5, 2), (1, 512, 512, 16, 5, 8), (1, 5600, 16, 8, 5, 2),
                  (1, 4096, 32, 16, 5, 2)]


@pytest.mark.gpu
@pytest.mark.parametrize("clusters", [True, False], ids=["cluster per group", "split-K blocks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_both_streaming_kernels(clusters, dtype):
    """A GroupNorm conv on the streaming route runs as one thread-block cluster per group
    (Hopper and newer) or as split-K blocks with a finishing block: each must be right, with
    FiLM and residual, and repeat bit for bit (both add the reduction's splits in a fixed
    order)."""
    with clusters_enabled(clusters):
        g = torch.Generator().manual_seed(9)
        for shape in CLUSTER_SHAPES:
            check(shape, dtype, "cuda")
            x, w, b, gamma, beta = make_inputs(shape, dtype, "cuda", g)
            film, residual = film_and_residual(shape, dtype, "cuda", g, "scale+bias")
            run = lambda: ops.conv1d_gn_mish(x, w, b, gamma, beta, shape[5], film=film, residual=residual)
            out = run()
            torch.testing.assert_close(
                out.cpu().double(), reference(x, w, b, gamma, beta, shape[5], film, residual),
                **TOLERANCES[dtype])
            assert torch.equal(out, run()), f"{shape}: a second run differs"


@pytest.mark.gpu
@pytest.mark.parametrize("clusters", [True, False], ids=["cluster per group", "split-K blocks"])
def test_launch_trace(clusters):
    """ops._C.start_launch_trace (scripts/dev/trace_conv.py): one row per block of each launch, the
    block's stamps in the order of its work. Every block of the cluster kernel leaves (stamps
    the last event); of the split-K kernel only the finishing blocks do: this also shows which
    kernel the U-Net's 256-channel length-16 layer takes on a Hopper GPU."""
    with clusters_enabled(clusters):
        g = torch.Generator().manual_seed(10)
        x, w, b, gamma, beta = make_inputs((1, 256, 256, 16, 5, 8), torch.float32, "cuda", g)
        buffer = torch.zeros(4096, 9, dtype=torch.int64, device="cuda")
        ops._C.start_launch_trace(buffer)
        try:
            for _ in range(2):
                ops.conv1d_gn_mish(x, w, b, gamma, beta, 8)
        finally:
            blocks = ops._C.stop_launch_trace()
        ops.conv1d_gn_mish(x, w, b, gamma, beta, 8)  # not traced
        torch.cuda.synchronize()
    assert len(blocks) == 2 and blocks[0] == blocks[1] > 0
    trace = buffer.cpu()
    first = trace[:blocks[0]]
    assert (first[:, :4] > 0).all(), "every block starts, waits, stages and streams"
    assert (first[:, 1:4] >= first[:, 0:3]).all()
    assert (trace[2 * blocks[0]:] == 0).all(), "rows past the traced launches"
    if torch.cuda.get_device_capability()[0] >= 9:
        assert (first[:, 8] > 0).all() == clusters
    with pytest.raises(ValueError, match="int64"):
        ops._C.start_launch_trace(torch.zeros(8, 9, device="cuda"))
    with pytest.raises(ValueError, match=r"\[rows, 9\]"):
        ops._C.start_launch_trace(torch.zeros(8, 5, dtype=torch.int64, device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("clusters", [True, False], ids=["clusters", "split-K blocks"])
def test_sm_count_sizes_the_waves(clusters):
    """KernelConfig.sm_count: the launch plans fill that many SMs, not the device's. A split-K
    launch of the U-Net's 256-channel length-16 layer then has at most two blocks per SM of the
    budget (fewer blocks than on the whole GPU), and every route stays exact on odd budgets:
    streaming GroupNorm convs (split-K or clusters, whose residency is scaled to the budget),
    the GEMM route's sliced GroupNorm epilogue, whose slices fill the budget (8 groups of 2048
    elements: 2 to 8 slices each, by the budget)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    x, w, b, gamma, beta = make_inputs((1, 256, 256, 16, 5, 8), torch.float32, "cuda", torch.Generator().manual_seed(11))

    def traced_blocks():
        buffer = torch.zeros(4096, 9, dtype=torch.int64, device="cuda")
        ops._C.start_launch_trace(buffer)
        try:
            ops.conv1d_gn_mish(x, w, b, gamma, beta, 8)
        finally:
            blocks = ops._C.stop_launch_trace()
        torch.cuda.synchronize()
        return blocks[0]

    with kernel_config(clusters=False):
        whole = traced_blocks()
        with kernel_config(sm_count=8):
            assert traced_blocks() <= 2 * 8 < whole
        with kernel_config(sm_count=10 * sms):
            assert traced_blocks() == whole, "a budget above the device's is the device's"
    g = torch.Generator().manual_seed(12)
    for budget in (2, 7, 33):
        with kernel_config(sm_count=budget, clusters=clusters):
            for shape in [(1, 256, 256, 16, 5, 8), (1, 1024, 1024, 4, 5, 8), (3, 9, 24, 5, 5, 24)]:
                x, w, b, gamma, beta = make_inputs(shape, torch.float32, "cuda", g)
                film, residual = film_and_residual(shape, torch.float32, "cuda", g, "scale+bias")
                out = ops.conv1d_gn_mish(x, w, b, gamma, beta, shape[5], film=film, residual=residual)
                torch.testing.assert_close(out.cpu().double(),
                                           reference(x, w, b, gamma, beta, shape[5], film, residual),
                                           **TOLERANCES[torch.float32])
            shape = (1, 16, 256, 64, 5, 8)
            x, w, b, gamma, beta = make_inputs(shape, torch.bfloat16, "cuda", g)
            with kernel_config(gemm_min_positions=1):
                out = ops.conv1d_gn_mish(x, w, b, gamma, beta, 8)
            torch.testing.assert_close(out.cpu().double(), reference(x, w, b, gamma, beta, 8, None, None),
                                       **TOLERANCES[torch.bfloat16])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("length", [1, 3, 4, 8, 16, 37])
def test_mish_over_its_whole_range(device, dtype, length):
    """GroupNorm's affine scaled so that Mish sees -150..150: its saturation on both sides (the
    CPU kernels' exp clamps at -87 and 88, their Mish at 20), at row lengths the CPU epilogue
    takes packed, by rows and with tails."""
    g = torch.Generator().manual_seed(length)
    shape = (3, 16, 48, length, 3, 4)
    x, w, b, _, _ = make_inputs(shape, dtype, device, g)
    gamma = (torch.linspace(-60, 60, 48) + 0.5).to(device, dtype)
    beta = torch.linspace(-90, 90, 48).to(device, dtype)
    film = (torch.randn(3, 96, generator=g)).to(device, dtype)
    residual = torch.randn(3, 48, length, generator=g).to(device, dtype)
    out = ops.conv1d_gn_mish(x, w, b, gamma, beta, 4, film=film, residual=residual)
    expected = reference(x, w, b, gamma, beta, 4, film, residual)
    # Outputs reach ~1e4: the tolerance is relative to them.
    torch.testing.assert_close(out.cpu().double(), expected, atol=TOLERANCES[dtype]["atol"] * 100,
                               rtol=TOLERANCES[dtype]["rtol"])


@pytest.mark.parametrize("lanes", [4, 8, 16, None], ids=["4", "8", "16", "widest"])
def test_cpu_kernels_at_every_vector_width(lanes):
    """The CPU epilogue is compiled for 4 (SSE2, NEON), 8 (AVX2) and 16 (AVX-512) lanes, the
    weight-streaming GEMM (both forms) for 4 and 16 and, in bf16, for AVX-512's bf16 dot
    product, and each runs the widest the CPU has; DPA_CPU_VECTOR_LANES narrows it (16: AVX-512
    without the dot product), so that this CPU checks the widths other CPUs take (a width it
    lacks falls back to a narrower one)."""
    code = textwrap.dedent("""
        import itertools
        import torch
        from tests.kernels.test_conv1d_gn_mish import ODD_SHAPES, UNET_SHAPES, check, film_and_residual, make_inputs, reference
        from tests.kernels.test_conv1d_gn_mish import TOLERANCES
        from diffusion_policy_accelerated.kernels import ops
        from diffusion_policy_accelerated.kernels.config import kernel_config
        for shape, route, dtype in itertools.product(ODD_SHAPES + UNET_SHAPES[:6], ("auto", "stream"),
                                                     (torch.float32, torch.bfloat16)):
            with kernel_config(cpu_conv=route):
                check(shape, dtype, "cpu")
                g = torch.Generator().manual_seed(1)
                x, w, b, gamma, beta = make_inputs(shape, dtype, "cpu", g)
                film, residual = film_and_residual(shape, dtype, "cpu", g, "scale+bias")
                out = ops.conv1d_gn_mish(x, w, b, gamma, beta, shape[5], film=film, residual=residual)
                torch.testing.assert_close(out.double(), reference(x, w, b, gamma, beta, shape[5], film, residual),
                                           **TOLERANCES[dtype])
        from tests.kernels import test_conv1d
        with kernel_config(cpu_conv="stream"):  # the k-major form: transposed convs
            for shape in test_conv1d.ODD_SHAPES + test_conv1d.UNET_SHAPES:
                if shape[7]:
                    for dtype in (torch.float32, torch.bfloat16):
                        test_conv1d.check(shape, dtype, "cpu")
    """)
    result = subprocess.run([sys.executable, "-c", code], env=lanes_env(lanes), cwd=Path(__file__).parent,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


def lanes_env(lanes):
    """The environment with DPA_CPU_VECTOR_LANES set to `lanes` (None: unset, the widest), and
    the repository on PYTHONPATH (the package may be built in place, not installed)."""
    env = {k: v for k, v in os.environ.items() if k != "DPA_CPU_VECTOR_LANES"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2])]
                                        + [p for p in [os.environ.get("PYTHONPATH")] if p])
    return env if lanes is None else dict(env, DPA_CPU_VECTOR_LANES=str(lanes))


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists() or " avx512_bf16" not in Path("/proc/cpuinfo").read_text(),
                    reason="needs a CPU with AVX-512's bf16 dot product")
def test_cpu_bf16_dot_product_runs():
    """On a CPU with vdpbf16ps a bf16 conv on the streaming GEMM takes the dot-product kernel:
    its bits differ from the AVX-512 kernel's (DPA_CPU_VECTOR_LANES=16), which sums the same
    exact products in another order; both are checked against float64 above."""
    code = textwrap.dedent("""
        import hashlib
        import torch
        from diffusion_policy_accelerated.kernels import ops
        from diffusion_policy_accelerated.kernels.config import kernel_config
        g = torch.Generator().manual_seed(3)
        x = torch.randn(1, 512, 16, generator=g).to(torch.bfloat16)
        w = (torch.randn(256, 512, 5, generator=g) / 50).to(torch.bfloat16)
        with kernel_config(cpu_conv="stream"):
            out = ops.conv1d(x, w, None, 1, 2, transposed=False)
        print(hashlib.sha256(out.view(torch.int16).numpy().tobytes()).hexdigest())
    """)
    digests = [subprocess.run([sys.executable, "-c", code], env=lanes_env(lanes), cwd=Path(__file__).parent,
                              capture_output=True, text=True, timeout=300, check=True).stdout.strip()
               for lanes in (16, None)]
    assert digests[0] != digests[1], "the bf16 dot-product kernel gave the AVX-512 kernel's bits: it did not run"


@pytest.mark.gpu
def test_sliced_group_norm_on_fewer_sms_than_planned_for():
    """In a process confined to 16 SMs (a CUDA green context) that did not say so
    (KernelConfig.sm_count unset), the sliced GroupNorm's 128 blocks are more than 16 SMs hold
    at once. The op must see the context's SMs and take two launches: a captured cooperative
    launch of that size never ran on replay (a hang), and a direct one is refused. Eagerly and
    replayed from a CUDA graph, the output is right and the counters zero again (a separate
    process: a green context is process-wide)."""
    from torch.cuda import green_contexts
    if not green_contexts.SUPPORTED or torch.cuda.get_device_properties(0).multi_processor_count <= 32:
        pytest.skip("needs CUDA green contexts and a GPU of more than 32 SMs")
    code = textwrap.dedent("""
        import torch
        from torch.cuda.green_contexts import GreenContext
        from tests.kernels.test_conv1d_gn_mish import TOLERANCES, film_and_residual, make_inputs, reference
        from diffusion_policy_accelerated.kernels import ops
        context = GreenContext.create(16, 0)
        context.set_context()
        shape = (1, 64, 512, 64, 5, 8)  # 8 groups of 4096 elements: 16 slices each
        g = torch.Generator().manual_seed(14)
        x, w, b, gamma, beta = make_inputs(shape, torch.bfloat16, "cuda", g)
        film, residual = film_and_residual(shape, torch.bfloat16, "cuda", g, "scale+bias")
        counters = torch.zeros(512, dtype=torch.int32, device="cuda")
        run = lambda: ops.conv1d_gn_mish(x, ops.taps_major(w), b, gamma, beta, 8, film=film, residual=residual,
                                         counters=counters)
        expected = reference(x, w, b, gamma, beta, 8, film, residual)
        torch.testing.assert_close(run().cpu().double(), expected, **TOLERANCES[torch.bfloat16])
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
        graph.replay()
        torch.testing.assert_close(out.cpu().double(), expected, **TOLERANCES[torch.bfloat16])
        assert not counters.any()
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", code], env=lanes_env(None), cwd=Path(__file__).parent,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]
