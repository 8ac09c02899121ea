"""The generic path: the denoising loop around any denoiser the U-Net kernels do not cover.

GraphedSampler runs this package's ConditionalUnet1D. `GenericSampler` runs a denoiser module
as it is (Diffusion Policy's TransformerForDiffusion, or any module called as
`denoiser(trajectory, timestep, **conditioning)` that returns a model output shaped like the
trajectory) inside the same loop: Diffusion Policy's noise draws, this package's fused DDPM /
DDIM step (DenoiseSchedule.step, which also inpaints the known part of the trajectory), and
on CUDA the whole loop as one CUDA graph replay per input shape, with GraphedSampler's
mechanisms (sampler.py's _LoopSampler: static input buffers, a warm-up on a side stream,
capture on the sampler's own stream, inlining into a whole policy call's graph).

Step i passes the denoiser the trajectory, the timestep `schedule.timesteps[i]` as a 0-dim
int64 tensor on the denoiser's device (Diffusion Policy's loop passes the same element of
`scheduler.timesteps`, on the CPU; on the device a graph can hold it), and the conditioning
tensors by name (Diffusion Policy's transformer: `cond`).

Before its first capture the denoiser's modules that ordinary PyTorch code keeps from being
captured are made capturable (capturable.py); a denoiser that still cannot be captured warns
once, naming the module and line, and runs eagerly from then on.
"""
import warnings
from typing import Optional

import torch
import torch.nn as nn

from ..kernels.config import current_kernel_config
from ..model.schedulers import DenoiseSchedule
from .capturable import CaptureError, make_capturable
from .sampler import _CapturedLoop, _LoopSampler

__all__ = ["GenericSampler"]


class GenericSampler(_LoopSampler):
    """`sampler(condition_data, condition_mask, generator=None, noise=None, initial_noise=None,
    **conditioning)` returns what Diffusion Policy's `conditional_sample` returns for a
    denoiser called as `denoiser(trajectory, t, **conditioning)`; one CUDA graph replay per
    call on CUDA (`use_cuda_graph=None`: where the denoiser's parameters are on a CUDA
    device), the same loop eagerly otherwise.

    The loop computes in the dtype of the denoiser's first floating-point parameter, on its
    device: floating inputs of any dtype are converted to it, and the trajectory comes back
    in condition_data's dtype. `noise` and `initial_noise` are GraphedSampler's. One graph is
    captured per (condition_data's shape, the conditioning's names, shapes and dtypes); the
    graphs read the denoiser's weights where they are at capture (build a new sampler after
    moving or replacing them)."""

    def __init__(self, denoiser: nn.Module, schedule: DenoiseSchedule, *, use_cuda_graph: Optional[bool] = None):
        if not isinstance(denoiser, nn.Module):
            raise TypeError(f"denoiser must be a torch.nn.Module, got {type(denoiser).__name__}")
        if not isinstance(schedule, DenoiseSchedule):
            raise TypeError(f"schedule must be a DenoiseSchedule, got {type(schedule).__name__}")
        parameter = next((p for p in denoiser.parameters() if p.is_floating_point()), None)
        if parameter is None:
            raise ValueError(f"denoiser ({type(denoiser).__name__}) has no floating-point parameter: the loop takes "
                             f"its device and dtype from the denoiser's")
        self.denoiser = denoiser
        self._init_loop(denoiser, parameter, "denoiser", schedule, use_cuda_graph)
        # Each step's timestep, as the 0-dim tensor the denoiser gets.
        self._timesteps = self.schedule.timesteps.to(self.device)
        self.refused: Optional[str] = None  # why the loop runs eagerly, once its capture failed

    def __call__(self, condition_data: torch.Tensor, condition_mask: torch.Tensor,
                 generator: Optional[torch.Generator] = None, noise: Optional[torch.Tensor] = None,
                 initial_noise: Optional[torch.Tensor] = None, **conditioning) -> torch.Tensor:
        self._check_tensors(dict(condition_data=condition_data, noise=noise, initial_noise=initial_noise),
                            condition_mask, others=conditioning)
        self._check_mask(condition_data, condition_mask)
        self._check_noise(condition_data, noise, initial_noise)
        if noise is None:
            noise = self._draw_noise(condition_data, generator, initial_noise)
        key = (tuple(condition_data.shape), current_kernel_config(),
               tuple((name, None if value is None else (tuple(value.shape), value.dtype))
                     for name, value in sorted(conditioning.items())))
        inputs = dict(condition_data=condition_data, condition_mask=condition_mask, noise=noise, **conditioning)
        return self._run(inputs, key).to(condition_data.dtype)

    def _loop(self, condition_data, condition_mask, noise, **conditioning):
        """Per step: the denoiser, then one fused denoise step, which also inpaints its result."""
        trajectory = torch.where(condition_mask, condition_data, noise[0])
        for i in range(self.num_steps):
            model_output = self.denoiser(trajectory, self._timesteps[i], **conditioning)
            if not isinstance(model_output, torch.Tensor) or model_output.shape != trajectory.shape \
                    or model_output.dtype != trajectory.dtype:
                got = (f"{str(model_output.dtype).removeprefix('torch.')} {list(model_output.shape)}"
                       if isinstance(model_output, torch.Tensor) else f"a {type(model_output).__name__}")
                raise ValueError(f"the denoiser ({type(self.denoiser).__name__}) must return a model output shaped "
                                 f"like the trajectory, {str(trajectory.dtype).removeprefix('torch.')} "
                                 f"{list(trajectory.shape)}; it returned {got}")
            step_noise = noise[i + 1] if self.schedule.needs_noise(i) else None
            trajectory = self.schedule.step(model_output, i, trajectory, step_noise,
                                            condition_data=condition_data, condition_mask=condition_mask)
        return trajectory

    def _new_graph(self, inputs) -> Optional[_CapturedLoop]:
        """A captured loop, or None (after one warning, with the loop eager from then on) where
        the denoiser cannot be captured."""
        make_capturable(self.denoiser)
        try:
            # thread_local: a host synchronisation of this thread's fails the capture, other
            # threads' CUDA calls (a server's) are left alone.
            return _CapturedLoop(self, inputs, capture_error_mode="thread_local")
        except CaptureError as error:
            self.refused = str(error)
            self.use_cuda_graph = False
            warnings.warn(f"diffusion_policy_accelerated: the denoising loop of {type(self.denoiser).__name__} "
                          f"cannot run as a CUDA graph ({error}); it runs eagerly from now on", RuntimeWarning,
                          stacklevel=4)
            return None
