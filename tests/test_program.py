"""The U-Net forward as one persistent kernel (GraphedSampler's experimental single-kernel
path, dpa StreamProgram) against the same sampler launching one kernel per conv.

Both paths run the same split-K streaming-conv code with the same plans (the same split-K
order, the same roundings), so their actions must be bit for bit equal, in every dtype;
test_sampler.py compares the per-conv path with the float64-checked reference loop. The
per-conv path's cluster kernels (which a program does not run) split the reductions and take
the statistics in other orders, so these tests turn them off.
"""
import re

import pytest
import torch

from diffusion_policy_accelerated import ops
from diffusion_policy_accelerated.sampler import GraphedSampler
from test_sampler import build, make_inputs

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_cuda_build = pytest.mark.skipif(not ops.built_with_cuda(), reason="extension built without CUDA")


@pytest.fixture(autouse=True)
def split_k_kernels():
    if not ops.built_with_cuda():
        yield
        return
    previous = ops.set_clusters(False)
    yield
    ops.set_clusters(previous)

# (down_dims, horizon, batch): 2-channel input layer (scalar weight loads), channel counts that
# are not multiples of 8 / 16 (mixed vector widths), position tiles of 4, 8 and 16.
SHAPES = [
    ([32, 64, 128], 16, 1),
    ([32, 64, 128], 8, 2),
    ([24, 40, 72], 16, 1),
    ([64, 128], 4, 3),
    ([256, 512, 1024], 16, 1),
]


def paired_samplers(device, dtype, scheduler, down_dims, **kwargs):
    unet, schedule, _ = build(device, scheduler=scheduler, down_dims=down_dims, **kwargs)
    unet = unet.to(dtype)
    return (GraphedSampler(unet, schedule, single_kernel_unet=True),
            GraphedSampler(unet, schedule, single_kernel_unet=False), schedule)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("down_dims,horizon,batch", SHAPES)
@pytest.mark.parametrize("use_cuda_graph", [True, False])
def test_single_kernel_equals_launch_per_conv(dtype, down_dims, horizon, batch, use_cuda_graph):
    single, per_conv, schedule = paired_samplers("cuda", dtype, "ddpm", down_dims, steps=6)
    single.use_cuda_graph = per_conv.use_cuda_graph = use_cuda_graph
    assert single.unet_path(batch, horizon) == "single kernel"
    for seed in range(2):  # the second call replays (or reruns) what the first one built
        inputs = make_inputs(batch, "cuda", seed, len(schedule.timesteps), horizon=horizon)
        expected = per_conv(**inputs)
        actual = single(**inputs)
        assert torch.isfinite(actual).all()
        assert torch.equal(actual, expected)


@needs_cuda
def test_program_writes_its_output():
    """A poisoned output buffer is overwritten entirely by one run."""
    single, per_conv, schedule = paired_samplers("cuda", torch.float32, "ddim", [32, 64, 128], steps=4)
    inputs = make_inputs(1, "cuda", 0, len(schedule.timesteps))
    expected = per_conv(**inputs)
    program = single._program((1, 16, False))
    with torch.inference_mode():  # the program's tensors are inference tensors
        program.output.fill_(float("nan"))
    assert torch.equal(single(**inputs), expected)


@needs_cuda
def test_falls_back_with_the_reason():
    single, per_conv, schedule = paired_samplers("cuda", torch.float32, "ddim", [32, 64, 128], steps=4)
    # batch x horizon = 64: the convs take the im2col + cuBLAS route, which a program does not run.
    with pytest.raises(RuntimeError, match="im2col"):
        single(**make_inputs(4, "cuda", 0, len(schedule.timesteps)))
    where_possible = GraphedSampler(single.unet, schedule, single_kernel_unet=None)
    assert re.match(r"one launch per conv: (conv1d_gn_mish(_shortcut)?|residual_block) takes its im2col",
                    where_possible.unet_path(4, 16))
    inputs = make_inputs(4, "cuda", 0, len(schedule.timesteps))
    assert torch.equal(where_possible(**inputs), per_conv(**inputs))
    assert per_conv.unet_path(1, 16) == "one launch per conv: single_kernel_unet=False"


@needs_cuda
def test_local_cond_falls_back():
    """local_cond adds a PyTorch op (x + h_local[0]) between the fused ones."""
    unet, schedule, per_conv = build("cuda", scheduler="ddim", steps=4, local_cond_dim=3)
    where_possible = GraphedSampler(unet, schedule, single_kernel_unet=None)
    assert "PyTorch op" in where_possible.unet_path(1, 16, local_cond=True)
    inputs = make_inputs(1, "cuda", 0, len(schedule.timesteps), local_dim=3)
    assert torch.equal(where_possible(**inputs), per_conv(**inputs))


def test_cpu_sampler_reports_its_path():
    unet, schedule, _ = build("cpu", scheduler="ddim", steps=2)
    sampler = GraphedSampler(unet, schedule, single_kernel_unet=None)
    assert sampler.unet_path(1, 16) == "one launch per conv: the U-Net is not on a CUDA device"
    with pytest.raises(RuntimeError, match="not on a CUDA device"):
        GraphedSampler(unet, schedule, single_kernel_unet=True).unet_path(1, 16)


def test_single_kernel_unet_must_be_a_bool_or_none():
    unet, schedule, _ = build("cpu", scheduler="ddim", steps=2)
    with pytest.raises(TypeError, match="single_kernel_unet must be None, True or False, got 'yes'"):
        GraphedSampler(unet, schedule, single_kernel_unet="yes")


@needs_cuda_build
def test_stream_program_misuse_raises():
    program = ops._C.StreamProgram()
    with pytest.raises(RuntimeError, match="still being recorded"):
        program.run()
    with pytest.raises(RuntimeError, match="run_traced: the program is still being recorded"):
        program.run_traced()
    program.begin()
    try:
        with pytest.raises(RuntimeError, match="another program"):
            ops._C.StreamProgram().begin()
    finally:
        program.end()
    assert program.failure == "no streaming conv was recorded"
    with pytest.raises(RuntimeError, match="recording failed: no streaming conv"):
        program.run()
    with pytest.raises(RuntimeError, match="run_traced: the recording failed"):
        program.run_traced()
    assert program.stage_names() == []
    with pytest.raises(RuntimeError, match="recorded already"):
        program.begin()
    with pytest.raises(ValueError, match="CUDA device"):
        ops._C.StreamProgram().add_input(torch.zeros(3))


@needs_cuda
def test_undeclared_input_fails_the_recording():
    from diffusion_policy_accelerated.model import recording_program

    x = torch.randn(1, 8, 16, device="cuda")
    w = torch.randn(16, 8, 3, device="cuda")
    program = ops._C.StreamProgram()
    with recording_program(program):
        ops.conv1d(x, w, None, 1, 1)
    assert "not declared" in program.failure


@needs_cuda
def test_traced_run_computes_the_same_and_stamps_every_stage():
    """run_traced (scripts/trace_program.py) gives the same output as run, and a timeline
    where every stage's blocks move forward in time and some block finishes its tiles."""
    single, _, _ = paired_samplers("cuda", torch.float32, "ddim", [32, 64, 128], steps=4)
    program = single._program((1, 16, False))
    with torch.inference_mode():
        program.sample.normal_()
        program.film.normal_()
        expected = program.run().clone()
        trace = program.program.run_traced()
        assert torch.equal(program.output, expected)
    stages = program.program.num_stages
    names = program.program.stage_names()
    assert len(names) == stages and names[0].startswith("conv1d_gn_mish")
    assert trace.dtype == torch.int64 and trace.shape[0] == stages and trace.shape[2] == 9
    trace = trace.cpu()
    for s in range(stages):
        used = trace[s, :, 0] > 0  # start, waited, staged, computed, counted
        assert used.any()
        steps = trace[s][used][:, :5]
        assert (steps[:, 1:] >= steps[:, :-1]).all()
        assert (trace[s, :, 8] > 0).any()  # some block finished the stage's tiles
        if s > 0:  # released only after every block of the previous stage streamed its weights
            assert trace[s][used][:, 1].min() >= trace[s - 1, :, 3].max()


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_l2_policy_does_not_change_results(dtype):
    """The evict-first switch changes where weights live in L2, never what is computed."""
    _, per_conv, schedule = paired_samplers("cuda", dtype, "ddim", [32, 64, 128], steps=4)
    inputs = make_inputs(1, "cuda", 0, len(schedule.timesteps))
    expected = per_conv(**inputs)
    previous = ops.set_weights_evict_first(True)
    try:
        for evict_first in (False, True):
            ops.set_weights_evict_first(evict_first)
            for single_kernel in (False, True):
                sampler = GraphedSampler(per_conv.unet, schedule, single_kernel_unet=single_kernel)
                assert torch.equal(sampler(**inputs), expected)
    finally:
        ops.set_weights_evict_first(previous)


@needs_cuda_build
@pytest.mark.parametrize("options", [-1, 4, 1 << 20])
def test_program_options_outside_the_mask_raise(options):
    with pytest.raises(ValueError, match="set_program_options"):
        ops._C.set_program_options(options)
    assert ops._C.set_program_options(0) == 0  # the failed calls changed nothing
