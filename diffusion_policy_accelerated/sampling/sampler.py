"""Diffusion Policy's `conditional_sample` (the whole denoising loop) as one CUDA graph.

Per step the loop does: inpaint the known part of the trajectory, run the U-Net, take a
DDPM/DDIM step. At batch 1 each step is a few hundred microseconds of GPU work but hundreds
of kernel launches, so the loop is captured once per batch size (static input buffers, a
warm-up on a side stream, capture) and every call copies its inputs in and replays it: one
launch for the whole action chunk.

Step-invariant work is hoisted out of the loop: the timestep MLP and the timestep half of
every FiLM encoder are tabulated per schedule (they depend only on t), and the observation
half of every FiLM encoder is one GEMM per call; the two halves are added for all the
residual blocks and many steps at once, and each block gets a slice. The inpainting of the
known part of the trajectory is done by the denoise step itself.

Noise: the initial trajectory is drawn exactly as Diffusion Policy draws it,
`torch.randn(condition_data.shape, generator=generator, ...)`, so with the same RNG state a
DDIM (eta = 0) action equals Diffusion Policy's up to fp32 rounding. The per-step noise of
DDPM (and DDIM with eta > 0) comes from ONE further draw of shape [steps, *shape] from the
same generator, outside the graph: the same distribution as diffusers' per-step draws but not
the same numbers. Pass `noise` ([steps + 1, *shape]: the initial trajectory, then step i's
variance noise at index i + 1) to reproduce a run exactly.
"""
import contextlib
import gc
import sys
import threading
import weakref
from typing import Dict, Iterator, Optional, Tuple

import torch

from ..model.unet import ConditionalUnet1D
from ..kernels import ops
from ..kernels.config import current_kernel_config
from ..model.schedulers import DenoiseSchedule
from .capturable import CaptureError, capture_failure, end_generator_capture
from .picard import Picard, PicardLoop, graph_loops_supported


# Memory for the FiLM inputs of several steps, formed together (GraphedSampler._step_films):
# every step of a 100-step loop up to batch 2 (image U-Net, fp32) or 5 (lowdim).
_FILM_ROWS_BYTES = 32 << 20


class _LoopSampler:
    """What GraphedSampler and the generic path's GenericSampler (generic.py) share: the
    device, dtype and schedule of a denoising loop over a network (`_loop`, the subclass's),
    Diffusion Policy's noise draws, the argument checks, and running the loop eagerly, inlined
    into a caller's capture, or as one CUDA graph per input signature (_CapturedLoop) on a
    stream of the sampler's own."""

    _picard: Optional[PicardLoop] = None  # GraphedSampler's parallel loop
    _picard_budget: Optional[int] = None

    def _init_loop(self, network: torch.nn.Module, parameter: torch.Tensor, what: str, schedule: DenoiseSchedule,
                   use_cuda_graph: Optional[bool]) -> None:
        """The loop's device and dtype are `parameter`'s, one of `network`'s (`what`, in messages)."""
        self.device, self.dtype = parameter.device, parameter.dtype
        if use_cuda_graph is None:
            use_cuda_graph = self.device.type == "cuda"
        if use_cuda_graph and self.device.type != "cuda":
            raise ValueError(f"use_cuda_graph needs the {what} on a CUDA device, it is on {self.device}")
        self._network, self._what = network, what
        self.schedule = schedule.to(self.device)
        self.use_cuda_graph = use_cuda_graph
        self.num_steps = len(schedule.timesteps)
        self._adds_noise = any(self.schedule.needs_noise(i) for i in range(self.num_steps))
        self._graphs: Dict[Tuple, "_CapturedLoop"] = {}
        self._inlined = 0
        self._capture_stream: Optional[torch.cuda.Stream] = None
        self._loop_pools: Optional[list] = None  # while capture() captures

    @contextlib.contextmanager
    def capture(self, graph: "torch.cuda.CUDAGraph", **kwargs) -> Iterator[None]:
        """torch.cuda.graph(graph, stream=capture_stream(), **kwargs), keeping the memory pools
        of the graph loops captured into it (a parallel loop's body) for the graph's life."""
        self._loop_pools, pools = [], None
        try:
            with _collector_paused(), torch.cuda.graph(graph, stream=self.capture_stream(), **kwargs):
                yield
            pools = self._loop_pools
        finally:
            if pools is None:  # the capture failed: nothing holds the pools
                _release_pools(self.device.index, self._loop_pools)
            self._loop_pools = None
        if pools:
            weakref.finalize(graph, _release_pools, self.device.index, pools)

    def capture_stream(self) -> torch.cuda.Stream:
        """The stream this sampler's graphs (and a whole policy call around it) are captured
        on: its own. torch.cuda.graph's default is one stream for the whole process, and what
        a library keeps per stream is then the same memory in every graph: cuBLAS's workspace.
        Two samplers' graphs replayed at once from two threads (a server's two instances) then
        wrote each other's GEMM workspace and returned wrong actions (test_serving's
        test_cuda_instances_side_by_side, on an H100)."""
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream(device=self.device)
        return self._capture_stream

    @contextlib.contextmanager
    def inlined(self) -> Iterator[None]:
        """Calls within the block run the loop on the caller's stream, eagerly or into a CUDA
        graph the caller is capturing (a whole policy call: policy_graph.py), not as a replay
        of a graph of the sampler's own."""
        self._inlined += 1
        try:
            yield
        finally:
            self._inlined -= 1

    def _draw_noise(self, condition_data: torch.Tensor, generator: Optional[torch.Generator],
                    initial_noise: Optional[torch.Tensor]) -> torch.Tensor:
        """All the loop's noise, [steps + 1, *shape]: Diffusion Policy's own first draw (or
        `initial_noise`), then one draw for all the steps' noise."""
        shape = condition_data.shape
        like = dict(device=condition_data.device, dtype=condition_data.dtype)
        initial = torch.randn(shape, generator=generator, **like) if initial_noise is None else initial_noise.to(**like)
        steps_shape = (self.num_steps,) + tuple(shape)
        # Draw step noise only if a step uses it, so that DDIM with eta = 0 consumes the
        # generator exactly as Diffusion Policy does.
        steps = (torch.randn(steps_shape, generator=generator, **like) if self._adds_noise
                 else torch.zeros(steps_shape, **like))
        return torch.cat([initial[None], steps])

    def _run(self, inputs: Dict[str, Optional[torch.Tensor]], key: Tuple) -> torch.Tensor:
        """`_loop(**inputs)`, its floating inputs in the loop's dtype and all on its device:
        eagerly, inlined into a caller's capture, or as the replay of the graph for `key`."""
        inputs = {k: None if v is None else v.to(self.device, self.dtype if v.is_floating_point() else v.dtype)
                  for k, v in inputs.items()}
        with torch.inference_mode():
            # Inside a capture of the caller's own, the loop joins that graph.
            if not self.use_cuda_graph or self._inlined or torch.cuda.is_current_stream_capturing():
                return self._loop(**inputs)
            captured = self._graphs.get(key)
            if captured is None:
                captured = self._new_graph(inputs)
                if captured is None:
                    return self._loop(**inputs)
                self._graphs[key] = captured
            return captured.replay(inputs)

    def _new_graph(self, inputs: Dict[str, Optional[torch.Tensor]]) -> Optional["_CapturedLoop"]:
        """The loop captured for these inputs' shapes (None: run it eagerly)."""
        return _CapturedLoop(self, inputs)

    def _check_tensors(self, floating: Dict[str, Optional[torch.Tensor]], condition_mask,
                       others: Optional[Dict[str, Optional[torch.Tensor]]] = None) -> None:
        """condition_data (in `floating`) and condition_mask are tensors with values (not meta),
        the other arguments None or such tensors; `floating`'s of a floating dtype."""
        for name, value in {**floating, "condition_mask": condition_mask, **(others or {})}.items():
            if value is None and name not in ("condition_data", "condition_mask"):
                continue
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
            if value.is_meta and self.device.type != "meta":
                raise ValueError(f"{name} is a meta tensor (a shape without data); the sampler needs values")
            if name in floating and not value.is_floating_point():
                raise TypeError(f"{name} must be a floating-point tensor (of any floating dtype: the loop computes "
                                f"in the {self._what}'s {str(self.dtype).removeprefix('torch.')}), got "
                                f"{str(value.dtype).removeprefix('torch.')}")

    @staticmethod
    def _check_mask(condition_data: torch.Tensor, condition_mask: torch.Tensor) -> None:
        if condition_mask.shape != condition_data.shape or condition_mask.dtype != torch.bool:
            raise ValueError(f"condition_mask must be a bool tensor shaped like condition_data "
                             f"{list(condition_data.shape)}, got {condition_mask.dtype} "
                             f"{list(condition_mask.shape)}")

    def _check_noise(self, condition_data: torch.Tensor, noise: Optional[torch.Tensor],
                     initial_noise: Optional[torch.Tensor]) -> None:
        if noise is not None and noise.shape != (self.num_steps + 1,) + tuple(condition_data.shape):
            raise ValueError(f"noise must be [{self.num_steps + 1}, *condition_data.shape], got "
                             f"{list(noise.shape)}")
        if initial_noise is not None and (noise is not None or initial_noise.shape != condition_data.shape):
            raise ValueError(f"initial_noise must be shaped like condition_data {list(condition_data.shape)} and "
                             f"not given with noise, got {list(initial_noise.shape)}"
                             + (" and noise" if noise is not None else ""))


class GraphedSampler(_LoopSampler):
    """`sampler(condition_data, condition_mask, local_cond, global_cond, generator)` returns
    what Diffusion Policy's `conditional_sample` returns, as one CUDA graph replay per call
    on CUDA (`use_cuda_graph=None` means: when the U-Net is on a CUDA device) and as the
    same hoisted loop run eagerly otherwise.

    One graph is captured per (batch, horizon, action dim, conditioning, kernel
    configuration) on first use, with a message on stderr. The U-Net's weights and the
    schedule must not change afterwards (build a new sampler if they do); the graphs keep
    references to them.

    `parallel` (None: the sequential loop) samples the same trajectory by Picard iteration
    (sampling/picard.py): True for the defaults, or a `Picard(window, tolerance)`. On CUDA its
    iterations loop inside the graph (CUDA 12.4+; else a budget of iterations measured at
    capture, unrolled, with the rest run eagerly where a call needs more).
    """

    def __init__(self, unet: ConditionalUnet1D, schedule: DenoiseSchedule, *,
                 use_cuda_graph: Optional[bool] = None, parallel=None):
        if not isinstance(unet, ConditionalUnet1D):
            raise TypeError(f"unet must be diffusion_policy_accelerated.ConditionalUnet1D, got "
                            f"{type(unet).__name__}")
        if not isinstance(schedule, DenoiseSchedule):
            raise TypeError(f"schedule must be a DenoiseSchedule, got {type(schedule).__name__}")
        self.unet = unet
        self._init_loop(unet, next(unet.parameters()), "U-Net", schedule, use_cuda_graph)
        with torch.inference_mode():
            per_step, per_observation = unet.film_embedding_tables(schedule.timesteps)
            # Every block's FiLM encoder side by side: [steps, sum of widths] per-step rows and
            # one [sum of widths, global_cond_dim] weight, so a call and a step each cost one
            # launch for all blocks; block m reads columns self._film_columns[m].
            self._film_table = torch.cat(list(per_step.values()), dim=1)
            self._film_weight = torch.cat(list(per_observation.values()), dim=0)
        self._film_columns, start = {}, 0
        for block, table in per_step.items():
            self._film_columns[block] = (start, start + table.shape[1])
            start += table.shape[1]
        self.parallel = Picard.of(parallel)
        self._picard = None if self.parallel is None else PicardLoop(self, self.parallel)
        # The Picard iterations unrolled into a graph where graph loops are not available.
        self._picard_budget: Optional[int] = None

    @property
    def last_iterations(self) -> Optional[int]:
        """The parallel loop's iterations in the last call (None: sequential)."""
        if self._picard is None or self._picard.last_iterations is None:
            return None
        return int(self._picard.last_iterations)

    def __call__(self, condition_data: torch.Tensor, condition_mask: torch.Tensor,
                 local_cond: Optional[torch.Tensor] = None,
                 global_cond: Optional[torch.Tensor] = None,
                 generator: Optional[torch.Generator] = None,
                 noise: Optional[torch.Tensor] = None,
                 initial_noise: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`noise` ([steps + 1, *condition_data.shape]) fixes all the noise; `initial_noise`
        (condition_data's shape) only the initial trajectory, drawn by a caller whose loop
        draws it otherwise (LeRobot's), the steps' noise then drawn as usual.

        The floating-point inputs may be of any floating dtype and device: they are converted
        to the U-Net's dtype and device, the loop computes in that dtype, and the trajectory
        returned is on the U-Net's device in condition_data's dtype (a float64 condition_data
        gets float64 back, computed in the U-Net's precision). Integer or bool data, and meta
        tensors, raise TypeError / ValueError naming the argument."""
        self._check_inputs(condition_data, condition_mask, local_cond, global_cond, noise, initial_noise)
        if noise is None:
            noise = self._draw_noise(condition_data, generator, initial_noise)
        inputs = dict(condition_data=condition_data, condition_mask=condition_mask,
                      local_cond=local_cond, global_cond=global_cond, noise=noise)
        # A graph bakes in the routes and launch features the configuration chose.
        key = (tuple(condition_data.shape), local_cond is not None, global_cond is not None, current_kernel_config())
        return self._run(inputs, key).to(condition_data.dtype)

    def _loop(self, condition_data, condition_mask, local_cond, global_cond, noise):
        """The hoisted denoising loop; run eagerly, or once under capture. Per step: the
        U-Net's launches and one denoise step, which also inpaints its result (for the next
        step, and after the last for the return), so no PyTorch kernel sits between two
        steps' convs."""
        film_observation = None
        if global_cond is not None:
            film_observation = torch.nn.functional.mish(global_cond) @ self._film_weight.t()
        if self._picard is not None:
            return self._picard.run(condition_data, condition_mask, local_cond, noise, film_observation,
                                    budget=self._picard_budget)
        step_films = self._step_films(film_observation, condition_data.shape[0])
        trajectory = torch.where(condition_mask, condition_data, noise[0])
        for i, step_film in enumerate(step_films):
            films = {m: step_film[:, lo:hi] for m, (lo, hi) in self._film_columns.items()}
            model_output = self.unet(trajectory, None, local_cond=local_cond, film_embeddings=films)
            step_noise = noise[i + 1] if self.schedule.needs_noise(i) else None
            trajectory = self.schedule.step(model_output, i, trajectory, step_noise,
                                            condition_data=condition_data, condition_mask=condition_mask)
        return trajectory

    def _step_films(self, film_observation: Optional[torch.Tensor], batch: int) -> Iterator[torch.Tensor]:
        """Each step's FiLM inputs of all blocks, [batch, all widths]: the step's row of the
        timestep table plus this call's observation part. The sums are formed for as many
        steps at once as fit in _FILM_ROWS_BYTES (all of them at small batches), in one
        launch per such chunk, outside the chain of the steps' kernels."""
        if film_observation is None:
            for i in range(self.num_steps):
                yield self._film_table[i].expand(batch, -1)
            return
        step_bytes = film_observation.numel() * film_observation.element_size()
        chunk = max(1, min(self.num_steps, _FILM_ROWS_BYTES // step_bytes))
        for first in range(0, self.num_steps, chunk):
            yield from (self._film_table[first:first + chunk, None, :] + film_observation).unbind(0)

    def _check_inputs(self, condition_data, condition_mask, local_cond, global_cond, noise, initial_noise):
        self._check_tensors(dict(condition_data=condition_data, local_cond=local_cond, global_cond=global_cond,
                                 noise=noise, initial_noise=initial_noise), condition_mask)
        if condition_data.dim() != 3:
            raise ValueError(f"condition_data must be [batch, horizon, action_dim], got "
                             f"{list(condition_data.shape)}")
        self._check_mask(condition_data, condition_mask)
        self.unet.check_inputs(condition_data.shape, local_cond, global_cond, sample_name="condition_data")
        self._check_noise(condition_data, noise, initial_noise)


_collector = {"lock": threading.Lock(), "captures": 0, "was_enabled": False}


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's garbage collector off while any thread captures a CUDA graph, after one collection.
    A CUDA graph destroyed during a capture invalidates it, and a graph whose owner sits in a
    reference cycle (a dropped sampler) is destroyed when the collector runs, which any
    allocation may trigger; torch.cuda.graph no longer collects first. Counted, so that one
    thread's capture ending does not turn the collector back on during another's."""
    gc.collect()
    with _collector["lock"]:
        if _collector["captures"] == 0:
            _collector["was_enabled"] = gc.isenabled()
            gc.disable()
        _collector["captures"] += 1
    try:
        yield
    finally:
        with _collector["lock"]:
            _collector["captures"] -= 1
            if _collector["captures"] == 0 and _collector["was_enabled"]:
                gc.enable()


def _release_pools(device_index: int, pools) -> None:
    for pool in pools:
        ops._C.release_graph_pool(device_index, pool)


class FollowingSampler:
    """The GraphedSampler of a policy whose U-Net, schedule or device may change between calls:
    rebuilt (tables, graphs) when `get`'s key (the schedule's settings), the device the
    policy's weights are on, or the U-Net's weights change, in place included (their version
    counters) or moved and back (their storage), so that a sampler never mixes new weights with
    tables or graphs of old ones. `build(unet, schedule)` makes the sampler: by default a
    GraphedSampler with `parallel`; the generic path's GenericSampler for another denoiser
    (`unet` is then that module)."""

    def __init__(self, unet: torch.nn.Module, parallel=None, *, build=None):
        self.unet = unet
        self.parallel = Picard.of(parallel)
        self.build = build or self._graphed_sampler
        # This package's U-Net has a fixed module tree; walking it (unet.parameters()) took
        # ~0.2 ms a call, more than the rest of a graphed policy call's host work.
        self._modules = list(unet.modules())
        self.key = None
        self.sampler: Optional[_LoopSampler] = None

    def get(self, key, make_schedule, device: torch.device) -> _LoopSampler:
        """The sampler for `key`, built with make_schedule() where it changed; the U-Net (its
        counters, or a copy of other weights) follows `device`, the policy's."""
        parameters = [p for module in self._modules for p in module._parameters.values() if p is not None]

        def full_key():
            # Versions for updates in place, storage for moves and conversions (which keep
            # versions).
            return (key, device, parameters[0].dtype, sum(p._version for p in parameters),
                    tuple(p.data_ptr() for p in parameters))
        if full_key() != self.key:
            self.unet.to(device=device)
            self.sampler = self.build(self.unet, make_schedule())
            self.key = full_key()  # after the move, which may have given the weights new storage
        return self.sampler

    def _graphed_sampler(self, unet: ConditionalUnet1D, schedule: DenoiseSchedule) -> "GraphedSampler":
        return GraphedSampler(unet, schedule, parallel=self.parallel)


class _CapturedLoop:
    """One captured `_loop` for fixed input shapes, with the static buffers it reads. Errors
    of the warm-up are raised as they are; a capture that fails raises CaptureError, naming
    the module and line that broke it (capturable.capture_failure)."""

    def __init__(self, sampler: _LoopSampler, inputs: Dict[str, Optional[torch.Tensor]],
                 capture_error_mode: str = "global"):
        self.sampler = sampler
        batch = inputs["condition_data"].shape[0]
        print(f"diffusion_policy_accelerated: capturing the {sampler.num_steps}-step denoising loop "
              f"as a CUDA graph for batch {batch} (once per input shape)...", file=sys.stderr, flush=True)
        self.static = {k: None if v is None else v.clone() for k, v in inputs.items()}
        side = torch.cuda.Stream(device=sampler.device)
        side.wait_stream(torch.cuda.current_stream(sampler.device))
        with torch.cuda.stream(side):  # warm-up: lazy init, cuBLAS handles, allocator pools
            sampler._loop(**self.static)
        torch.cuda.current_stream(sampler.device).wait_stream(side)
        self.picard_budget = None
        if sampler._picard is not None and not graph_loops_supported():
            # No loops in graphs here: the warm-up's iterations, and a quarter more, unrolled.
            self.picard_budget = sampler.last_iterations + max(2, sampler.last_iterations // 4)
            print(f"diffusion_policy_accelerated: this CUDA runtime or driver has no graph loops (CUDA 12.4+): "
                  f"{self.picard_budget} Picard iterations unrolled into the graph (the warm-up took "
                  f"{sampler.last_iterations}); a call that needs more finishes eagerly", file=sys.stderr, flush=True)
        sampler._picard_budget = self.picard_budget
        self.graph = torch.cuda.CUDAGraph()
        caller = torch.cuda.current_stream(sampler.device)
        try:
            with sampler.capture(self.graph, capture_error_mode=capture_error_mode):
                self.output = sampler._loop(**self.static)
        except Exception as error:
            # torch.cuda.graph hands the caller's stream back only after a capture that ends well.
            torch.cuda.set_stream(caller)
            end_generator_capture(sampler.device)
            raise CaptureError(capture_failure(error, sampler._network)) from error
        finally:
            sampler._picard_budget = None
        self.iterations = self.start = None
        if sampler._picard is not None:
            self.iterations, self.start = sampler._picard.last_iterations, sampler._picard.last_start

    def replay(self, inputs: Dict[str, Optional[torch.Tensor]]) -> torch.Tensor:
        for name, value in inputs.items():
            if value is not None:
                self.static[name].copy_(value)
        self.graph.replay()
        if self.iterations is not None:
            self.sampler._picard.last_iterations = self.iterations
            if self.picard_budget is not None and int(self.start.min()) < self.sampler.num_steps:
                return self.sampler._loop(**self.static)  # past the unrolled budget: eagerly
        # A copy, so that the caller's result survives the next replay.
        return self.output.clone()
