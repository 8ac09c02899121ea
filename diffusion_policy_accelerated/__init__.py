"""Fast Diffusion Policy inference: fused CUDA kernels, a checkpoint-compatible
`ConditionalUnet1D`, and DDPM/DDIM steps equal to diffusers'.

Attributes load on first use, so importing the package neither loads nor JIT-builds the
C++ extension until an op is needed.
"""
import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "ConditionalUnet1D": "model",
    "DenoiseSchedule": "schedulers",
    "accelerate": "integration",
    "load_checkpoint": "checkpoint",
    "load_lerobot_pretrained": "lerobot",
    "conv1d_gn_mish": "ops",
    "denoise_step": "ops",
    "built_with_cuda": "ops",
    "KernelConfig": "routing",
    "kernel_config": "routing",
    "current_kernel_config": "routing",
}
__all__ = sorted(_EXPORTS) + ["ops"]


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    if name == "ops":
        return importlib.import_module(".ops", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
