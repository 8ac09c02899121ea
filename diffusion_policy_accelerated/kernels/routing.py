"""Which route a conv takes, asked of the one place that decides it (csrc/conv1d/conv_route.h,
through the `dpa::conv_route`, `dpa::taps_major_pays` and `dpa::block_op_pays` ops).

The model asks `taps_major_pays` (which weight layout to pass) and `block_op_pays` (whether a
residual block runs as one op); `conv_route` answers, in words, what a conv of given sizes
does and why, for `model.routes.explain` and `dpa routes`. Answers are cached per question and
kernel configuration: the model asks at every eager forward.
"""
import functools
from typing import NamedTuple, Optional, Tuple, Union

import torch

from .config import KernelConfig, current_kernel_config, library

__all__ = ["GpuLimits", "H100", "Route", "taps_major_pays", "block_op_pays", "conv_route", "portable_launches", "route_device"]


class GpuLimits(NamedTuple):
    """What the route rules read of a GPU, for asking about one this machine does not have."""
    major: int             # compute capability
    sms: int
    smem_optin: int        # shared memory a block may opt into, bytes
    hopper_code: bool = True  # the library's kernels were built with Hopper code


# The GPU the defaults were measured on, and what `explain` assumes for "cuda" without a GPU.
H100 = GpuLimits(9, 132, 227 * 1024)
Device = Union[torch.device, str, GpuLimits, None]


def route_device(device: Device) -> Tuple[int, ...]:
    """The route ops' device argument: () for the CPU, (index,) for a CUDA device here, the
    limits of a described GPU, or, for "cuda" on a machine without a GPU, an H100's."""
    if isinstance(device, GpuLimits):
        return (int(device.major), int(device.sms), int(device.smem_optin), int(bool(device.hopper_code)))
    device = torch.device("cuda" if device is None else device)
    if device.type != "cuda":
        return ()
    if not torch.cuda.is_available():
        return route_device(H100)
    return (torch.cuda.current_device() if device.index is None else device.index,)


@functools.lru_cache(maxsize=4096)
def _ask(op: str, config: KernelConfig, *args):
    # The config is part of the key; the op reads the calling thread's, which is that one.
    return getattr(torch.ops.dpa, op)(*args)


def _cuda_kernels(x: torch.Tensor) -> bool:
    """Whether x is on a GPU the loaded library has kernels for (a CPU-only build has none)."""
    return x.is_cuda and library().built_with_cuda()


def _conv_sizes(conv) -> Tuple[int, int, int]:
    return int(conv.in_channels), int(conv.out_channels), int(conv.kernel_size[0])


def taps_major_pays(conv: torch.nn.Conv1d, x: torch.Tensor) -> bool:
    """Whether a GroupNorm conv ("same" padding, stride 1) over x runs faster with a taps-major
    weight (`ops.taps_major`): conv_route.h's taps_major_pays, on x's device and dtype."""
    if not _cuda_kernels(x):
        return False
    return _ask("taps_major_pays", current_kernel_config(), int(x.shape[0]), int(x.shape[2]), *_conv_sizes(conv),
                conv.weight.dtype, route_device(x.device))


def block_op_pays(first: torch.nn.Conv1d, groups: int, x: torch.Tensor) -> bool:
    """Whether a residual block whose first GroupNorm conv is `first` (GroupNorm of `groups`),
    over x, runs as one dpa::residual_block: conv_route.h's block_op_pays (on CUDA where both
    its convs take the GEMM route; on the streaming route each conv is one launch already)."""
    if not _cuda_kernels(x):
        return False
    return _ask("block_op_pays", current_kernel_config(), int(x.shape[0]), int(x.shape[2]), *_conv_sizes(first),
                int(groups), first.weight.dtype, route_device(x.device))


class Route(NamedTuple):
    """A conv's route in words and why; on the GEMM route in fp32 its GEMM's slices on the
    narrow GEMM (0: not taken) or on cuBLAS (1: whole)."""
    route: str
    why: str
    narrow_splits: int
    cublas_splits: int


def conv_route(conv, batch: int, length: int, dtype: torch.dtype, device: Device,
               groups: int = 0, block: Optional[Tuple[int, torch.nn.Conv1d, int]] = None) -> Route:
    """The Route of `conv` (nn.Conv1d or nn.ConvTranspose1d) over an input of `batch` rows
    and `length` positions, as the model runs it: `groups` its GroupNorm's (0: a plain conv);
    `block`, where the conv belongs to a residual block, (role: 1 its first conv, 2 its second,
    3 its shortcut; the block's first conv; its groups). `device`: see route_device."""
    library()
    block_sizes = [] if block is None else [block[0], *_conv_sizes(block[1]), int(block[2])]
    return Route(*_ask("conv_route", current_kernel_config(), int(batch), int(length), *_conv_sizes(conv),
                       int(conv.stride[0]), int(conv.padding[0]), isinstance(conv, torch.nn.ConvTranspose1d),
                       int(groups), tuple(block_sizes), dtype, route_device(device)))


def portable_launches(device: Device = None) -> bool:
    """Whether the CUDA ops on `device` (default: the current CUDA device) launch without
    Hopper's clusters and programmatic dependent launch: an older GPU, kernels built without
    Hopper code, or the calling thread's configuration turning both off."""
    library()
    return _ask("portable_launches", current_kernel_config(), route_device(device))
