"""Helpers the tests share: the device parametrisation, poisoned outputs, the bad-input
tables, and the CUDA launch checks."""
import re

import pytest
import torch

from diffusion_policy_accelerated.kernels import ops
from diffusion_policy_accelerated.kernels.config import kernel_config

# Every test that takes `device` runs on the CPU and, where one exists, on the GPU; without a
# GPU the CUDA cases show up as skipped rather than disappearing.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def poison_allocator(device, numel, dtype):
    """Leave a NaN-filled block of the output's size in the allocator's free list, so that an
    op allocating its output there and failing to write an element shows NaN."""
    torch.full((numel,), float("nan"), dtype=dtype, device=device)


def check_bad_input(op, args, change, error, text, device):
    """`op(**args)` with `change` applied (its tensors moved to `device`) must raise `error`
    with `text` in the message: the bad-input tables of the op tests."""
    args.update({k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in change.items()})
    with pytest.raises(error, match=re.escape(text)):
        op(**args)


def check_mixed_devices(op, args, name):
    """`op(**args)`, every tensor on CUDA but `name` moved to the CPU, must raise a
    RuntimeError naming it (x is checked against weight, so the message names weight)."""
    args[name] = args[name].cpu()
    with pytest.raises(RuntimeError, match=f"{name if name != 'x' else 'weight'} is on"):
        op(**args)


def clusters_enabled(enabled):
    """kernel_config(clusters=enabled) for the block's duration: the streaming convs' cluster
    kernels or their split-K blocks."""
    return kernel_config(clusters=enabled)


def assert_one_cluster_launch(run):
    """run() must make exactly one traced launch, every block of which stamps the launch
    trace's last event: a cluster kernel's blocks all do, of the split-K kernels only the
    finishing blocks."""
    buffer = torch.zeros(4096, 9, dtype=torch.int64, device="cuda")
    ops._C.start_launch_trace(buffer)
    try:
        run()
    finally:
        blocks = ops._C.stop_launch_trace()
    assert len(blocks) == 1, "one launch"
    assert (buffer[:blocks[0], 8] > 0).all(), "a block did not finish a unit: not a cluster kernel"


def run_behind_a_sleep(run, inputs):
    """run(*copies of inputs) on a fresh stream, the copies written there after a long sleep,
    and its outputs cloned on that stream right after it: an op that forks work to a stream of
    its own must start it after what the caller's stream queued, and make the caller's stream
    wait for it, or it reads the copies, or the clones read its outputs, before they are
    written. Returns the clones as a tuple."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        copies = [torch.full_like(t, float("nan")) for t in inputs]
        torch.cuda._sleep(100_000_000)
        for copy, t in zip(copies, inputs):
            copy.copy_(t)
        outputs = run(*copies)
        outputs = tuple(o.clone() for o in (outputs if isinstance(outputs, tuple) else (outputs,)))
    stream.synchronize()
    return outputs
