"""residual_block (a whole ConditionalResidualBlock1D given its FiLM: two Conv1dBlocks, the
residual or its 1x1 shortcut) against float64 PyTorch references, on CPU and (where present)
CUDA, and on the CUDA GEMM route against the separate ops it fuses.

Tolerances are conv1d_gn_mish's per dtype (test_conv1d_gn_mish). The reference rounds what
the op rounds between its convs (the first conv's output, the shortcut's) to the dtype, so
that it measures each conv's arithmetic, as the single-op tests do."""

import threading

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from diffusion_policy_accelerated.kernels import ops
from diffusion_policy_accelerated.kernels.config import kernel_config
from tests.support import DEVICES, check_bad_input, check_mixed_devices, poison_allocator, run_behind_a_sleep
from tests.kernels.test_conv1d_gn_mish import FILM_LAYOUTS, TOLERANCES, film_and_residual, make_inputs, reference
from tests.kernels.test_conv1d_gn_mish_shortcut import shortcut_reference, split_input

# (batch, in_channels, out_channels, length, kernel_size, groups); a shortcut exactly where
# the channel count changes, as in the U-Net. The lowdim U-Net's blocks at horizon 16 and
# batch 1 (streaming route) and 64 (GEMM route); then odd batches and sizes.
UNET_SHAPES = [(1, 2, 256, 16, 5, 8), (1, 256, 256, 16, 5, 8), (1, 512, 1024, 4, 5, 8),
               (1, 1024, 1024, 4, 5, 8), (64, 256, 512, 8, 5, 8), (64, 1024, 1024, 4, 5, 8),
               (64, 2048, 512, 4, 5, 8)]
OTHER_SHAPES = [(3, 7, 6, 3, 3, 3), (5, 24, 24, 7, 5, 4), (2, 5, 64, 9, 5, 16), (1, 33, 40, 5, 7, 5),
                (9, 16, 16, 4, 3, 8), (1, 1, 3, 1, 1, 1), (33, 12, 12, 3, 3, 2)]
# Groups of more than 1024 elements, which the GEMM route's epilogue does not hold in
# registers: with contiguous weights the op runs the separate ops there (taps-major ones:
# test_sliced_groups_stay_fused_with_taps_major_weights).
LONG_GROUP_SHAPES = [(2, 64, 64, 160, 5, 4), (3, 32, 48, 100, 3, 2)]


def make_block(shape, dtype, device, generator, film_layout="scale+bias"):
    """The op's keyword arguments for a block of this shape (a shortcut iff channels change)."""
    batch, cin, cout, length, k, groups = shape
    x, w, b, gamma, beta = make_inputs(shape, dtype, device, generator)
    _, w2, b2, gamma2, beta2 = make_inputs((batch, cout, cout, length, k, groups), dtype, device, generator)
    film, _ = film_and_residual(shape, dtype, device, generator, film_layout)
    args = dict(x=x, weight=w, bias=b, gn_weight=gamma, gn_bias=beta, weight2=w2, bias2=b2,
                gn_weight2=gamma2, gn_bias2=beta2, num_groups=groups, eps=1e-5, film=film)
    if cin != cout:
        args["shortcut_weight"] = (torch.randn(cout, cin, 1, generator=generator) * cin ** -0.5).to(device, dtype)
        args["shortcut_bias"] = (torch.randn(cout, generator=generator) * 0.1).to(device, dtype)
    return args


def block_reference(args, skip=None):
    """float64 ConditionalResidualBlock1D from the op's (rounded) arguments, rounding the first
    conv's output and the shortcut's to the op's dtype where the op stores them."""
    x = args["x"] if skip is None else torch.cat((args["x"], skip), dim=1)
    dtype, groups = x.dtype, args["num_groups"]
    h = reference(x, args["weight"], args["bias"], args["gn_weight"], args["gn_bias"], groups, args["film"])
    if args.get("shortcut_weight") is None:
        residual = x.cpu().double()
    else:
        residual = shortcut_reference(x, args["shortcut_weight"], args["shortcut_bias"]).to(dtype).double()
    return reference(h.to(dtype), args["weight2"], args["bias2"], args["gn_weight2"], args["gn_bias2"],
                     groups, residual=residual)


def check(shape, dtype, device, seed=0, skip_from=None, film_layout="scale+bias", counters=None,
          taps_major=False):
    g = torch.Generator().manual_seed(seed)
    args = make_block(shape, dtype, device, g, film_layout)
    if taps_major:
        args["weight"], args["weight2"] = ops.taps_major(args["weight"]), ops.taps_major(args["weight2"])
    full_input = args["x"]
    skip = None
    if skip_from is not None:
        args["x"], skip = split_input(full_input, skip_from)
    batch, _, cout, length, k, _ = shape
    # Room for the output and for the GEMM route's second im2col columns.
    poison_allocator(device, batch * cout * length * k, dtype)
    out = ops.residual_block(**args, skip=skip, counters=counters)
    assert out.shape == (batch, cout, length) and out.dtype == dtype and out.device == full_input.device
    assert out.is_contiguous()
    assert not out.isnan().any(), "unwritten (poisoned) or NaN outputs"
    torch.testing.assert_close(out.cpu().double(), block_reference(args, skip), **TOLERANCES[dtype])
    return args, skip, out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", UNET_SHAPES + OTHER_SHAPES + LONG_GROUP_SHAPES, ids=str)
def test_matches_float64_reference(shape, dtype, device):
    if device == "cpu" and shape[0] == 64 and shape[1] >= 1024:
        shape = (8,) + shape[1:]  # keep CI's 2-core run short
    check(shape, dtype, device)


# The up path's blocks (the level's output, then the skip connection), odd splits, and an
# identity residual read from a concatenation.
SKIP_CASES = [((64, 2048, 512, 4, 5, 8), 1024), ((1, 1024, 256, 8, 5, 8), 512),
              ((3, 7, 6, 3, 3, 3), 3), ((33, 40, 40, 3, 5, 5), 8), ((5, 24, 24, 7, 5, 4), 23)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape,skip_from", SKIP_CASES, ids=str)
def test_skip_is_read_as_the_concatenation(shape, skip_from, dtype, device):
    if device == "cpu" and shape[0] == 64:
        shape = (4,) + shape[1:]
    check(shape, dtype, device, skip_from=skip_from)


# Taps-major weights (ops.taps_major), as ConditionalUnet1D passes them on the GEMM route:
# there the first conv's GEMM multiplies x's columns, its epilogue writes its output
# channels-last for the second's; U-Net blocks with and without a shortcut, a skip
# concatenation, odd sizes, a long group (cut into slices), and the streaming route.
TAPS_MAJOR_CASES = [((64, 256, 512, 8, 5, 8), None), ((64, 1024, 1024, 4, 5, 8), None),
                    ((64, 2048, 512, 4, 5, 8), 1024), ((33, 40, 40, 3, 5, 5), 8), ((5, 24, 24, 7, 5, 4), None),
                    ((9, 16, 16, 4, 3, 8), None), ((2, 64, 64, 160, 5, 4), None), ((1, 512, 1024, 4, 5, 8), None)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape,skip_from", TAPS_MAJOR_CASES, ids=str)
def test_taps_major_weights(shape, skip_from, dtype, device):
    if device == "cpu" and shape[0] == 64:
        shape = (4,) + shape[1:]  # keep CI's 2-core run short
    check(shape, dtype, device, skip_from=skip_from, taps_major=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("film_layout", FILM_LAYOUTS)
def test_film_layouts(film_layout, device):
    for shape in [(2, 64, 128, 8, 5, 8), (40, 32, 32, 4, 5, 8)]:
        check(shape, torch.float32, device, film_layout=film_layout)


@pytest.mark.parametrize("device", DEVICES)
def test_strided_input_and_no_optional_parameters(device):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, 24, 40, generator=g).to(device).transpose(0, 2)  # [40, 24, 16], strided
    w = torch.randn(24, 24, 3, generator=g).to(device) * 0.2
    w2 = torch.randn(24, 24, 5, generator=g).to(device) * 0.1
    out = ops.residual_block(x, w, None, None, None, w2, None, None, None, 4, 1e-5)
    args = dict(x=x, weight=w, bias=None, gn_weight=None, gn_bias=None, weight2=w2, bias2=None,
                gn_weight2=None, gn_bias2=None, num_groups=4, film=None)
    torch.testing.assert_close(out.cpu().double(), block_reference(args), **TOLERANCES[torch.float32])


@pytest.mark.parametrize("device", DEVICES)
def test_counters_are_left_zero_and_reusable(device):
    counters = torch.zeros(4096, dtype=torch.int32, device=device)
    for seed, shape in enumerate([(1, 256, 512, 8, 5, 8), (1, 1024, 1024, 4, 5, 8), (64, 64, 96, 4, 5, 8)]):
        for _ in range(2):
            check(shape, torch.float32, device, counters=counters, seed=seed)
            assert int(counters.abs().sum()) == 0


def separate_ops(args, skip):
    """What the op fuses, as the separate ops (what ConditionalResidualBlock1D runs per conv)."""
    a = dict(args)
    x = a.pop("x")
    conv = lambda inp, **kw: ops.conv1d_gn_mish(inp, a["weight2"], a["bias2"], a["gn_weight2"], a["gn_bias2"],
                                                 a["num_groups"], a["eps"], **kw)
    if a.get("shortcut_weight") is None:
        inp = x if skip is None else torch.cat((x, skip), dim=1)
        h = ops.conv1d_gn_mish(inp, a["weight"], a["bias"], a["gn_weight"], a["gn_bias"], a["num_groups"],
                               a["eps"], film=a["film"])
        return conv(h, residual=inp)
    h, residual = ops.conv1d_gn_mish_shortcut(x, a["weight"], a["bias"], a["gn_weight"], a["gn_bias"],
                                              a["num_groups"], a["eps"], a["shortcut_weight"],
                                              a["shortcut_bias"], film=a["film"], skip=skip)
    return conv(h, residual=residual)


def kernel_launches(run, name):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if name in e.key)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_gemm_route_fuses_and_matches_the_separate_ops(dtype):
    """On the GEMM route the first conv's epilogue writes the second conv's im2col columns
    (one im2col launch per block, where the separate ops make two) and the second's adds the
    shortcut's GEMM result rounded as conv1d stores it. The second GEMM reads its columns
    transposed, so cuBLAS may add up in another order than the separate ops: they agree
    within the dtype's tolerance. Groups too long to hold in registers take the separate ops."""
    with kernel_config(gemm_min_positions=1):
        cases = [(s, None) for s in UNET_SHAPES + OTHER_SHAPES + LONG_GROUP_SHAPES] + SKIP_CASES
        for seed, (shape, skip_from) in enumerate(cases):
            args, skip, out = check(shape, dtype, "cuda", seed=seed, skip_from=skip_from)
            torch.testing.assert_close(out, separate_ops(args, skip), **TOLERANCES[dtype],
                                       msg=lambda m: f"{shape}, skip from {skip_from}: {m}")
            held = (shape[2] // shape[5]) * shape[3] <= 1024
            im2cols = kernel_launches(lambda: ops.residual_block(**args, skip=skip), "im2col_kernel")
            assert im2cols == (1 if held else 2), f"{shape}: {im2cols} im2col launches"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_taps_major_weights_take_the_gemm_route_at_any_size(dtype):
    """Below KernelConfig.gemm_min_positions contiguous weights stream; taps-major ones (the
    caller's choice: ConditionalUnet1D's for large layers) take the fused GEMM route: its two
    GroupNorm epilogues, and one im2col launch at batch 2, none at batch 1, where x's [C][L]
    is the GEMM's operand as it is."""
    for shape, im2cols in [((2, 1024, 1024, 4, 5, 8), 1), ((1, 64, 32, 3, 3, 8), 0)]:
        args, _, _ = check(shape, dtype, "cuda", taps_major=True)
        assert kernel_launches(lambda: ops.residual_block(**args), "im2col_kernel") == im2cols
        assert kernel_launches(lambda: ops.residual_block(**args), "group_norm_epilogue") == 2
        contiguous = dict(args, weight=args["weight"].contiguous(), weight2=args["weight2"].contiguous())
        assert kernel_launches(lambda: ops.residual_block(**contiguous), "im2col_kernel") == 0
        assert kernel_launches(lambda: ops.residual_block(**contiguous), "group_norm_epilogue") == 0


# Groups past 1024 elements whose second weight is taps-major, at batch 2+: the epilogue is
# cut into slices, which write the second conv's operand channels-last, so the op stays
# fused. LeRobot's 512-channel blocks at horizon 64, groups ending inside a channel, and a
# shortcut with a skip concatenation. (At batch 1 the op runs per conv.)
SLICED_CASES = [((2, 512, 512, 64, 5, 8), None), ((2, 64, 512, 64, 5, 8), None), ((3, 32, 48, 100, 3, 2), None),
                ((2, 1024, 256, 40, 5, 8), 512)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sliced_groups_stay_fused_with_taps_major_weights(dtype):
    """Each of the sliced epilogue's kernels (cluster on Hopper, cooperative, two launches):
    right against float64, the same bits as the others, in the default layout and
    channels-last; and fused: one im2col launch (x's), where the separate ops make two."""
    from tests.kernels.test_conv1d_gn_mish import SLICED_WAYS
    hopper = torch.cuda.get_device_capability()[0] >= 9
    for seed, (shape, skip_from) in enumerate(SLICED_CASES):
        counters = torch.zeros(2 * shape[2], dtype=torch.int32, device="cuda")  # with a shortcut's
        outs = {}
        for way, (config, kernel) in SLICED_WAYS.items():
            if way == "cluster" and not hopper:
                continue
            with kernel_config(**config):
                args, skip, outs[way] = check(shape, dtype, "cuda", seed=seed, skip_from=skip_from, counters=counters,
                                              taps_major=True)
                assert kernel_launches(lambda: ops.residual_block(**args, skip=skip, counters=counters),
                                       kernel + "<") == 2, f"{shape} {way}: not both epilogues sliced so"
                poison_allocator("cuda", outs[way].numel(), dtype)
                stored = ops.residual_block(**args, skip=skip, counters=counters, channels_last=True)
                assert stored.transpose(1, 2).is_contiguous() and torch.equal(stored, outs[way]), f"{shape} {way}"
            assert not counters.any(), f"{shape} {way}: counters left non-zero"
        im2cols = kernel_launches(lambda: ops.residual_block(**args, skip=skip), "im2col_kernel")
        assert im2cols == 1, f"{shape}: {im2cols} im2col launches"
        for way, out in outs.items():
            assert torch.equal(out, outs["two launches"]), f"{shape}: {way} differs from the two launches"


def stored_channels_last(t):
    """t stored [B][L][C] in memory, as residual_block(channels_last=True) returns it."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


# The fused GEMM route with taps-major weights (identity, shortcut, skip; a long group cut
# into slices), with contiguous weights (im2col's form, 35 positions), and the streaming
# route (batch 1).
CHANNELS_LAST_CASES = [((64, 256, 256, 8, 5, 8), None, True), ((64, 256, 512, 8, 5, 8), None, True),
                       ((64, 2048, 512, 4, 5, 8), 1024, True), ((2, 64, 64, 160, 5, 4), None, True),
                       ((5, 24, 24, 7, 5, 4), None, False), ((1, 512, 1024, 4, 5, 8), None, False)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape,skip_from,taps_major", CHANNELS_LAST_CASES, ids=str)
def test_channels_last_output_holds_the_same_values(shape, skip_from, taps_major, dtype, device):
    """channels_last=True returns the same bits stored [B][L][C]: written so by the fused
    GEMM route's epilogue, copied elsewhere (other routes, the CPU)."""
    if device == "cpu" and shape[0] == 64:
        shape = (4,) + shape[1:]
    args, skip, out = check(shape, dtype, device, skip_from=skip_from, taps_major=taps_major)
    poison_allocator(device, out.numel(), dtype)
    stored = ops.residual_block(**args, skip=skip, channels_last=True)
    assert stored.shape == out.shape and stored.transpose(1, 2).is_contiguous()
    assert torch.equal(stored, out), "values differ from the default layout's (or were not written)"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_channels_last_input_is_read_in_place(dtype):
    """With a taps-major first weight, an x stored channels-last (a previous block's
    channels_last output) is the first GEMM's operand as it is, and the identity residual is
    read from it: no im2col (transposing) launch. Against float64, with and without a
    shortcut, at U-Net shapes, below KernelConfig.gemm_min_positions and odd sizes; and two blocks
    chained so, as ConditionalUnet1D chains them."""
    shapes = [(64, 256, 256, 8, 5, 8), (64, 1024, 1024, 4, 5, 8), (64, 256, 512, 8, 5, 8),
              (2, 1024, 1024, 4, 5, 8), (3, 40, 40, 9, 5, 5), (2, 64, 96, 5, 3, 8)]
    for seed, shape in enumerate(shapes):
        args = make_block(shape, dtype, "cuda", torch.Generator().manual_seed(seed))
        args["weight"], args["weight2"] = ops.taps_major(args["weight"]), ops.taps_major(args["weight2"])
        args["x"] = stored_channels_last(args["x"])
        poison_allocator("cuda", shape[0] * shape[2] * shape[3], dtype)
        out = ops.residual_block(**args)
        assert out.is_contiguous() and not out.isnan().any(), f"{shape}: unwritten or NaN outputs"
        torch.testing.assert_close(out.cpu().double(), block_reference(args), **TOLERANCES[dtype],
                                   msg=lambda m: f"{shape}: {m}")
        assert kernel_launches(lambda: ops.residual_block(**args), "im2col_kernel") == 0, shape
    # Two blocks of one width, the first's output passed channels-last to the second.
    g = torch.Generator().manual_seed(len(shapes))
    first, second = (make_block((64, 512, 512, 8, 5, 8), dtype, "cuda", g) for _ in range(2))
    for args in (first, second):
        args["weight"], args["weight2"] = ops.taps_major(args["weight"]), ops.taps_major(args["weight2"])
    h = ops.residual_block(**first, channels_last=True)
    out = ops.residual_block(**dict(second, x=h))
    torch.testing.assert_close(out, ops.residual_block(**dict(second, x=h.contiguous())), **TOLERANCES[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("route,threshold", [("streaming kernels", 1 << 62), ("im2col + GEMM", 1)])
def test_cuda_graph_replay(route, threshold):
    """Captured and replayed with new inputs copied in, as GraphedSampler does."""
    with kernel_config(gemm_min_positions=threshold, gemm_min_work=threshold):
        g = torch.Generator().manual_seed(9)
        args = make_block((4, 64, 128, 8, 5, 8), torch.float32, "cuda", g)
        ops.residual_block(**args)  # warm-up: workspaces and cuBLAS handles outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = ops.residual_block(**args)
        for _ in range(2):
            args["x"].copy_(torch.randn(args["x"].shape, generator=g).cuda())
            graph.replay()
            torch.testing.assert_close(out.cpu().double(), block_reference(args), **TOLERANCES[torch.float32])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_ordered_on_the_callers_stream(dtype):
    """On the GEMM route the shortcut's GEMM runs on a side stream (in half precision, and in
    fp32 below 256 positions), overlapping the first conv's: it must wait for what the
    caller's stream queued, and the caller's stream for it."""
    with kernel_config(gemm_min_positions=1):
        g = torch.Generator().manual_seed(11)
        for shape in [(64, 256, 512, 8, 5, 8), (33, 12, 20, 3, 3, 2)]:
            args = make_block(shape, dtype, "cuda", g)
            for side_stream in (True, False):
                with kernel_config(side_stream=side_stream):
                    (out,) = run_behind_a_sleep(lambda x: ops.residual_block(**{**args, "x": x}), [args["x"]])
                torch.testing.assert_close(out.cpu().double(), block_reference(args), **TOLERANCES[dtype])


@pytest.mark.gpu
def test_captures_on_two_threads_at_once():
    """Two threads capturing at the same time, each on its own stream (a server with a model
    copy per stream): each caller's stream forks to a side stream of its own, where a shared
    one would merge the two captures, a CUDA error. The threads meet at each step so that
    both captures are under way while the op runs, and no thread synchronizes the device
    (torch.cuda.graph does, so the lower-level capture calls) while the other captures."""
    with kernel_config(gemm_min_positions=1):
        g = torch.Generator().manual_seed(13)
        blocks = [make_block((8, 64, 128, 4, 5, 8), torch.bfloat16, "cuda", g) for _ in range(2)]
        step = threading.Barrier(2, timeout=60)
        graphs, outputs, errors = [None, None], [None, None], []

        def capture(i):
            try:
                stream = torch.cuda.Stream()
                with torch.cuda.stream(stream):
                    ops.residual_block(**blocks[i])  # warm-up: this thread's cuBLAS handle
                    stream.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    step.wait()
                    graph.capture_begin(capture_error_mode="thread_local")
                    step.wait()
                    out = ops.residual_block(**blocks[i])
                    step.wait()
                    graph.capture_end()
                    step.wait()
                    graph.replay()
                    stream.synchronize()
                graphs[i], outputs[i] = graph, out  # the graph's pool holds out
            except Exception as error:  # reported by the main thread
                errors.append(error)
                step.abort()

        threads = [threading.Thread(target=capture, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, errors
        for args, out in zip(blocks, outputs):
            torch.testing.assert_close(out.cpu().double(), block_reference(args), **TOLERANCES[torch.bfloat16])


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    g = torch.Generator().manual_seed(6)
    for shape in [(1, 8, 16, 16, 5, 8), (3, 6, 6, 3, 3, 3), (40, 8, 8, 4, 5, 4)]:
        args = make_block(shape, torch.float32, device, g)
        positional = [args[k] for k in ("x", "weight", "bias", "gn_weight", "gn_bias", "weight2", "bias2",
                                        "gn_weight2", "gn_bias2", "num_groups", "eps")]
        positional += [args.get("shortcut_weight"), args.get("shortcut_bias")]
        torch.library.opcheck(torch.ops.dpa.residual_block.default, tuple(positional), dict(film=args["film"]))
    first, skip = split_input(args["x"], 3)
    positional[0] = first
    torch.library.opcheck(torch.ops.dpa.residual_block.default, tuple(positional),
                          dict(film=args["film"], skip=skip))
    torch.library.opcheck(torch.ops.dpa.residual_block.default, tuple(positional),
                          dict(film=args["film"], skip=skip, channels_last=True))


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile(device):
    g = torch.Generator().manual_seed(7)
    args = make_block((2, 8, 16, 16, 5, 8), torch.float32, device, g)
    fn = torch.compile(lambda **kw: ops.residual_block(**kw) * 2, fullgraph=True)
    torch.testing.assert_close(fn(**args), ops.residual_block(**args) * 2)


def good_args(device="cpu"):
    args = make_block((2, 4, 8, 6, 3, 4), torch.float32, device, torch.Generator().manual_seed(8))
    args["film"] = None
    return args


BAD_INPUTS = [
    # (what to change, expected exception, text the message must contain)
    (dict(weight2=torch.randn(8, 4, 3)), ValueError, "weight2 must be [8, 8, kernel_size]"),
    (dict(weight2=torch.randn(7, 8, 3)), ValueError, "weight2 must be [8, 8, kernel_size]"),
    (dict(weight2=torch.randn(8, 8, 4)), ValueError, "weight2's kernel_size must be odd"),
    (dict(weight2=torch.randn(8, 8)), ValueError, "weight2 must be 3-D"),
    (dict(weight2=torch.randn(8, 8, 3, dtype=torch.float16)), TypeError, "weight2 has dtype"),
    (dict(bias2=torch.randn(7)), ValueError, "bias2 must have shape [8]"),
    (dict(gn_weight2=torch.randn(8, 1)), ValueError, "gn_weight2 must have shape [8]"),
    (dict(gn_bias2=torch.randn(9)), ValueError, "gn_bias2 must have shape [8]"),
    (dict(shortcut_weight=None), ValueError, "shortcut_bias was given without shortcut_weight"),
    (dict(shortcut_weight=None, shortcut_bias=None), ValueError, "the input's 4 channels must equal out_channels (8)"),
    (dict(shortcut_weight=torch.randn(6, 4, 1), shortcut_bias=torch.randn(6)), ValueError,
     "shortcut_weight must have 8 output channels"),
    (dict(shortcut_weight=torch.randn(8, 4, 3)), ValueError, "shortcut_weight must be [shortcut_channels, 4, 1]"),
    (dict(weight=torch.randn(8, 5, 3)), ValueError, "residual_block: weight has in_channels 5"),
    (dict(num_groups=3), ValueError, "num_groups must be >= 1 and divide"),
    (dict(eps=-1.0), ValueError, "eps must be finite and >= 0"),
    (dict(film=torch.randn(2, 7)), ValueError, "film must be [2, 8] (a bias) or [2, 16]"),
    (dict(counters=torch.zeros(15, dtype=torch.int32)), ValueError, "at least out_channels (16)"),
    (dict(x=torch.randn(2, 4, 6, dtype=torch.float64)), TypeError, "x must be float32, float16 or bfloat16"),
    (dict(x=torch.randn(2, 4)), ValueError, "x must be 3-D"),
    (dict(skip=torch.randn(2, 3, 5)), ValueError, "skip must be [2, skip_channels >= 1, 6]"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("change,error,text", BAD_INPUTS, ids=lambda v: v if isinstance(v, str) else "")
def test_bad_input_raises(change, error, text, device):
    check_bad_input(ops.residual_block, good_args(device), change, error, text, device)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["x", "weight", "weight2", "bias2", "gn_weight2", "shortcut_weight", "film",
                                  "counters", "skip"])
def test_mixed_devices_raise(name):
    args = good_args("cuda")
    if name == "skip":
        args.update(x=args["x"][:, :2], skip=args["x"][:, 2:])
    args.update(film=torch.randn(2, 16, device="cuda"), counters=torch.zeros(16, dtype=torch.int32, device="cuda"))
    check_mixed_devices(ops.residual_block, args, name)
