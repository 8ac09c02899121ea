"""Which path each convolution takes, and why: the kernel configuration, its measured
thresholds, and the route rules, in one place.

A conv of the U-Net takes one of these routes:

  CPU          ATen's convolution (oneDNN), im2col + one GEMM, or over few positions im2col
               + the package's weight-streaming GEMM, in the input's dtype or (half
               precision) on fp32 copies of its operands, whichever was fastest at the shape's
               first call (`cpu_conv`), then the fused GroupNorm / Mish / FiLM / residual pass.
  streaming    CUDA, batch x length below `gemm_min_positions` (and below `gemm_min_work`
               multiply-adds): the weight-streaming kernels, which read every weight once at
               close to HBM bandwidth (a robot's batch 1). On Hopper a layer runs as
               thread-block clusters where its plan fits (`clusters`), elsewhere as split-K
               blocks with a finishing block; csrc/conv1d/cuda/launch_plan.cpp cuts it into
               blocks from the SMs (`sm_count`, else the device's) and shared memory.
  GEMM         CUDA, from `gemm_min_positions` on, or from `gemm_min_work_positions` where a
               conv's multiply-adds reach `gemm_min_work` (`transposed_gemm_min_work`), or in
               half precision without Hopper's launch features from
               `portable_half_gemm_min_positions`: im2col + one cuBLAS GEMM + an epilogue
               kernel; in fp32 over up to 32 positions the package's own GEMM instead
               (`narrow_gemm`). In half precision a GroupNorm conv's weight may be passed
               taps-major (`taps_major_pays`): the GEMM then multiplies x itself and the
               epilogue adds up the taps, and a taps-major weight takes this route at any size.
  block op     on the GEMM route, a whole residual block is one `dpa::residual_block`
               (`block_op_pays`), whose epilogues hand data to the next GEMM without launches
               of their own, and which may store its output channels-last for the next block.

`explain(unet, batch, horizon)` lists every conv of a forward with its route and the reason;
`python -m diffusion_policy_accelerated.routing --unet lowdim --batch 1 8 64` prints it.

The thresholds below were measured on an H100 80GB (torch 2.11.0+cu130): BENCHMARKS.md,
"Conv1dBlock shapes", has the sweep's command, docs/tried.md the A/Bs behind the rest. The
kernel configuration is read when an op launches and when a CUDA graph captures one
(GraphedSampler captures again when it changes).
"""
import argparse
import contextlib
import dataclasses
import functools
import threading
from typing import Iterator, List, NamedTuple, Optional, Tuple

import torch
import torch.nn as nn

__all__ = ["KernelConfig", "kernel_config", "current_kernel_config", "taps_major_pays", "block_op_pays",
           "on_gemm_route", "portable_launches", "ConvRoute", "explain"]


# KernelConfig.cpu_conv's values, in the extension's order (csrc/common/kernel_config.h).
CPU_CONV_ROUTES = ("auto", "aten", "gemm", "stream", "fp32")
# The fields that take one of a few values.
_CHOICES = {"cpu_conv": CPU_CONV_ROUTES}


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """What the ops may use. The defaults are the measured best; the switches exist to
    measure what each feature buys (`with kernel_config(clusters=False): ...`)."""

    # batch x length from which a conv takes the GEMM route instead of streaming its weights.
    # At 32 positions the GEMM route was 1.3-3.2x faster on the U-Nets' large layers (batch 8,
    # length 4) and streaming up to 1.4x faster on small ones (batch 2, length 16); below 32
    # streaming won everywhere against im2col's GEMM.
    gemm_min_positions: int = 32
    # ... and below it, from gemm_min_work_positions on, a conv whose multiply-adds (weight
    # elements x batch x length) reach gemm_min_work. At 16 positions the streaming kernels are
    # compute-bound on wide layers (fp32, LeRobot's U-Net at horizon 64: 77-109 µs per
    # 2048->2048 k5 conv, 28 µs of weight reads). Streaming against im2col + GEMM, fp32 at 16
    # positions (bench_conv_blocks.py --sweep-paths): 1024->2048 (168M) 57.3 / 41.9 µs,
    # 2048->2048 (335M) 91.1 / 66.7, but 4096->1024 (335M) 83.6 / 87.7; at 84M (1024->1024,
    # 2048->512) streaming was as fast or faster (26.3 / 35.9). With 2^27 LeRobot's default
    # action at horizon 64, batch 1, DDPM-100 took 117.0 against 137.5 ms in fp32. Once fp32
    # GEMMs were cut into slices (fp32_gemm_max_splits), 2^26 took those 84M convs too: H100,
    # fp32 ms, 2^26 / 2^27 / 2^26, batch 1 horizon 32 80.27 / 81.64 / 80.59, horizon 64
    # 98.55 / 100.50 / 98.87; batch 2 within 0.2%; the horizon-16 U-Nets' routes unchanged.
    # Once the fp32 narrow GEMM launched as its im2col started (under PDL), 2^25 took the 42-50M
    # convs (512->1024 k5, the 1024-channel k3 downsampling) as well: ms, 2^26 / 2^25 / 2^24 /
    # 2^26 / 2^25, fp32 horizon 32 72.71 / 70.77 / 75.13 / 72.70 / 70.85, horizon 64 75.93 /
    # 75.15 / 75.44 / 75.97 / 75.18; bf16 horizon 32 43.90 / 44.05 / 43.60 / 43.84 / 44.11,
    # horizon 64 42.90 / 42.64 / 42.92 / 42.99 / 42.71; horizons 16 and 128 and lowdim and
    # image at batch 2 within 0.5% in both.
    gemm_min_work: int = 1 << 25
    gemm_min_work_positions: int = 16
    # ... and, where the ops launch without Hopper's clusters and programmatic dependent
    # launch (GPUs before Hopper, or both switched off), half-precision convs from this many
    # positions: the streaming kernels there are split-K with a finishing block, and lose to
    # cuBLAS's tensor cores sooner. H100, both off, batch 1, horizon 16, DDPM-100, ms off / on
    # (scripts/dev/portable_half_routes.py; green contexts): whole GPU, bf16 lowdim 33.28 /
    # 30.83, image 60.61 / 56.05, fp16 lowdim 34.99 / 31.90, image 63.43 / 57.22; 48 SMs bf16
    # lowdim 37.84 / 37.04, image 90.33 / 81.71; 16 SMs bf16 lowdim 59.74 / 59.98 (the one
    # loss), image 184.02 / 165.07, fp16 lowdim 64.21 / 63.30. From 16 positions it gained
    # less (whole GPU, bf16: lowdim 32.84, image 58.98), from 1 lowdim lost (36.76), and fp32
    # lost from 16 on (lowdim 37.91 against 35.04): its GEMMs are SIMT. Once the split-K
    # finishing block held its tile (d7c36a2), off / 8 / off / 8: whole GPU bf16 lowdim 30.28 /
    # 29.07 / 30.37 / 29.05, image 53.77 / 52.43 / 53.67 / 52.27; 48 SMs lowdim 35.75 / 35.69,
    # image 83.65 / 78.11; from 16 again less (whole GPU lowdim 30.37, image 53.08).
    portable_half_gemm_min_positions: int = 8
    # ... and a transposed conv (the U-Nets' upsampling, C -> C, k4, stride 2) from
    # gemm_min_work_positions input positions on where its weight elements x positions reach
    # this. At 16 positions the streaming kernel took 4x as long as at 8 from 512 channels on
    # (scripts/dev/resample_routes.py, H200, streaming / GEMM µs: 512 fp32 26.6 / 14.5, bf16
    # 28.2 / 9.0; 1024 fp32 33.0 / 21.5, bf16 33.9 / 11.0), while at 256 channels (4.2M)
    # streaming was as fast or faster (6.8 / 12.5 fp32, 8.2 / 8.0 bf16).
    transposed_gemm_min_work: int = 1 << 24
    # On the GEMM route, a residual block's 1x1 shortcut GEMM runs on a side stream beside the
    # first conv's GEMM. In half precision, and in fp32 below 256 positions, that took 0.9-12 µs
    # off 25 of the 30 U-Net blocks measured, left 4 within 0.2 µs and lengthened one by
    # 2.5 µs; from 256 positions on, fp32's SIMT GEMMs fill the GPU, and it lengthened blocks
    # by up to 8 µs about as often as it shortened them.
    side_stream: bool = True
    side_stream_fp32_max_positions: int = 256
    # fp32 convs on the GEMM route (im2col form): the most slices of the reduction their cuBLAS
    # GEMM is cut into where it is a few tiles (gemm_route.h's gemm_splits; 1: never). H100,
    # DDPM-100, fp32 ms per action (scripts/benchmark.py --ours-only), 16 / 1 / 16: LeRobot's
    # U-Net at batch 1, horizon 32 81.57 / 83.06 / 81.25, 64 102.25 / 115.38 / 101.94, 128
    # 109.48 / 122.01 / 109.49; at batch 8, horizon 16: lowdim 58.15 / 66.89 / 58.58, image
    # 109.04 / 117.69 / 109.05, LeRobot's 108.84 / 117.53 / 109.01; batch 64 unchanged (no
    # split). 32 / 16 / 32 at batch 1: horizon 64 100.76 / 102.22 / 100.88, 128 108.35 /
    # 109.60 / 108.59. 8 slices also where tiles x 8 fill the SMs at most four times (33-66
    # tiles; batch 1 unchanged), new / old / new: LeRobot's batch 8 horizon 64 222.46 / 229.45 /
    # 222.59, 128 387.67 / 393.85 / 387.57; batch 64 lowdim 133.92 / 139.60 / 133.22, image
    # 374.08 / 378.70 / 374.37; batch 8 at horizons 16 and 32 within 0.5%. Up to 32 slices
    # where they fill the SMs four times (not twice) lost at batch 1: horizon 64 101.51 /
    # 99.14 / 101.58, 128 113.91 / 108.99 / 114.17.
    fp32_gemm_max_splits: int = 32
    # fp32 convs on the GEMM route (im2col form) over up to 32 positions (a batch-1 layer of a
    # long horizon, a deep layer of a small batch): the package's own GEMM
    # (csrc/conv1d/cuda/narrow_gemm.cu), which streams the weights through a shared-memory
    # ring, instead of cuBLAS's SIMT SGEMM cut into slices.
    # H100, µs per fp32 conv1d_gn_mish of LeRobot's U-Net at batch 1 (im2col, GEMM, epilogue),
    # narrow / cuBLAS / narrow (scripts/dev/profile_gemm_route.py --narrow): 2048->2048 k5 52.0
    # / 60.2 / 51.9, 4096->1024 51.4 / 62.4 / 50.9, 1024->1024 20.4 / 25.1 / 20.3 (horizon
    # 64), 2048->512 21.8 / 32.1 / 21.9 (horizon 32). DDPM-100 fp32 ms, LeRobot's U-Net at
    # batch 1: horizon 64 86.40 / 95.17 / 86.11, 32 77.11 / 79.62 / 76.78. Over 17-32
    # positions a block holds 32 (2^23 weight elements at most, and not beside a cuBLAS GEMM;
    # csrc/conv1d/cuda/gemm_route.cpp): DDPM-100 fp32 ms, new / 16 at most / new, LeRobot's
    # U-Net at batch 1, horizon 32 72.68 / 74.36 / 72.91, 64 80.45 / 82.03 / 80.24, 128 101.78
    # / 102.04 / 101.98; batch 2 lowdim 30.65 / 31.45 / 30.54, image 77.52 / 78.28 / 77.49;
    # batch 8 lowdim 54.76 / 55.09 / 54.52, image 103.83 / 103.62 / 103.57.
    narrow_gemm: bool = True
    # Hopper: streaming convs as thread-block clusters (distributed shared memory) instead of
    # split-K blocks and a finishing block; 4-7% per lowdim/image action at batch 1. Also the
    # GEMM route's sliced GroupNorm epilogue (below): a group's slices one cluster, their
    # moments exchanged in shared memory, not through global memory.
    clusters: bool = True
    # Hopper: programmatic dependent launch, each kernel starting while the previous one ends
    # and requesting its weights early; 0.3-3 µs per launch at batch 1.
    pdl: bool = True
    # The GEMM route's GroupNorm epilogue over groups larger than a block holds (LeRobot's
    # U-Net at horizon 64: 4096 elements), cut into slices over the SMs, in one cooperative
    # launch (every block resident; a slice's block waits for its group's other slices'
    # moments) instead of two (moments stored, then read back to normalise). Any GPU since
    # Pascal, where clusters are not taken; where the op has no counters, or the blocks are
    # not resident at once, two.
    cooperative_group_norm: bool = True
    # Streamed weights (each read once per forward) loaded evict-first in L2, keeping the
    # activations, partial sums and code there: 1-4 ms per DDPM-100 action at batch 1.
    weights_evict_first: bool = True
    # Taps-major weights (half precision, GroupNorm convs): from this many input channels. At
    # 2 input channels (the U-Nets' first conv) the GEMM over C_in alone was slower (batch 64,
    # bf16: 6.0 against 3.3 µs); from 256 on it was faster for 32 of 36 convs, by up to 43%.
    taps_major_min_in_channels: int = 64
    # ... and below gemm_min_positions, from 8 positions on at batch 2+ (16 at batch 1; 8 with
    # taps_major_min_work_batch_1) where C_in x C_out x positions reaches this: layers past it
    # ran faster so than on the streaming kernels (bf16, batch 4, length 4: lowdim 1024->1024
    # 13.1 against 30.9 µs, image 2048->2048 27.5 against 91.9), those below it slower. At batch 1 that is a long
    # horizon's deep layers (LeRobot's 2048 channels at length 16 of horizon 64); the
    # horizon-16 U-Nets' batch-1 layers stay below it and stream.
    taps_major_min_work: int = 1 << 23
    # ... and at batch 1 also from 8 positions where C_in x C_out x positions reaches this:
    # LeRobot's 1024- to 4096-channel layers at length 8 of horizon 32 (2048->2048 over 8
    # positions in bf16, --sweep-paths at batch 2: streaming 40.4, taps-major GEMM 27.3 µs),
    # whose default action at horizon 32, batch 1, DDPM-100 took 57.72 / 70.74 / 57.59 ms in
    # bf16 (new / old / new). The horizon-16 U-Nets' batch-1 layers at length 8 (8.4M at
    # most) stream.
    taps_major_min_work_batch_1: int = 1 << 24
    # CPU: how the ops run a conv. "auto": the first call of each shape, dtype and thread
    # count times ATen's conv (oneDNN), im2col + one GEMM and, over up to 32 positions in fp32
    # or bf16, im2col + the package's weight-streaming GEMM (a transposed conv: ATen's or the
    # streaming GEMM), on its own inputs, and keeps the fastest for the process
    # (csrc/conv1d/cpu/conv_route_cpu.h: no rule held across shapes and CPUs); a half-precision
    # conv each of them also on fp32 copies of its operands, which wins on CPUs without
    # half-precision arithmetic. "aten" / "gemm" / "stream" fix the route in the input's dtype,
    # "fp32" as ATen's conv of fp32 copies (reproducible bits, or a measurement).
    cpu_conv: str = "auto"
    # CUDA: the SMs the launch plans fill (None: the device's). A process given fewer SMs than
    # the device has (a CUDA green context, an MPS client's share) sets it; planned for the
    # whole GPU, its split-K waves would queue behind one another. Also measures a smaller GPU
    # on a large one (scripts/benchmark_sm_budget.py). Larger than the device's: the device's.
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


def current_kernel_config() -> KernelConfig:
    """The calling thread's kernel configuration (DEFAULT outside `kernel_config`)."""
    return getattr(_thread, "config", None) or DEFAULT


def _push(extension, config: Optional[KernelConfig], process_default: bool = False) -> None:
    """Hands `config` to the extension (None: drop the thread's override)."""
    if config is None:
        extension.clear_thread_kernel_config()
        return
    extension.set_kernel_config(config.gemm_min_positions, config.gemm_min_work, config.gemm_min_work_positions,
                                config.transposed_gemm_min_work, config.portable_half_gemm_min_positions,
                                config.side_stream_fp32_max_positions, config.fp32_gemm_max_splits,
                                config.narrow_gemm, config.side_stream, config.clusters, config.pdl,
                                config.cooperative_group_norm, config.weights_evict_first,
                                CPU_CONV_ROUTES.index(config.cpu_conv), config.sm_count or 0, process_default)


def install_default(extension) -> None:
    """Sets the extension's process-wide default (the package's loader calls this once)."""
    _push(extension, DEFAULT, process_default=True)


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
    from . import ops

    previous = getattr(_thread, "config", None)
    _thread.config = new
    _push(ops._C, new)
    try:
        yield new
    finally:
        _thread.config = previous
        _push(ops._C, previous)


# ---------------------------------------------------------------------------------------
# The route rules. The CUDA ops apply gemm_min_positions and the side stream themselves
# (csrc/conv1d/cuda/gemm_route.h); the model asks these for the weights' layout and for
# whole-block ops. Each rule is a function of the conv and the input's batch, length and
# dtype, so that explain() answers for shapes nothing has run at.

def _work(conv: nn.Module, positions: int) -> int:
    """A conv's multiply-adds over `positions`: its weight's elements times the positions."""
    return conv.in_channels * conv.out_channels * conv.kernel_size[0] * positions


def _min_work(conv: nn.Module, config: KernelConfig) -> Tuple[str, int]:
    """The work threshold below gemm_min_positions that applies to conv: (its name, value)."""
    if isinstance(conv, nn.ConvTranspose1d):
        return "transposed_gemm_min_work", config.transposed_gemm_min_work
    return "gemm_min_work", config.gemm_min_work


def portable_launches(config: Optional[KernelConfig] = None, device: Optional[torch.device] = None) -> bool:
    """Whether the CUDA ops launch without Hopper's clusters and programmatic dependent launch:
    `device` (default: the current CUDA device; the ops ask their input's) is older than
    Hopper, the loaded library's kernels were built without Hopper code (an arch list without
    9.0), or `config` (default: the calling thread's) turns both off. Without a GPU here, as
    on Hopper."""
    config = config or current_kernel_config()
    if not (config.clusters or config.pdl):
        return True
    if not torch.cuda.is_available():
        return False
    if torch.cuda.get_device_capability(device)[0] < 9:
        return True
    index = torch.device(device).index if device is not None else None
    return not _library_has_hopper_code(torch.cuda.current_device() if index is None else index)


@functools.lru_cache(maxsize=None)
def _library_has_hopper_code(index: int) -> bool:
    """Whether the loaded library's kernels carry Hopper code for CUDA device `index`
    (csrc/common/cuda/hopper_code.cu); True where that cannot be asked: no such device here,
    or no CUDA build. Asked once a device: the model asks at every eager forward."""
    if index >= torch.cuda.device_count():
        return True
    from . import ops  # loads the library, as any op on this GPU would

    return not ops.built_with_cuda() or bool(ops._C.hopper_launches(index))


def _gemm_by_size(conv: nn.Module, positions: int, dtype: torch.dtype, config: KernelConfig,
                  device: Optional[torch.device]) -> bool:
    """The ops' own rule for a contiguous weight (csrc/conv1d/cuda/gemm_route.h)."""
    return positions >= config.gemm_min_positions or (
        positions >= config.gemm_min_work_positions and _work(conv, positions) >= _min_work(conv, config)[1]) or (
        dtype != torch.float32 and positions >= config.portable_half_gemm_min_positions
        and portable_launches(config, device))


# gemm_splits' constants (csrc/conv1d/cuda/gemm_route.cpp, which says why).
_SPLIT_TILE, _SPLIT_MIN_DEPTH, _SPLIT_FEWEST = (128, 32), 128, 8


def _gemm_splits(conv: nn.Module, positions: int, dtype: torch.dtype, device: torch.device,
                 config: KernelConfig) -> int:
    """The slices of its reduction an im2col GEMM of `conv` is cut into (gemm_route.h's
    gemm_splits; 1: whole): fp32, no transposed conv, on a GPU whose SMs are known here."""
    if dtype != torch.float32 or isinstance(conv, nn.ConvTranspose1d) or not torch.cuda.is_available():
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    sms = min(sms, config.sm_count) if config.sm_count else sms
    tiles = -(-conv.out_channels // _SPLIT_TILE[0]) * -(-positions // _SPLIT_TILE[1])
    most = 2 * sms // tiles
    if most < _SPLIT_FEWEST and _SPLIT_FEWEST * tiles <= 4 * sms:
        most = _SPLIT_FEWEST
    most, depth, splits = min(most, config.fp32_gemm_max_splits), conv.in_channels * conv.kernel_size[0], 1
    while 2 * splits <= most and depth % (2 * splits) == 0 and depth // (2 * splits) >= _SPLIT_MIN_DEPTH:
        splits *= 2
    return splits if splits >= _SPLIT_FEWEST else 1


# narrow_gemm's rule (csrc/conv1d/cuda/gemm_route.cpp's narrow_gemm_splits): positions, weight
# rows per block, reduction elements per stage of its ring; a block holds 16 positions, or 32
# where the GEMM has more than 16, and then only up to _NARROW_WIDE_MAX_WEIGHTS weight elements
# and not beside a cuBLAS GEMM on another stream (gemm_route.cpp has the measurements).
_NARROW_MAX_POSITIONS, _NARROW_ROWS, _NARROW_CHUNK, _NARROW_WIDE_MAX_WEIGHTS = 32, 32, 128, 1 << 23


def _narrow_stage_bytes(positions: int) -> int:
    """Shared-memory bytes per stage of narrow_gemm.cu's ring (its stage_bytes)."""
    return _NARROW_CHUNK * ((16 if positions <= 16 else _NARROW_MAX_POSITIONS) + 4 + _NARROW_ROWS) * 4


def _narrow_gemm_splits(conv: nn.Module, positions: int, dtype: torch.dtype, device: torch.device,
                        config: KernelConfig, beside_cublas: bool = False) -> int:
    """The slices of its reduction narrow_gemm.cu cuts an im2col GEMM of `conv` into, or 0
    where cuBLAS runs it (gemm_route.h's narrow_gemm_splits): fp32, no transposed conv, up to
    32 positions (over 16, up to 2^23 weight elements and not `beside_cublas`: running
    concurrently with a cuBLAS GEMM on another stream), on a GPU known here; the tensors are
    taken as aligned, as the model's are."""
    if (dtype != torch.float32 or isinstance(conv, nn.ConvTranspose1d) or not config.narrow_gemm
            or positions > _NARROW_MAX_POSITIONS or not torch.cuda.is_available()):
        return 0
    reduction = conv.in_channels * conv.kernel_size[0]
    if positions > 16 and (beside_cublas or conv.out_channels * reduction > _NARROW_WIDE_MAX_WEIGHTS):
        return 0
    props = torch.cuda.get_device_properties(device)
    if (props.major < 8 or reduction % 4 or positions % 4
            or props.shared_memory_per_block_optin
            < (3 if positions <= 16 else 4) * _narrow_stage_bytes(positions)):
        return 0
    sms = min(props.multi_processor_count, config.sm_count) if config.sm_count else props.multi_processor_count
    row_tiles, chunks = -(-conv.out_channels // _NARROW_ROWS), -(-reduction // _NARROW_CHUNK)
    wanted = min(max(sms // row_tiles, 1), chunks)
    return -(-chunks // -(-chunks // wanted))


def _taps_major_pays(conv: nn.Conv1d, batch: int, length: int, dtype: torch.dtype, config: KernelConfig,
                     device: Optional[torch.device]) -> bool:
    if (dtype not in (torch.float16, torch.bfloat16) or conv.kernel_size[0] == 1
            or conv.in_channels < config.taps_major_min_in_channels):
        return False
    positions = batch * length
    work = conv.in_channels * conv.out_channels * positions
    if batch == 1 and positions >= 8 and work >= config.taps_major_min_work_batch_1:
        return True
    return _gemm_by_size(conv, positions, dtype, config, device) or (
        positions >= (8 if batch >= 2 else 16) and work >= config.taps_major_min_work)


def _block_op_pays(first: nn.Conv1d, second: nn.Conv1d, batch: int, length: int, dtype: torch.dtype,
                   config: KernelConfig, device: Optional[torch.device]) -> bool:
    return all(_gemm_by_size(conv, batch * length, dtype, config, device)
               or _taps_major_pays(conv, batch, length, dtype, config, device) for conv in (first, second))


def on_gemm_route(conv: nn.Conv1d, x: torch.Tensor) -> bool:
    """Whether `conv` (contiguous weight, keeping x's length) over x takes the CUDA ops' im2col +
    cuBLAS route."""
    return x.is_cuda and _gemm_by_size(conv, x.shape[0] * x.shape[2], x.dtype, current_kernel_config(), x.device)


def taps_major_pays(conv: nn.Conv1d, x: torch.Tensor) -> bool:
    """Whether conv (stride 1, keeping x's length) is faster over x with a taps-major weight
    on the GEMM route: half precision, a kernel wider than 1, enough input channels, and the
    GEMM route or, below it, enough work (8+ positions at batch 2+; at batch 1 16+, or 8+ with
    taps_major_min_work_batch_1). In fp32, cuBLAS's GEMMs over C_in (SIMT, no tensor cores)
    made steps 4-9% slower at batch 64 and the image U-Net's at batch 8."""
    return x.is_cuda and _taps_major_pays(conv, x.shape[0], x.shape[2], conv.weight.dtype, current_kernel_config(),
                                          x.device)


def block_op_pays(first: nn.Conv1d, second: nn.Conv1d, x: torch.Tensor) -> bool:
    """Whether a residual block with these two GroupNorm convs, over x, runs as one
    dpa::residual_block: on CUDA where its convs take the GEMM route (from
    gemm_min_positions, or below it where both take taps-major weights), whose launches it
    saves (4-5% per step at batch 8 and 64 in half precision). On the streaming route each
    conv is one launch already, and the per-conv ops keep per-layer profiling as it is."""
    return x.is_cuda and _block_op_pays(first, second, x.shape[0], x.shape[2], first.weight.dtype,
                                        current_kernel_config(), x.device)


# ---------------------------------------------------------------------------------------
# Explaining a forward.

# The most elements of a GroupNorm group that residual_block's fused GEMM-route epilogue holds
# in registers (csrc/conv1d/cuda/conv_params.h, kHeldPerThread x kThreads); past it the
# epilogue is cut into slices, which write the second conv's GEMM operand only where that
# conv's taps are GEMM rows (a taps-major weight) and the batch is 2+ (conv1d_cuda.cpp says
# why); otherwise the op runs its convs one by one.
_BLOCK_OP_MAX_GROUP = 1024


class ConvRoute(NamedTuple):
    """One conv of a forward: its module name, shapes and route, and why."""
    module: str
    shape: str
    route: str
    why: str


def _conv_route(name: str, conv: nn.Module, shape: torch.Size, device: torch.device, dtype: torch.dtype,
                block: Optional[nn.Module], group_norm: bool, config: KernelConfig) -> ConvRoute:
    """The route of `conv` over an input of `shape`: `block` is its residual block, if any;
    `group_norm` whether it is a Conv1dBlock's conv (the model passes only those taps-major)."""
    transposed = isinstance(conv, nn.ConvTranspose1d)
    batch, channels, length = shape
    described = (f"{'ConvTranspose1d' if transposed else 'Conv1d'} {channels}->{conv.out_channels} "
                 f"k{conv.kernel_size[0]}, x [{batch}, {channels}, {length}]")
    if device.type != "cuda":
        # The streaming GEMM has fp32 and bf16; "auto" times it up to 32 positions (input
        # positions for a transposed conv), conv_route_cpu.cpp's few_positions(), and a
        # half-precision conv's routes also on fp32 copies of its operands.
        streams = dtype in (torch.float32, torch.bfloat16)
        half = dtype in (torch.float16, torch.bfloat16)
        operands = {"auto": ", in the input's dtype" + (" or on fp32 copies of its operands" if half else ""),
                    "fp32": " on fp32 copies of its operands" if half else ", in fp32"}.get(
                        config.cpu_conv, ", in the input's dtype")
        conv_name = "transposed conv" if transposed else "conv"
        if config.cpu_conv == "fp32":
            how = f"ATen's {conv_name} (cpu_conv 'fp32')"
        elif transposed:
            how = ("ATen's transposed conv or (up to 32 positions) the weight-streaming GEMM, "
                   "whichever was faster at this shape's first call (cpu_conv 'auto')"
                   if config.cpu_conv == "auto" else
                   "the weight-streaming GEMM (cpu_conv 'stream')" if config.cpu_conv == "stream" and streams else
                   f"ATen's transposed conv (cpu_conv '{config.cpu_conv}')")
        else:
            how = {"auto": "ATen's conv, one GEMM or (up to 32 positions) the weight-streaming GEMM, "
                           "whichever was fastest at this shape's first call (cpu_conv 'auto')",
                   "aten": "ATen's conv (cpu_conv 'aten')", "gemm": "im2col + one GEMM (cpu_conv 'gemm')",
                   "stream": "im2col + the weight-streaming GEMM (cpu_conv 'stream')" if streams
                             else "ATen's conv (cpu_conv 'stream' has no fp16)"}[config.cpu_conv]
        return ConvRoute(name, described, "CPU", how + operands + (", then the fused epilogue" if group_norm else ""))
    # The ops' GEMM N: output positions, or for a transposed conv input positions.
    kernel, stride, padding = conv.kernel_size[0], conv.stride[0], conv.padding[0]
    positions = batch * (length if transposed else (length + 2 * padding - kernel) // stride + 1)
    taps = group_norm and _taps_major_pays(conv, batch, length, dtype, config, device)
    sized = conv  # the conv whose size decides the route

    def sliced(gemm_conv: nn.Module, narrow: bool = True, beside_cublas: bool = False) -> str:
        """The GEMM's kernel where it is the package's (narrow_gemm), and its slices."""
        splits = _narrow_gemm_splits(gemm_conv, positions, dtype, device, config, beside_cublas) if narrow else 0
        if splits:
            return ", narrow GEMM" + (f", {splits} slices" if splits > 1 else "")
        splits = _gemm_splits(gemm_conv, positions, dtype, device, config)
        return f", {splits} slices" if splits > 1 else ""

    paired = beside_cublas = False
    if block is not None:
        first, second = block.blocks[0].block[0], block.blocks[1].block[0]
        # A block with a shortcut runs its first conv and the shortcut as one
        # conv1d_gn_mish_shortcut, on the first conv's route, with the contiguous weight.
        paired = isinstance(block.residual_conv, nn.Conv1d) and conv in (first, block.residual_conv)
        # A paired shortcut's GEMM runs beside the first conv's where on a side stream.
        beside_cublas = (paired and conv is block.residual_conv and _shortcut_beside(block, dtype, positions, config)
                         and not _narrow_gemm_splits(first, positions, dtype, device, config))
        if _block_op_pays(first, second, batch, length, dtype, config, device):
            group = first.out_channels // block.blocks[0].block[1].num_groups * length
            layout = ", taps-major" if taps else ""
            if group <= _BLOCK_OP_MAX_GROUP or (batch > 1 and _taps_major_pays(second, batch, length, dtype, config,
                                                                                device)):
                # The op's shortcut GEMM is cuBLAS's, never split, beside the first conv's
                # GEMM on a side stream where side_stream has it; its second conv's GEMM reads
                # its columns transposed, which the narrow GEMM does not.
                if not taps and conv is not block.residual_conv:
                    layout = sliced(conv, narrow=conv is not second,
                                    beside_cublas=conv is first and _shortcut_beside(block, dtype, positions, config))
                return ConvRoute(name, described, "GEMM, block op" + layout,
                                 "its residual block runs as one op on the GEMM route")
            layout = layout or sliced(conv, beside_cublas=beside_cublas)
            # The shortcut runs on its first conv's route.
            why = ("as its block's first conv, "
                   + _gemm_reason(first, positions, dtype, _taps_major_pays(first, batch, length, dtype, config, device),
                                  config, device)
                   if conv is block.residual_conv else _gemm_reason(conv, positions, dtype, taps, config, device))
            return ConvRoute(name, described, "GEMM" + layout,
                             f"{why}; its residual block's op runs per conv: a GroupNorm group of {group} "
                             f"elements is more than the fused epilogue holds ({_BLOCK_OP_MAX_GROUP}), at batch 1 "
                             "or with a second conv whose weight is not taps-major")
        taps = taps and not paired
        sized = first if paired else conv
    why = _gemm_reason(sized, positions, dtype, taps, config, device)
    if why is not None:
        layout = ", taps-major" if taps else sliced(conv, beside_cublas=beside_cublas)
        return ConvRoute(name, described, "GEMM" + layout,
                         why + ("; with the block's first conv, in one op" if paired else ""))
    plan = "Hopper: clusters where they fit, else split-K" if config.clusters else "split-K (clusters off)"
    below = ("multiply-adds {} < {} {}".format(_work(sized, positions), *_min_work(sized, config))
             if positions >= config.gemm_min_work_positions
             else f"< gemm_min_work_positions {config.gemm_min_work_positions}")
    return ConvRoute(name, described, "streaming" + (", paired" if paired else ""),
                     f"batch x length {positions} < gemm_min_positions {config.gemm_min_positions}, {below}; {plan}"
                     + ("; the block's first conv and shortcut in one launch" if paired else ""))


def _shortcut_beside(block: nn.Module, dtype: torch.dtype, positions: int, config: KernelConfig) -> bool:
    """Whether the block's 1x1 shortcut GEMM runs on a side stream, beside its first conv's
    (csrc/conv1d/cuda/gemm_route.cpp's shortcut_on_side_stream)."""
    return (isinstance(block.residual_conv, nn.Conv1d) and config.side_stream
            and (dtype != torch.float32 or positions < config.side_stream_fp32_max_positions))


def _gemm_reason(conv: nn.Module, positions: int, dtype: torch.dtype, taps: bool,
                 config: KernelConfig, device: Optional[torch.device]) -> Optional[str]:
    """Why `conv` over `positions` takes the GEMM route (None: it streams)."""
    if positions >= config.gemm_min_positions:
        return f"batch x length {positions} >= gemm_min_positions {config.gemm_min_positions}"
    if (positions >= config.gemm_min_work_positions
            and _work(conv, positions) >= _min_work(conv, config)[1]):
        return (f"batch x length {positions} >= gemm_min_work_positions {config.gemm_min_work_positions} and "
                "multiply-adds {} >= {} {}".format(_work(conv, positions), *_min_work(conv, config)))
    if _gemm_by_size(conv, positions, dtype, config, device):
        return (f"half precision without Hopper's clusters and programmatic dependent launch, batch x length "
                f"{positions} >= portable_half_gemm_min_positions {config.portable_half_gemm_min_positions}")
    if taps:
        return (f"half precision, 8+ positions at batch 2+ (16+ at batch 1) and C_in x C_out x positions "
                f">= {config.taps_major_min_work} (at batch 1 from 8 positions: "
                f">= {config.taps_major_min_work_batch_1}): a taps-major weight")
    return None


def explain(unet, batch: int, horizon: int, dtype: Optional[torch.dtype] = None,
            device: Optional[str] = None) -> List[ConvRoute]:
    """Every conv of one forward of `unet` (this package's ConditionalUnet1D) at this batch and
    horizon, in call order, with the route it takes on `device` in `dtype` (default: the
    model's) under the calling thread's kernel configuration. One plain forward of the model,
    where it is, finds the shapes."""
    from .model import ConditionalResidualBlock1D, ConditionalUnet1D, Conv1dBlock, conv1d_block_shapes

    if not isinstance(unet, ConditionalUnet1D):
        raise TypeError(f"unet must be diffusion_policy_accelerated.ConditionalUnet1D, got {type(unet).__name__}")
    parameter = next(unet.parameters())
    dtype = parameter.dtype if dtype is None else dtype
    device = parameter.device if device is None else torch.device(device)
    names = {module: name for name, module in unet.named_modules()}
    group_norm_convs = {m.block[0] for m in unet.modules() if isinstance(m, Conv1dBlock)}
    owners = {}
    for block in unet.modules():
        if isinstance(block, ConditionalResidualBlock1D):
            owners.update({conv_block.block[0]: block for conv_block in block.blocks})
            if isinstance(block.residual_conv, nn.Conv1d):
                owners[block.residual_conv] = block
    calls = []
    hooks = [module.register_forward_hook(lambda m, args, out: calls.append((m, args[0].shape)))
             for module in unet.modules() if isinstance(module, (nn.Conv1d, nn.ConvTranspose1d))]
    try:
        conv1d_block_shapes(unet, horizon, batch)  # a plain forward, which fires every hook
    finally:
        for hook in hooks:
            hook.remove()
    config = current_kernel_config()
    return [_conv_route(names[conv], conv, shape, device, dtype, owners.get(conv), conv in group_norm_convs, config)
            for conv, shape in calls]


def main(argv=None) -> None:
    from .configs import HORIZON, UNETS
    from .model import ConditionalUnet1D

    parser = argparse.ArgumentParser(description="Which route each conv of a U-Net forward takes, and why.")
    parser.add_argument("--unet", default="lowdim", choices=sorted(UNETS))
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--horizon", type=int, default=HORIZON)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args(argv)
    with torch.device("meta"):
        unet = ConditionalUnet1D(**UNETS[args.unet])
    for batch in args.batch:
        print(f"{args.unet} U-Net, batch {batch}, horizon {args.horizon}, {args.dtype} on {args.device}:")
        for r in explain(unet, batch, args.horizon, getattr(torch, args.dtype), args.device):
            print(f"  {r.module:34s} {r.shape:42s} {r.route:30s} {r.why}")


if __name__ == "__main__":
    main()
