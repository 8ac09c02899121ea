"""fp32 cuBLAS GEMMs cut along their reduction (KernelConfig.fp32_gemm_max_splits; conv_route.h's
cublas_splits; the narrow GEMM, which would take most of these shapes, off): each op on the
GEMM route, with the GEMM whole and split into 8 to 32 slices
whose partial sums the epilogue adds up, against the float64 references of the ops' own tests
(fp32 tolerance 1e-4 there). The shapes are a few 128 x 32 tiles, which any GPU of 8 SMs or
more splits: a held GroupNorm group, a sliced one (4096 elements), an odd batch and length, a
strided plain conv, a block's first conv with its 1x1 shortcut, and a whole residual block.
Each runs whole and with at most 8 and 32 slices: bits that differ between those runs (other
summation orders) show that a split ran. Comparing with the whole GEMM alone is not enough:
cuBLAS itself may cut it the same way and add the parts in the same order (the shortcut
pair's 1024 -> 256 conv over 32 positions on an H100: the same bits as 32 slices)."""

import pytest
import torch

from diffusion_policy_accelerated.kernels.config import kernel_config
from tests.kernels import test_conv1d as conv1d_tests
from tests.kernels import test_conv1d_gn_mish as gn_mish_tests
from tests.kernels import test_conv1d_gn_mish_shortcut as shortcut_tests
from tests.kernels import test_residual_block as block_tests

pytestmark = pytest.mark.gpu


def whole_and_split(run):
    """run() on the GEMM route with the GEMM whole, then in at most 8 and 32 slices; the
    three outputs."""
    outs = []
    for splits in (1, 8, 32):
        with kernel_config(gemm_min_positions=1, fp32_gemm_max_splits=splits, narrow_gemm=False):
            outs.append(run())
    return outs


def assert_split_ran(outs):
    assert not all(torch.equal(outs[0], out) for out in outs[1:]), \
        "whole and split GEMMs gave the same bits: no split ran"


# (batch, C_in, C_out, length, kernel, groups); slices: 32 of 160 (5120 / 32), 16 of 160,
# 8 of 240.
@pytest.mark.parametrize("shape", [(1, 1024, 96, 24, 5, 8), (1, 512, 128, 64, 5, 2), (3, 384, 40, 7, 5, 5)],
                         ids=str)
def test_conv1d_gn_mish(shape):
    assert_split_ran(whole_and_split(lambda: gn_mish_tests.check(shape, torch.float32, "cuda")))


# (batch, C_in, C_out, length, kernel, stride, padding, transposed): a stride-2 downsampling
# conv (8 slices of 192) and a conv at batch 2 (16 of 200).
@pytest.mark.parametrize("shape", [(1, 512, 64, 64, 3, 2, 1, False), (2, 640, 48, 9, 5, 1, 2, False)], ids=str)
def test_conv1d(shape):
    assert_split_ran(whole_and_split(lambda: conv1d_tests.check(shape, torch.float32, "cuda")))


# The block's first conv in 32 slices of 160 and its 1x1 shortcut (C_in 1024) in 8 of 128, each
# output checked on its own: with the input given whole, split into x and skip (im2col reads
# both), and with a taps-major first conv, whose fp32 GEMM is never cut (the same bits) while
# the shortcut's reads x in place.
@pytest.mark.parametrize("skip_from,taps_major", [(None, False), (512, False), (None, True)],
                         ids=["x", "x and skip", "taps-major"])
def test_conv1d_gn_mish_shortcut(skip_from, taps_major):
    shape = (1, 1024, 256, 32, 5, 8)
    outs, shortcuts = zip(*whole_and_split(
        lambda: shortcut_tests.check(shape, torch.float32, "cuda", skip_from=skip_from, taps_major=taps_major)))
    assert_split_ran(shortcuts)
    if taps_major:
        assert all(torch.equal(outs[0], out) for out in outs[1:]), "a taps-major GEMM was cut"
    else:
        assert_split_ran(outs)


# One op on the GEMM route. 1024 -> 256: the first conv in 32 slices of 160, the second in 8 of
# 160, also with the input split into x and skip. 16 -> 256: only the second conv is cut (its
# columns are the first epilogue's output, read transposed), so differing bits are its split's.
@pytest.mark.parametrize("shape,skip_from", [((1, 1024, 256, 32, 5, 8), None), ((1, 1024, 256, 32, 5, 8), 512),
                                             ((1, 16, 256, 32, 5, 8), None)], ids=str)
def test_residual_block(shape, skip_from):
    assert_split_ran(whole_and_split(lambda: block_tests.check(shape, torch.float32, "cuda", skip_from=skip_from)[2]))
