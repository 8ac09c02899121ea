"""Fast Diffusion Policy inference: fused CUDA kernels, a checkpoint-compatible
`ConditionalUnet1D`, DDPM/DDIM steps equal to diffusers', and whole denoising loops and policy
calls as CUDA graphs.

The package is laid out by layer, each importing only those below it:
  kernels/   the compiled ops, their configuration and the route each conv takes
  model/     the U-Net, the denoising schedules, reference configurations
  sampling/  the denoising loop as one graph (GraphedSampler), whole policy calls
  adapters/  Diffusion Policy's and LeRobot's policies and checkpoints
  serving/   `dpa serve` and its client
  tools/     the demo and the profiler; cli.py, the `dpa` command, on top

Attributes load on first use, so importing the package neither loads nor JIT-builds the
C++ extension until an op is needed.
"""
import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "ConditionalUnet1D": "model.unet",
    "DenoiseSchedule": "model.schedulers",
    "GraphedSampler": "sampling.sampler",
    "GenericSampler": "sampling.generic",
    "Picard": "sampling.picard",
    "NonFiniteError": "sampling.finite",
    "accelerate": "adapters.diffusion_policy",
    "load_checkpoint": "adapters.checkpoint",
    "load_lerobot_pretrained": "adapters.lerobot",
    "conv1d_gn_mish": "kernels.ops",
    "denoise_step": "kernels.ops",
    "built_with_cuda": "kernels.ops",
    "KernelConfig": "kernels.config",
    "kernel_config": "kernels.config",
    "current_kernel_config": "kernels.config",
}
__all__ = sorted(_EXPORTS) + ["ops"]


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    if name == "ops":
        return importlib.import_module(".kernels.ops", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
