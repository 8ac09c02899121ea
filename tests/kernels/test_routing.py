"""The kernel configuration (KernelConfig, kernel_config) and the route rules (conv_route.h, asked
through the route ops; GPUs this machine lacks are described)."""
import threading

import pytest
import torch

import diffusion_policy_accelerated as dpa
from diffusion_policy_accelerated.kernels import ops
from diffusion_policy_accelerated.kernels import routing
from diffusion_policy_accelerated.model.unet import ConditionalUnet1D
from diffusion_policy_accelerated.kernels import config
from diffusion_policy_accelerated.kernels.config import CPU_CONV_ROUTES, KernelConfig, current_kernel_config, kernel_config
from diffusion_policy_accelerated.kernels.routing import H100, GpuLimits
from diffusion_policy_accelerated.model.routes import explain


def test_defaults_and_package_exports():
    assert dpa.KernelConfig is KernelConfig and dpa.kernel_config is kernel_config
    assert current_kernel_config() == KernelConfig() == config.DEFAULT
    assert KernelConfig().gemm_min_positions == 32


@pytest.mark.parametrize("field,value,error,text", [
    ("gemm_min_positions", 0, ValueError, "KernelConfig.gemm_min_positions must be in [1, 2**63), got 0"),
    ("gemm_min_positions", 2 ** 63, ValueError, "KernelConfig.gemm_min_positions must be in [1, 2**63)"),
    ("gemm_min_positions", 3.0, TypeError, "KernelConfig.gemm_min_positions must be an int, got 3.0"),
    ("gemm_min_positions", True, TypeError, "KernelConfig.gemm_min_positions must be an int, got True"),
    ("side_stream_fp32_max_positions", -1, ValueError, "KernelConfig.side_stream_fp32_max_positions must be in"),
    ("fp32_gemm_max_splits", 0, ValueError, "KernelConfig.fp32_gemm_max_splits must be in [1, 2**63), got 0"),
    ("clusters", 1, TypeError, "KernelConfig.clusters must be a bool, got 1"),
    ("pdl", "no", TypeError, "KernelConfig.pdl must be a bool, got 'no'"),
    ("taps_major_min_work", None, TypeError, "KernelConfig.taps_major_min_work must be an int, got None"),
    ("taps_major_min_work_batch_1", 0, ValueError, "KernelConfig.taps_major_min_work_batch_1 must be in [1, 2**63)"),
    ("cpu_conv", "fast", ValueError,
     "KernelConfig.cpu_conv must be one of ['auto', 'aten', 'gemm', 'stream', 'fp32'], got 'fast'"),
    ("cpu_conv", None, ValueError, "KernelConfig.cpu_conv must be one of"),
    ("gemm_min_work", 0, ValueError, "KernelConfig.gemm_min_work must be in [1, 2**63), got 0"),
    ("gemm_min_work_positions", "16", TypeError, "KernelConfig.gemm_min_work_positions must be an int"),
    ("transposed_gemm_min_work", -1, ValueError, "KernelConfig.transposed_gemm_min_work must be in [1, 2**63)"),
    ("portable_half_gemm_min_positions", 0, ValueError,
     "KernelConfig.portable_half_gemm_min_positions must be in [1, 2**63)"),
    ("cooperative_group_norm", 0, TypeError, "KernelConfig.cooperative_group_norm must be a bool, got 0"),
    ("narrow_gemm", 1, TypeError, "KernelConfig.narrow_gemm must be a bool, got 1"),
    ("sm_count", 0, ValueError, "KernelConfig.sm_count must be in [1, 2**63), got 0"),
    ("sm_count", 16.0, TypeError, "KernelConfig.sm_count must be an int, got 16.0"),
])
def test_bad_values_name_the_field(field, value, error, text):
    with pytest.raises(error, match=text.replace("[", r"\[").replace("*", r"\*").replace("(", r"\(")
                       .replace(")", r"\)")):
        KernelConfig(**{field: value})
    with pytest.raises(error):
        with kernel_config(**{field: value}):
            pass
    assert current_kernel_config() == KernelConfig()


def test_unknown_fields_and_bad_config():
    with pytest.raises(TypeError, match=r"kernel_config: unknown fields \['cluster'\]"):
        with kernel_config(cluster=False):
            pass
    with pytest.raises(TypeError, match="config must be a KernelConfig, got dict"):
        with kernel_config({"clusters": False}):
            pass


def test_nesting_restores_even_on_error():
    with kernel_config(clusters=False) as outer:
        assert outer == current_kernel_config() == KernelConfig(clusters=False)
        with kernel_config(gemm_min_positions=5):
            assert current_kernel_config() == KernelConfig(clusters=False, gemm_min_positions=5)
        assert current_kernel_config() == outer
        with pytest.raises(RuntimeError, match="inside"):
            with kernel_config(KernelConfig(pdl=False)):
                assert current_kernel_config() == KernelConfig(pdl=False)
                raise RuntimeError("inside")
        assert current_kernel_config() == outer
    assert current_kernel_config() == KernelConfig()


def test_a_threads_config_is_its_own():
    seen = {}
    entered, release = threading.Event(), threading.Event()

    def worker():
        with kernel_config(gemm_min_positions=7):
            entered.set()
            release.wait(10)
            seen["worker"] = current_kernel_config().gemm_min_positions

    thread = threading.Thread(target=worker)
    thread.start()
    assert entered.wait(10)
    seen["main"] = current_kernel_config().gemm_min_positions
    release.set()
    thread.join(10)
    assert seen == {"worker": 7, "main": 32}


@pytest.mark.gpu
def test_the_ops_read_the_threads_config():
    """The extension reads the calling thread's configuration at launch: with
    gemm_min_positions 1 a batch-1 conv takes the GEMM route (an im2col launch shows in the
    profiler), by default it streams; another thread's override does not leak."""
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(1, 64, 8, device="cuda")
    w = torch.randn(64, 64, 3, device="cuda")

    def kernels():
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            ops.conv1d(x, w, None, 1, 1)
            torch.cuda.synchronize()
        return " ".join(e.name for e in prof.events())

    with kernel_config(gemm_min_positions=1):
        assert "im2col" in kernels()
        result = {}
        thread = threading.Thread(target=lambda: result.update(names=kernels()))
        thread.start()
        thread.join(60)
        assert "im2col" not in result["names"]
    assert "im2col" not in kernels()


def test_cpu_conv_auto_keeps_the_route_it_timed():
    """cpu_conv 'auto' times the CPU routes at a shape's first call and keeps the fastest: its
    outputs are those of one forced route, bit for bit, at every later call."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(1, 96, 4, generator=g), torch.randn(128, 96, 5, generator=g)
    forced = {}
    for route in ("aten", "gemm", "stream"):
        with kernel_config(cpu_conv=route):
            forced[route] = ops.conv1d(x, w, None, 1, 2)
    if torch.equal(forced["aten"], forced["gemm"]) and torch.equal(forced["aten"], forced["stream"]):
        pytest.skip("this CPU's routes round alike here: which one 'auto' kept cannot be told")
    first = ops.conv1d(x, w, None, 1, 2)
    assert any(torch.equal(first, out) for out in forced.values())
    for _ in range(3):
        assert torch.equal(ops.conv1d(x, w, None, 1, 2), first)


def test_explain_names_every_conv_and_its_route():
    torch.manual_seed(0)
    unet = ConditionalUnet1D(2, global_cond_dim=8, down_dims=[32, 64, 128], kernel_size=5)
    convs = [m for m in unet.modules() if isinstance(m, (torch.nn.Conv1d, torch.nn.ConvTranspose1d))]
    routes = explain(unet, 1, 16, device="cuda")
    # Every conv once, except local_cond's encoder (none here).
    assert len(routes) == len(convs)
    assert {r.route for r in routes} == {"streaming", "streaming, paired"}
    assert all("gemm_min_positions 32" in r.why for r in routes)
    routes = explain(unet, 64, 16, dtype=torch.bfloat16, device="cuda")
    block_convs = [r for r in routes if ".blocks." in r.module]
    assert block_convs and all(r.route.startswith("GEMM, block op") for r in block_convs)
    assert any("taps-major" in r.route for r in block_convs)
    with kernel_config(gemm_min_positions=1 << 40, gemm_min_work=1 << 40):
        assert all(r.route.startswith("streaming") for r in explain(unet, 64, 16, device="cuda"))
    cpu = explain(unet, 3, 16, device="cpu")
    assert {r.route for r in cpu} == {"CPU"} and any("whichever was fastest" in r.why for r in cpu)
    with kernel_config(cpu_conv="gemm"):
        assert all("GEMM" in r.why or "transposed" in r.why for r in explain(unet, 3, 16, device="cpu"))
    # Forced streaming: every conv in fp32, none in fp16 (ATen's conv there, as the ops do).
    with kernel_config(cpu_conv="stream"):
        assert all("weight-streaming GEMM (cpu_conv 'stream')" in r.why for r in explain(unet, 1, 16, device="cpu"))
        assert not any("weight-streaming" in r.why
                       for r in explain(unet, 1, 16, dtype=torch.float16, device="cpu"))
    # Half precision: "auto" times each route on fp32 copies too; "fp32" takes ATen's conv of them.
    assert all("or on fp32 copies of its operands" in r.why
               for r in explain(unet, 1, 16, dtype=torch.bfloat16, device="cpu"))
    assert not any("fp32 copies" in r.why for r in cpu)
    with kernel_config(cpu_conv="fp32"):
        assert all("(cpu_conv 'fp32') on fp32 copies of its operands" in r.why
                   for r in explain(unet, 1, 16, dtype=torch.float16, device="cpu"))
    # A half-precision model's shapes are found with inputs of its dtype.
    assert explain(unet.to(torch.bfloat16), 64, 16, device="cuda") == routes
    with pytest.raises(TypeError, match="unet must be diffusion_policy_accelerated.ConditionalUnet1D"):
        explain(torch.nn.Linear(2, 2), 1, 16)
    # A stride-2 conv's positions are its output's, as the ops count them: at batch 2 and
    # length 16 it streams (16 < 32) while the blocks before it are GEMMs (32).
    routes = {r.module: r for r in explain(unet, 2, 16, device="cuda")}
    assert routes["down_modules.0.2.conv"].route == "streaming"
    assert routes["down_modules.0.1.blocks.0.block.0"].route.startswith("GEMM")
    # Half precision at batch 1: taps-major GEMMs only where a long horizon leaves deep layers
    # with 16+ positions and enough work; the horizon-16 U-Nets' batch-1 convs all stream.
    from diffusion_policy_accelerated.model.configs import UNETS
    with torch.device("meta"):
        for name in ("lowdim", "image", "lerobot"):
            model = ConditionalUnet1D(**UNETS[name])
            for dtype in (torch.bfloat16, torch.float32):
                assert all(r.route.startswith("streaming") or "gemm_min_positions" in r.why
                           for r in explain(model, 1, 16, dtype=dtype, device="cuda")), (name, dtype)
        lerobot = ConditionalUnet1D(**UNETS["lerobot"])
        deep = {r.module: r for r in explain(lerobot, 1, 64, dtype=torch.bfloat16, device="cuda")}
        wide = {r.module: r for r in explain(lerobot, 1, 64, dtype=torch.float32, device="cuda")}
        with kernel_config(gemm_min_work=1 << 62, transposed_gemm_min_work=1 << 62):
            narrow = {r.module: r for r in explain(lerobot, 1, 64, dtype=torch.float32, device="cuda")}
    assert deep["mid_modules.0.blocks.0.block.0"].route == "GEMM, taps-major"
    # Horizon 32: LeRobot's 2048-channel layers have 8 positions, taps-major GEMMs in half
    # precision from taps_major_min_work_batch_1 (its 1024->1024 convs there, 2^23, stream).
    with torch.device("meta"):
        h32 = {r.module: r for r in explain(lerobot, 1, 32, dtype=torch.bfloat16, device="cuda")}
        with kernel_config(taps_major_min_work_batch_1=1 << 62):
            h32_streaming = {r.module: r for r in explain(lerobot, 1, 32, dtype=torch.bfloat16, device="cuda")}
    for module in ("mid_modules.0.blocks.0.block.0", "down_modules.2.1.blocks.1.block.0",
                   "down_modules.2.0.blocks.1.block.0"):
        assert h32[module].route == "GEMM, taps-major" and "from 8 positions" in h32[module].why, h32[module]
        assert h32_streaming[module].route.startswith("streaming"), h32_streaming[module]
    assert h32["up_modules.0.1.blocks.0.block.0"].route.startswith("streaming")
    # The stride-2 downsampling conv over 16 positions (1024 x 1024 x 3 x 16 multiply-adds, 2^25.6)
    # takes the GEMM route by its work in both precisions (gemm_min_work 2^25), not taps-major.
    assert deep["down_modules.1.2.conv"].route == "GEMM" and "multiply-adds" in deep["down_modules.1.2.conv"].why
    # In fp32 the 2048- and 1024-channel convs at 16 positions (2048 x 2048 x 5 x 16 and
    # 1024 x 1024 x 5 x 16 multiply-adds) take the GEMM route by their work too.
    # On a GPU their GEMMs are the package's narrow GEMM, cut into slices that put a block on
    # each SM (narrow_gemm_splits): 2048 rows (64 blocks of 32) into 2, 1024 rows into 4 on an
    # H100's 132. Without it (narrow_gemm off), on a GPU of 128+ SMs cuBLAS's GEMMs are cut
    # (cublas_splits): 2048 rows over 16 positions (16 of cuBLAS's 128 x 32 tiles) into 16, 1024
    # rows (8 tiles) into 32; with fp32_gemm_max_splits 1 too, they are whole. Without a GPU
    # here "cuda" is an H100.
    sms = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else H100.sms
    with torch.device("meta"), kernel_config(narrow_gemm=False):
        cublas = {r.module: r for r in explain(lerobot, 1, 64, dtype=torch.float32, device="cuda")}
        with kernel_config(fp32_gemm_max_splits=1):
            whole = {r.module: r for r in explain(lerobot, 1, 64, dtype=torch.float32, device="cuda")}
    for module in ("mid_modules.0.blocks.0.block.0", "down_modules.2.1.blocks.1.block.0",
                   "up_modules.0.1.blocks.0.block.0"):
        assert wide[module].route.startswith("GEMM") and "multiply-adds" in wide[module].why, wide[module]
        slices = "GEMM, 16 slices" if module != "up_modules.0.1.blocks.0.block.0" else "GEMM, 32 slices"
        narrow_slices = "GEMM, narrow GEMM, " + ("2" if module != "up_modules.0.1.blocks.0.block.0" else "4")
        if 128 <= sms < 256:  # the counts the rules give there (cublas_splits)
            assert cublas[module].route == slices, cublas[module]
        if 128 <= sms < 160:  # narrow_splits: 1024 rows (32 blocks) get 5 slices from 160 SMs
            assert wide[module].route == narrow_slices + " slices", wide[module]
        assert whole[module].route == "GEMM", whole[module]
        assert narrow[module].route.startswith("streaming"), narrow[module]
    assert wide["down_modules.1.2.conv"].route.startswith("GEMM"), wide["down_modules.1.2.conv"]
    assert narrow["down_modules.1.2.conv"].route.startswith("streaming"), narrow["down_modules.1.2.conv"]
    # The upsampling conv over 16 positions (1024 x 1024 x 4 x 16): the GEMM route by
    # transposed_gemm_min_work, in both precisions; the horizon-16 U-Nets' (at most 8) stream.
    for routes in (wide, deep):
        assert "transposed_gemm_min_work" in routes["up_modules.0.2.conv"].why, routes["up_modules.0.2.conv"]
        assert routes["up_modules.0.2.conv"].route == "GEMM", routes["up_modules.0.2.conv"]
    assert narrow["up_modules.0.2.conv"].route.startswith("streaming"), narrow["up_modules.0.2.conv"]
    # Without Hopper's launch features, half-precision convs take the GEMM route from 8
    # positions (portable_half_gemm_min_positions): the lowdim U-Net's 16- and 8-position
    # convs at batch 1, not its 4-position ones, and none in fp32 or with either feature on.
    with torch.device("meta"):
        lowdim = ConditionalUnet1D(**UNETS["lowdim"])
        with kernel_config(clusters=False, pdl=False):
            assert routing.portable_launches("cuda")
            portable = explain(lowdim, 1, 16, dtype=torch.bfloat16, device="cuda")
            portable_fp32 = explain(lowdim, 1, 16, dtype=torch.float32, device="cuda")
        with kernel_config(clusters=False):
            split_k = explain(lowdim, 1, 16, dtype=torch.bfloat16, device="cuda")
    by_length = {}
    for r in portable:
        by_length.setdefault(int(r.shape.split(", ")[-1].rstrip("]")), set()).add(r.route.split(",")[0])
    assert by_length[4] == {"streaming"} and "GEMM" in by_length[8] and "GEMM" in by_length[16], by_length
    assert any("portable_half_gemm_min_positions 8" in r.why for r in portable)
    assert all(r.route.startswith("streaming") for r in portable_fp32 + split_k)
    # A GroupNorm group too large for the fused block epilogue: the block's op runs per conv.
    long = {r.module: r for r in explain(unet, 1, 512, device="cuda")}
    assert "runs per conv" in long["down_modules.0.0.blocks.1.block.0"].why
    # ... unless, at batch 2+, the second conv's weight is taps-major (half precision): the
    # epilogue's slices write its operand, as residual_block_cuda decides. LeRobot's U-Net at
    # horizon 64 (groups of 2048-4096 elements).
    with torch.device("meta"):
        lerobot = ConditionalUnet1D(**UNETS["lerobot"])
    for batch, dtype, fused in [(8, torch.bfloat16, True), (2, torch.float16, True), (1, torch.bfloat16, False),
                                (8, torch.float32, False)]:
        routes = {r.module: r for r in explain(lerobot, batch, 64, dtype=dtype, device="cuda")}
        for module in ("down_modules.0.0.blocks.1.block.0", "mid_modules.0.blocks.1.block.0"):
            route = routes[module]
            assert ("block op" in route.route) == fused and ("runs per conv" in route.why) != fused, \
                (batch, dtype, route)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,dtype", [(1, torch.float32), (3, torch.bfloat16), (8, torch.float32),
                                         (2, torch.float16), (64, torch.bfloat16)], ids=str)
def test_explain_matches_what_the_model_runs(batch, dtype, monkeypatch):
    """The residual blocks explain() calls block ops are those the model runs as one
    dpa::residual_block (at batch 3 in half precision only the large ones)."""
    torch.manual_seed(0)
    unet = ConditionalUnet1D(2, global_cond_dim=8, down_dims=[256, 512, 1024], kernel_size=5,
                             cond_predict_scale=True).cuda().to(dtype).eval()
    calls = []
    real = ops.residual_block
    monkeypatch.setattr(ops, "residual_block", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    with torch.inference_mode():
        unet(torch.randn(batch, 16, 2, device="cuda", dtype=dtype), 5,
             global_cond=torch.randn(batch, 8, device="cuda", dtype=dtype))
    routes = explain(unet, batch, 16)
    explained = [r for r in routes if r.module.endswith("blocks.0.block.0") and "block op" in r.route]
    assert len(explained) == len(calls)


def test_portable_launches_follow_the_device():
    """The rules follow the GPU a conv runs on, as the ops do (they ask their input's): a GPU
    before Hopper, or kernels built without Hopper code, launch portably, and half-precision
    convs there take the GEMM route from 8 positions. The GPUs are described: no GPU is needed."""
    older = GpuLimits(8, 108, 163 * 1024)
    assert not routing.portable_launches(H100)
    assert routing.portable_launches(older) and routing.portable_launches(H100._replace(hopper_code=False))
    with kernel_config(clusters=False, pdl=False):
        assert routing.portable_launches(H100)
    assert not routing.portable_launches("cpu")
    with torch.device("meta"):
        unet = ConditionalUnet1D(2, global_cond_dim=8, down_dims=[256, 512, 1024])
        routes = {name: explain(unet, 1, 16, dtype=torch.bfloat16, device=gpu)
                  for name, gpu in (("hopper", H100), ("older", older))}
    assert not any("portable_half_gemm_min_positions" in r.why for r in routes["hopper"])
    assert any("portable_half_gemm_min_positions" in r.why for r in routes["older"])


def gemm_route(cin, cout, kernel, positions, gpu=H100, dtype=torch.float32, transposed=False, **config):
    """The route string of a conv over `positions` (batch 1) forced onto the GEMM route, on a
    described GPU: its slices show there (", narrow GEMM, n slices" or ", n slices")."""
    conv = (torch.nn.ConvTranspose1d(cin, cout, kernel, device="meta") if transposed
            else torch.nn.Conv1d(cin, cout, kernel, device="meta"))
    length = positions if transposed else positions + kernel - 1  # `positions` outputs
    with kernel_config(gemm_min_positions=1, **config):
        route = routing.conv_route(conv, 1, length, dtype, gpu)
    assert route.route.startswith("GEMM"), route
    return route.route


@pytest.mark.parametrize("sms,out_channels,in_channels,kernel,positions,splits", [
    (132, 2048, 2048, 5, 16, 16),   # 16 tiles: as many as fill the SMs twice
    (132, 1024, 1024, 5, 16, 32),   # 8 tiles: 33, capped by fp32_gemm_max_splits
    (132, 512, 512, 5, 64, 16),     # 8 tiles, but no slice shorter than 128 (2560 / 32 = 80)
    (132, 2048, 2048, 5, 128, 8),   # 64 tiles: 8 fill the SMs four times at most
    (132, 2048, 2048, 5, 512, 1),   # 256 tiles: not even 8
    (132, 256, 16, 5, 64, 1),       # a reduction of 80: too short
    (132, 256, 96, 5, 32, 1),       # a reduction of 480: 2 slices of 128+ at most, fewer than 8
    (16, 2048, 2048, 5, 16, 1),     # 16 SMs (a green context): 2 slices, fewer than 8
])
def test_cublas_splits_rule(sms, out_channels, in_channels, kernel, positions, splits):
    """conv_route.h's cublas_splits on a described GPU of `sms` SMs, in fp32 only: half
    precision and transposed convs are never cut; fp32_gemm_max_splits 1 never cuts."""
    gpu = H100._replace(sms=sms)
    expected = "GEMM" + (f", {splits} slices" if splits > 1 else "")
    assert gemm_route(in_channels, out_channels, kernel, positions, gpu, narrow_gemm=False) == expected
    # sm_count caps a described GPU's SMs as it does a real one's.
    assert gemm_route(in_channels, out_channels, kernel, positions, H100, narrow_gemm=False, sm_count=sms) == expected
    assert gemm_route(in_channels, out_channels, kernel, positions, gpu, dtype=torch.bfloat16) == "GEMM"
    assert gemm_route(in_channels, out_channels, kernel, positions // 2, gpu, transposed=True) == "GEMM"
    assert gemm_route(in_channels, out_channels, kernel, positions, gpu, narrow_gemm=False,
                      fp32_gemm_max_splits=1) == "GEMM"


@pytest.mark.parametrize("sms,out_channels,in_channels,kernel,positions,splits", [
    (132, 2048, 2048, 5, 16, 2),    # 64 blocks of 32 rows: 2 slices put one on each SM
    (132, 1024, 4096, 5, 16, 4),    # 32 blocks: 4
    (132, 256, 256, 5, 12, 10),     # 8 blocks: 16 wanted, but a reduction of 10 chunks: a slice each
    (132, 1024, 1024, 5, 32, 4),    # 32 positions, a block holding all: 32 blocks, 4 slices
    (132, 512, 512, 5, 20, 7),      # 20 positions in a block of 32: 16 blocks, 20 chunks in 7 slices
    (132, 2048, 1024, 5, 32, 0),    # over 16 positions, more than 2^23 weight elements: cuBLAS
    (132, 1024, 1024, 5, 36, 0),    # more than a block's 32 positions: cuBLAS
    (132, 256, 256, 5, 14, 0),      # positions not a multiple of 4
    (132, 256, 3, 5, 16, 0),        # a reduction of 15, not a multiple of 4
    (132, 32, 16, 5, 16, 1),        # one block, a reduction of one chunk: whole
    (16, 2048, 2048, 5, 16, 1),     # 16 SMs (a green context): 64 blocks already, whole
])
def test_narrow_gemm_rule(sms, out_channels, in_channels, kernel, positions, splits):
    """conv_route.h's narrow_splits on a described H100-like GPU of `sms` SMs: fp32 im2col
    GEMMs only, none before Ampere or where a block's shared memory holds fewer than 3 stages
    of the ring, none with narrow_gemm off."""
    gpu = H100._replace(sms=sms)
    conv = torch.nn.Conv1d(in_channels, out_channels, kernel, device="meta")

    def narrow(gpu, dtype=torch.float32, **config):
        with kernel_config(gemm_min_positions=1, **config):
            return routing.conv_route(conv, 1, positions + kernel - 1, dtype, gpu).narrow_splits
    assert narrow(gpu) == splits
    assert gemm_route(in_channels, out_channels, kernel, positions, gpu).startswith("GEMM, narrow GEMM") == (splits > 0)
    assert narrow(gpu, torch.bfloat16) == narrow(gpu, narrow_gemm=False) == 0
    assert narrow(gpu, sm_count=8) == (1 if splits else 0)
    for older in (gpu._replace(major=7), gpu._replace(smem_optin=64 << 10)):
        assert narrow(older) == 0


def test_narrow_gemm_over_32_positions():
    """17-32 positions (a block holding 32): up to 2^23 weight elements, 4 stages of shared
    memory (not 99 KB's 3); 16 positions are unaffected. explain() shows it on LeRobot's U-Net:
    at horizon 64 the 32-position layers and the shortcut beside the narrow 2048 -> 512 conv;
    at horizon 128 not the shortcut beside the 4096 -> 1024 conv, whose 21M weight elements
    are cuBLAS's, and which a narrow GEMM would not run beside (not beside cuBLAS)."""
    assert gemm_route(1024, 2048, 4, 32) == "GEMM, narrow GEMM, 2 slices"  # 2^23 weight elements: taken
    assert "narrow" not in gemm_route(1028, 2048, 4, 32)  # more
    sm86 = H100._replace(major=8, smem_optin=99 << 10)
    assert gemm_route(1024, 1024, 5, 16, sm86) == "GEMM, narrow GEMM, 4 slices"
    assert "narrow" not in gemm_route(1024, 1024, 5, 20, sm86) + gemm_route(1024, 1024, 5, 32, sm86)
    from diffusion_policy_accelerated.model.configs import UNETS
    with torch.device("meta"):
        lerobot = ConditionalUnet1D(**UNETS["lerobot"])
        h64, h128 = ({r.module: r for r in explain(lerobot, 1, horizon, dtype=torch.float32, device=H100)}
                     for horizon in (64, 128))
    for module in ("down_modules.1.1.blocks.0.block.0", "up_modules.1.0.blocks.0.block.0",
                   "up_modules.1.0.residual_conv"):
        assert h64[module].route.startswith("GEMM, narrow GEMM"), h64[module]
    for module in ("up_modules.0.0.blocks.0.block.0", "up_modules.0.0.residual_conv"):
        assert h128[module].route.startswith("GEMM") and "narrow" not in h128[module].route, h128[module]
    assert h128["up_modules.0.1.blocks.0.block.0"].route.startswith("GEMM, narrow GEMM")


def test_route_ops_reject_bad_questions():
    conv = torch.nn.Conv1d(64, 64, 5, padding=2, device="meta")
    for args, text in [((conv, 0, 16, torch.float32, H100), "sizes must be positive"),
                       ((conv, 1, 16, torch.float64, H100), "dtype must be float32, float16 or bfloat16"),
                       ((conv, 1, 16, torch.float32, GpuLimits(0, 132, 0)), "a described GPU needs")]:
        with pytest.raises(ValueError, match=text):
            routing.conv_route(*args)
    with pytest.raises(ValueError, match=r"block must be \[\] or"):
        torch.ops.dpa.conv_route(1, 16, 64, 64, 5, 1, 2, False, 8, [4, 64, 64, 5, 8], torch.float32, [])


def test_kernel_config_reaches_cpp_by_field_name():
    """C++ reads the configuration by field name: the dataclass's fields are exactly its, and
    a dict with one missing or unknown is refused."""
    import dataclasses
    assert sorted(f.name for f in dataclasses.fields(KernelConfig)) == sorted(ops._C.kernel_config_fields())
    assert tuple(ops._C.cpu_conv_names()) == CPU_CONV_ROUTES
    fields = dataclasses.asdict(KernelConfig())
    with pytest.raises(ValueError, match="no field pdl"):
        ops._C.set_kernel_config({k: v for k, v in fields.items() if k != "pdl"}, False)
    with pytest.raises(ValueError, match="1 unknown fields"):
        ops._C.set_kernel_config({**fields, "fast": True}, False)
    ops._C.clear_thread_kernel_config()


@pytest.mark.gpu
def test_hopper_launches_need_hopper_code():
    """The ops take Hopper's clusters and programmatic dependent launch only on a Hopper or
    newer GPU whose kernels carry Hopper code (common/cuda/hopper_code.cu reads the library's
    PTX version): built with 9.0 in the arch list, as by default, on a Hopper GPU they do, and
    portable_launches says the same; on older GPUs they never do."""
    hopper = torch.cuda.get_device_capability()[0] >= 9
    assert ops._C.hopper_launches(torch.cuda.current_device()) == hopper
    assert routing.portable_launches("cuda") == (not hopper)
    with kernel_config(clusters=False, pdl=False):
        assert routing.portable_launches("cuda")
