"""Parallel-in-time sampling: the denoising loop's steps refined together by Picard iteration
(ParaDiGMS: Shih et al., "Parallel Sampling of Diffusion Models", NeurIPS 2023).

With all noise drawn up front, the trajectory x[0..N] of a DDPM or DDIM loop is the fixed
point of x[j] = x[k] + sum_{i=k}^{j-1} (F_i(x[i]) - x[i]), F_i being step i (U-Net, denoise
step, inpainting). Each batch row keeps a window of `window` steps from its first step whose
input is not final yet. An iteration evaluates the U-Net once on every window step at once
(window x batch rows, each with its own timestep), rebuilds the window by a cumulative sum,
and moves the window's start past the states whose change since the last iteration is
within tolerance, and past the one after them, which then depends only on final states.
States enter a window as a guess: a step from the state before them with the latest model
output (at the start, the output expected at pure noise), noise included.

Stopping rule: state x[i + 1] (step i's output) is final when the mean over its elements of
the squared change between two iterations is at most (tolerance * sigma_i)^2, sigma_i^2 being
step i's noise variance (DenoiseSchedule.noise_variance: DDPM's posterior variance, for DDIM
its eta = 1 variance). The loop ends when every row's window has passed x[N]; it takes at
most N iterations (a window moves at least one step each). With tolerance 0 a state is final
only once it no longer changes: the sequential trajectory for the same noise, up to fp32
rounding.

Where the GPU is idle at small batches, an iteration of `window` rows costs little more than
a sequential step, and the loop takes far fewer iterations than steps. In a CUDA graph the
iterations run in a loop node of the graph (CUDA 12.4+): one replay, no host round trip.
"""
import dataclasses
import os
from typing import Optional

import torch

from ..kernels import ops

__all__ = ["Picard"]


@dataclasses.dataclass(frozen=True)
class Picard:
    """Parallel sampling's settings: `window` steps evaluated together per batch row (at most
    the schedule's steps; the whole loop where larger), and `tolerance` (>= 0) on each step's
    change, in units of the step's noise standard deviation."""

    window: int = 16
    tolerance: float = 0.1

    def __post_init__(self):
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"Picard.window must be a positive int (steps evaluated together), got {self.window!r}")
        if (isinstance(self.tolerance, bool) or not isinstance(self.tolerance, (int, float))
                or not self.tolerance >= 0 or self.tolerance == float("inf")):
            raise ValueError(f"Picard.tolerance must be a finite number >= 0 (in units of each step's noise "
                             f"standard deviation), got {self.tolerance!r}")

    @staticmethod
    def of(value) -> Optional["Picard"]:
        """`parallel=` as callers give it: None or False (sequential), True (the defaults), a
        Picard, or a dict of its fields."""
        if value is None or value is False:
            return None
        if value is True:
            return Picard()
        if isinstance(value, Picard):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - {f.name for f in dataclasses.fields(Picard)})
            if unknown:
                raise TypeError(f"parallel: unknown settings {unknown}; Picard has window and tolerance")
            return Picard(**value)
        raise TypeError(f"parallel must be None, a bool, a Picard or a dict of its fields, got "
                        f"{type(value).__name__}")


class PicardLoop:
    """The parallel loop of one GraphedSampler: its tables on the sampler's device."""

    def __init__(self, sampler, settings: Picard):
        self.sampler = sampler
        self.schedule = sampler.schedule
        self.steps = sampler.num_steps
        self.window = min(settings.window, self.steps)
        variance = self.schedule.noise_variance().to(torch.float32)
        self.thresholds = (variance * float(settings.tolerance) ** 2).to(sampler.device)
        # The last run's iteration count and windows' starts (device tensors; a captured run's
        # are the graph's, which each replay updates).
        self.last_iterations: Optional[torch.Tensor] = None
        self.last_start: Optional[torch.Tensor] = None

    def _first_guess(self, trajectory, step_noise, condition_data, condition_mask) -> None:
        """The first window's states x[1..window], guessed by stepping from x[0] with the model
        output expected at pure noise: the noise itself for epsilon prediction; zero for sample
        prediction (the normalised data's mean) and for v prediction (sqrt(alpha_bar) * noise -
        sqrt(1 - alpha_bar) * sample, near 0 there). The guesses carry their noise and a drift,
        where copies of x[0] have neither (picard_update guesses each later window's new states
        the same way, with the last output; fewer iterations, docs/tried.md)."""
        s = self.schedule
        output = trajectory[0] if s.prediction_type == "epsilon" else torch.zeros_like(trajectory[0])
        for i in range(self.window):
            trajectory[i + 1] = ops.denoise_step(
                output, trajectory[i], None if step_noise is None else step_noise[i], s.table, i, scheduler=s.kind,
                prediction_type=s.prediction_type, clip_sample_range=s.clip_sample_range,
                use_clipped_model_output=s.use_clipped_model_output, condition_data=condition_data,
                condition_mask=condition_mask)

    def run(self, condition_data, condition_mask, local_cond, noise, film_observation,
            budget: Optional[int] = None) -> torch.Tensor:
        """The loop's last state [batch, ...]. Under a CUDA graph capture, as a loop node of the
        graph (or, with `budget`, that many iterations unrolled); else iterating eagerly until
        every window has passed the last step. The iteration count stays in
        `last_iterations` (a device tensor)."""
        s, batch = self.schedule, condition_data.shape[0]
        device = condition_data.device
        trajectory = torch.where(condition_mask, condition_data, noise[0]).unsqueeze(0).repeat(
            self.steps + 1, *([1] * condition_data.dim())).contiguous()
        start = torch.zeros(batch, dtype=torch.int32, device=device)
        state = torch.zeros(3, dtype=torch.int32, device=device)
        step_noise = noise[1:] if self.sampler._adds_noise else None
        self._first_guess(trajectory, step_noise, condition_data, condition_mask)
        repeated_local = None if local_cond is None else local_cond.repeat(self.window, 1, 1)

        def iteration(handle: int = 0) -> None:
            states, films = ops.picard_window(trajectory, start, self.window, self.sampler._film_table,
                                              film_observation)
            embeddings = {m: films[:, lo:hi] for m, (lo, hi) in self.sampler._film_columns.items()}
            output = self.sampler.unet(states, None, local_cond=repeated_local, film_embeddings=embeddings)
            ops.picard_update(trajectory, start, state, output, step_noise, s.table, self.thresholds,
                              scheduler=s.kind, prediction_type=s.prediction_type,
                              clip_sample_range=s.clip_sample_range,
                              use_clipped_model_output=s.use_clipped_model_output,
                              condition_data=condition_data, condition_mask=condition_mask,
                              conditional_handle=handle)

        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            if budget is not None:
                for _ in range(budget):
                    iteration()
            else:
                pools = self.sampler._loop_pools
                if pools is None:
                    raise RuntimeError("a parallel sampler's graph is captured through GraphedSampler.capture, "
                                       "which keeps its loop's memory for the graph's life")
                pools.append(torch.cuda.graph_pool_handle())
                handle = ops._C.begin_graph_loop(pools[-1])
                try:
                    iteration(handle)
                finally:
                    ops._C.end_graph_loop()
        else:
            while int(start.min()) < self.steps:
                iteration()
        self.last_iterations, self.last_start = state[:1], start
        return trajectory[self.steps]


def graph_loops_supported() -> bool:
    """Whether this build and driver capture loops into CUDA graphs (CUDA 12.4+);
    DPA_NO_GRAPH_LOOPS=1 takes the unrolled budget instead (to compare, or to work around)."""
    return ops.built_with_cuda() and not os.environ.get("DPA_NO_GRAPH_LOOPS") and bool(ops._C.graph_loops_supported())
