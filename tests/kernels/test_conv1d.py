"""conv1d (Conv1d / ConvTranspose1d + bias + residual) against a float64 PyTorch reference, on
CPU and (where present) CUDA."""

import pytest
import torch
import torch.nn.functional as F

from diffusion_policy_accelerated.kernels import ops
from diffusion_policy_accelerated.kernels.config import kernel_config
from diffusion_policy_accelerated.model.unet import ConditionalUnet1D
from tests.support import (DEVICES, assert_one_cluster_launch, check_bad_input, check_mixed_devices,
                      clusters_enabled, poison_allocator)

# Tolerances per dtype, on outputs of size ~1 (weights scaled like PyTorch's default init):
#  fp32: fp32 accumulation of up to ~4k products: ~1e-6, margin x100.
#  fp16 / bf16: one rounding of the output (2^-11 / 2^-8 relative) dominates: ~4 ulps.
TOLERANCES = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}


def unet_conv_shapes(down_dims, input_dim, horizon=16):
    """(batch, in, out, length, kernel, stride, padding, transposed) of every plain conv of a
    Diffusion Policy U-Net (down/upsampling, 1x1 residual and final convs), read off hooks on
    a meta-device forward."""
    with torch.device("meta"):
        unet = ConditionalUnet1D(input_dim, global_cond_dim=8, down_dims=down_dims, kernel_size=5)
    shapes = []

    def hook(module, args, out):
        x = args[0]
        shapes.append((x.shape[0], x.shape[1], out.shape[1], x.shape[2], module.kernel_size[0],
                       module.stride[0], module.padding[0], isinstance(module, torch.nn.ConvTranspose1d)))

    convs = [m for name, m in unet.named_modules()
             if isinstance(m, (torch.nn.Conv1d, torch.nn.ConvTranspose1d)) and ".block." not in name]
    hooks = [m.register_forward_hook(hook) for m in convs]
    unet.use_fused_ops = False
    with torch.no_grad():
        unet(torch.zeros(1, horizon, input_dim, device="meta"), 0,
             global_cond=torch.zeros(1, 8, device="meta"))
    for h in hooks:
        h.remove()
    return sorted(set(shapes))


UNET_SHAPES = unet_conv_shapes([256, 512, 1024], 2) + unet_conv_shapes([512, 1024, 2048], 10)
ODD_SHAPES = [
    (1, 3, 5, 7, 3, 1, 1, False), (3, 5, 4, 9, 4, 3, 2, False), (2, 8, 6, 1, 1, 1, 0, False),
    (1, 6, 9, 10, 7, 2, 0, False), (5, 4, 3, 6, 2, 1, 1, False), (1, 1, 1, 1, 1, 1, 0, False),
    (1, 7, 5, 3, 3, 3, 0, True), (3, 6, 10, 5, 4, 2, 1, True), (2, 4, 4, 1, 5, 1, 2, True),
    (1, 9, 3, 8, 2, 2, 0, True), (4, 5, 7, 3, 1, 1, 0, True), (1, 33, 65, 7, 4, 2, 1, True),
    (2, 3, 1, 4, 1, 1, 0, True),
]
BATCH64_SHAPES = [(64, 512, 512, 8, 3, 2, 1, False), (64, 512, 512, 4, 4, 2, 1, True),
                  (64, 1024, 256, 8, 1, 1, 0, False)]


def make_inputs(shape, dtype, device, generator):
    batch, cin, cout, length, k, _, _, transposed = shape
    rand = lambda *s, scale=1.0: (torch.randn(*s, generator=generator) * scale).to(device, dtype)
    w_shape = (cin, cout, k) if transposed else (cout, cin, k)
    return rand(batch, cin, length), rand(*w_shape, scale=(cin * k) ** -0.5), rand(cout, scale=0.1)


def reference(x, w, b, stride, padding, transposed, residual=None):
    d = lambda t: None if t is None else t.detach().double().cpu()
    conv = F.conv_transpose1d if transposed else F.conv1d
    out = conv(d(x), d(w), d(b), stride=stride, padding=padding)
    return out if residual is None else out + d(residual)


def check(shape, dtype, device, seed=0, with_residual=True, taps_major=False):
    g = torch.Generator().manual_seed(seed)
    x, w, b = make_inputs(shape, dtype, device, g)
    _, _, _, _, _, stride, padding, transposed = shape
    if taps_major:
        w = ops.taps_major(w)
    expected_shape = reference(x, w, b, stride, padding, transposed).shape
    residual = torch.randn(expected_shape, generator=g).to(device, dtype) if with_residual else None
    poison_allocator(device, expected_shape.numel(), dtype)
    out = ops.conv1d(x, w, b, stride, padding, transposed=transposed, residual=residual)
    assert out.shape == expected_shape and out.dtype == dtype and out.device == x.device
    assert not out.isnan().any(), "unwritten (poisoned) or NaN outputs"
    torch.testing.assert_close(out.cpu().double(),
                               reference(x, w, b, stride, padding, transposed, residual),
                               **TOLERANCES[dtype])
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", UNET_SHAPES + ODD_SHAPES, ids=str)
def test_matches_float64_reference(shape, dtype, device):
    check(shape, dtype, device)


# The CPU's conv routes, each forced (KernelConfig.cpu_conv; "auto" picks one by timing; the
# streaming GEMM has fp32 and bf16, fp16 takes ATen's conv there; "fp32" is ATen's conv of fp32
# copies of half-precision operands, the output in their dtype), on every non-transposed shape:
# strides, paddings, kernel sizes 1-7, odd batches.
CPU_ROUTE_SHAPES = [s for s in UNET_SHAPES + ODD_SHAPES + BATCH64_SHAPES if not s[7]]


@pytest.mark.parametrize("route", ["aten", "gemm", "stream", "fp32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_every_cpu_route(route, dtype):
    with kernel_config(cpu_conv=route):
        for seed, shape in enumerate(CPU_ROUTE_SHAPES):
            check(shape, dtype, "cpu", seed=seed, with_residual=seed % 2 == 0, taps_major=seed % 3 == 1)
        # No bias, and an input read through strides (a slice of a wider tensor).
        g = torch.Generator().manual_seed(5)
        x = torch.randn(3, 12, 9, generator=g).to(dtype)[:, ::2]
        w = (torch.randn(8, 6, 3, generator=g) / 4).to(dtype)
        out = ops.conv1d(x, w, None, 2, 1, transposed=False)
        torch.testing.assert_close(out.double(), reference(x, w, None, 2, 1, False), **TOLERANCES[dtype])


# ... and the transposed ones, which have ATen's route and the streaming GEMM's (k-major, then
# each tap's products added where they land): strides 1-3, paddings 0-2, a length-1 output.
@pytest.mark.parametrize("route", ["aten", "stream", "fp32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_every_cpu_route_transposed(route, dtype):
    with kernel_config(cpu_conv=route):
        for seed, shape in enumerate(s for s in UNET_SHAPES + ODD_SHAPES + BATCH64_SHAPES if s[7]):
            check(shape, dtype, "cpu", seed=seed, with_residual=seed % 2 == 0)


# The weight-streaming GEMM's edges (csrc/conv1d/cpu/stream_gemm_cpu.cpp): rows not a multiple
# of its 4-row blocks, reductions not a multiple of its vectors (15, 100, 495; 65, odd, and 32
# for the 32 bf16 of a dot-product step), 1 to 33 positions (blocks of 4 partly or wholly past
# the last), a 1x1 conv.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cout,cin,k,batch,length", [(5, 3, 5, 1, 1), (7, 20, 5, 3, 5), (130, 99, 5, 2, 7),
                                                     (4, 16, 1, 1, 16), (9, 20, 5, 1, 33), (6, 13, 5, 1, 9),
                                                     (6, 32, 1, 2, 3)], ids=str)
def test_stream_route_edges(cout, cin, k, batch, length, dtype):
    g = torch.Generator().manual_seed(cout)
    x = torch.randn(batch, cin, length, generator=g).to(dtype)
    w = (torch.randn(cout, cin, k, generator=g) / (cin * k) ** 0.5).to(dtype)
    for b in (None, torch.randn(cout, generator=g).to(dtype)):
        with kernel_config(cpu_conv="stream"):
            poison_allocator("cpu", batch * cout * length, dtype)
            out = ops.conv1d(x, w, b, 1, k // 2, transposed=False)
        assert not out.isnan().any(), "unwritten (poisoned) or NaN outputs"
        torch.testing.assert_close(out.double(), reference(x, w, b, 1, k // 2, False), **TOLERANCES[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", BATCH64_SHAPES, ids=str)
def test_batch_64(shape, dtype, device):
    check(shape, dtype, device)


# Conv1d weights stored taps-major (ops.taps_major): the CUDA GEMM route multiplies their rows
# (output channel, tap) with x at every input position and gathers each output's taps, with
# any stride and padding; elsewhere the weight is read through a contiguous copy. The U-Net's
# downsampling at batch 64, then odd ones (batch x output length 32, 35 and 27).
TAPS_MAJOR_SHAPES = [(64, 512, 512, 8, 3, 2, 1, False), (8, 64, 32, 9, 4, 3, 2, False),
                     (5, 4, 3, 6, 2, 1, 1, False), (3, 7, 5, 13, 5, 1, 0, False)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", TAPS_MAJOR_SHAPES, ids=str)
def test_taps_major_weight(shape, dtype, device):
    check(shape, dtype, device, taps_major=True)


@pytest.mark.parametrize("device", DEVICES)
def test_no_bias_no_residual_and_strided_input(device):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 6, 3, generator=g).to(device).transpose(0, 2)  # [3, 6, 16], strided
    for transposed in (False, True):
        w = torch.randn(6, 6, 3, generator=g).to(device) / 4
        out = ops.conv1d(x, w, None, 2, 1, transposed=transposed)
        torch.testing.assert_close(out.cpu().double(), reference(x, w, None, 2, 1, transposed),
                                   **TOLERANCES[torch.float32])


@pytest.mark.parametrize("device", DEVICES)
def test_counters_are_left_zero(device):
    counters = torch.zeros(1024, dtype=torch.int32, device=device)
    g = torch.Generator().manual_seed(2)
    for shape in [(1, 512, 512, 16, 3, 2, 1, False), (1, 512, 512, 4, 4, 2, 1, True),
                  (1, 256, 2, 16, 1, 1, 0, False)]:
        x, w, b = make_inputs(shape, torch.float32, device, g)
        for _ in range(2):
            out = ops.conv1d(x, w, b, shape[5], shape[6], transposed=shape[7], counters=counters)
            assert int(counters.abs().sum()) == 0
        torch.testing.assert_close(out.cpu().double(), reference(x, w, b, *shape[5:]),
                                   **TOLERANCES[torch.float32])


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    g = torch.Generator().manual_seed(3)
    for shape in [(1, 8, 16, 16, 3, 2, 1, False), (2, 6, 4, 5, 4, 2, 1, True), (3, 4, 2, 7, 1, 1, 0, False)]:
        x, w, b = make_inputs(shape, torch.float32, device, g)
        args = (x, w, b, shape[5], shape[6], shape[7])
        torch.library.opcheck(torch.ops.dpa.conv1d.default, args)
        residual = torch.randn(reference(*args).shape, generator=g).to(device)
        torch.library.opcheck(torch.ops.dpa.conv1d.default, args, dict(residual=residual))


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile(device):
    g = torch.Generator().manual_seed(4)
    x, w, b = make_inputs((2, 8, 8, 8, 4, 2, 1, True), torch.float32, device, g)
    fn = torch.compile(lambda x, w, b: ops.conv1d(x, w, b, 2, 1, transposed=True) * 2, fullgraph=True)
    torch.testing.assert_close(fn(x, w, b), ops.conv1d(x, w, b, 2, 1, transposed=True) * 2)


def good_args(device="cpu"):
    g = torch.Generator().manual_seed(5)
    x, w, b = make_inputs((2, 4, 8, 6, 3, 2, 1, False), torch.float32, device, g)
    return dict(x=x, weight=w, bias=b, stride=2, padding=1)


BAD_INPUTS = [
    # (what to change, expected exception, text the message must contain)
    (dict(x=torch.randn(2, 4, 6, dtype=torch.float64)), TypeError, "x must be float32"),
    (dict(weight=torch.randn(8, 4, 3, dtype=torch.bfloat16)), TypeError, "weight has dtype"),
    (dict(bias=torch.randn(8, dtype=torch.float16)), TypeError, "bias has dtype"),
    (dict(x=torch.randn(4, 6)), ValueError, "x must be 3-D"),
    (dict(weight=torch.randn(8, 12)), ValueError, "weight must be 3-D"),
    (dict(weight=torch.randn(8, 5, 3)), ValueError, "weight has in_channels 5"),
    (dict(weight=torch.randn(8, 4, 0)), ValueError, "kernel_size >= 1"),
    (dict(bias=torch.randn(7)), ValueError, "bias must have shape [8]"),
    (dict(stride=0), ValueError, "stride must be >= 1"),
    (dict(padding=-1), ValueError, "padding must be >= 0"),
    (dict(weight=torch.randn(8, 4, 9), padding=1), ValueError, "gives no output"),
    (dict(x=torch.randn(0, 4, 6)), ValueError, "x must be non-empty"),
    (dict(residual=torch.randn(2, 8, 4)), ValueError, "residual must have the output's shape [2, 8, 3]"),
    (dict(counters=torch.zeros(8, dtype=torch.int64)), TypeError, "counters must be int32"),
    (dict(counters=torch.zeros(3, dtype=torch.int32)), ValueError, "at least out_channels (8)"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("change,error,text", BAD_INPUTS, ids=lambda v: v if isinstance(v, str) else "")
def test_bad_input_raises(change, error, text, device):
    check_bad_input(ops.conv1d, good_args(device), change, error, text, device)


@pytest.mark.parametrize("device", DEVICES)
def test_transposed_weight_layout_is_checked(device):
    args = good_args(device)
    with pytest.raises(ValueError, match="weight has in_channels 8"):
        ops.conv1d(args["x"], args["weight"], args["bias"], 2, 1, transposed=True)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["x", "weight", "bias", "residual", "counters"])
def test_mixed_devices_raise(name):
    args = good_args("cuda")
    args.update(residual=torch.randn(2, 8, 3, device="cuda"),
                counters=torch.zeros(8, dtype=torch.int32, device="cuda"))
    check_mixed_devices(ops.conv1d, args, name)


@pytest.mark.gpu
@pytest.mark.parametrize("route,threshold", [("streaming kernels", 1 << 62), ("im2col + GEMM", 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("with_residual", [False, True])
def test_both_cuda_routes(route, threshold, dtype, with_residual):
    """The op picks its CUDA route by batch * length; each route must be right on every shape
    (ODD_SHAPES: strides past the kernel size, taps that land on no output, length 1)."""
    with kernel_config(gemm_min_positions=threshold, gemm_min_work=threshold):
        for shape in [(1, 256, 256, 16, 3, 2, 1, False), (3, 7, 6, 3, 4, 2, 1, True),
                      (8, 64, 96, 4, 1, 1, 0, False), (2, 9, 24, 5, 5, 3, 2, True),
                      (2, 9, 24, 5, 2, 3, 0, True)] + ODD_SHAPES:
            check(shape, dtype, "cuda", with_residual=with_residual)


# Plain and transposed convs on the streaming route. The lowdim U-Net's at batch 1 first
# (downsampling, final conv, upsampling), the image U-Net's upsampling; then slices through
# the cluster's shared-memory weight ring (4096 -> 64 k3), channels no multiple of a cluster's
# rows or 32 (a short last unit), batches up to 32 positions, other kernel sizes and strides
# (taps no multiple of the vector, strides past the kernel size), reductions too short to
# split (a one-block cluster, so split-K).
LOWDIM_STREAMING_SHAPES = [(1, 256, 256, 16, 3, 2, 1, False), (1, 512, 512, 8, 3, 2, 1, False),
                           (1, 256, 2, 16, 1, 1, 0, False), (1, 512, 512, 4, 4, 2, 1, True),
                           (1, 256, 256, 8, 4, 2, 1, True)]
STREAMING_SHAPES = LOWDIM_STREAMING_SHAPES + [
    (1, 1024, 1024, 4, 4, 2, 1, True), (1, 512, 512, 8, 4, 2, 1, True), (1, 4096, 64, 4, 3, 1, 1, False),
    (3, 6, 10, 5, 4, 2, 1, True), (1, 33, 65, 7, 4, 2, 1, True), (2, 100, 70, 16, 4, 2, 1, True),
    (2, 300, 70, 16, 3, 1, 1, False), (3, 5, 4, 9, 4, 3, 2, False), (1, 9, 3, 8, 2, 2, 0, True),
    (2, 4, 4, 1, 5, 1, 2, True), (1, 7, 5, 3, 3, 3, 0, True), (4, 5, 7, 3, 1, 1, 0, True),
    (1, 1, 40, 8, 4, 2, 1, True), (1, 3, 5, 7, 3, 1, 1, False)]


@pytest.mark.gpu
@pytest.mark.parametrize("clusters", [True, False], ids=["clusters", "split-K blocks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_both_streaming_kernels(clusters, dtype):
    """A conv on the streaming route runs as thread-block clusters (a row tile or 32 output
    channels each: Hopper and newer, where the plan fits) or as split-K blocks with finishing
    blocks: each must be right, with and without a residual."""
    with clusters_enabled(clusters):
        for seed, shape in enumerate(STREAMING_SHAPES):
            check(shape, dtype, "cuda", seed=seed)
            check(shape, dtype, "cuda", seed=seed, with_residual=False)


@pytest.mark.gpu(capability=9)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", LOWDIM_STREAMING_SHAPES, ids=str)
def test_lowdim_convs_take_clusters(shape, dtype):
    """Every block of a cluster kernel stamps the launch trace's last event (of the split-K
    kernels only the finishing blocks do): the lowdim U-Net's plain and transposed convs are
    cluster launches."""
    assert_one_cluster_launch(lambda: check(shape, dtype, "cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [False, True])
def test_programmatic_dependent_launch_chain(pdl):
    """Back-to-back streaming kernels, each reading the last one's output, inside a CUDA graph
    (where PDL lets the next kernel start early): the result must not depend on the switch."""
    g = torch.Generator().manual_seed(6)
    ws = [(torch.randn(256, 256, 3, generator=g) / 28).cuda() for _ in range(6)]
    x = torch.randn(1, 256, 16, generator=g).cuda()
    counters = torch.zeros(256, dtype=torch.int32, device="cuda")
    with kernel_config(pdl=pdl):
        def chain():
            y = x
            for w in ws:
                y = ops.conv1d(y, w, None, 1, 1, counters=counters)
            return y

        expected = x.double().cpu()
        for w in ws:
            expected = F.conv1d(expected, w.double().cpu(), padding=1)
        chain()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain()
        for _ in range(3):
            graph.replay()
            torch.testing.assert_close(out.cpu().double(), expected, **TOLERANCES[torch.float32])
