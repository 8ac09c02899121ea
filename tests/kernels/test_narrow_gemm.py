"""The GEMM route's own fp32 GEMM over few positions (KernelConfig.narrow_gemm; narrow_gemm.cu,
taken where conv_route.h's narrow_splits says): each op on the GEMM route with it and
with cuBLAS's, against the float64 references of the ops' own tests (fp32 tolerance 1e-4
there). The shapes cover what the kernel masks: output channels that are not a multiple of
its 32 rows a block, reductions that are not a multiple of its 128-element chunk, fewer
positions than a block's 16 or 32 (a block holds 32 from 17 positions on), two batch rows,
a sliced GroupNorm group, a strided conv, a block's first conv with its 1x1 shortcut (which
reads the centre tap's rows of the same columns, every fifth row; over 32 positions on a
side stream the shortcut's GEMM is narrow only beside the first conv's narrow GEMM), and a
whole residual block (its first GEMM; over 32 positions cuBLAS's beside its shortcut's cuBLAS
GEMM on a side stream), and inputs of other strides. Bits that differ from cuBLAS's (another
summation order) show that the kernel ran. A NaN-filled block of its partial sums' size is
left in the allocator first (the op's inputs may take it; an unwritten partial then shows as
stale values against the reference). With a budget of one or two SMs, a block's slice is
dozens of chunks: the ring's stages are refilled many times, and the im2col before it (under
PDL a few blocks an SM) takes many passes over the columns. Where the kernel cannot take a
GEMM (positions or reductions not a multiple of 4, more than 32 positions) the bits are
cuBLAS's."""

import pytest
import torch

from diffusion_policy_accelerated.kernels import ops
from diffusion_policy_accelerated.kernels import routing
from diffusion_policy_accelerated.kernels.config import kernel_config
from tests.support import poison_allocator
from tests.kernels import test_conv1d as conv1d_tests
from tests.kernels import test_conv1d_gn_mish as gn_mish_tests
from tests.kernels import test_conv1d_gn_mish_shortcut as shortcut_tests
from tests.kernels import test_residual_block as block_tests

pytestmark = pytest.mark.gpu(capability=8)  # cp.async


def splits(cin, cout, k, positions):
    """The slices conv_route.h's narrow_splits cuts a conv's GEMM over `positions` into on this
    GPU (0: cuBLAS runs it), read off the route of the conv forced onto the GEMM route."""
    conv = torch.nn.Conv1d(cin, cout, k, padding=k // 2, device="meta")
    with kernel_config(gemm_min_positions=1):
        return routing.conv_route(conv, 1, positions, torch.float32, "cuda").narrow_splits


# 17-32 positions: a block of 32 needs 4 stages of its ring in shared memory (A100, H100; not
# sm_86/89, where cuBLAS takes those GEMMs).
WIDE = pytest.mark.skipif(not torch.cuda.is_available() or splits(1024, 1024, 5, 32) == 0,
                          reason="needs 4 stages of a 32-position block in shared memory")


def narrow_and_cublas(run, partials):
    """run() on the GEMM route with the narrow GEMM, then with cuBLAS's; `partials`: the
    elements of the narrow GEMM's partial sums, poisoned before it runs."""
    outs = []
    for narrow in (True, False):
        with kernel_config(gemm_min_positions=1, narrow_gemm=narrow):
            if narrow:
                poison_allocator("cuda", partials, torch.float32)
            outs.append(run())
    return outs


def assert_narrow_ran(outs):
    assert not torch.equal(outs[0], outs[1]), "the narrow GEMM gave cuBLAS's bits: it did not run"


# (batch, C_in, C_out, length, kernel, groups): 40 rows (a block's 32 and 8 of the next), a
# reduction of 500 (3 chunks and 116) over 12 positions, and over 20 (a 32-position block);
# 96 rows over 16 and over 32; two batch rows of 8, and of 12 (24 positions); a 512-channel
# group of 8192 elements, and of 16384 over 32 positions (sliced epilogue).
@pytest.mark.parametrize("shape", [(1, 100, 40, 12, 5, 4), pytest.param((1, 100, 40, 20, 5, 4), marks=WIDE),
                                   (1, 1024, 96, 16, 5, 8), pytest.param((1, 1024, 96, 32, 5, 8), marks=WIDE),
                                   (2, 256, 64, 8, 5, 8), pytest.param((2, 256, 64, 12, 5, 8), marks=WIDE),
                                   (1, 512, 512, 16, 5, 1), pytest.param((1, 512, 512, 32, 5, 1), marks=WIDE)],
                         ids=str)
def test_conv1d_gn_mish(shape):
    batch, cin, cout, length, k, _ = shape
    s = splits(cin, cout, k, batch * length)
    assert s > 0, "the shape should take the narrow GEMM"
    assert_narrow_ran(narrow_and_cublas(lambda: gn_mish_tests.check(shape, torch.float32, "cuda"),
                                        s * cout * batch * length))


# (batch, C_in, C_out, length, kernel, stride, padding, transposed): stride-2 downsampling
# convs to 16 and 32 positions, and batch 3 of length 4.
@pytest.mark.parametrize("shape", [(1, 512, 64, 32, 3, 2, 1, False),
                                   pytest.param((1, 512, 64, 64, 3, 2, 1, False), marks=WIDE),
                                   (3, 160, 48, 4, 5, 1, 2, False)], ids=str)
def test_conv1d(shape):
    batch, cin, cout, length, k, stride, padding, _ = shape
    positions = batch * ((length + 2 * padding - k) // stride + 1)
    s = splits(cin, cout, k, positions)
    assert s > 0, "the shape should take the narrow GEMM"
    assert_narrow_ran(narrow_and_cublas(lambda: conv1d_tests.check(shape, torch.float32, "cuda"),
                                        s * cout * positions))


@pytest.mark.parametrize("skip_from", [None, 512], ids=["x", "x and skip"])
def test_conv1d_gn_mish_shortcut(skip_from):
    shape = (1, 1024, 256, 16, 5, 8)
    outs, shortcuts = zip(*narrow_and_cublas(
        lambda: shortcut_tests.check(shape, torch.float32, "cuda", skip_from=skip_from),
        splits(1024, 256, 5, 16) * 256 * 16))
    assert_narrow_ran(outs)
    assert_narrow_ran(shortcuts)


# (C_in, C_out, side stream, first conv narrow, shortcut narrow) over 32 positions: a narrow
# block then takes an SM's registers whole, so the shortcut's GEMM on a side stream
# (KernelConfig.side_stream) takes the narrow GEMM only beside the first conv's narrow GEMM,
# not beside cuBLAS's (a 1024 -> 2048 k5 weight is more than 2^23 elements).
@WIDE
@pytest.mark.parametrize("cin,cout,side_stream,first_narrow,shortcut_narrow", [
    (512, 256, True, True, True), (1024, 2048, True, False, False), (1024, 2048, False, False, True)], ids=str)
def test_shortcut_at_32_positions(cin, cout, side_stream, first_narrow, shortcut_narrow):
    shape = (1, cin, cout, 32, 5, 8)
    partials = max(splits(cin, cout, 5, 32), splits(cin, cout, 1, 32)) * cout * 32
    with kernel_config(side_stream=side_stream):
        outs, shortcuts = zip(*narrow_and_cublas(lambda: shortcut_tests.check(shape, torch.float32, "cuda"),
                                                 partials))
    for pair, narrow in ((outs, first_narrow), (shortcuts, shortcut_narrow)):
        if narrow:
            assert_narrow_ran(pair)
        else:
            assert torch.equal(pair[0], pair[1]), "the narrow GEMM ran where cuBLAS's should"


# (length, side stream, first conv narrow): over 32 positions its shortcut's cuBLAS GEMM on a
# side stream runs beside the first conv's, which is then cuBLAS's too (narrow_gemm_splits).
@pytest.mark.parametrize("length,side_stream,first_narrow", [
    (16, True, True), (32, True, False), pytest.param(32, False, True, marks=WIDE)], ids=str)
def test_residual_block(length, side_stream, first_narrow):
    """One op on the GEMM route (groups of 512 or 1024 elements, held): its first conv's GEMM
    is the narrow one; its second reads the first epilogue's columns transposed and stays
    cuBLAS's."""
    shape = (1, 1024, 256, length, 5, 8)
    with kernel_config(side_stream=side_stream):
        outs = narrow_and_cublas(lambda: block_tests.check(shape, torch.float32, "cuda")[2],
                                 splits(1024, 256, 5, length) * 256 * length)
    if first_narrow:
        assert_narrow_ran(outs)
    else:
        assert torch.equal(outs[0], outs[1]), "the narrow GEMM ran beside the shortcut's cuBLAS GEMM"


# A budget of 1 and 2 SMs (KernelConfig.sm_count): whole reductions of 40 and 80 chunks a block
# (the second LeRobot's 2048 -> 2048 k5 layer at horizon 64; the third its 2048 -> 512 layer
# at horizon 32, 32 positions), the ring refilled throughout.
@pytest.mark.parametrize("shape,sm_count", [((1, 1024, 96, 16, 5, 8), 1), ((1, 2048, 2048, 16, 5, 8), 2),
                                            pytest.param((1, 2048, 512, 32, 5, 8), 2, marks=WIDE)], ids=str)
def test_long_slices(shape, sm_count):
    batch, cin, cout, length, k, _ = shape
    with kernel_config(sm_count=sm_count):
        assert splits(cin, cout, k, batch * length) == 1
        assert_narrow_ran(narrow_and_cublas(lambda: gn_mish_tests.check(shape, torch.float32, "cuda"),
                                            cout * batch * length))


# The im2col before a narrow GEMM (under PDL im2col_narrow_kernel, a thread per element of
# the columns) reads x through its strides: x channels-last, and a view that starts inside
# its rows and channels (not 16-byte aligned), at two batch rows, and over 32 positions.
@pytest.mark.parametrize("layout", ["channels-last", "offset view"])
@pytest.mark.parametrize("shape", [(2, 256, 64, 8, 5, 8), pytest.param((1, 256, 64, 32, 5, 8), marks=WIDE)], ids=str)
def test_strided_input(shape, layout):
    batch, cin, cout, length, _, groups = shape
    x, w, b, gamma, beta = gn_mish_tests.make_inputs(shape, torch.float32, "cuda", torch.Generator().manual_seed(1))
    if layout == "channels-last":
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    else:
        outer = torch.randn(batch, cin + 1, length + 3, device="cuda")
        outer[:, 1:, 3:] = x
        x = outer[:, 1:, 3:]
    expected = gn_mish_tests.reference(x, w, b, gamma, beta, groups)

    def run():
        out = ops.conv1d_gn_mish(x, w, b, gamma, beta, groups)
        torch.testing.assert_close(out.cpu().double(), expected, **gn_mish_tests.TOLERANCES[torch.float32])
        return out

    assert_narrow_ran(narrow_and_cublas(run, splits(cin, cout, 5, batch * length) * cout * batch * length))


# Not taken: 7 and 18 positions, a reduction of 15 (3 channels), 36 positions.
@pytest.mark.parametrize("shape", [(1, 64, 32, 7, 5, 4), (1, 64, 32, 18, 5, 4), (1, 3, 32, 16, 5, 4),
                                   (3, 64, 32, 12, 5, 4)], ids=str)
def test_cublas_where_the_narrow_gemm_does_not_fit(shape):
    batch, cin, cout, length, k, _ = shape
    assert splits(cin, cout, k, batch * length) == 0
    outs = narrow_and_cublas(lambda: gn_mish_tests.check(shape, torch.float32, "cuda"), 1)
    assert torch.equal(outs[0], outs[1])

