"""Half-precision GroupNorm convs as one tensor-core launch on Hopper
(csrc/conv1d/cuda/group_norm_gemm.cu, KernelConfig.group_norm_gemm), against the float64
references of the ops' own tests (their bf16 / fp16 tolerances). Every shape here is one the
launch takes on a Hopper GPU whose build has sm_90a code (each test asserts it, so a build
that silently lost that code fails): groups of 128 and 256 channels, 16 to 64 positions
(padded up to wgmma's N where they are fewer), 2 to 8 slices of the reduction, odd batches
and lengths, kernels of 3 and 5, FiLM and residual epilogues, an input read with strides,
and the concatenated input and 1x1 shortcut of a residual block's first conv. Outputs are
poisoned first. Elsewhere the tests skip."""

import pytest
import torch

from diffusion_policy_accelerated import ops
from diffusion_policy_accelerated.configs import UNETS
from diffusion_policy_accelerated.model import ConditionalUnet1D
from diffusion_policy_accelerated.routing import kernel_config, group_norm_gemm_takes
from conftest import poison_allocator
import test_conv1d_gn_mish as gn_mish_tests
import test_conv1d_gn_mish_shortcut as shortcut_tests

HALF = [torch.bfloat16, torch.float16]

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                                reason="needs a Hopper GPU")


@pytest.fixture(autouse=True)
def launch_on():
    """Off by default (routing.KernelConfig.group_norm_gemm): these tests switch it on."""
    with kernel_config(group_norm_gemm=True):
        yield


def assert_taken(shape, dtype):
    batch, cin, cout, length, k, groups = shape
    conv = torch.nn.Conv1d(cin, cout, k, padding=k // 2)
    x = torch.empty(batch, cin, length, device="cuda", dtype=dtype)
    assert group_norm_gemm_takes(conv, groups, x), f"{shape} in {dtype} did not take the tensor-core launch"


# (batch, C_in, C_out, length, kernel, groups): LeRobot's U-Net at horizon 64, batch 1 (its
# 2048- and 1024-channel levels), then odd ones: batch 3, length 13 of 16 (N padded), kernel
# 3, 2 groups of 128 in 4 slices; batch 2, 20 of 32 positions, 2 groups of 256, a reduction
# of 1000 (its last tile part zeros), the most outputs a block's threads finish; 40 of 64
# positions over 2 groups of 128.
SHAPES = [(1, 2048, 2048, 16, 5, 8), (1, 4096, 1024, 16, 5, 8), (1, 1024, 2048, 16, 5, 8),
          (1, 1024, 1024, 32, 5, 8), (3, 384, 256, 13, 3, 2), (2, 200, 512, 20, 5, 2), (1, 512, 256, 40, 5, 2)]


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_float64_reference(shape, dtype):
    assert_taken(shape, dtype)
    gn_mish_tests.check(shape, dtype, "cuda")


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("film_layout", gn_mish_tests.FILM_LAYOUTS)
@pytest.mark.parametrize("shape", [(1, 2048, 2048, 16, 5, 8), (3, 384, 256, 13, 3, 2)], ids=str)
def test_film_and_residual_epilogue(shape, film_layout, dtype):
    assert_taken(shape, dtype)
    g = torch.Generator().manual_seed(7)
    x, w, b, gamma, beta = gn_mish_tests.make_inputs(shape, dtype, "cuda", g)
    film, residual = gn_mish_tests.film_and_residual(shape, dtype, "cuda", g, film_layout)
    batch, _, cout, length, _, groups = shape
    for kwargs in (dict(film=film), dict(residual=residual), dict(film=film, residual=residual)):
        poison_allocator("cuda", batch * cout * length, dtype)
        out = ops.conv1d_gn_mish(x, w, b, gamma, beta, groups, **kwargs)
        torch.testing.assert_close(out.cpu().double(), gn_mish_tests.reference(x, w, b, gamma, beta, groups, **kwargs),
                                   **gn_mish_tests.TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_strided_input_no_bias_no_affine(dtype):
    """x stored channels-last (staged element by element, not in 16-byte pieces), and no bias
    or GroupNorm affine."""
    shape = (1, 1024, 1024, 32, 5, 8)
    assert_taken(shape, dtype)
    g = torch.Generator().manual_seed(8)
    x, w, _, _, _ = gn_mish_tests.make_inputs(shape, dtype, "cuda", g)
    x = x.transpose(1, 2).contiguous().transpose(1, 2)
    poison_allocator("cuda", 1024 * 32, dtype)
    out = ops.conv1d_gn_mish(x, w, None, None, None, 8)
    torch.testing.assert_close(out.cpu().double(), gn_mish_tests.reference(x, w, None, None, None, 8),
                               **gn_mish_tests.TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("skip_from", [None, 2048], ids=["x", "x and skip"])
def test_with_shortcut(skip_from, dtype):
    """A residual block's first conv (the up path's: 4096 -> 1024 over x and its skip
    connection, read in place) beside its 1x1 shortcut."""
    shape = (1, 4096, 1024, 16, 5, 8)
    assert_taken(shape, dtype)
    shortcut_tests.check(shape, dtype, "cuda", skip_from=skip_from)


def test_off_gives_the_cublas_route():
    """The switch: off, the same conv is cuBLAS's GEMM and an epilogue (other bits, as close)."""
    shape, dtype = (1, 2048, 2048, 16, 5, 8), torch.bfloat16
    on = gn_mish_tests.check(shape, dtype, "cuda")
    with kernel_config(group_norm_gemm=False):
        conv = torch.nn.Conv1d(2048, 2048, 5, padding=2)
        assert not group_norm_gemm_takes(conv, 8, torch.empty(1, 2048, 16, device="cuda", dtype=dtype))
        off = gn_mish_tests.check(shape, dtype, "cuda")
    assert not torch.equal(on, off)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_lerobot_unet_forward(dtype):
    """LeRobot's default U-Net (down_dims 512/1024/2048) at horizon 64, batch 1: the forward
    with the launch against the same weights in float64 (tolerance: the bf16 / fp16 U-Net
    against float64 at this depth, measured with the launch off, times 2)."""
    torch.manual_seed(0)
    unet = ConditionalUnet1D(**UNETS["lerobot"]).cuda().eval()
    x, t = torch.randn(1, 64, 2, device="cuda"), torch.tensor([37], device="cuda")
    cond = torch.randn(1, UNETS["lerobot"]["global_cond_dim"], device="cuda")
    with torch.no_grad():
        unet.use_fused_ops = False
        expected = unet.double()(x.double(), t, global_cond=cond.double())
        unet.use_fused_ops = True
        half = unet.to(dtype)
        with kernel_config(group_norm_gemm=False):
            off = half(x.to(dtype), t, global_cond=cond.to(dtype)).double()
        on = half(x.to(dtype), t, global_cond=cond.to(dtype)).double()
    assert not torch.equal(on, off), "the launch was not taken"
    off_error = (off - expected).abs().max().item()
    on_error = (on - expected).abs().max().item()
    assert on_error <= 2 * off_error, f"max |error| {on_error:.3g} with the launch, {off_error:.3g} without"
