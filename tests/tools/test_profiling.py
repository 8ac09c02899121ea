"""The profiling toolkit on a CPU: formulas against hand-computed answers, module ranges on a
tiny U-Net, the table builders on synthetic traces (CPU ops, and CUDA kernels linked to
their launches) with known durations, and scripts/profile_action.py end to end."""
import csv
import importlib.util
import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from diffusion_policy_accelerated.kernels import ops
from diffusion_policy_accelerated.model.unet import ConditionalUnet1D, Conv1dBlock
from diffusion_policy_accelerated.tools.costs import (
    cat_cost, conv1d_cost, conv1d_gn_mish_cost, conv1d_gn_mish_shortcut_cost, conv_transpose1d_cost,
    denoise_step_cost, elementwise_cost, fused_conv1d_cost, group_norm_cost, linear_cost, matmul_cost,
    mish_cost, residual_block_cost)
from diffusion_policy_accelerated.tools.profiling import (
    ROOFLINE_COLUMNS, Peaks, analyse, call_graph_png, format_gpu_split, layer_names, layer_of, parse_trace,
    record_trace, roofline_op)

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


# --- formulas ---------------------------------------------------------------------------

@pytest.mark.parametrize("cost, expected", [
    # x [2, 4, 10], w [6, 4, 3], stride 2, padding 1: L_out = (10 + 2 - 2 - 1) // 2 + 1 = 5;
    # FLOPs 2*2*6*5*4*3 = 1440 + bias 2*6*5 = 60; bytes 4 * (80 + 72 + 6 + 60) = 872.
    (conv1d_cost((2, 4, 10), (6, 4, 3), F32, stride=2, padding=1), (1500, 872)),
    # groups 2: w [6, 2, 3], no bias, padding 0: L_out = 8; 2*1*6*8*2*3 = 576;
    # bytes 4 * (40 + 36 + 48) = 496.
    (conv1d_cost((1, 4, 10), (6, 2, 3), F32, bias=False, groups=2), (576, 496)),
    # dilation 2, kernel 3: L_out = 10 - 4 = 6; 2*1*1*6*1*3 = 36 + 6; bytes 2 * (10 + 3 + 1 + 6) = 40.
    (conv1d_cost((1, 1, 10), (1, 1, 3), F16, dilation=2), (42, 40)),
    # x [1, 4, 8], w [4, 2, 4], stride 2, padding 1: L_out = 7*2 - 2 + 3 + 1 = 16;
    # 2*1*4*8*2*4 = 512 + bias 1*2*16 = 32; bytes 2 * (32 + 32 + 2 + 32) = 196.
    (conv_transpose1d_cost((1, 4, 8), (4, 2, 4), F16, stride=2, padding=1), (544, 196)),
    # [2, 8, 5] = 80 elements: 7 * 80; bytes 4 * (80 + 8 + 8 + 80) = 704.
    (group_norm_cost((2, 8, 5), F32), (560, 704)),
    (group_norm_cost((2, 8, 5), F32, affine=False), (560, 640)),
    # 12 elements: 4 * 12; bytes 2 * (12 + 12).
    (mish_cost((3, 4), BF16), (48, 48)),
    # x [2, 3, 5] -> 6 rows, w [7, 5]: 2*6*5*7 = 420 + bias 6*7 = 42; bytes 4 * (30 + 35 + 7 + 42) = 456.
    (linear_cost((2, 3, 5), (7, 5), F32), (462, 456)),
    # addmm: the same product with the bias broadcast; mm without it: 4 * (30 + 35 + 42) = 428.
    (matmul_cost((6, 5), (5, 7), F32, bias=(7,)), (462, 456)),
    (matmul_cost((6, 5), (5, 7), F32), (420, 428)),
    # [4, 1, 3] + [5, 3] -> [4, 5, 3] = 60 elements; bytes 4 * (12 + 15 + 60) = 348.
    (elementwise_cost([(4, 1, 3), (5, 3)], F32), (60, 348)),
    # 24 + 40 elements read and written: 2 * 64 * 4 = 512.
    (cat_cost([(2, 3, 4), (2, 5, 4)], F32), (0, 512)),
    # x [1, 4, 16], w [8, 4, 5] (padding 2, L 16): conv 2*8*16*4*5 = 5120 + bias 128;
    # GroupNorm 7*128 = 896; Mish 4*128 = 512 -> 6656. Bytes 4 * (64 + 160 + 3*8 + 128) = 1504.
    (conv1d_gn_mish_cost((1, 4, 16), (8, 4, 5), F32), (6656, 1504)),
    # bf16, no bias, no affine: bytes 2 * (64 + 160 + 128) = 704.
    (conv1d_gn_mish_cost((1, 4, 16), (8, 4, 5), BF16, bias=False, affine=False), (6528, 704)),
    # With FiLM [1, 16] (scale and bias: 2 per element, 256) and a residual (1 per element,
    # 128): 6656 + 384 = 7040; bytes + 4 * (16 + 128) = 1504 + 576 = 2080.
    (conv1d_gn_mish_cost((1, 4, 16), (8, 4, 5), F32, film=(1, 16), residual=True), (7040, 2080)),
    # FiLM [1, 8] is a bias only: 6656 + 128; bytes 1504 + 4 * 8 = 1536.
    (conv1d_gn_mish_cost((1, 4, 16), (8, 4, 5), F32, film=(1, 8)), (6784, 1536)),
    # conv1d_gn_mish (6656, 1504 above) + a 1x1 conv of the same x to 6 channels: 2*96*4 + 96
    # = 864 FLOPs; bytes 4 * (24 + 6 + 96) = 504, x being read once -> (7520, 2008).
    (conv1d_gn_mish_shortcut_cost((1, 4, 16), (8, 4, 5), (6, 4, 1), F32), (7520, 2008)),
    # Identity residual block, x [1, 8, 16], weights [8, 8, 5] and [8, 8, 3]: conv1d_gn_mish
    # 10368 + 896 + 512 = 11776, then 6272 + 896 + 512 + 128 (residual) = 7808; bytes are x,
    # both weights, six parameter vectors and the output: 4 * (128 + 320 + 192 + 48 + 128).
    (residual_block_cost((1, 8, 16), (8, 8, 5), (8, 8, 3), F32), (19584, 3264)),
    # dpa::conv1d = the conv's cost (first case above: 1500, 872) + a residual [2, 6, 5]:
    # 60 FLOPs and 4 * 60 bytes.
    (fused_conv1d_cost((2, 4, 10), (6, 4, 3), F32, stride=2, padding=1, residual=True), (1560, 1112)),
    # transposed, as the conv_transpose1d case above.
    (fused_conv1d_cost((1, 4, 8), (4, 2, 4), F16, stride=2, padding=1, transposed=True), (544, 196)),
    # DDPM, epsilon, clipped, noise: x0 3 + clip 2 + update 3 + noise 2 = 10 per element, 32
    # elements; bytes 4 * 32 * (3 inputs + 1 output) + the 32-byte table row = 544.
    (denoise_step_cost((1, 16, 2), F32, scheduler="ddpm", prediction_type="epsilon", clip=True,
                       noise=True), (320, 544)),
    # DDIM, epsilon, no clip, no noise: x0 3 + update 3 = 6; bytes 4 * 32 * 3 + 32 = 416.
    (denoise_step_cost((1, 16, 2), F32, scheduler="ddim", prediction_type="epsilon", clip=False),
     (192, 416)),
    # DDIM, sample prediction: x0 0 + epsilon from x0 3 + clip 2 + update 3 = 8; bf16 bytes
    # 2 * 32 * 3 + 32 = 224.
    (denoise_step_cost((1, 16, 2), BF16, scheduler="ddim", prediction_type="sample", clip=True),
     (256, 224)),
])
def test_formula_known_answers(cost, expected):
    assert cost == expected


def _trace_of(fn, tmp_path, model=None):
    trace, _ = record_trace(fn, model or torch.nn.Identity(), "cpu", tmp_path / "trace.json")
    return parse_trace(trace)


def test_formulas_read_the_recorded_arguments(tmp_path):
    """Each op runs in a range of its own; the op the roofline charges there must have exactly
    the formula's cost, i.e. the registry reads the op's schema arguments right."""
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(2, 4, 10, generator=g), torch.randn(6, 4, 3, generator=g), torch.randn(6, generator=g)
    wt, x8 = torch.randn(4, 2, 4, generator=g), torch.randn(1, 4, 8, generator=g)
    a, m, bias7 = torch.randn(6, 5, generator=g), torch.randn(5, 7, generator=g), torch.randn(7, generator=g)
    gx, gw, gb = torch.randn(1, 4, 16, generator=g), torch.randn(8, 4, 5, generator=g), torch.randn(8, generator=g)
    s = torch.randn(1, 16, 2, generator=g)
    table = torch.rand(3, 8, generator=g)
    cases = {
        "conv1d": (lambda: F.conv1d(x, w, b, stride=2, padding=1),
                   "aten::conv1d", conv1d_cost((2, 4, 10), (6, 4, 3), F32, stride=2, padding=1)),
        # padding="same" is not recorded at conv1d: the convolution it calls is charged.
        "conv1d same": (lambda: F.conv1d(x, w, None, padding="same"),
                        "aten::convolution", conv1d_cost((2, 4, 10), (6, 4, 3), F32, bias=False, padding=1)),
        "conv_transpose1d": (lambda: F.conv_transpose1d(x8, wt, None, stride=2, padding=1),
                             "aten::conv_transpose1d",
                             conv_transpose1d_cost((1, 4, 8), (4, 2, 4), F32, bias=False, stride=2, padding=1)),
        "group_norm": (lambda: F.group_norm(gx, 2, None, None), "aten::group_norm",
                       group_norm_cost((1, 4, 16), F32, affine=False)),
        "mish": (lambda: F.mish(gx), "aten::mish", mish_cost((1, 4, 16), F32)),
        "linear": (lambda: F.linear(torch.ones(2, 3, 5), torch.ones(7, 5), bias7), "aten::linear",
                   linear_cost((2, 3, 5), (7, 5), F32)),
        "addmm": (lambda: torch.addmm(bias7, a, m), "aten::addmm", matmul_cost((6, 5), (5, 7), F32, bias=(7,))),
        "mm": (lambda: torch.mm(a, m), "aten::mm", matmul_cost((6, 5), (5, 7), F32)),
        "add": (lambda: torch.ones(4, 1, 3) + torch.ones(5, 3), "aten::add",
                elementwise_cost([(4, 1, 3), (5, 3)], F32)),
        "cat": (lambda: torch.cat([torch.ones(2, 3, 4), torch.ones(2, 5, 4)], 1), "aten::cat",
                cat_cost([(2, 3, 4), (2, 5, 4)], F32)),
        "fused": (lambda: ops.conv1d_gn_mish(gx, gw, gb, gb, gb, 2), "dpa::conv1d_gn_mish",
                  conv1d_gn_mish_cost((1, 4, 16), (8, 4, 5), F32)),
        "fused film residual": (
            lambda: ops.conv1d_gn_mish(gx, gw, gb, gb, gb, 2, film=torch.ones(1, 16),
                                       residual=torch.ones(1, 8, 16)),
            "dpa::conv1d_gn_mish",
            conv1d_gn_mish_cost((1, 4, 16), (8, 4, 5), F32, film=(1, 16), residual=True)),
        "fused shortcut": (
            lambda: ops.conv1d_gn_mish_shortcut(gx, gw, gb, gb, gb, 2, 1e-5, torch.ones(6, 4, 1), None,
                                                film=torch.ones(1, 16)),
            "dpa::conv1d_gn_mish_shortcut",
            conv1d_gn_mish_shortcut_cost((1, 4, 16), (8, 4, 5), (6, 4, 1), F32, shortcut_bias=False,
                                         film=(1, 16))),
        "fused shortcut with skip": (
            lambda: ops.conv1d_gn_mish_shortcut(gx[:, :1], gw, gb, gb, gb, 2, 1e-5, torch.ones(6, 4, 1),
                                                None, skip=gx[:, 1:]),
            "dpa::conv1d_gn_mish_shortcut",
            conv1d_gn_mish_shortcut_cost((1, 4, 16), (8, 4, 5), (6, 4, 1), F32, shortcut_bias=False)),
        "residual block": (
            lambda: ops.residual_block(gx, gw, gb, gb, gb, torch.ones(8, 8, 3), None, None, None, 2, 1e-5,
                                       torch.ones(8, 4, 1), None, film=torch.ones(1, 16)),
            "dpa::residual_block",
            residual_block_cost((1, 4, 16), (8, 4, 5), (8, 8, 3), F32, shortcut_weight=(8, 4, 1), bias2=False,
                                affine2=False, shortcut_bias=False, film=(1, 16))),
        "residual block with skip": (
            lambda: ops.residual_block(gx[:, :3], gw, None, None, None, torch.ones(8, 8, 3), gb, gb, gb, 2,
                                       1e-5, torch.ones(8, 4, 1), gb, skip=gx[:, 3:]),
            "dpa::residual_block",
            residual_block_cost((1, 4, 16), (8, 4, 5), (8, 8, 3), F32, shortcut_weight=(8, 4, 1), bias=False,
                                affine=False)),
        "fused conv": (lambda: ops.conv1d(x, w, b, 2, 1, residual=torch.ones(2, 6, 5)), "dpa::conv1d",
                       fused_conv1d_cost((2, 4, 10), (6, 4, 3), F32, stride=2, padding=1, residual=True)),
        "fused conv transposed": (lambda: ops.conv1d(x8, wt, None, 2, 1, transposed=True), "dpa::conv1d",
                                  fused_conv1d_cost((1, 4, 8), (4, 2, 4), F32, bias=False, stride=2,
                                                    padding=1, transposed=True)),
        "denoise": (lambda: ops.denoise_step(s, s, s, table, 1, scheduler="ddpm", clip_sample_range=1.0),
                    "dpa::denoise_step",
                    denoise_step_cost((1, 16, 2), F32, scheduler="ddpm", prediction_type="epsilon",
                                      clip=True, noise=True)),
        "denoise ddim": (lambda: ops.denoise_step(s, s, None, table, 1, scheduler="ddim",
                                                  prediction_type="sample"),
                         "dpa::denoise_step",
                         denoise_step_cost((1, 16, 2), F32, scheduler="ddim", prediction_type="sample",
                                           clip=False)),
        # aten::convolution also runs 2-D convolutions: no 1-D formula may claim them.
        "conv2d": (lambda: F.conv2d(torch.ones(1, 2, 4, 4), torch.ones(3, 2, 3, 3)), None, None),
    }

    def run_all():
        for name, (fn, _, _) in cases.items():
            with torch.profiler.record_function(name):
                fn()

    events = _trace_of(run_all, tmp_path)
    for name, (_, op_name, cost) in cases.items():
        charged = {roofline_op(e) for e in events if e.kind == "op" and layer_of(e) == name} - {None}
        assert [(op.name, op.cost) for op in charged] == ([] if op_name is None else [(op_name, cost)]), name


# --- module ranges ----------------------------------------------------------------------

def _tiny_unet():
    torch.manual_seed(0)
    return ConditionalUnet1D(input_dim=2, global_cond_dim=4, diffusion_step_embed_dim=8,
                             down_dims=[8, 16], kernel_size=3, n_groups=2, cond_predict_scale=True).eval()


def test_unet_layer_names():
    names = set(layer_names(_tiny_unet()).values())
    assert {"ConditionalUnet1D", "step_encoder.1", "down.0.res0", "down.0.res0.block0",
            "down.0.res0.block0.conv", "down.0.res0.block0.norm", "down.0.res0.block0.mish",
            "down.0.res0.block0.unfused", "down.0.res0.film.1", "down.0.res0.residual",
            "down.0.downsample", "down.1.res1.block1", "mid.res0.block1", "up.0.res0.block0",
            "up.0.upsample", "final.block0", "final.block0.conv", "final.conv"} <= names
    plain = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Sequential(torch.nn.ReLU()))
    assert set(layer_names(plain).values()) == {"Sequential", "0", "1", "1.0"}


@pytest.mark.parametrize("fused", [True, False])
def test_trace_ops_carry_their_module(tmp_path, fused):
    unet = _tiny_unet()
    unet.use_fused_ops = fused
    sample, cond = torch.randn(1, 8, 2), torch.randn(1, 4)
    with torch.inference_mode():
        events = _trace_of(lambda: unet(sample, 3, global_cond=cond), tmp_path, unet)
    blocks = {name for module, name in layer_names(unet).items() if isinstance(module, Conv1dBlock)}
    # Two residual blocks of two Conv1dBlocks per down level (2), mid and up level (1), + final.
    assert "down.0.res0.block0" in blocks and len(blocks) == 2 * 2 * (2 + 1 + 1) + 1
    ranges = {e.name for e in events if e.kind == "range"}
    assert blocks <= ranges
    if fused:
        # A residual block's first conv runs with its 1x1 shortcut where it has one.
        layers = [layer_of(e) for e in events
                  if e.name in ("dpa::conv1d_gn_mish", "dpa::conv1d_gn_mish_shortcut")]
        assert sorted(layers) == sorted(blocks)
        assert any(e.name == "dpa::conv1d_gn_mish_shortcut" for e in events)
    else:
        norms = [layer_of(e) for e in events if e.name == "aten::group_norm"]
        assert sorted(norms) == sorted(f"{b}.norm" for b in blocks)
    linears = {layer_of(e) for e in events if e.name == "aten::linear"}
    assert {"step_encoder.1", "step_encoder.3", "down.0.res0.film.1"} <= linears


def test_module_ranges_close_when_forward_raises(tmp_path):
    class Broken(torch.nn.Module):
        def forward(self, x):
            raise RuntimeError("boom")

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), Broken())

    def run():
        with pytest.raises(RuntimeError, match="boom"):
            model(torch.ones(1, 2))
        torch.mm(torch.ones(2, 2), torch.ones(2, 2))

    events = _trace_of(run, tmp_path, model)
    assert [layer_of(e) for e in events if e.name == "aten::mm"] == ["-"]


# --- tables from synthetic traces -------------------------------------------------------

PEAKS = Peaks(bandwidth_gbs=100.0, tflops={F32: 1.0, BF16: 2.0})
# mish of [1, 1000] fp32: 4000 FLOPs, 8000 bytes -> bound max(4 ns, 80 ns) = 0.08 us (memory).
# mm [64, 64] @ [64, 64] fp32: 2 * 64**3 = 524288 FLOPs -> 0.524288 us at 1 TFLOP/s;
# 3 * 4096 * 4 = 49152 bytes -> 0.49152 us at 100 GB/s: bound 0.524288 us (compute).
MISH_BOUND_US, MM_BOUND_US = 0.08, 0.524288


def _x(cat, name, ts, dur, tid=1, **args):
    return dict(ph="X", cat=cat, name=name, pid=1, tid=tid, ts=ts, dur=dur, args=args)


def _op(name, ts, dur, dims=None, types=None):
    if dims is None:
        return _x("cpu_op", name, ts, dur)
    return _x("cpu_op", name, ts, dur, **{"Input Dims": dims, "Input type": types,
                                         "Concrete Inputs": [""] * len(dims)})


def _host_events():
    return [
        _x("user_annotation", "down.0.res0.block0", 0, 200),
        _op("aten::mish", 10, 20, [[1, 1000]], ["float"]),
        _op("aten::mm", 40, 50, [[64, 64], [64, 64]], ["float", "float"]),
        _op("aten::resize_", 41, 1, [[0], []], ["float", "ScalarList"]),  # inside mm: not outermost
        _op("aten::mish", 120, 40, [[1, 1000]], ["float"]),
        _op("aten::where", 200, 10),  # after the range, no formula
    ]


def test_cpu_tables_from_op_events():
    analysis = analyse({"traceEvents": _host_events()}, PEAKS)
    assert not analysis.on_gpu and analysis.gpu_split is None
    top = {row["name"]: row for row in analysis.top}
    assert list(top) == ["aten::mish", "aten::mm", "aten::where"]  # resize_ is inside mm
    # Outermost ops: mish 20 + 40, mm 50, where 10 = 120 us.
    assert top["aten::mish"]["total_us"] == 60 and top["aten::mish"]["calls"] == 2
    assert top["aten::mish"]["mean_us"] == 30 and top["aten::mish"]["share"] == pytest.approx(0.5)
    assert top["aten::mm"]["share"] == pytest.approx(50 / 120)
    assert top["aten::mm"]["layers"] == "down.0.res0.block0" and top["aten::where"]["layers"] == "-"
    assert analysis.roofline_share == pytest.approx(110 / 120)
    rows = {row["op"]: row for row in analysis.roofline}
    assert [row["op"] for row in analysis.roofline] == ["aten::mish", "aten::mm"]  # by total time
    mish, mm = rows["aten::mish"], rows["aten::mm"]
    assert (mish["layer"], mish["shapes"], mish["dtype"], mish["calls"]) == (
        "down.0.res0.block0", "1x1000", "float32", 2)
    assert (mish["flops"], mish["bytes"], mish["limit"]) == (4000, 8000, "memory")
    assert mish["mean_us"] == 30 and mish["bound_us"] == pytest.approx(MISH_BOUND_US)
    assert mish["roofline_fraction"] == pytest.approx(MISH_BOUND_US / 30)
    assert mish["tflops"] == pytest.approx(4000 / 30e-6 / 1e12)
    assert mish["gbs"] == pytest.approx(8000 / 30e-6 / 1e9)
    assert (mm["flops"], mm["bytes"], mm["limit"]) == (524288, 49152, "compute")
    assert mm["roofline_fraction"] == pytest.approx(MM_BOUND_US / 50)


def test_gpu_tables_from_kernel_events():
    """The same trace with CUDA launches inside the ops and kernels on the device timeline,
    linked only by correlation ids: kernel times replace op times."""
    launches = [_x("cuda_runtime", "cudaLaunchKernel", ts, 1, correlation=c)
                for ts, c in ((12, 1), (45, 2), (60, 3), (122, 4), (202, 5), (205, 6))]
    device = [
        _x("kernel", "mish_kernel", 1000, 2, tid=7, correlation=1),
        _x("kernel", "gemm_a", 1010, 4, tid=7, correlation=2),
        _x("kernel", "gemm_b", 1012, 8, tid=7, correlation=3),  # another stream: overlaps gemm_a
        _x("kernel", "mish_kernel", 1022, 3, tid=7, correlation=4),
        _x("kernel", "where_kernel", 1030, 1, tid=7, correlation=5),
        _x("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 1040, 5, tid=7, correlation=6),
    ]
    analysis = analyse({"traceEvents": _host_events() + launches + device}, PEAKS)
    assert analysis.on_gpu
    # Busy: [1000, 1002) + [1010, 1020) + [1022, 1025) + [1030, 1031) = 16 us of kernels, then
    # 5 us of copy, in a window of 1045 - 1000 = 45 us: idle 45 - 21 = 24.
    assert analysis.gpu_split == dict(window_us=45, compute_us=16, memory_us=5, idle_us=24)
    assert format_gpu_split(analysis.gpu_split) == (
        "GPU time over 45.0 us (first to last device event): compute 16.0 us (35.6%), "
        "memcpy/memset 5.0 us (11.1%), idle 24.0 us (53.3%)")
    top = {row["name"]: row for row in analysis.top}
    # All device time: 2 + 4 + 8 + 3 + 1 + 5 = 23 us.
    assert top["gemm_b"]["share"] == pytest.approx(8 / 23) and top["mish_kernel"]["calls"] == 2
    assert top["mish_kernel"]["total_us"] == 5 and top["mish_kernel"]["layers"] == "down.0.res0.block0"
    assert top["Memcpy DtoD (Device -> Device)"]["layers"] == "-"
    # Ops with a formula launched 2 + 3 (mish) and 4 + 8 (mm) of the 23 us.
    assert analysis.roofline_share == pytest.approx(17 / 23)
    rows = {row["op"]: row for row in analysis.roofline}
    assert rows["aten::mm"]["calls"] == 1 and rows["aten::mm"]["mean_us"] == 12
    assert rows["aten::mm"]["roofline_fraction"] == pytest.approx(MM_BOUND_US / 12)
    assert rows["aten::mish"]["calls"] == 2 and rows["aten::mish"]["mean_us"] == 2.5
    assert rows["aten::mish"]["roofline_fraction"] == pytest.approx(MISH_BOUND_US / 2.5)


def test_half_precision_ops_use_the_bf16_peak():
    bf16_mm = _op("aten::mm", 0, 10, [[64, 64], [64, 64]], ["c10::Half", "c10::Half"])
    (row,) = analyse({"traceEvents": [bf16_mm]}, PEAKS).roofline
    # 524288 FLOPs at 2 TFLOP/s = 0.262144 us; 6 * 4096 bytes at 100 GB/s = 0.24576 us.
    assert row["dtype"] == "float16" and row["roofline_fraction"] == pytest.approx(0.262144 / 10)


def test_call_graph_png(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert call_graph_png(tmp_path / "f.prof", tmp_path / "f.png") == \
        "call graph PNG skipped: gprof2dot and dot not on PATH"
    # Stand-ins (shell builtins only: PATH holds nothing else) with the real tools' command
    # lines: gprof2dot -f pstats FILE > dot source, dot -Tpng -o PNG < dot source.
    for tool, body in (("gprof2dot", 'echo "digraph { $3 }"'),
                       ("dot", 'while IFS= read -r line; do echo "$line"; done > "$3"')):
        (tmp_path / tool).write_text(f"#!/bin/sh\n{body}\n")
        (tmp_path / tool).chmod(0o755)
    message = call_graph_png(tmp_path / "f.prof", tmp_path / "f.png")
    assert message == f"call graph: {tmp_path / 'f.png'}"
    assert (tmp_path / "f.png").read_text() == f"digraph {{ {tmp_path / 'f.prof'} }}\n"


# --- scripts/profile_action.py end to end ------------------------------------------------------

def _script(monkeypatch, relative):
    """scripts/<relative> loaded as a module, its folder on sys.path as when it runs."""
    path = Path(__file__).resolve().parents[2] / "scripts" / relative
    monkeypatch.syspath_prepend(str(path.parent))
    spec = importlib.util.spec_from_file_location("dpa_script_" + path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _profile_script(monkeypatch):
    return _script(monkeypatch, "profile_action.py")  # sys.path as `python scripts/profile_action.py` has it


@pytest.mark.parametrize("mode", ["eager", "ours"])
def test_profile_script_on_cpu(tmp_path, capsys, monkeypatch, mode):
    analysis = _profile_script(monkeypatch).main(["--mode", mode, "--device", "cpu", "--down-dims", "8", "16",
                                       "--steps", "2", "--reps", "1", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    for heading in ("one action", "top CPU ops", "per-op roofline", "autograd profiler",
                    "cProfile of one U-Net forward"):
        assert heading in printed
    assert (tmp_path / f"{mode}_report.txt").read_text().strip() in printed.strip()
    assert ("scheduler step" in printed) == (mode == "eager")

    trace = json.loads((tmp_path / f"{mode}_trace.json").read_text())
    ranges = {e["name"] for e in trace["traceEvents"] if e.get("cat") == "user_annotation"}
    assert {"down.0.res0.block0", "mid.res1.block1", "up.0.upsample"} <= ranges

    with open(tmp_path / f"{mode}_roofline.csv") as f:
        table = list(csv.DictReader(f))
    assert list(table[0]) == [key for key, _, _ in ROOFLINE_COLUMNS]
    assert len(table) == len(analysis.roofline) > 10
    ops_seen = {row["op"] for row in table}
    fused = {"dpa::conv1d_gn_mish", "dpa::conv1d", "dpa::denoise_step"}
    assert fused <= ops_seen if mode == "ours" else not fused & ops_seen
    assert all(float(row["roofline_fraction"]) > 0 and math.isfinite(float(row["roofline_fraction"]))
               for row in table)
    assert (tmp_path / f"{mode}_roofline.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / f"{mode}_forward.prof").stat().st_size > 0


@pytest.mark.parametrize("args", [["--mode", "graph"], ["--mode", "eager", "--no-graph"]])
def test_profile_script_rejects(tmp_path, monkeypatch, args):
    with pytest.raises(SystemExit):
        _profile_script(monkeypatch).main(args + ["--device", "cpu", "--out", str(tmp_path)])


# --- the scripts' argument checks: what they refuse ---------------------------------------------

def _assert_rejects(module, args, message, capsys, asks_for_gpu=True):
    """main(args) exits as argparse does on a bad argument, with `message` (a regex); and with
    valid arguments on a machine without a GPU, says it needs one."""
    with pytest.raises(SystemExit) as exit_info:
        module.main(args)
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)
    if asks_for_gpu and not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            module.main([])
        assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("args,message", [
    (["--sms", "16", "0"], r"--sms takes positive integers, got \[16, 0\]"),
    (["--batch", "-1"], r"--batch takes positive integers, got \[-1\]"),
    (["--unet", "tiny"], "invalid choice: 'tiny'"),
])
def test_sm_budget_script_rejects(monkeypatch, capsys, args, message):
    _assert_rejects(_script(monkeypatch, "benchmark_sm_budget.py"), args, message, capsys)


@pytest.mark.parametrize("args,message", [
    (["--positions", "0"], "--positions must be at least 1, got 0"),
    (["--sms", "48", "-8"], r"--sms takes positive integers, got \[48, -8\]"),
])
def test_portable_half_routes_script_rejects(monkeypatch, capsys, args, message):
    _assert_rejects(_script(monkeypatch, "dev/portable_half_routes.py"), args, message, capsys, asks_for_gpu=False)


@pytest.mark.parametrize("args,message", [
    (["--steps", "2"], "--steps must be 3 or more, got 2"),
    (["--batch", "0"], "--batch must be 1 or more, got 0"),
    (["--horizon", "-4"], "--horizon must be 1 or more, got -4"),
    (["--dtype", "float64"], "invalid choice: 'float64'"),
])
def test_step_timeline_script_rejects(monkeypatch, capsys, args, message):
    _assert_rejects(_script(monkeypatch, "dev/step_timeline.py"), args, message, capsys)
