"""A policy's whole observation-to-action call as one CUDA graph per input signature.

GraphedSampler makes the denoising loop one graph replay, but a policy's `predict_action` also
normalises the observations, runs the observation encoder (a ResNet18 is some 60 kernels per
camera) and unnormalises the actions, eagerly, launch by launch: at batch 1 that costs more
in launches than the encoder's arithmetic. `GraphedPolicyCall` stands in for such a method
(Diffusion Policy's `predict_action`, LeRobot's `generate_actions`) and captures all of it,
the denoising loop inlined, as one graph per input signature (the tree of arguments, every
tensor's shape, dtype and device, the other arguments' values, the kernel configuration);
each call copies the new observations into the graph's input buffers, replays it, and
returns copies of its outputs. The modules are used as they are.

Before the first capture, the owner's modules whose ordinary code breaks a capture are made
capturable where that changes no result (capturable.py: torchvision's Normalize builds its
constants once per device, PyTorch's transformer modules test their mask once; torchvision's
random transforms refuse to be captured). What a graph still cannot hold is found at capture
where it can be: an encoder that synchronises with the host (`.item()`, a branch on a
tensor's value, a copy to the CPU) makes the capture fail, and the warning names the module
and the line; one whose Python code does something else on a later call (a counter, a random
choice on the host) makes the first replay differ from the eager call it is checked against.
Either way the method warns once and runs eagerly from then on (the denoising loop still as
the sampler's own graph). What the graphs follow: the arguments' signature, the owner's and
its `config`'s plain attributes (n_action_steps, horizon, ...), autocast and cuDNN's TF32
switch, the kernel configuration, and the owner's tensors (moved, converted or replaced ones
drop the graphs; loaded in place, the graphs read them). What they cannot: Python state deeper
in the modules (an encoder's crop size changed after the first call); accelerate a fresh
policy after changing that.

Random numbers: the graph draws the initial trajectory (and DDPM's step noise) from the
default CUDA generator inside the replay, at the generator's offset at call time, and
advances it as the eager call would: seeded the same, the graphed call draws the same noise
as the eager one. Calls with a `torch.Generator` argument, with tensors on the CPU or on
another device, or with the policy in training mode run eagerly.
"""
import sys
import types
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ..kernels.config import current_kernel_config
from .capturable import capture_failure, end_generator_capture, make_capturable
from .finite import CallFlags, FiniteGuard
from .sampler import GraphedSampler

__all__ = ["GraphedPolicyCall"]

# Bumped whenever any module anywhere registers a parameter, buffer or submodule (assignment,
# load_state_dict(assign=True), Diffusion Policy's normaliser replacing its ParameterDict): the
# cheap sign that an owner's tensors may have been replaced, which is then checked.
_registrations = 0
_hooks_installed = False


def _count_registration(*args):
    global _registrations
    _registrations += 1


def _install_registration_hooks() -> None:
    global _hooks_installed
    if not _hooks_installed:
        from torch.nn.modules import module

        module.register_module_parameter_registration_hook(_count_registration)
        module.register_module_buffer_registration_hook(_count_registration)
        module.register_module_module_registration_hook(_count_registration)
        _hooks_installed = True


# Plain attribute values a graph's key holds (the method reads them as Python values).
_PLAIN = (bool, int, float, str, type(None))


def _plain_attributes(obj) -> Tuple:
    return tuple((k, v) for k, v in vars(obj).items() if isinstance(v, _PLAIN)) if hasattr(obj, "__dict__") else ()


class GraphedPolicyCall:
    """`call(*args, **kwargs)` returns what `method(*args, **kwargs)` returns, as one CUDA
    graph replay on CUDA. `owner` is the module whose parameters and buffers the method reads
    (a move or conversion of them, seen as new storage, drops the graphs); `sampler()` returns
    the GraphedSampler the method's denoising loop will use now, built anew where the
    schedule or weights changed (which also drops the graphs). With `check_finite`, a call
    whose observations or actions hold NaN or Inf raises NonFiniteError (finite.py), the flags
    computed inside the graph and read with one copy after the replay."""

    def __init__(self, method: Callable, owner: nn.Module, sampler: Callable[[], GraphedSampler], name: str,
                 check_finite: bool = False):
        self.method = method
        self.owner = owner
        self.sampler = sampler
        self.name = name
        self.guard = FiniteGuard(method, name, owner) if check_finite else None
        self.refused: Optional[str] = None  # why the method runs eagerly, once capture failed
        self._graphs: Dict[Tuple, "_CapturedCall"] = {}
        # (sampler, registrations, tensors, their storage) the graphs were made with
        self._state: Optional[Tuple] = None
        _install_registration_hooks()

    def __call__(self, *args, **kwargs):
        sampler = self.sampler()
        # A caller capturing a graph of its own gets the call inlined into it.
        if (self.refused is not None or not sampler.use_cuda_graph or self.owner.training
                or torch.cuda.is_current_stream_capturing()):
            return self._eager(*args, **kwargs)
        leaves, spec = tree_flatten((args, kwargs))
        key = self._key(leaves, spec, sampler)
        if key is None:
            return self._eager(*args, **kwargs)
        self._drop_stale_graphs(sampler)
        captured = self._graphs.get(key)
        if captured is not None:
            return self._checked(captured, captured.replay(leaves))
        captured = self._capture(leaves, spec, sampler)
        if captured is None:
            return self._eager(*args, **kwargs)
        self._graphs[key] = captured
        # The checked first replay ran on these very inputs and drew this call's noise.
        return self._checked(captured, captured.copy_of_output())

    def _eager(self, *args, **kwargs):
        """The method run as it is (guarded where the call checks for NaN and Inf)."""
        return (self.guard or self.method)(*args, **kwargs)

    def _checked(self, captured: "_CapturedCall", output):
        """`output`, after the replay's flags (with check_finite) say it and the observations are finite."""
        if captured.flags is not None:
            self.guard.check(captured.flags)
        return output

    def _key(self, leaves: List[Any], spec, sampler: GraphedSampler) -> Optional[Tuple]:
        """The graph's key for these arguments, or None where the call must run eagerly."""
        device = sampler.device
        signature = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                if leaf.device != device:
                    return None
                signature.append((leaf.shape, leaf.dtype))
            elif isinstance(leaf, torch.Generator):
                return None
            else:
                try:
                    hash(leaf)
                except TypeError:
                    return None
                signature.append((type(leaf), leaf))
        return (spec, tuple(signature), current_kernel_config(), _plain_attributes(self.owner),
                _plain_attributes(getattr(self.owner, "config", None)), torch.is_autocast_enabled("cuda"),
                torch.backends.cudnn.allow_tf32)

    def _drop_stale_graphs(self, sampler: GraphedSampler) -> None:
        """Graphs read the weights where they were at capture and hold the sampler's tables:
        a new sampler, or tensors moved or converted (new storage) or replaced since, drop them.
        The owner's tensors are listed anew (a walk of its modules, ~0.1-0.4 ms) only after some
        module registered a tensor or submodule."""
        if self._state is not None:
            old_sampler, registrations, tensors, pointers = self._state
            if old_sampler is sampler and tuple(map(torch.Tensor.data_ptr, tensors)) == pointers:
                if registrations == _registrations:
                    return
                current = tuple(self.owner.parameters()) + tuple(self.owner.buffers())
                if len(current) == len(tensors) and all(a is b for a, b in zip(current, tensors)):
                    self._state = (sampler, _registrations, tensors, pointers)
                    return
        self._graphs.clear()
        tensors = tuple(self.owner.parameters()) + tuple(self.owner.buffers())
        self._state = (sampler, _registrations, tensors, tuple(map(torch.Tensor.data_ptr, tensors)))

    def _capture(self, leaves: List[Any], spec, sampler: GraphedSampler) -> Optional["_CapturedCall"]:
        """A checked capture of the call, or None (after one warning) where it cannot be."""
        print(f"diffusion_policy_accelerated: capturing {self.name} (normalisation, observation encoder and the "
              f"{sampler.num_steps}-step denoising loop) as one CUDA graph (once per input shape)...",
              file=sys.stderr, flush=True)
        rng = torch.cuda.get_rng_state(sampler.device)
        make_capturable(self.owner)
        try:
            return _CapturedCall(self.method, leaves, spec, sampler, self.guard)
        except _NotCapturable as reason:
            torch.cuda.set_rng_state(rng, sampler.device)  # the eager call draws what it would have
            self.refused = str(reason)
            self._graphs.clear()
            warnings.warn(f"diffusion_policy_accelerated: {self.name} cannot run as one CUDA graph ({reason}); it "
                          f"runs eagerly from now on, with the denoising loop as its own graph", RuntimeWarning,
                          stacklevel=3)
            return None


class _NotCapturable(Exception):
    pass


class _CapturedCall:
    """One captured call with its static inputs and outputs."""

    def __init__(self, method: Callable, leaves: List[Any], spec, sampler: GraphedSampler,
                 guard: Optional[FiniteGuard] = None):
        device = sampler.device
        # The observations' and actions' finiteness flags, written by every replay (with a guard).
        self.flags: Optional[CallFlags] = None
        self.static = [leaf.clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        args, kwargs = tree_unflatten(self.static, spec)
        rng = torch.cuda.get_rng_state(device)
        caller = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device=device)
        side.wait_stream(caller)
        with torch.cuda.device(device), torch.no_grad(), sampler.inlined():
            # Warm-up (lazy initialisation, cuDNN's choices, allocator pools), whose result the
            # first replay is checked against; errors here are the caller's, raised as they are.
            with torch.cuda.stream(side):
                expected = method(*args, **kwargs)
            caller.wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            try:
                # thread_local: a host synchronisation of this thread's fails the capture, other
                # threads' CUDA calls (a server's) are left alone.
                with sampler.capture(self.graph, capture_error_mode="thread_local"):
                    flags = None if guard is None else CallFlags(guard.observations(args, kwargs))
                    self.output = method(*args, **kwargs)
                    if flags is not None:
                        flags.finish(guard.actions(self.output))
                self.flags = flags
            except Exception as error:  # any failure of the capture: run eagerly, never guess
                # A capture that ends in an error leaves its stream current (torch.cuda.graph
                # restores the caller's only after a capture that ends well).
                torch.cuda.set_stream(caller)
                end_generator_capture(device)
                # The modules are named within the method's owner (a bound method's object).
                raise _NotCapturable(capture_failure(error, getattr(method, "__self__", None)))
        torch.cuda.set_rng_state(rng, device)  # the replay draws what the warm-up drew
        self.graph.replay()
        self._check(expected)

    def _check(self, expected) -> None:
        """The first replay against the eager warm-up on the same inputs and noise: the same
        kernels, so equal up to the order of atomics; a Python-side difference between calls
        is far more."""
        got_leaves, got_spec = tree_flatten(self.output)
        want_leaves, want_spec = tree_flatten(expected)
        if got_spec != want_spec:
            raise _NotCapturable("the graph's output has another structure than the eager call's")
        for got, want in zip(got_leaves, want_leaves):
            if not isinstance(want, (torch.Tensor,) + _PLAIN):
                # A leaf of another type (a numpy array, an object holding tensors) could alias
                # the graph's buffers, which copy_of_output copies only as tensors.
                raise _NotCapturable(f"it returns a {type(want).__name__}, which a graph's output cannot be copied as")
            if isinstance(want, torch.Tensor) != isinstance(got, torch.Tensor):
                raise _NotCapturable("the graph's output has another structure than the eager call's")
            if not isinstance(want, torch.Tensor):
                if got != want:
                    raise _NotCapturable(f"an output changed between calls ({want!r}, then {got!r})")
                continue
            if got.shape != want.shape or got.dtype != want.dtype:
                raise _NotCapturable("an output's shape or dtype differs from the eager call's")
            if want.is_floating_point():
                # The scale of the finite values: NaN or Inf actions (a first call with a NaN
                # observation; the guard's to report) must not make the tolerance NaN and refuse
                # the graph. allclose compares NaN with NaN and an Inf with itself.
                finite = want[torch.isfinite(want)]
                scale = finite.abs().max().item() if finite.numel() else 0.0
                if not torch.allclose(got, want, rtol=1e-3, atol=1e-3 * max(scale, 1.0), equal_nan=True):
                    raise _NotCapturable("its first replay differs from the eager call on the same inputs: the "
                                         "method does something else on each call")
            elif not torch.equal(got, want):
                raise _NotCapturable("its first replay differs from the eager call on the same inputs")

    def replay(self, leaves: List[Any]):
        for static, leaf in zip(self.static, leaves):
            if isinstance(leaf, torch.Tensor):
                static.copy_(leaf)
        self.graph.replay()
        return self.copy_of_output()

    def copy_of_output(self):
        """The last replay's outputs, copied so that they survive the next replay."""
        return tree_map(lambda value: value.clone() if isinstance(value, torch.Tensor) else value, self.output)


def set_encoder_precision(encoder: nn.Module, dtype: Optional[torch.dtype], channels_last: bool) -> None:
    """Runs an observation encoder (in place) under CUDA autocast to `dtype` (float16 or
    bfloat16: convolutions and matrix products in it, normalisations in fp32, the weights kept
    as they are), its features returned in its weights' dtype; and with `channels_last`, its
    4-D weights channels-last, so cuDNN's convolutions run NHWC. Both change the features by
    rounding; benchmark_policy.py reports what that does to the actions."""
    if isinstance(encoder, nn.ModuleList):  # an encoder per camera (LeRobot's option), each called
        for member in encoder:
            set_encoder_precision(member, dtype, channels_last)
        return
    if channels_last:
        encoder.to(memory_format=torch.channels_last)
    if dtype is None:
        return
    encoder._dpa_autocast_dtype = dtype
    # A method bound to the encoder, not a closure: copy.deepcopy rebinds it to the copy, and
    # pickle finds it by name.
    encoder.forward = types.MethodType(_autocast_forward, encoder)


def _autocast_forward(encoder: nn.Module, *args, **kwargs):
    out_dtype = next((p.dtype for p in encoder.parameters() if p.is_floating_point()), torch.float32)
    # cache_enabled=False: autocast's cache of cast weights must not outlive a graph capture.
    with torch.autocast("cuda", dtype=encoder._dpa_autocast_dtype, cache_enabled=False):
        features = type(encoder).forward(encoder, *args, **kwargs)
    return tree_map(lambda value: value.to(out_dtype)
                    if isinstance(value, torch.Tensor) and value.is_floating_point() else value, features)


def check_encoder_options(encoder: Optional[nn.Module], where: str, encoder_dtype,
                          encoder_channels_last: Optional[bool]) -> bool:
    """accelerate()'s encoder options, validated before the policy is changed; returns whether
    the encoder goes channels-last (None: where there is one; on an H100 that took 0.37 ms off
    a one-camera batch-1 call, cuDNN's TF32 kernels reading NHWC without a conversion per
    conv: BENCHMARKS.md, "End to end")."""
    if encoder_dtype is not None and encoder_dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"encoder_dtype must be torch.float16, torch.bfloat16 or None, got {encoder_dtype!r}")
    if encoder_channels_last is not None and not isinstance(encoder_channels_last, bool):
        raise TypeError(f"encoder_channels_last must be a bool or None, got {encoder_channels_last!r}")
    if (encoder_dtype is not None or encoder_channels_last) and not isinstance(encoder, nn.Module):
        option = "encoder_dtype" if encoder_dtype is not None else "encoder_channels_last"
        raise ValueError(f"{option}: the policy has no observation encoder ({where}) to run so")
    return isinstance(encoder, nn.Module) if encoder_channels_last is None else encoder_channels_last
