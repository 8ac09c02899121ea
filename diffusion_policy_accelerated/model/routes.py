"""Every conv of a U-Net forward with the route it takes, and why (`dpa routes` prints it).

The route rules are csrc/conv1d/conv_route.h's; this walks the model to find each conv's
input shape and its place in a residual block, and asks them (kernels/routing.py)."""
from typing import List, NamedTuple, Optional

import torch
import torch.nn as nn

from ..kernels.routing import Device, conv_route
from .unet import ConditionalResidualBlock1D, ConditionalUnet1D, Conv1dBlock, conv1d_block_shapes

__all__ = ["ConvRoute", "explain"]


class ConvRoute(NamedTuple):
    """One conv of a forward: its module name, shapes and route, and why."""
    module: str
    shape: str
    route: str
    why: str


def explain(unet: ConditionalUnet1D, batch: int, horizon: int, dtype: Optional[torch.dtype] = None,
            device: Device = None) -> List[ConvRoute]:
    """Every conv of one forward of `unet` at this batch and horizon, in call order, with the
    route it takes on `device` (default: the model's; "cuda" on a machine without a GPU: an
    H100, the GPU the defaults were measured on; or a routing.GpuLimits) in `dtype` (default: the model's) under the
    calling thread's kernel configuration. One plain forward of the model, where it is (the
    meta device answers at once), finds the shapes."""
    if not isinstance(unet, ConditionalUnet1D):
        raise TypeError(f"unet must be diffusion_policy_accelerated.ConditionalUnet1D, got {type(unet).__name__}")
    parameter = next(unet.parameters())
    dtype = parameter.dtype if dtype is None else dtype
    device = parameter.device if device is None else device
    names = {module: name for name, module in unet.named_modules()}
    groups = {m.block[0]: m.block[1].num_groups for m in unet.modules() if isinstance(m, Conv1dBlock)}
    roles = {}
    for block in unet.modules():
        if isinstance(block, ConditionalResidualBlock1D):
            first, second = block.blocks[0].block[0], block.blocks[1].block[0]
            place = (first, block.blocks[0].block[1].num_groups)
            roles[first], roles[second] = (1, *place), (2, *place)
            if isinstance(block.residual_conv, nn.Conv1d):
                roles[block.residual_conv] = (3, *place)
    calls = []
    hooks = [module.register_forward_hook(lambda m, args, out: calls.append((m, args[0].shape)))
             for module in unet.modules() if isinstance(module, (nn.Conv1d, nn.ConvTranspose1d))]
    try:
        conv1d_block_shapes(unet, horizon, batch)  # a plain forward, which fires every hook
    finally:
        for hook in hooks:
            hook.remove()
    routes = []
    for conv, (rows, channels, length) in calls:
        kind = "ConvTranspose1d" if isinstance(conv, nn.ConvTranspose1d) else "Conv1d"
        shape = f"{kind} {channels}->{conv.out_channels} k{conv.kernel_size[0]}, x [{rows}, {channels}, {length}]"
        route = conv_route(conv, rows, length, dtype, device, groups=groups.get(conv, 0), block=roles.get(conv))
        routes.append(ConvRoute(names[conv], shape, route.route, route.why))
    return routes
