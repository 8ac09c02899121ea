"""ConditionalUnet1D: checkpoint compatibility with Diffusion Policy and fused-op numerics.

Compatibility is proven against `dp_reference.RefUnet`, a plain-PyTorch rewrite of Diffusion
Policy's module tree written independently of the package under test.
"""
import copy
import re
import functools
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import diffusion_policy_accelerated.model.unet as model_mod
from diffusion_policy_accelerated.model.unet import Conv1dBlock, ConditionalUnet1D
from diffusion_policy_accelerated.kernels.config import current_kernel_config, kernel_config
from tests.support.dp_reference import RefUnet, randomize_

# The repository (or site-packages) folder that holds the package.
PACKAGE_PARENT = Path(model_mod.__file__).resolve().parents[2]


# --------------------------------------------------------------------------------------
# Configurations and helpers.
# --------------------------------------------------------------------------------------

# (name, constructor kwargs, batch, horizon, timestep form)
CONFIGS = [
    ("gcond_film_k5", dict(input_dim=2, global_cond_dim=20, diffusion_step_embed_dim=32,
                           down_dims=[32, 64, 128], kernel_size=5, n_groups=8,
                           cond_predict_scale=True), 3, 16, "batch"),
    ("lcond_only_2lvl_g4", dict(input_dim=3, local_cond_dim=4, diffusion_step_embed_dim=16,
                                down_dims=[64, 128], kernel_size=3, n_groups=4,
                                cond_predict_scale=False), 1, 8, "int"),
    ("lcond_gcond_film_g4", dict(input_dim=2, local_cond_dim=3, global_cond_dim=10,
                                 diffusion_step_embed_dim=32, down_dims=[32, 64, 128],
                                 kernel_size=3, n_groups=4, cond_predict_scale=True),
     2, 16, "0dim"),
    ("gcond_2lvl_k5_h8", dict(input_dim=5, global_cond_dim=7, diffusion_step_embed_dim=64,
                              down_dims=[64, 128], kernel_size=5, n_groups=8,
                              cond_predict_scale=False), 3, 8, "0dim"),
    ("nocond_3lvl_h8", dict(input_dim=4, diffusion_step_embed_dim=32, down_dims=[32, 64, 128]),
     2, 8, "int"),
]
CONFIG_IDS = [c[0] for c in CONFIGS]
# Diffusion Policy's defaults (the Push-T low-dim shape); ~65M parameters.
DEFAULT_CFG = dict(input_dim=2, global_cond_dim=20)


def make_pair(cfg, seed=0):
    """(float64 reference, our model loaded from the reference's state_dict, float64)."""
    torch.manual_seed(seed)
    ref = randomize_(RefUnet(**cfg), seed).double().eval()
    ours = ConditionalUnet1D(**cfg).double().eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours


@functools.lru_cache(maxsize=None)
def _cached_pair(name):
    cfg = dict(DEFAULT_CFG) if name == "default" else next(c[1] for c in CONFIGS if c[0] == name)
    return make_pair(cfg, seed=sum(map(ord, name)))  # hash() is salted per process


def pair(name):
    """Fresh copies of a cached pair (tests convert dtypes/devices in place)."""
    ref, ours = _cached_pair(name)
    return copy.deepcopy(ref), copy.deepcopy(ours)


def make_inputs(cfg, batch, horizon, ts_form, seed=1):
    gen = torch.Generator().manual_seed(seed)
    sample = torch.randn(batch, horizon, cfg["input_dim"], generator=gen, dtype=torch.float64)
    t = torch.randint(0, 100, (batch,), generator=gen)
    if ts_form == "int":
        t = t[:1].expand(batch).clone()
        timestep = int(t[0])
    elif ts_form == "0dim":
        t = t[:1].expand(batch).clone()
        timestep = t[0].clone()
    else:
        timestep = t.clone()
    kw = {}
    if cfg.get("local_cond_dim") is not None:
        kw["local_cond"] = torch.randn(batch, horizon, cfg["local_cond_dim"], generator=gen,
                                       dtype=torch.float64)
    if cfg.get("global_cond_dim") is not None:
        kw["global_cond"] = torch.randn(batch, cfg["global_cond_dim"], generator=gen,
                                        dtype=torch.float64)
    return sample, timestep, t, kw


def cast(x, dtype, device):
    if torch.is_tensor(x):
        return x.to(device=device, dtype=dtype if x.is_floating_point() else x.dtype)
    return x


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def n_conv_blocks(model):
    return sum(isinstance(m, Conv1dBlock) for m in model.modules())


# --------------------------------------------------------------------------------------
# Checkpoint compatibility and exact (float64) equivalence.
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", CONFIG_IDS + ["default"])
def test_state_dict_keys_and_shapes_match_diffusion_policy(name):
    ref, ours = _cached_pair(name)
    ref_sd, our_sd = ref.state_dict(), ours.state_dict()
    assert list(our_sd) == list(ref_sd)  # same keys, same order
    for k in ref_sd:
        assert our_sd[k].shape == ref_sd[k].shape, k
    # And a freshly constructed model accepts a reference checkpoint strictly.
    fresh = ConditionalUnet1D(**(DEFAULT_CFG if name == "default" else dict(
        next(c[1] for c in CONFIGS if c[0] == name))))
    fresh.load_state_dict(ref.state_dict(), strict=True)


def test_default_keys_spot_check():
    _, ours = _cached_pair("default")
    sd = ours.state_dict()
    for key, shape in [
        ("diffusion_step_encoder.1.weight", (1024, 256)),
        ("diffusion_step_encoder.3.weight", (256, 1024)),
        ("down_modules.0.0.blocks.0.block.0.weight", (256, 2, 3)),
        ("down_modules.0.0.blocks.0.block.1.weight", (256,)),
        ("down_modules.0.0.cond_encoder.1.weight", (256, 276)),
        ("down_modules.0.0.residual_conv.weight", (256, 2, 1)),
        ("down_modules.0.2.conv.weight", (256, 256, 3)),
        ("mid_modules.1.blocks.1.block.0.weight", (1024, 1024, 3)),
        ("up_modules.0.0.blocks.0.block.0.weight", (512, 2048, 3)),
        ("up_modules.1.2.conv.weight", (256, 256, 4)),  # ConvTranspose1d: [in, out, k]
        ("final_conv.0.block.0.weight", (256, 256, 3)),
        ("final_conv.1.weight", (2, 256, 1)),
    ]:
        assert tuple(sd[key].shape) == shape, key
    assert not any(k.startswith("down_modules.2.2.") for k in sd)  # last level: Identity
    assert not any(k.startswith("local_cond_encoder") for k in sd)


def test_final_block_uses_eight_groups_regardless_of_n_groups():
    m = ConditionalUnet1D(input_dim=2, diffusion_step_embed_dim=16, down_dims=[32, 64], n_groups=4)
    assert m.final_conv[0].block[1].num_groups == 8
    assert m.down_modules[0][0].blocks[0].block[1].num_groups == 4


@pytest.mark.parametrize("name", CONFIG_IDS)
def test_float64_matches_reference(name):
    _, cfg, batch, horizon, ts_form = next(c for c in CONFIGS if c[0] == name)
    ref, ours = pair(name)
    sample, timestep, t, kw = make_inputs(cfg, batch, horizon, ts_form)
    with torch.no_grad():
        expected = ref(sample, t, **kw)
        out = ours(sample, timestep, **kw)
        # Unknown keyword arguments are accepted and ignored, as in DP.
        out_kw = ours(sample, timestep, unused_kwarg=123, **kw)
    assert out.shape == (batch, horizon, cfg["input_dim"]) and out.dtype == torch.float64
    assert rel_err(out, expected) < 1e-10
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out_kw, out, rtol=0, atol=0)


def test_timestep_forms_agree():
    _, cfg, batch, horizon, _ = CONFIGS[0]
    _, ours = pair(CONFIGS[0][0])
    sample, _, _, kw = make_inputs(cfg, batch, horizon, "batch")
    with torch.no_grad():
        outs = [ours(sample, t, **kw)
                for t in (17, torch.tensor(17), torch.tensor([17] * batch), torch.tensor([17]))]
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], rtol=0, atol=0)


def test_up_path_local_cond_is_unused_like_diffusion_policy():
    """DP's `idx == len(self.up_modules)` never fires: local_cond_encoder[1] has no effect."""
    name = "lcond_gcond_film_g4"
    _, cfg, batch, horizon, ts_form = next(c for c in CONFIGS if c[0] == name)
    _, ours = pair(name)
    sample, timestep, _, kw = make_inputs(cfg, batch, horizon, ts_form)
    with torch.no_grad():
        before = ours(sample, timestep, **kw)
        for p in ours.local_cond_encoder[1].parameters():
            p.add_(1.0)
        after = ours(sample, timestep, **kw)
        for p in ours.local_cond_encoder[0].parameters():
            p.add_(1.0)
        changed = ours(sample, timestep, **kw)
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    assert not torch.allclose(changed, before)


# --------------------------------------------------------------------------------------
# Fused-path dispatch, checked with a stand-in ops module (no compiled extension needed).
# --------------------------------------------------------------------------------------

class FakeOps:
    """Computes the fused ops with PyTorch and counts calls (conv1d_gn_mish in `calls`; a
    conv1d_gn_mish_shortcut counts as one of each, and in `shortcut_calls`)."""

    def __init__(self):
        self.calls = 0
        self.conv_calls = 0
        self.shortcut_calls = 0
        self.skips = 0  # shortcut calls given a skip connection to read in place

    def built_with_cuda(self):
        return False

    def conv1d_gn_mish(self, x, weight, bias, gn_weight, gn_bias, num_groups, eps, *, film=None,
                       residual=None, counters=None):
        self.calls += 1
        y = F.conv1d(x, weight, bias, padding=weight.shape[-1] // 2)
        y = F.mish(F.group_norm(y, num_groups, gn_weight, gn_bias, eps))
        if film is not None:
            c = weight.shape[0]
            y = film[:, :c, None] * y + film[:, c:, None] if film.shape[1] == 2 * c else y + film[:, :, None]
        return y if residual is None else y + residual

    def conv1d(self, x, weight, bias, stride, padding, *, transposed, residual=None, counters=None):
        self.conv_calls += 1
        y = (F.conv_transpose1d if transposed else F.conv1d)(x, weight, bias, stride, padding)
        return y if residual is None else y + residual

    def conv1d_gn_mish_shortcut(self, x, weight, bias, gn_weight, gn_bias, num_groups, eps,
                                shortcut_weight, shortcut_bias, *, film=None, counters=None, skip=None):
        self.shortcut_calls += 1
        self.skips += skip is not None
        x = x if skip is None else torch.cat((x, skip), dim=1)
        return (self.conv1d_gn_mish(x, weight, bias, gn_weight, gn_bias, num_groups, eps, film=film),
                self.conv1d(x, shortcut_weight, shortcut_bias, 1, 0, transposed=False))


def n_plain_convs(model):
    """Down/upsampling, 1x1 residual and final convs: what dpa::conv1d runs."""
    return sum(isinstance(m, (torch.nn.Conv1d, torch.nn.ConvTranspose1d)) for m in model.modules()) \
        - n_conv_blocks(model)


@pytest.fixture
def fake_ops(monkeypatch):
    fake = FakeOps()
    monkeypatch.setattr(model_mod, "_OPS", fake)
    monkeypatch.setattr(model_mod, "_OPS_HAS_CUDA", False)
    return fake


def _small_fp32():
    _, cfg, batch, horizon, ts_form = CONFIGS[0]
    ref, ours = pair(CONFIGS[0][0])
    sample, timestep, _, kw = make_inputs(cfg, batch, horizon, ts_form)
    return ours.float(), sample.float(), timestep, {k: v.float() for k, v in kw.items()}


def test_fused_dispatch(fake_ops):
    ours, sample, timestep, kw = _small_fp32()
    n = n_conv_blocks(ours)
    with torch.no_grad():
        fused = ours(sample, timestep, **kw)
    assert fake_ops.calls == n and fake_ops.conv_calls == n_plain_convs(ours)
    # Every residual block with a 1x1 shortcut runs it with its first conv.
    assert fake_ops.shortcut_calls == sum(isinstance(m, torch.nn.Conv1d) for name, m in ours.named_modules()
                                          if name.endswith("residual_conv")) > 0
    # The up path's first blocks read their skip connections in place: no torch.cat.
    assert fake_ops.skips == len(ours.up_modules) > 0
    with torch.inference_mode():
        ours(sample, timestep, **kw)
    assert fake_ops.calls == 2 * n and fake_ops.conv_calls == 2 * n_plain_convs(ours)

    ours.use_fused_ops = False
    assert not ours.use_fused_ops
    assert all(not m.use_fused_ops for m in ours.modules() if isinstance(m, Conv1dBlock))
    with torch.no_grad():
        plain = ours(sample, timestep, **kw)
    assert fake_ops.calls == 2 * n and fake_ops.conv_calls == 2 * n_plain_convs(ours)
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)

    assert ours.set_fused_ops(True) is ours and ours.use_fused_ops
    assert all(m.use_fused_ops for m in ours.modules() if isinstance(m, Conv1dBlock))
    with torch.no_grad():  # float64 never reaches the kernels (they have no fp64 variant)
        ours.double()(sample.double(), timestep, **{k: v.double() for k, v in kw.items()})
    assert fake_ops.calls == 2 * n


def test_training_takes_plain_path_and_backward_works(fake_ops):
    ours, sample, timestep, kw = _small_fp32()
    ours.train()
    assert ours.use_fused_ops
    out = ours(sample, timestep, **kw)
    assert fake_ops.calls == 0 and fake_ops.conv_calls == 0
    out.square().mean().backward()
    for name, p in ours.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert any(p.grad.abs().sum() > 0 for p in ours.parameters())

    # Frozen weights but a differentiable input (e.g. guidance): still the plain path.
    ours.requires_grad_(False)
    x = sample.clone().requires_grad_(True)
    ours(x, timestep, **kw).sum().backward()
    assert fake_ops.calls == 0 and fake_ops.conv_calls == 0 and x.grad is not None
    # Frozen weights and nothing else needing grad: fused even with grad mode on.
    ours(sample, timestep, **kw)
    assert fake_ops.calls == n_conv_blocks(ours) and fake_ops.conv_calls == n_plain_convs(ours)


def test_import_does_not_load_extension():
    """Building/inspecting a model, or running it unfused, must not load the C++ extension."""
    code = textwrap.dedent("""
        import sys, torch
        from diffusion_policy_accelerated.model.unet import ConditionalUnet1D
        m = ConditionalUnet1D(2, global_cond_dim=3, diffusion_step_embed_dim=16,
                              down_dims=[16, 32])
        x, g = torch.zeros(1, 8, 2), torch.zeros(1, 3)
        m.use_fused_ops = False
        with torch.no_grad():
            m(x, 0, global_cond=g)
        m.use_fused_ops = True
        with torch.no_grad():
            m.double()(x.double(), 0, global_cond=g.double())  # float64: never fused
        bad = [k for k in sys.modules if k in ("diffusion_policy_accelerated._C",
                                               "diffusion_policy_accelerated.kernels.ops")]
        assert not bad, bad
    """)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PACKAGE_PARENT)


# --------------------------------------------------------------------------------------
# Fused path with the compiled extension, against the float64 reference.
# --------------------------------------------------------------------------------------



@pytest.fixture
def counted_ops(monkeypatch):
    """The real ops module with the ops that run Conv1dBlocks (conv1d_gn_mish, and
    conv1d_gn_mish_shortcut for a residual block's first; residual_block for both of a block)
    wrapped to count the Conv1dBlocks they run (proves fusion ran); `residual_blocks` counts
    residual_block calls."""
    ops = model_mod._ops()
    counter = {"calls": 0, "residual_blocks": 0}

    def counting(real, conv_blocks):
        whole_block = real is ops.residual_block

        def call(*args, **kwargs):
            counter["calls"] += conv_blocks
            counter["residual_blocks"] += whole_block
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(ops, "conv1d_gn_mish", counting(ops.conv1d_gn_mish, 1))
    monkeypatch.setattr(ops, "conv1d_gn_mish_shortcut", counting(ops.conv1d_gn_mish_shortcut, 1))
    monkeypatch.setattr(ops, "residual_block", counting(ops.residual_block, 2))
    return counter


@pytest.fixture
def no_tf32():
    """TF32 would make the plain fp32 CUDA path ~1e-3 accurate and the comparison moot."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


# Relative L2 error bounds against float64 evaluated on the *same rounded* weights and inputs,
# so they measure arithmetic error only.
# - float32: unit roundoff 6e-8; ~30 conv/GroupNorm layers with dot products of up to
#   K*C_in ~ 6k terms leave ~1e-6 (measured 4e-7..2e-6, CPU and H100). 1e-4 has margin
#   for any summation order, yet an indexing or normalisation bug gives O(1) errors.
# - float16: unit roundoff 4.9e-4; every intermediate activation (~60 on the longest path,
#   incl. residual adds and FiLM) is rounded to fp16 and the errors add up to ~1e-3
#   (measured 8e-4..2.3e-3, plain path included): 1e-2.
# - bfloat16: unit roundoff 3.9e-3 (8x fp16), same reasoning gives ~1e-2 (measured
#   6e-3..1.3e-2): 3e-2.
# The plain PyTorch path must meet the same bound, so the bound reflects the dtype rather
# than slack for the kernel; and since the kernel accumulates and normalises in fp32 it
# must also be no less accurate than PyTorch (within a factor allowing for rounding luck).
TOLS = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}


def _check_fused(name, dtype, device, counter, batch=None, horizon=None):
    if name == "default":
        cfg, batch, horizon, ts_form = DEFAULT_CFG, batch or 1, horizon or 16, "batch"
    else:
        _, cfg, b, h, ts_form = next(c for c in CONFIGS if c[0] == name)
        batch, horizon = batch or b, horizon or h
    ref, ours = pair(name)
    ours = ours.to(device=device, dtype=dtype)
    # Reference weights = our rounded weights, in float64.
    ref = ref.to(device)
    ref.load_state_dict({k: v.double() for k, v in ours.state_dict().items()}, strict=True)
    sample, timestep, t, kw = make_inputs(cfg, batch, horizon, ts_form)
    sample = cast(sample, dtype, device)
    kw = {k: cast(v, dtype, device) for k, v in kw.items()}
    timestep = cast(timestep, None, device)
    with torch.no_grad():
        expected = ref(sample.double(), t.to(device), **{k: v.double() for k, v in kw.items()})
        before = counter["calls"]
        fused = ours(sample, timestep, **kw)
        assert counter["calls"] - before == n_conv_blocks(ours)
        ours.use_fused_ops = False
        plain = ours(sample, timestep, **kw)
        assert counter["calls"] - before == n_conv_blocks(ours)
    assert fused.dtype == dtype and fused.shape == expected.shape
    assert torch.isfinite(fused).all()
    e_fused, e_plain = rel_err(fused, expected), rel_err(plain, expected)
    tol = TOLS[dtype]
    assert e_plain < tol, f"plain path {dtype} on {device}: rel err {e_plain:.3g} (bound is unfair)"
    assert e_fused < tol, (f"fused path {name} {dtype} on {device}: rel err {e_fused:.3g} "
                           f"(plain {e_plain:.3g}, bound {tol})")
    assert e_fused < 3 * e_plain, (f"fused path {name} {dtype} on {device} is less accurate "
                                   f"than PyTorch: rel err {e_fused:.3g} vs {e_plain:.3g}")
    return e_fused, e_plain


@pytest.mark.parametrize("name", CONFIG_IDS)
def test_fused_cpu_float32(name, counted_ops):
    _check_fused(name, torch.float32, "cpu", counted_ops)


def test_fused_cpu_float32_default_config(counted_ops):
    _check_fused("default", torch.float32, "cpu", counted_ops)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", CONFIG_IDS[:3])
def test_fused_cpu_half(name, dtype, counted_ops):
    _check_fused(name, dtype, "cpu", counted_ops)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("name", CONFIG_IDS + ["default"])
def test_fused_cuda(name, dtype, counted_ops, no_tf32):
    assert model_mod._ops().built_with_cuda(), "a CUDA machine must run the CUDA build"
    batch, horizon = (8, 16) if name == "default" else (None, None)
    _check_fused(name, dtype, "cuda", counted_ops, batch=batch, horizon=horizon)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_fused_cuda_long_horizon_batch_1(dtype, counted_ops, no_tf32):
    """Horizon 64 at batch 1: GEMM-route convs at lengths 64 and 32 whose GroupNorm groups
    exceed the fused block epilogue, and, in half precision, the 1024-channel convs at length
    16 as taps-major GEMMs (routing.taps_major_pays at batch 1)."""
    from diffusion_policy_accelerated.model.routes import explain

    ours = pair("default")[1]
    routes = explain(ours, 1, 64, dtype=dtype, device="cuda")
    taps_major = [r for r in routes if "taps-major" in r.route and "1024->1024" in r.shape]
    assert bool(taps_major) == (dtype != torch.float32)
    _check_fused("default", dtype, "cuda", counted_ops, batch=1, horizon=64)


@pytest.mark.gpu(capability=9)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("batch", [1, 2, 8])
def test_gemm_route_graph_bits_with_and_without_pdl(batch, dtype, no_tf32):
    """The GEMM route's kernels are programmatic dependents, launched while the kernel before
    them still runs (gemm_epilogue.cuh). A forward at horizon 64 (fp32 narrow GEMMs over 16 and
    32 positions, sliced GroupNorm epilogues, shortcuts on a side stream, at batch 8 residual
    blocks as one op), captured in a CUDA graph with PDL on and off: every replay, into a
    NaN-filled output, gives the same bits."""
    ours = pair("default")[1].to(device="cuda", dtype=dtype)
    sample, timestep, _, kw = make_inputs(DEFAULT_CFG, batch, 64, "batch")
    sample, timestep = cast(sample, dtype, "cuda"), cast(timestep, None, "cuda")
    kw = {k: cast(v, dtype, "cuda") for k, v in kw.items()}
    replays = []
    for pdl in (False, True):
        with kernel_config(pdl=pdl), torch.no_grad():
            ours(sample, timestep, **kw)  # routes chosen, workspaces allocated
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = ours(sample, timestep, **kw)
            for _ in range(3):
                out.fill_(float("nan"))
                graph.replay()
                replays.append(out.clone())
    assert torch.isfinite(replays[0]).all()
    for replay in replays[1:]:
        assert torch.equal(replay, replays[0])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("batch", [3, 64])
def test_residual_blocks_are_one_op_on_the_gemm_route(batch, dtype, counted_ops, no_tf32):
    """Where batch x length reaches the GEMM route, each residual block is one
    dpa::residual_block; below it (batch 3 at lengths 8 and 4) the per-conv ops, except
    blocks of large layers in half precision (taps-major weights)."""
    before = counted_ops["residual_blocks"]
    _check_fused("default", dtype, "cuda", counted_ops, batch=batch, horizon=16)
    threshold = current_kernel_config().gemm_min_positions
    # The default U-Net's 12 residual blocks at horizon 16: 2 at length 16 (down), 4 at 8
    # (down, up), 6 at 4 (down, mid, up). Below gemm_min_positions none has the work that
    # takes a conv to the GEMM route (gemm_min_work: at batch 3 the largest with 16+
    # positions, an up block's 1024->256 k3 conv over 24, has 19M multiply-adds).
    expected = sum(n for length, n in ((16, 2), (8, 4), (4, 6)) if batch * length >= threshold)
    if dtype != torch.float32 and batch * 4 < threshold:
        # Below it, in half precision, blocks whose two convs both take taps-major weights
        # (C_in x C_out x positions >= 2^23, from batch 2) too: at batch 3 the three
        # 1024->1024 blocks at length 4 (down, mid).
        expected += 3
    assert counted_ops["residual_blocks"] - before == expected


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("batch, horizon, calls, half_channels_last",
                         [(64, 16, (12, 12), 6), (1, 64, (9, 10), 0)], ids=["b64-T16", "b1-T64"])
def test_blocks_hand_on_channels_last_outputs_where_the_next_reads_them_so(batch, horizon, calls,
                                                                           half_channels_last, dtype, monkeypatch):
    """At batch 64 in half precision a residual block whose output only the next block reads,
    and reads in place when it is stored channels-last (reads_channels_last: taps-major
    weights), asks residual_block for that layout: the first block of each down and up level
    and the first mid block, 6 of the default U-Net's 12. In fp32 (contiguous weights) none.
    At batch 1 none either: [1][C][L] is the taps-major GEMM's operand as it is, and at horizon
    64 the blocks that run as the op (calls: fp32, half; in fp32 all but the first block at 16
    positions, whose 512->1024 k3 conv streams: 2^24.6 multiply-adds, below gemm_min_work)
    would have stored it channels-last by a copy. That the U-Net's output stays right is the
    fused-path tests' job."""
    ops = model_mod._ops()
    real, layouts = ops.residual_block, []

    def recording(*args, channels_last=False, **kwargs):
        layouts.append(channels_last)
        return real(*args, channels_last=channels_last, **kwargs)

    monkeypatch.setattr(ops, "residual_block", recording)
    _, unet = pair("default")
    unet = unet.to("cuda", dtype)
    with torch.no_grad():
        unet(torch.randn(batch, horizon, 2, device="cuda", dtype=dtype), 5,
             global_cond=torch.randn(batch, DEFAULT_CFG["global_cond_dim"], device="cuda", dtype=dtype))
    assert len(layouts) == calls[dtype != torch.float32]
    assert sum(layouts) == (0 if dtype == torch.float32 else half_channels_last)


@pytest.mark.gpu
def test_gemm_route_weight_copies_follow_the_weights():
    """On the GEMM route in half precision the model passes taps-major copies of its conv
    weights (ops.taps_major), kept between calls: an in-place update of the weights and a new
    dtype must reach them. A stale copy would be off by O(1); fused against plain PyTorch in
    the same dtype differ by about each one's rounding error (TOLS)."""
    _, unet = pair("default")
    unet = unet.to("cuda", torch.bfloat16)
    sample = torch.randn(64, 16, 2, device="cuda")
    cond = torch.randn(64, DEFAULT_CFG["global_cond_dim"], device="cuda")

    def fused_against_plain(dtype):
        with torch.no_grad():
            fused = unet(sample.to(dtype), 5, global_cond=cond.to(dtype))
            unet.use_fused_ops = False
            plain = unet(sample.to(dtype), 5, global_cond=cond.to(dtype))
            unet.use_fused_ops = True
        return rel_err(fused, plain)

    fused_against_plain(torch.bfloat16)
    copies = [m._taps_major_weight[2] for m in unet.modules() if "_taps_major_weight" in m.__dict__]
    assert copies and all(w.stride(1) == 1 and w.dtype == torch.bfloat16 for w in copies)
    with torch.no_grad():
        for name, p in unet.named_parameters():
            if name.endswith("block.0.weight"):
                p.mul_(-0.5)
    assert fused_against_plain(torch.bfloat16) < 2 * TOLS[torch.bfloat16]
    with torch.inference_mode():  # inference tensors have no version counter
        unet = unet.to(torch.float16)
    assert fused_against_plain(torch.float16) < 2 * TOLS[torch.float16]


def test_conv1d_block_shapes_lists_every_fused_call():
    from diffusion_policy_accelerated.model.unet import conv1d_block_shapes
    with torch.device("meta"):
        unet = ConditionalUnet1D(2, global_cond_dim=4, down_dims=[32, 64, 128], kernel_size=5)
        with_local = ConditionalUnet1D(2, local_cond_dim=3, down_dims=[32, 64, 128], kernel_size=3,
                                       n_groups=4)
    # 3 down levels x 2 residual blocks x 2 Conv1dBlocks, 2 mid blocks x 2, 2 up levels x 2 x 2,
    # and the final block: 25; the local-cond encoder adds 2 residual blocks x 2.
    shapes = conv1d_block_shapes(unet, horizon=16, batch=3)
    assert len(shapes) == 25 and len(conv1d_block_shapes(with_local, horizon=8)) == 29
    assert shapes[0] == (3, 2, 32, 16, 5, 8)          # input_dim -> down_dims[0], full horizon
    assert shapes[-1] == (3, 32, 32, 16, 5, 8)         # final block: n_groups is always 8
    assert (3, 128, 128, 4, 5, 8) in shapes            # the mid blocks run at horizon / 4


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("change,text", [
    (dict(global_cond=torch.zeros(3, 39)), re.escape("global_cond must be [3, 40] (global_cond_dim=40) for sample "
                                                     "[3, 16, 2], got [3, 39]")),
    (dict(global_cond=None), re.escape("global_cond is required: this U-Net was built with global_cond_dim=40; "
                                       "pass a tensor of shape [3, 40]")),
    (dict(local_cond=torch.zeros(3, 16, 4)), re.escape("local_cond must be [3, 16, 5] (local_cond_dim=5)")),
    (dict(local_cond=None), re.escape("local_cond is required: this U-Net was built with local_cond_dim=5")),
    (dict(sample=torch.zeros(3, 10, 2)), re.escape("the horizon (sample.shape[1]) must be a positive multiple of 4 "
                                                   "for this U-Net (3 levels, down_dims [32, 64, 128]")),
    (dict(sample=torch.zeros(3, 16, 3)), re.escape("sample must be [batch, horizon, input_dim=2], got [3, 16, 3]")),
])
def test_inputs_that_do_not_fit_the_unet(device, change, text):
    """Inputs of the wrong width or a horizon the U-Net cannot halve raise one ValueError in the
    model's terms before any op runs."""
    unet = ConditionalUnet1D(2, local_cond_dim=5, global_cond_dim=40, down_dims=[32, 64, 128],
                             kernel_size=5).to(device).eval()
    args = dict(sample=torch.zeros(3, 16, 2), local_cond=torch.zeros(3, 16, 5), global_cond=torch.zeros(3, 40))
    args.update(change)
    args = {k: None if v is None else v.to(device) for k, v in args.items()}
    with torch.profiler.profile() as prof, pytest.raises(ValueError, match=text):
        unet(args["sample"], 5, local_cond=args["local_cond"], global_cond=args["global_cond"])
    assert not [e.name for e in prof.events() if e.name.startswith(("dpa::", "aten::conv", "aten::linear"))]
