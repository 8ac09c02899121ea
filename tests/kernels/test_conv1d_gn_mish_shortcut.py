"""conv1d_gn_mish_shortcut (a residual block's first Conv1dBlock with FiLM, and its 1x1
shortcut conv of the same input) against float64 PyTorch references, on CPU and (where
present) CUDA. Both outputs use conv1d_gn_mish's per-dtype tolerances (test_conv1d_gn_mish):
the shortcut is a plain conv with fp32 accumulation, well inside them."""

import pytest
import torch
import torch.nn.functional as F

from diffusion_policy_accelerated.kernels import ops
from diffusion_policy_accelerated.kernels.config import kernel_config
from tests.support import (DEVICES, assert_one_cluster_launch, check_bad_input, check_mixed_devices,
                      clusters_enabled, poison_allocator, run_behind_a_sleep)
from tests.kernels.test_conv1d_gn_mish import FILM_LAYOUTS, TOLERANCES, film_and_residual, make_inputs, reference

# (batch, in_channels, out_channels, length, kernel_size, groups) of the residual blocks that
# change the channel count: lowdim U-Net (action dim 2), image U-Net (action dim 10), at
# horizon 16, then other batches and odd sizes.
UNET_SHAPES = [
    (1, 2, 256, 16, 5, 8), (1, 256, 512, 8, 5, 8), (1, 512, 1024, 4, 5, 8), (1, 2048, 512, 4, 5, 8),
    (1, 1024, 256, 8, 5, 8), (1, 10, 512, 16, 5, 8), (1, 512, 1024, 8, 5, 8), (1, 1024, 2048, 4, 5, 8),
    (1, 4096, 1024, 4, 5, 8), (1, 2048, 512, 8, 5, 8),
]
OTHER_SHAPES = [
    (3, 256, 512, 8, 5, 8), (2, 1024, 256, 8, 5, 8), (7, 512, 1024, 4, 5, 8), (3, 7, 6, 3, 3, 3),
    (2, 5, 64, 9, 5, 16), (1, 33, 40, 5, 7, 5), (3, 4, 8, 2, 3, 4), (1, 1, 3, 1, 1, 1),
]


def shortcut_reference(x, weight, bias):
    d = lambda t: None if t is None else t.detach().double().cpu()
    return F.conv1d(d(x), d(weight), d(bias))


def make_shortcut(shape, dtype, device, generator, channels=None):
    _, cin, cout, _, _, _ = shape
    channels = cout if channels is None else channels
    weight = (torch.randn(channels, cin, 1, generator=generator) * cin ** -0.5).to(device, dtype)
    return weight, (torch.randn(channels, generator=generator) * 0.1).to(device, dtype)


def split_input(x, skip_from):
    """(x's first skip_from channels, the rest as `skip`), `skip` with other strides than x:
    the op must read cat((x, skip), dim=1) wherever the two halves live."""
    skip = x[:, skip_from:].transpose(1, 2).contiguous().transpose(1, 2)
    return x[:, :skip_from], skip


def check(shape, dtype, device, film_layout="scale+bias", shortcut_channels=None, counters=None,
          shortcut=None, seed=0, skip_from=None, taps_major=False):
    g = torch.Generator().manual_seed(seed)
    x, w, b, gamma, beta = make_inputs(shape, dtype, device, g)
    if taps_major:
        w = ops.taps_major(w)
    ws, bs = make_shortcut(shape, dtype, device, g, shortcut_channels) if shortcut is None else shortcut
    film, _ = film_and_residual(shape, dtype, device, g, film_layout)
    batch, _, cout, length, _, groups = shape
    first, skip = (x, None) if skip_from is None else split_input(x, skip_from)
    poison_allocator(device, batch * max(cout, ws.shape[0]) * length, dtype)
    out, short = ops.conv1d_gn_mish_shortcut(first, w, b, gamma, beta, groups, 1e-5, ws, bs, film=film,
                                             counters=counters, skip=skip)
    assert out.shape == (batch, cout, length) and short.shape == (batch, ws.shape[0], length)
    assert out.dtype == short.dtype == dtype and out.device == short.device == x.device
    assert not out.isnan().any() and not short.isnan().any(), "unwritten (poisoned) or NaN outputs"
    torch.testing.assert_close(out.cpu().double(), reference(x, w, b, gamma, beta, groups, film),
                               **TOLERANCES[dtype])
    torch.testing.assert_close(short.cpu().double(), shortcut_reference(x, ws, bs), **TOLERANCES[dtype])
    return out, short


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", UNET_SHAPES + OTHER_SHAPES, ids=str)
def test_matches_float64_reference(shape, dtype, device):
    check(shape, dtype, device)


# The up path's blocks (input: the level's output, then the skip connection of as many
# channels), then odd splits.
SKIP_CASES = [((1, 2048, 512, 4, 5, 8), 1024), ((1, 1024, 256, 8, 5, 8), 512),
              ((1, 4096, 1024, 4, 5, 8), 2048), ((1, 2048, 512, 8, 5, 8), 1024),
              ((3, 256, 512, 8, 5, 8), 128), ((3, 7, 6, 3, 3, 3), 3), ((2, 5, 64, 9, 5, 16), 1),
              ((1, 33, 40, 5, 7, 5), 32)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape,skip_from", SKIP_CASES, ids=str)
def test_skip_is_read_as_the_concatenation(shape, skip_from, dtype, device):
    check(shape, dtype, device, skip_from=skip_from)


# A taps-major first weight (ops.taps_major): on the CUDA GEMM route the shortcut's GEMM then
# reads x's columns as they are, not the centre tap's rows of im2col's.
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape,skip_from", [((64, 256, 512, 8, 5, 8), None), ((8, 2048, 512, 4, 5, 8), 1024),
                                             ((3, 33, 40, 17, 7, 5), 32), ((1, 33, 40, 5, 7, 5), None)], ids=str)
def test_taps_major_weight(shape, skip_from, dtype, device):
    check(shape, dtype, device, skip_from=skip_from, taps_major=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("film_layout", FILM_LAYOUTS)
def test_film_layouts_and_other_shortcut_widths(film_layout, device):
    for channels in (256, 3, 517):
        check((2, 64, 256, 8, 5, 8), torch.float32, device, film_layout, shortcut_channels=channels)


@pytest.mark.parametrize("device", DEVICES)
def test_counters_are_left_zero_and_reusable(device):
    counters = torch.zeros(4096, dtype=torch.int32, device=device)
    for seed, shape in enumerate([(1, 256, 512, 8, 5, 8), (1, 2048, 512, 4, 5, 8), (1, 2, 256, 16, 5, 8)]):
        for _ in range(2):
            check(shape, torch.float32, device, counters=counters, seed=seed)
            assert int(counters.abs().sum()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_misaligned_shortcut_weight_takes_two_launches(dtype):
    """A shortcut weight 16-byte misaligned cannot use the vector loads the first conv's can:
    the op then launches the two kernels separately, with the same results."""
    shape = (1, 512, 1024, 4, 5, 8)
    g = torch.Generator().manual_seed(5)
    ws, bs = make_shortcut(shape, dtype, "cuda", g)
    storage = torch.empty(ws.numel() + 1, dtype=dtype, device="cuda")
    misaligned = storage[1:].view_as(ws).copy_(ws)
    assert misaligned.data_ptr() % 16 != 0 and misaligned.is_contiguous()
    check(shape, dtype, "cuda", shortcut=(misaligned, bs))


# Streaming-route pairs (shape, shortcut channels or None: as many as the conv's, skip_from
# or None): the U-Nets' at batch 1, their slices streamed through registers or (2048->512 L4,
# 1024->2048 L4) the cluster's shared-memory ring; shortcuts narrower or wider than the conv
# and no multiple of a cluster's rows (a short last unit); odd batches, groups too small for a
# cluster of two, a reduction not a multiple of the vector.
PAIR_CASES = [((1, 2, 256, 16, 5, 8), None, None), ((1, 256, 512, 8, 5, 8), None, None),
              ((1, 512, 1024, 4, 5, 8), None, None), ((1, 2048, 512, 4, 5, 8), None, 1024),
              ((1, 1024, 256, 8, 5, 8), None, 512), ((1, 1024, 2048, 4, 5, 8), None, None),
              ((1, 256, 512, 8, 5, 8), 3, None), ((1, 256, 512, 8, 5, 8), 517, 100),
              ((1, 2048, 512, 4, 5, 8), 1000, None), ((3, 256, 512, 8, 5, 8), None, 128),
              ((7, 64, 96, 4, 5, 8), 33, None), ((3, 9, 24, 5, 5, 24), None, None),
              ((2, 33, 40, 7, 5, 5), 41, 32), ((1, 1304, 200, 4, 5, 8), 300, None)]

# The pairs of the lowdim U-Net (horizon 16), which on a Hopper GPU must take the cluster
# kernel in every dtype.
LOWDIM_PAIRS = PAIR_CASES[:5]


@pytest.mark.gpu
@pytest.mark.parametrize("clusters", [True, False], ids=["clusters", "split-K blocks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_both_streaming_kernels(clusters, dtype):
    """On the streaming route a pair runs as thread-block clusters (a GroupNorm group each,
    and the shortcut's rows in clusters of the same size: Hopper and newer, where the plan
    fits) or as split-K blocks with finishing blocks: each must be right and repeat bit for
    bit (both add the reduction's splits in a fixed order)."""
    with clusters_enabled(clusters):
        for seed, (shape, channels, skip_from) in enumerate(PAIR_CASES):
            run = lambda: check(shape, dtype, "cuda", shortcut_channels=channels, skip_from=skip_from, seed=seed)
            out, short = run()
            again, short_again = run()
            assert torch.equal(out, again) and torch.equal(short, short_again), f"{shape}: a second run differs"


@pytest.mark.gpu(capability=9)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape,channels,skip_from", LOWDIM_PAIRS, ids=str)
def test_lowdim_pairs_take_clusters(shape, channels, skip_from, dtype):
    """Every block of the cluster kernel stamps the launch trace's last event (of the split-K
    kernel only the finishing blocks do): the lowdim U-Net's pairs are one cluster launch."""
    assert_one_cluster_launch(lambda: check(shape, dtype, "cuda", shortcut_channels=channels, skip_from=skip_from))


@pytest.mark.gpu
@pytest.mark.parametrize("route,threshold", [("streaming kernels", 1 << 62), ("im2col + GEMM", 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_both_cuda_routes(route, threshold, dtype):
    """The GEMM route's shortcut reads the first conv's centre-tap columns in place: an odd
    number of positions puts them at an offset no multiple of 16 bytes."""
    with kernel_config(gemm_min_positions=threshold, gemm_min_work=threshold):
        for shape in [(1, 256, 512, 8, 5, 8), (3, 7, 6, 3, 3, 3), (64, 64, 96, 4, 5, 8),
                      (5, 33, 40, 7, 7, 5), (2, 9, 24, 1, 1, 24)]:
            for channels in (None, 3):
                check(shape, dtype, "cuda", shortcut_channels=channels)
            check(shape, dtype, "cuda", skip_from=shape[1] // 2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(64, 256, 512, 8, 5, 8), (33, 12, 20, 3, 3, 2)], ids=str)
def test_ordered_on_the_callers_stream(shape, dtype):
    """On the GEMM route the shortcut's GEMM and epilogue run on a side stream (in half
    precision, and in fp32 below 256 positions), overlapping the GroupNorm conv's: they must
    wait for what the caller's stream queued, and the caller's stream for them."""
    with kernel_config(gemm_min_positions=1):
        g = torch.Generator().manual_seed(12)
        groups = shape[5]
        x, w, b, gamma, beta = make_inputs(shape, dtype, "cuda", g)
        ws, bs = make_shortcut(shape, dtype, "cuda", g)
        film, _ = film_and_residual(shape, dtype, "cuda", g, "scale+bias")
        for side_stream in (True, False):
            with kernel_config(side_stream=side_stream):
                out, short = run_behind_a_sleep(
                    lambda x: ops.conv1d_gn_mish_shortcut(x, w, b, gamma, beta, groups, 1e-5, ws, bs, film=film), [x])
            torch.testing.assert_close(out.cpu().double(), reference(x, w, b, gamma, beta, groups, film),
                                       **TOLERANCES[dtype])
            torch.testing.assert_close(short.cpu().double(), shortcut_reference(x, ws, bs), **TOLERANCES[dtype])


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    g = torch.Generator().manual_seed(6)
    for shape in [(1, 8, 16, 16, 5, 8), (3, 5, 6, 3, 3, 3)]:
        x, w, b, gamma, beta = make_inputs(shape, torch.float32, device, g)
        ws, bs = make_shortcut(shape, torch.float32, device, g)
        film, _ = film_and_residual(shape, torch.float32, device, g, "scale+bias")
        torch.library.opcheck(torch.ops.dpa.conv1d_gn_mish_shortcut.default,
                              (x, w, b, gamma, beta, shape[5], 1e-5, ws, bs), dict(film=film))
    torch.library.opcheck(torch.ops.dpa.conv1d_gn_mish_shortcut.default,
                          (x, w, None, None, None, shape[5], 1e-5, ws, None))
    first, skip = split_input(x, 2)
    torch.library.opcheck(torch.ops.dpa.conv1d_gn_mish_shortcut.default,
                          (first, w, b, gamma, beta, shape[5], 1e-5, ws, bs), dict(film=film, skip=skip))


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile(device):
    g = torch.Generator().manual_seed(7)
    shape = (2, 8, 16, 16, 5, 8)
    x, w, b, gamma, beta = make_inputs(shape, torch.float32, device, g)
    ws, bs = make_shortcut(shape, torch.float32, device, g)

    def block(*args):
        out, short = ops.conv1d_gn_mish_shortcut(*args)
        return out + short

    args = (x, w, b, gamma, beta, 8, 1e-5, ws, bs)
    torch.testing.assert_close(torch.compile(block, fullgraph=True)(*args), block(*args))


def good_args(device="cpu"):
    g = torch.Generator().manual_seed(8)
    x, w, b, gamma, beta = make_inputs((2, 4, 8, 6, 3, 4), torch.float32, device, g)
    ws, bs = make_shortcut((2, 4, 8, 6, 3, 4), torch.float32, device, g)
    return dict(x=x, weight=w, bias=b, gn_weight=gamma, gn_bias=beta, num_groups=4, eps=1e-5,
                shortcut_weight=ws, shortcut_bias=bs)


BAD_INPUTS = [
    # (what to change, expected exception, text the message must contain)
    (dict(shortcut_weight=torch.randn(8, 4, 3)), ValueError, "shortcut_weight must be [shortcut_channels, 4, 1]"),
    (dict(shortcut_weight=torch.randn(8, 5, 1)), ValueError, "shortcut_weight must be [shortcut_channels, 4, 1]"),
    (dict(shortcut_weight=torch.randn(0, 4, 1)), ValueError, "shortcut_weight must be"),
    (dict(shortcut_weight=torch.randn(8, 4)), ValueError, "shortcut_weight must be 3-D"),
    (dict(shortcut_weight=torch.randn(8, 4, 1, dtype=torch.float16)), TypeError, "shortcut_weight has dtype"),
    (dict(shortcut_bias=torch.randn(7)), ValueError, "shortcut_bias must have shape [8]"),
    (dict(weight=torch.randn(8, 5, 3)), ValueError, "conv1d_gn_mish_shortcut: weight has in_channels 5"),
    (dict(num_groups=3), ValueError, "num_groups must be >= 1 and divide"),
    (dict(film=torch.randn(2, 7)), ValueError, "film must be [2, 8] (a bias) or [2, 16]"),
    (dict(counters=torch.zeros(15, dtype=torch.int32)), ValueError, "at least out_channels (16)"),
    (dict(counters=torch.zeros(16)), TypeError, "counters must be int32"),
    (dict(skip=torch.randn(2, 3, 6)), ValueError, "weight has in_channels 4 but x has 7 channels (with skip's)"),
    (dict(skip=torch.randn(3, 3, 6)), ValueError, "skip must be [2, skip_channels >= 1, 6]"),
    (dict(skip=torch.randn(2, 3, 5)), ValueError, "skip must be [2, skip_channels >= 1, 6]"),
    (dict(skip=torch.randn(2, 0, 6)), ValueError, "skip must be [2, skip_channels >= 1, 6]"),
    (dict(skip=torch.randn(2, 3)), ValueError, "skip must be 3-D"),
    (dict(skip=torch.randn(2, 3, 6, dtype=torch.float16)), TypeError, "skip has dtype"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("change,error,text", BAD_INPUTS, ids=lambda v: v if isinstance(v, str) else "")
def test_bad_input_raises(change, error, text, device):
    check_bad_input(ops.conv1d_gn_mish_shortcut, good_args(device), change, error, text, device)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["x", "weight", "shortcut_weight", "shortcut_bias", "film", "counters", "skip"])
def test_mixed_devices_raise(name):
    args = good_args("cuda")
    if name == "skip":
        args.update(x=args["x"][:, :2], skip=args["x"][:, 2:])
    args.update(film=torch.randn(2, 16, device="cuda"), counters=torch.zeros(16, dtype=torch.int32, device="cuda"))
    check_mixed_devices(ops.conv1d_gn_mish_shortcut, args, name)
