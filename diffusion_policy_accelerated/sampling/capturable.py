"""Ordinary module code made capturable in a CUDA graph, and what still is not, named.

A CUDA graph records the kernels a call launches; work on the host is not recorded, and a
host synchronisation during the capture fails it. Encoders and denoisers are full of code
that is ordinary in eager PyTorch and breaks a capture:

- constant tensors built from Python values on every call: torchvision's `Normalize` calls
  `torch.as_tensor(mean, device=cuda)` (a copy from pageable host memory, which a capture
  refuses) and then `(std == 0).any()` (a read back). `make_capturable` gives it a forward
  that builds them once per device, dtype and values, outside the capture, with the same
  check, and computes the same `(x - mean) / std`;
- a value read back to choose a path: `nn.TransformerEncoder` / `nn.TransformerDecoder` test
  whether their attention mask is causal, `bool((mask == causal).all())`, on every call. The
  answer is kept per mask tensor (its identity and version), found before the capture, and
  passed on as the `is_causal` hint the modules would have computed;
- random numbers drawn on the host (torchvision's `Random*` transforms, `ColorJitter`, the
  auto-augment policies): a graph would replay one draw forever, so they cannot be captured
  without changing results. During a capture they raise an error naming themselves;
- Python-side shape logic (crops, resizes, slicing) is capturable as it is: the graphs are
  per input shape.

Only the exact classes are changed, whose forward is known; their type, state_dict and
results stay as they were (the new forwards are instance attributes, kept by deepcopy and
pickle). Anything else (`.item()`, a branch on a tensor, a copy to the host) still fails the
capture: `capture_failure` describes that failure with the innermost module running and
the innermost line outside PyTorch and this package.
"""
import linecache
import numbers
import os
from typing import List, Optional

import torch
import torch.nn as nn
import torch.nn.modules.transformer as _transformer

__all__ = ["CaptureError", "HostRandomnessError", "make_capturable", "capture_failure", "end_generator_capture"]


class CaptureError(RuntimeError):
    """A module's code could not be captured as a CUDA graph (the message says where)."""


class HostRandomnessError(RuntimeError):
    """A module that draws random numbers on the host was called during a CUDA graph capture."""


# torchvision's transforms that draw their parameters on the host on every call (besides every
# class whose name starts with "Random").
_HOST_RANDOM_TRANSFORMS = ("ColorJitter", "AutoAugment", "RandAugment", "TrivialAugmentWide", "AugMix",
                           "ElasticTransform")


def make_capturable(root: nn.Module) -> List[str]:
    """Makes the known capture-breaking modules in `root`'s tree capturable, in place (see the
    module's docstring); returns the names of the modules changed by this call. Idempotent;
    a module with a `forward` of its own instance (another wrapper's) is left alone."""
    changed = []
    for name, module in root.named_modules():
        own_forward = vars(module).get("forward")
        if isinstance(own_forward, _CapturableForward):
            continue
        kind = type(module)
        if own_forward is None and kind.__module__ == "torchvision.transforms.transforms" \
                and kind.__name__ == "Normalize":
            module.forward = _NormalizeForward(module)
        elif own_forward is None and kind is nn.TransformerEncoder and _HAS_CAUSAL_DETECTION:
            module.forward = _EncoderForward(module)
        elif own_forward is None and kind is nn.TransformerDecoder and _HAS_CAUSAL_DETECTION:
            module.forward = _DecoderForward(module)
        elif _is_torchvision(kind) and (kind.__name__.startswith("Random") or kind.__name__ in _HOST_RANDOM_TRANSFORMS):
            if _refuse_host_randomness_in_capture in module._forward_pre_hooks.values():
                continue
            module.register_forward_pre_hook(_refuse_host_randomness_in_capture)
        else:
            continue
        changed.append(name)
    return changed


def _is_torchvision(kind: type) -> bool:
    return kind.__module__.startswith("torchvision.transforms")


def _refuse_host_randomness_in_capture(module: nn.Module, args) -> None:
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise HostRandomnessError(
            f"{type(module).__name__} draws its random parameters on the host on every call, which a CUDA graph "
            f"would replay as one fixed draw")


class _CapturableForward:
    """A capturable stand-in for its module's forward (an instance attribute of the module)."""

    def __init__(self, module: nn.Module):
        self.module = module


def _plain_numbers(value):
    """`value` as a hashable key where it is a number or a sequence of numbers, else None."""
    if isinstance(value, numbers.Real):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, numbers.Real) for v in value):
        return tuple(value)
    return None


class _NormalizeForward(_CapturableForward):
    """torchvision.transforms.Normalize's forward on a float tensor image with a mean and std
    of plain numbers: `(tensor - mean) / std` with mean and std built, and std checked for
    zeros, once per device, dtype and values (torchvision does both on every call). Other
    inputs go to torchvision's own forward."""

    def __init__(self, module: nn.Module):
        super().__init__(module)
        self.constants = {}

    def __call__(self, tensor):
        module = self.module
        mean, std = _plain_numbers(module.mean), _plain_numbers(module.std)
        if (mean is None or std is None or not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point()
                or tensor.ndim < 3):
            return type(module).forward(module, tensor)
        key = (tensor.device, tensor.dtype, mean, std)
        constants = self.constants.get(key)
        if constants is None:
            like = dict(dtype=tensor.dtype, device=tensor.device)
            mean_tensor, std_tensor = torch.as_tensor(module.mean, **like), torch.as_tensor(module.std, **like)
            if (std_tensor == 0).any():  # torchvision's check and message
                raise ValueError(f"std evaluated to zero after conversion to {tensor.dtype}, leading to division "
                                 f"by zero.")
            constants = tuple(value.view(-1, 1, 1) if value.ndim == 1 else value
                              for value in (mean_tensor, std_tensor))
            self.constants[key] = constants
        mean_tensor, std_tensor = constants
        # torchvision: clone unless inplace, then sub_ and div_: the same values.
        return (tensor.sub_(mean_tensor) if module.inplace else tensor.sub(mean_tensor)).div_(std_tensor)


# PyTorch's own test of a mask (private; present in every torch this package supports, 2.4+).
_HAS_CAUSAL_DETECTION = hasattr(_transformer, "_detect_is_causal_mask") and hasattr(_transformer, "_get_seq_len")


class _CausalMaskForward(_CapturableForward):
    """What PyTorch's transformer modules compute on every call where a mask is given without
    an is_causal hint, `_detect_is_causal_mask(mask, None, seq_len)` (a read back), kept for
    the last mask tensor: found again where the mask is another tensor, was changed in place
    (its version) or the sequence length differs."""

    def __init__(self, module: nn.Module):
        super().__init__(module)
        self.last = None  # (mask, its version, sequence length, is causal)

    def is_causal(self, mask: torch.Tensor, sequence: torch.Tensor) -> bool:
        size = _transformer._get_seq_len(sequence, self.module.layers[0].self_attn.batch_first)
        version = _version(mask)
        if self.last is not None and self.last[0] is mask and self.last[1:3] == (version, size):
            return self.last[3]
        answer = _transformer._detect_is_causal_mask(mask, None, size)
        self.last = (mask, version, size, answer)
        return answer


def _version(tensor: torch.Tensor) -> Optional[int]:
    try:
        return tensor._version
    except RuntimeError:  # an inference tensor has no version counter (nor can change outside inference mode)
        return None


class _EncoderForward(_CausalMaskForward):
    def __call__(self, src, mask=None, src_key_padding_mask=None, is_causal=None):
        if is_causal is None and mask is not None:
            is_causal = self.is_causal(mask, src)
        return type(self.module).forward(self.module, src, mask=mask, src_key_padding_mask=src_key_padding_mask,
                                         is_causal=is_causal)


class _DecoderForward(_CausalMaskForward):
    def __call__(self, tgt, memory, tgt_mask=None, memory_mask=None, tgt_key_padding_mask=None,
                 memory_key_padding_mask=None, tgt_is_causal=None, memory_is_causal=False):
        if tgt_is_causal is None and tgt_mask is not None:
            tgt_is_causal = self.is_causal(tgt_mask, tgt)
        return type(self.module).forward(self.module, tgt, memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
                                         tgt_key_padding_mask=tgt_key_padding_mask,
                                         memory_key_padding_mask=memory_key_padding_mask,
                                         tgt_is_causal=tgt_is_causal, memory_is_causal=memory_is_causal)


_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def capture_failure(error: BaseException, root: Optional[nn.Module] = None) -> str:
    """What broke a capture, for a warning: the error (the one that broke it, where
    torch.cuda.graph's own error at the capture's end hides it), the innermost module that
    was running (by its name in `root`'s tree) and the innermost line outside PyTorch and
    this package, with its source."""
    cause = error
    if "capture" in str(error) and isinstance(error.__context__, Exception):
        cause = error.__context__
    lines = str(cause).strip().splitlines()
    text = f"capture failed: {type(cause).__name__}: {lines[0] if lines else ''}"
    module, site = None, None
    traceback = cause.__traceback__
    while traceback is not None:
        frame = traceback.tb_frame
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module):
            module = owner
        filename = os.path.abspath(frame.f_code.co_filename)
        if not filename.startswith((_TORCH_DIR, _PACKAGE_DIR)):
            site = (filename, traceback.tb_lineno)
        traceback = traceback.tb_next
    if module is not None:
        kind = f"{type(module).__module__}.{type(module).__qualname__}"
        names = {} if root is None else {id(m): name for name, m in root.named_modules()}
        name = names.get(id(module))
        text += f"; in module {name} ({kind})" if name else f"; in a {kind}"
    if site is not None:
        source = linecache.getline(*site).strip()
        text += f", at {site[0]}:{site[1]}" + (f": `{source}`" if source else "")
    return text


def end_generator_capture(device: torch.device) -> None:
    """A capture that fails leaves the default CUDA generator expecting to be captured (PyTorch
    ends a generator's capture only when the graph's does), and every later random draw on
    the device raising; the capture of one trivial kernel starts and ends its capture again."""
    with torch.cuda.graph(torch.cuda.CUDAGraph(), capture_error_mode="thread_local"):
        torch.zeros(1, device=device)
