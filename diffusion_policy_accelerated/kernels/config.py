"""The kernels' configuration (`KernelConfig`): the thresholds and switches the route rules
(csrc/conv1d/conv_route.h) and the launches read, and the loaded library it is handed to.

The defaults are the measured best; docs/tried.md has the measurement behind each. The
configuration reaches C++ by field name when the library loads (the process default) and in
`with kernel_config(...)` (the calling thread's override); the ops read it when they launch
and when a CUDA graph captures them (GraphedSampler captures again when it changes).
"""
import contextlib
import dataclasses
import threading
from typing import Iterator, Optional

from .library import load_extension

__all__ = ["KernelConfig", "kernel_config", "current_kernel_config", "library", "CPU_CONV_ROUTES"]

# KernelConfig.cpu_conv's values (csrc/common/kernel_config.h's CpuConv).
CPU_CONV_ROUTES = ("auto", "aten", "gemm", "stream", "fp32")
_CHOICES = {"cpu_conv": CPU_CONV_ROUTES}


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """What the ops may use. The defaults are the measured best; the switches exist to
    measure what each feature buys (`with kernel_config(clusters=False): ...`)."""

    # CUDA: batch x length from which a conv takes the GEMM route (im2col + one GEMM + an
    # epilogue) instead of streaming its weights.
    gemm_min_positions: int = 32
    # ... and below it, from gemm_min_work_positions on, a conv whose multiply-adds (weight
    # elements x batch x length) reach gemm_min_work: there the streaming kernels are bound by
    # arithmetic, not bytes.
    gemm_min_work: int = 1 << 25
    gemm_min_work_positions: int = 16
    # ... and in half precision without Hopper's clusters and programmatic dependent launch
    # (older GPUs, or both switched off), from this many positions: the split-K kernels lose to
    # the tensor cores sooner.
    portable_half_gemm_min_positions: int = 8
    # ... and a transposed conv (the U-Nets' upsampling) from gemm_min_work_positions input
    # positions on where its weight elements x positions reach this.
    transposed_gemm_min_work: int = 1 << 24
    # On the GEMM route a residual block's 1x1 shortcut GEMM runs on a side stream beside its
    # first conv's; in fp32 only below side_stream_fp32_max_positions, from where fp32's SIMT
    # GEMMs fill the GPU.
    side_stream: bool = True
    side_stream_fp32_max_positions: int = 256
    # fp32 GEMMs of few tiles are cut into at most this many slices of their reduction (1:
    # never), so that they fill the SMs.
    fp32_gemm_max_splits: int = 32
    # fp32 GEMMs over up to 32 positions run on the package's narrow GEMM, which streams the
    # weights through a shared-memory ring, instead of cuBLAS's SIMT SGEMM.
    narrow_gemm: bool = True
    # Hopper: streaming convs (and the GEMM route's sliced GroupNorm epilogue) as thread-block
    # clusters instead of split-K blocks and a finishing block.
    clusters: bool = True
    # Hopper: programmatic dependent launch, each kernel starting while the previous one ends
    # and requesting its weights early.
    pdl: bool = True
    # The GEMM route's GroupNorm epilogue over groups larger than a block holds in one
    # cooperative launch (every block resident) instead of two, where clusters are not taken.
    cooperative_group_norm: bool = True
    # Streamed weights (each read once per forward) loaded evict-first in L2, keeping the
    # activations, partial sums and code there.
    weights_evict_first: bool = True
    # Half precision: a GroupNorm conv's weight is passed taps-major (its GEMM multiplies x
    # itself, the epilogue adds up the taps) from this many input channels, on the GEMM route ...
    taps_major_min_in_channels: int = 64
    # ... and below it from 8 positions at batch 2+ (16 at batch 1) where C_in x C_out x
    # positions reaches taps_major_min_work ...
    taps_major_min_work: int = 1 << 23
    # ... and at batch 1 from 8 positions where it reaches taps_major_min_work_batch_1 (a long
    # horizon's deep layers).
    taps_major_min_work_batch_1: int = 1 << 24
    # CPU: "auto" times ATen's conv, im2col + one GEMM and (over few positions) the package's
    # weight-streaming GEMM at each shape's first call and keeps the fastest (no rule held
    # across shapes and CPUs), a half-precision conv also on fp32 copies of its operands;
    # "aten" / "gemm" / "stream" fix the route in the input's dtype, "fp32" as ATen's conv of
    # fp32 copies.
    cpu_conv: str = "auto"
    # CUDA: the SMs the launch plans fill (None: the device's). A process given fewer SMs than
    # the device has (a CUDA green context, an MPS share) sets it, or its split-K waves would
    # queue behind one another.
    sm_count: Optional[int] = None

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "sm_count" and value is None:
                continue
            if field.name in _CHOICES:
                if value not in _CHOICES[field.name]:
                    raise ValueError(f"KernelConfig.{field.name} must be one of {list(_CHOICES[field.name])}, "
                                     f"got {value!r}")
            elif field.type in (bool, "bool"):
                if not isinstance(value, bool):
                    raise TypeError(f"KernelConfig.{field.name} must be a bool, got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"KernelConfig.{field.name} must be an int, got {value!r}")
            elif not 1 <= value < 2 ** 63:
                raise ValueError(f"KernelConfig.{field.name} must be in [1, 2**63), got {value}")


DEFAULT = KernelConfig()
_thread = threading.local()
_library = None
_library_lock = threading.Lock()


def library():
    """The compiled extension, loaded (or JIT-built) on first use, with the process default
    configuration handed to it before any op runs."""
    global _library
    with _library_lock:
        if _library is None:
            loaded = load_extension()
            loaded.set_kernel_config(dataclasses.asdict(DEFAULT), True)
            _library = loaded
    return _library


def current_kernel_config() -> KernelConfig:
    """The calling thread's kernel configuration (DEFAULT outside `kernel_config`)."""
    return getattr(_thread, "config", None) or DEFAULT


def _push(config: Optional[KernelConfig]) -> None:
    """Hands the calling thread's override to the extension (None: drop it)."""
    if config is None:
        library().clear_thread_kernel_config()
    else:
        library().set_kernel_config(dataclasses.asdict(config), False)


@contextlib.contextmanager
def kernel_config(config: Optional[KernelConfig] = None, **changes) -> Iterator[KernelConfig]:
    """`with kernel_config(clusters=False): ...` runs the block's ops (on this thread) with the
    current configuration changed so, or with `config` given whole; yields it. Nested blocks
    stack; the previous configuration is restored on exit, also on an exception."""
    if config is not None and not isinstance(config, KernelConfig):
        raise TypeError(f"config must be a KernelConfig, got {type(config).__name__}")
    unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(KernelConfig)})
    if unknown:
        raise TypeError(f"kernel_config: unknown fields {unknown}; KernelConfig has "
                        f"{[f.name for f in dataclasses.fields(KernelConfig)]}")
    new = dataclasses.replace(config or current_kernel_config(), **changes)
    previous = getattr(_thread, "config", None)
    _thread.config = new
    _push(new)
    try:
        yield new
    finally:
        _thread.config = previous
        _push(previous)
