"""The non-finite guard: a robot must never execute NaN or Inf actions without being told.

A guarded call (a policy's `predict_action`, LeRobot's `generate_actions`, a loaded checkpoint's
`predict_action`) checks its observations (its floating-point tensor and array arguments) and
its actions (its floating-point tensor results) and raises `NonFiniteError` instead of
returning actions where either holds a NaN or an Inf, naming which.

How: every checked tensor gets a flag, `torch.isfinite(t).all()`, computed on its device (in a
CUDA-graphed call, inside the graph: GraphedPolicyCall), and the flags are read on the host
together, in one copy, after the call; only where one is False is anything else read (which
rows, which of the policy's weights are not finite). The observations' flags are taken before
the call, so a method that writes to its arguments is judged on what it was given.

Cost: reading the flags waits for the device to finish the call, so a guarded call returns
its actions computed, not queued; PyTorch has no way to defer the check to the caller's own
copy of the actions to the host. A robot loop that copies the actions to the host right after
the call waits there anyway and pays one more copy of a few bytes; a caller that queues more
device work behind the call (a simulator stepping its environments on the GPU) loses that
overlap, and turns the guard off (`check_finite=False`). Outside a graph each flag is two small
kernel launches. A call made while the caller captures a CUDA graph of its own cannot read
anything: it runs unchecked, and the caller's replays are its own to check.
"""
import inspect
import sys
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

__all__ = ["NonFiniteError", "FiniteGuard", "CallFlags", "named_arrays", "check_finite_option"]

# What an error names at most: rows of a tensor, weights of the policy.
_LISTED = 5


class NonFiniteError(ValueError):
    """A guarded call saw NaN or Inf. `where` is "observations" (its inputs) or "actions" (its
    results); `names` are the offending arguments or results ("obs_dict['obs']",
    "result['action']"); the message says which rows and, for actions, which of the policy's
    weights are not finite, if any. No actions are returned with it."""

    def __init__(self, message: str, where: str, names: Sequence[str]):
        super().__init__(message)
        self.where = where
        self.names = tuple(names)


def named_arrays(value: Any, name: str) -> List[Tuple[str, Any]]:
    """The floating-point tensors (and numpy arrays) in `value`, a tree of dicts, lists and
    tuples, each with its path from `name` ("obs_dict['image']"), in a fixed order."""
    found: List[Tuple[str, Any]] = []
    numpy = sys.modules.get("numpy")  # an array can only be one where numpy is imported

    def visit(node, path):
        if isinstance(node, torch.Tensor):
            if node.is_floating_point() and not node.is_meta:
                found.append((path, node))
        elif numpy is not None and isinstance(node, numpy.ndarray):
            if numpy.issubdtype(node.dtype, numpy.floating):
                found.append((path, node))
        elif isinstance(node, Mapping):
            for key, item in node.items():
                visit(item, f"{path}[{key!r}]")
        elif isinstance(node, (list, tuple)):
            for index, item in enumerate(node):
                visit(item, f"{path}[{index}]")

    visit(value, name)
    return found


def _flag(array) -> torch.Tensor:
    """Whether every element of `array` is finite, as a 0-d bool tensor on its device (a host
    array's on the CPU, computed there)."""
    if not isinstance(array, torch.Tensor):
        array = torch.from_numpy(array)
    return torch.isfinite(array).all()


def _bad_rows(array) -> str:
    """' (rows [i, ...] of n)' for the rows (first dimension) of `array` holding a NaN or an Inf;
    '' for an array of one dimension."""
    tensor = array if isinstance(array, torch.Tensor) else torch.from_numpy(array)
    if tensor.dim() < 2:
        return ""
    rows = (~torch.isfinite(tensor)).flatten(1).any(1).nonzero().flatten().tolist()
    listed = ", ".join(map(str, rows[:_LISTED])) + (", ..." if len(rows) > _LISTED else "")
    return f" (rows [{listed}] of {tensor.shape[0]})"


# What a guard names where actions are not finite: a module (its parameters and buffers), or a
# function returning (name, tensor) pairs.
Weights = Union[nn.Module, Callable[[], Iterable[Tuple[str, torch.Tensor]]]]


def _bad_weights(weights: Weights) -> List[str]:
    """The names of the floating-point weights holding a NaN or an Inf."""
    named = (list(weights.named_parameters()) + list(weights.named_buffers()) if isinstance(weights, nn.Module)
             else list(weights()))
    return [name for name, t in named if t.is_floating_point() and not bool(torch.isfinite(t).all())]


class CallFlags:
    """One call's checked observations and actions by name, and their flags: the observations'
    taken when it is made (before the call), the actions' by `finish` (after it). In a graph
    capture both are the graph's: `stacked` holds what every replay writes."""

    def __init__(self, observations: List[Tuple[str, Any]]):
        self.observations = observations
        self.actions: List[Tuple[str, Any]] = []
        self._flags = [_flag(array) for _, array in observations]

    def finish(self, actions: List[Tuple[str, Any]]) -> None:
        self.actions = actions
        flags = self._flags + [_flag(array) for _, array in actions]
        # One bool tensor per device, so that each device's flags are read in one copy.
        groups: Dict[torch.device, List[int]] = {}
        for index, flag in enumerate(flags):
            groups.setdefault(flag.device, []).append(index)
        self._groups = list(groups.values())
        self.stacked = [torch.stack([flags[i] for i in indices]) for indices in self._groups]

    def read(self) -> List[bool]:
        """Every flag, observations first: one copy to the host per device (one on a GPU)."""
        values = [True] * sum(map(len, self._groups))
        for indices, group in zip(self._groups, self.stacked):
            for index, value in zip(indices, group.tolist()):
                values[index] = value
        return values


class FiniteGuard:
    """`guard(*args, **kwargs)` returns `method(*args, **kwargs)`, or raises NonFiniteError
    where its observations or actions hold NaN or Inf (see the module doc). `name` is the
    method's name in messages; `weights`, the policy's weights (a module, or a function
    returning (name, tensor) pairs), which a message about actions names where they are not
    finite."""

    def __init__(self, method: Callable, name: str, weights: Weights):
        self.method = method
        self.name = name
        self.weights = weights
        try:
            self._signature: Optional[inspect.Signature] = inspect.signature(method)
        except (TypeError, ValueError):  # a callable Python cannot introspect: names by position
            self._signature = None

    def observations(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> List[Tuple[str, Any]]:
        """The call's floating-point arguments, named as the method names them (by position
        where the method has no signature these arguments fit)."""
        arguments = None
        if self._signature is not None:
            try:
                arguments = self._signature.bind(*args, **kwargs).arguments.items()
            except TypeError:  # the method will raise its own error for these arguments
                pass
        if arguments is None:
            arguments = [(f"args[{i}]", value) for i, value in enumerate(args)] + list(kwargs.items())
        return [found for name, value in arguments for found in named_arrays(value, name)]

    def actions(self, output: Any) -> List[Tuple[str, Any]]:
        return named_arrays(output, "result")

    def __call__(self, *args, **kwargs):
        return self.run(lambda: self.method(*args, **kwargs), self.observations(args, kwargs))

    def run(self, call: Callable[[], Any], observations: List[Tuple[str, Any]]) -> Any:
        """`call()` guarded, with its `observations` ((name, array) pairs: `observations()` or
        `named_arrays`)."""
        # Nothing can be read inside a capture of the caller's own (see the module doc); there is
        # none before CUDA is initialised (and asking would fail where there is no driver).
        if torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():
            return call()
        flags = CallFlags(observations)
        output = call()
        flags.finish(self.actions(output))
        self.check(flags)
        return output

    def check(self, flags: CallFlags) -> None:
        """Reads the flags (the call's one synchronisation) and raises where one is False."""
        values = flags.read()
        if all(values):
            return
        count = len(flags.observations)
        bad_inputs = [(n, a) for (n, a), ok in zip(flags.observations, values[:count]) if not ok]
        if bad_inputs:
            raise NonFiniteError(
                f"{self.name}: NaN or Inf in the observations: " + "; ".join(n + _bad_rows(a) for n, a in bad_inputs)
                + ". No actions were returned (check_finite=False turns this check off).", "observations",
                [n for n, _ in bad_inputs])
        bad_outputs = [(n, a) for (n, a), ok in zip(flags.actions, values[count:]) if not ok]
        weights = _bad_weights(self.weights)
        cause = (f"these weights of the policy are not finite: {_listed(weights)}" if weights else
                 "the policy's weights are finite, so its arithmetic overflowed or divided by zero (float16 or "
                 "bfloat16 weights? observations far outside the training range?)")
        raise NonFiniteError(
            f"{self.name}: NaN or Inf in the actions, from finite observations: "
            + "; ".join(n + _bad_rows(a) for n, a in bad_outputs)
            + f"; {cause}. They were not returned (check_finite=False turns this check off).",
            "actions", [n for n, _ in bad_outputs])


def _listed(names: List[str]) -> str:
    return ", ".join(names[:_LISTED]) + (f" and {len(names) - _LISTED} more" if len(names) > _LISTED else "")


def check_finite_option(check_finite) -> bool:
    """`check_finite=` as the adapters take it: a bool."""
    if not isinstance(check_finite, bool):
        raise TypeError(f"check_finite must be a bool (True: raise NonFiniteError instead of returning NaN or Inf "
                        f"actions), got {check_finite!r}")
    return check_finite
