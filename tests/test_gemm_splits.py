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


def test_conv1d_gn_mish_shortcut():
    # The first conv in 32 slices of 160, the shortcut (C_in 1024, one tap) in 8 of 128.
    shape = (1, 1024, 256, 32, 5, 8)
    whole, split = whole_and_split(lambda: torch.cat(shortcut_tests.check(shape, torch.float32, "cuda")))
    assert_split_ran(whole, split)


def test_residual_block():
    # One op on the GEMM route: the first conv in 32 slices of 160, the second in 8 of 160.
    shape = (1, 1024, 256, 32, 5, 8)
    whole, split = whole_and_split(lambda: block_tests.check(shape, torch.float32, "cuda")[2])
    assert_split_ran(whole, split)
