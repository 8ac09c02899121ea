"""A share of the GPU's SMs for this process: a smaller GPU's compute measured on a large one.

`confine_to_sms(budget)` makes a CUDA green context of `budget` SMs current (torch.cuda.
green_contexts), so that every kernel, cuBLAS call and CUDA graph the process runs after it
runs there; call it before anything creates a stream. The driver rounds the budget to its SM
granularity (multiples of 8 on Hopper); the SMs the context got are returned, for
`KernelConfig(sm_count=...)`. Only the SMs are confined: memory bandwidth and caches stay the
large GPU's, so a budget stands for a smaller GPU's compute, not its memory system.
"""
import ctypes
from typing import List, Optional

import torch

# The contexts made current: a green context lives as long as its Python object.
_CONTEXTS: List[object] = []


def current_context_sms() -> Optional[int]:
    """SMs of the calling thread's current CUDA context (a green context's share), read
    through the driver (cuCtxGetDevResource), or None where the driver lacks it."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        context = ctypes.c_void_p()
        # CUdevResource: the type (4 bytes), 92 bytes the driver keeps, then the SM
        # resource, whose first field is smCount; 144 bytes in all (cuda.h, resource ABI 1).
        resource = (ctypes.c_ubyte * 256)()
        if cuda.cuCtxGetCurrent(ctypes.byref(context)) != 0 or \
                cuda.cuCtxGetDevResource(context, resource, 1) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return int.from_bytes(bytes(resource[96:100]), "little")


def confine_to_sms(budget: int) -> int:
    """Run this process's CUDA work on `budget` SMs from now on: the SMs it got, or the
    device's own count where the budget covers the device (no green context then)."""
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise ValueError(f"budget must be a positive number of SMs, got {budget!r}")
    if not torch.cuda.is_available():
        raise RuntimeError("confining the work to some SMs needs a CUDA GPU, and none is visible")
    device_sms = torch.cuda.get_device_properties(0).multi_processor_count
    if budget >= device_sms:
        return device_sms
    from torch.cuda import green_contexts

    if not green_contexts.SUPPORTED:
        raise RuntimeError("this PyTorch build has no CUDA green contexts (torch.cuda.green_contexts.SUPPORTED)")
    try:
        context = green_contexts.GreenContext.create(budget, 0)
    except RuntimeError as error:  # e.g. a budget the driver's SM granularity rounds past the device
        raise RuntimeError(f"no green context of {budget} SMs on this {device_sms}-SM GPU: {error}") from error
    context.set_context()
    _CONTEXTS.append(context)
    got = current_context_sms()
    if got is None:
        raise RuntimeError("the driver does not report the green context's SMs (cuCtxGetDevResource)")
    return got
