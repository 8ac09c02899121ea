"""fp32 GEMMs cut along their reduction (KernelConfig.fp32_gemm_max_splits; gemm_route.h's
gemm_splits): each op on the GEMM route, with the GEMM whole and split into 8 to 32 slices
whose partial sums the epilogue adds up, against the float64 references of the ops' own tests
(fp32 tolerance 1e-4 there). The shapes are a few 128 x 32 tiles, which any GPU of 8 SMs or
more splits: a held GroupNorm group, a sliced one (4096 elements), an odd batch and length, a
strided plain conv, a block's first conv with its 1x1 shortcut, and a whole residual block.
The split's bits differ from the whole GEMM's (another summation order), which shows that it
ran."""

import pytest
import torch

from diffusion_policy_accelerated.routing import kernel_config
import test_conv1d as conv1d_tests
import test_conv1d_gn_mish as gn_mish_tests
import test_conv1d_gn_mish_shortcut as shortcut_tests
import test_residual_block as block_tests

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def whole_and_split(run):
    """run() on the GEMM route with the GEMM whole, then split; both outputs."""
    outs = []
    for splits in (1, 32):
        with kernel_config(gemm_min_positions=1, fp32_gemm_max_splits=splits):
            outs.append(run())
    return outs


def assert_split_ran(whole, split):
    assert not torch.equal(whole, split), "the split GEMM gave the whole GEMM's bits: it did not run"


# (batch, C_in, C_out, length, kernel, groups); slices: 32 of 160 (5120 / 32), 16 of 160,
# 8 of 240.
@pytest.mark.parametrize("shape", [(1, 1024, 96, 24, 5, 8), (1, 512, 128, 64, 5, 2), (3, 384, 40, 7, 5, 5)],
                         ids=str)
def test_conv1d_gn_mish(shape):
    whole, split = whole_and_split(lambda: gn_mish_tests.check(shape, torch.float32, "cuda"))
    assert_split_ran(whole, split)


# (batch, C_in, C_out, length, kernel, stride, padding, transposed): a stride-2 downsampling
# conv (8 slices of 192) and a conv at batch 2 (16 of 200).
@pytest.mark.parametrize("shape", [(1, 512, 64, 64, 3, 2, 1, False), (2, 640, 48, 9, 5, 1, 2, False)], ids=str)
def test_conv1d(shape):
    whole, split = whole_and_split(lambda: conv1d_tests.check(shape, torch.float32, "cuda"))
    assert_split_ran(whole, split)


# The block's first conv in 32 slices of 160 and its 1x1 shortcut (C_in 1024) in 8 of 128, each
# output checked on its own: with the input given whole, split into x and skip (im2col reads
# both), and with a taps-major first conv, whose fp32 GEMM is never cut (the same bits) while
# the shortcut's reads x in place.
@pytest.mark.parametrize("skip_from,taps_major", [(None, False), (512, False), (None, True)],
                         ids=["x", "x and skip", "taps-major"])
def test_conv1d_gn_mish_shortcut(skip_from, taps_major):
    shape = (1, 1024, 256, 32, 5, 8)
    (out_whole, short_whole), (out_split, short_split) = whole_and_split(
        lambda: shortcut_tests.check(shape, torch.float32, "cuda", skip_from=skip_from, taps_major=taps_major))
    assert_split_ran(short_whole, short_split)
    if taps_major:
        assert torch.equal(out_whole, out_split), "a taps-major GEMM was cut"
    else:
        assert_split_ran(out_whole, out_split)


# One op on the GEMM route. 1024 -> 256: the first conv in 32 slices of 160, the second in 8 of
# 160, also with the input split into x and skip. 16 -> 256: only the second conv is cut (its
# columns are the first epilogue's output, read transposed), so differing bits are its split's.
@pytest.mark.parametrize("shape,skip_from", [((1, 1024, 256, 32, 5, 8), None), ((1, 1024, 256, 32, 5, 8), 512),
                                             ((1, 16, 256, 32, 5, 8), None)], ids=str)
def test_residual_block(shape, skip_from):
    whole, split = whole_and_split(lambda: block_tests.check(shape, torch.float32, "cuda", skip_from=skip_from)[2])
    assert_split_ran(whole, split)
