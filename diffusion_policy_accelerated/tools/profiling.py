"""Where the time of an action goes, and how far each op is from its roofline.

`scripts/profile_action.py` drives this for Diffusion Policy's loop; the pieces take any model:

- `costs.op_cost`: FLOP and byte formulas per op, applied to the input shapes a
  `torch.profiler` trace records;
- `measure_peaks`: copy bandwidth and matmul rate measured on the device itself: the
  roofline's ceilings;
- `Phases` / `time_breakdown`: synchronised wall time of the named parts of an action;
- `module_ranges`: a profiler range around every module call, named after the module
  (`down.0.res0.block0` in the U-Net), so that every op and kernel has a layer;
- `parse_trace` / `analyse`: an exported Chrome trace turned into the top ops/kernels
  table, the GPU time split and the per-op roofline table. On a GPU the time is the
  kernels' (each matched through its launch to the op and the module range around it); on
  a CPU it is the ops' own: the same functions, fed different events.
"""
import contextlib
import cProfile
import csv
import io
import itertools
import json
import math
import pstats
import re
import shutil
import statistics
import subprocess
import time
import warnings
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .costs import Cost, OpInputs, dtype_name, op_cost

# --- peaks ------------------------------------------------------------------------------

def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds_per_call(fn: Callable[[], object], device: torch.device, reps: int = 10, rounds: int = 5) -> float:
    """The fastest of `rounds` rounds' mean time per call: these time ceilings, and on a shared
    CPU a single round's mean mixed in other load (one 2-core VM's fp32 matmul rate read 100 to
    174 GFLOP/s from run to run, under what its convs reached)."""
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(rounds):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) * 1e-3
        else:
            start_s = time.perf_counter()
            for _ in range(reps):
                fn()
            seconds = time.perf_counter() - start_s
        best = min(best, seconds / reps)
    return best


def copy_bandwidth_gbs(nbytes: int = 2 << 30, device="cuda") -> float:
    """Device-to-device copy rate, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / _seconds_per_call(lambda: dst.copy_(src), torch.device(device)) / 1e9


def read_bandwidth_gbs(nbytes: int = 1 << 30, device="cpu") -> float:
    """The rate of a sum over a buffer too large for the caches: bytes read alone. A batch-1
    forward only reads its weights; on a CPU a copy (read plus write-allocate) counts twice
    the bytes of that rate (2-core AMD EPYC: copy 55-61 GB/s, sum 31), so a floor from the
    copy rate would be half what the memory allows."""
    src = torch.ones(nbytes // 4, device=device)
    return nbytes / _seconds_per_call(lambda: src.sum(), torch.device(device)) / 1e9


def matmul_tflops(n: int, dtype: torch.dtype, device="cuda") -> float:
    """Dense [n, n] @ [n, n] rate, TF32 off (the fp32 rate is that of true fp32)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        seconds = _seconds_per_call(lambda: torch.mm(a, b), torch.device(device))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    return 2 * n ** 3 / seconds / 1e12


@dataclass
class Peaks:
    """The roofline's ceilings, measured: copy bandwidth and dense matmul rate per dtype."""
    bandwidth_gbs: float
    tflops: Dict[torch.dtype, float]

    def flops_per_s(self, dtype: torch.dtype) -> float:
        # fp16 runs on the same tensor cores as bf16; anything unmeasured (a float64 scalar)
        # is charged at the fp32 rate.
        key = torch.bfloat16 if dtype == torch.float16 else dtype
        return self.tflops.get(key, self.tflops[torch.float32]) * 1e12

    def describe(self) -> str:
        rates = ", ".join(f"{dtype_name(d)} matmul {v:.3g} TFLOP/s" for d, v in self.tflops.items())
        return f"copy bandwidth {self.bandwidth_gbs:.0f} GB/s, {rates}"


def measure_peaks(device) -> Peaks:
    device = torch.device(device)
    # On a GPU large enough that caches and launch overhead do not count; on a CPU a rough
    # estimate in well under a second.
    nbytes, n = (2 << 30, 8192) if device.type == "cuda" else (64 << 20, 512)
    return Peaks(copy_bandwidth_gbs(nbytes, device),
                 {dtype: matmul_tflops(n, dtype, device) for dtype in (torch.float32, torch.bfloat16)})


def median_ms(fn: Callable[[], object], warmup: int = 2, reps: int = 7) -> float:
    """Median CUDA-event time of fn() in ms, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def wall_ms(fn: Callable[[], object], warmup: int = 3, reps: int = 20, device="cuda") -> float:
    """Median wall-clock ms of fn(), the device synchronised after each call: what a caller
    waits for, host work included."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def weight_copies(weight_bytes: int) -> int:
    """How many copies of a weight overflow the L2 cache (160 MB of them, 2 to 64)."""
    return max(2, min(64, -(-160_000_000 // weight_bytes)))


def graph_time_ms(fn: Callable[[int], object], copies: int, replays: int = 30) -> float:
    """Median time of one call fn(i) in ms: a CUDA graph of `copies` calls (i = 0.., one per
    weight copy, so that each call reads its weights from HBM as in a forward), replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(copies):  # warm-up outside the graph (cuDNN picks its algorithm here)
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            fn(i)
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / copies)
    return statistics.median(times)


# --- coarse breakdown -------------------------------------------------------------------

class Phases:
    """`with phases(name):` marks a part of an action: a profiler range, and with `timed`
    its wall time, synchronised before and after so that the GPU work a part queues is
    charged to it and not to the part that next waits for the GPU."""

    def __init__(self, device, timed: bool = True):
        self.device = torch.device(device)
        self.timed = timed
        self.seconds: Dict[str, float] = defaultdict(float)
        self.calls: Counter = Counter()

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        with torch.profiler.record_function(name):
            if not self.timed:
                yield
                return
            synchronize(self.device)
            start = time.perf_counter()
            yield
            synchronize(self.device)
            self.seconds[name] += time.perf_counter() - start
            self.calls[name] += 1


def time_breakdown(action: Callable[[Phases], object], device, reps: int = 3) -> List[dict]:
    """Mean ms per action of each part `action(phases)` names, of everything else, and the total."""
    device = torch.device(device)
    phases = Phases(device)
    total = 0.0
    for _ in range(reps):
        synchronize(device)
        start = time.perf_counter()
        action(phases)
        synchronize(device)
        total += time.perf_counter() - start
    rows = [dict(part=name, ms=1e3 * s / reps, calls=phases.calls[name] / reps)
            for name, s in phases.seconds.items()]
    rows.append(dict(part="everything else", ms=1e3 * (total - sum(phases.seconds.values())) / reps,
                     calls=None))
    rows.append(dict(part="total (one action)", ms=1e3 * total / reps, calls=1))
    for row in rows:
        row["share"] = row["ms"] / rows[-1]["ms"]
        row["ms_per_call"] = row["ms"] / row["calls"] if row["calls"] else None
    return rows


# --- module ranges ----------------------------------------------------------------------

# ConditionalUnet1D's qualified module names, shortened to how one talks about the U-Net:
# down_modules.0.0.blocks.0 -> down.0.res0.block0, its conv -> down.0.res0.block0.conv, ...
_UNET_LAYER_NAMES = [
    (r"^down_modules\.(\d+)\.([01])(?=\.|$)", r"down.\1.res\2"),
    (r"^down_modules\.(\d+)\.2(?=\.|$)", r"down.\1.downsample"),
    (r"^up_modules\.(\d+)\.([01])(?=\.|$)", r"up.\1.res\2"),
    (r"^up_modules\.(\d+)\.2(?=\.|$)", r"up.\1.upsample"),
    (r"^mid_modules\.(\d+)", r"mid.res\1"),
    (r"^local_cond_encoder\.(\d+)", r"local.res\1"),
    (r"^diffusion_step_encoder", "step_encoder"),
    (r"^final_conv\.0", "final.block0"),
    (r"^final_conv\.1", "final.conv"),
    (r"^final_conv", "final"),
    (r"\.blocks\.(\d+)", r".block\1"),
    # Conv1dBlock's Sequential runs only on the unfused path.
    (r"(block\d)\.block\.0$", r"\1.conv"),
    (r"(block\d)\.block\.1$", r"\1.norm"),
    (r"(block\d)\.block\.2$", r"\1.mish"),
    (r"(block\d)\.block$", r"\1.unfused"),
    (r"\.cond_encoder", ".film"),
    (r"\.residual_conv", ".residual"),
]


def layer_names(model: nn.Module) -> Dict[nn.Module, str]:
    """Every submodule's range name: its qualified name in `model` (the root: its class
    name), in ConditionalUnet1D shortened as `down.0.res0.block0`."""
    from ..model.unet import ConditionalUnet1D

    rules = _UNET_LAYER_NAMES if isinstance(model, ConditionalUnet1D) else []
    names = {}
    for qualified, module in model.named_modules():
        name = qualified
        for pattern, replacement in rules:
            name = re.sub(pattern, replacement, name)
        names[module] = name or type(model).__name__
    return names


@contextlib.contextmanager
def module_ranges(model: nn.Module) -> Iterator[Dict[nn.Module, str]]:
    """While active, every module call of `model` is a profiler range named by `layer_names`."""
    names, handles = layer_names(model), []
    for module, name in names.items():
        # A stack, because a module may be called again before it returns (recursion).
        open_ranges: List[torch.profiler.record_function] = []

        def enter(module, args, name=name, open_ranges=open_ranges):
            open_ranges.append(torch.profiler.record_function(name).__enter__())

        def leave(module, args, output, open_ranges=open_ranges):
            open_ranges.pop().__exit__(None, None, None)

        handles.append(module.register_forward_pre_hook(enter))
        # always_call: an exception in forward must still close the range.
        handles.append(module.register_forward_hook(leave, always_call=True))
    try:
        yield names
    finally:
        for handle in handles:
            handle.remove()


def record_trace(fn: Callable[[], object], model: nn.Module, device, path) -> Tuple[dict, object]:
    """Runs `fn` under torch.profiler (CPU, and CUDA on a GPU) with shapes and module ranges,
    exports the Chrome trace to `path`; returns (the trace as loaded back, the profiler)."""
    device = torch.device(device)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with warnings.catch_warnings():
        # It warns that events are cleared between cycles; there is one cycle.
        warnings.filterwarnings("ignore", message=".*clears events at the end of each cycle")
        with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
            with module_ranges(model):
                fn()
            synchronize(device)
    prof.export_chrome_trace(str(path))
    with open(path) as f:
        return json.load(f), prof


# --- trace analysis ---------------------------------------------------------------------

_HOST_KINDS = {"cpu_op": "op", "user_annotation": "range", "cuda_runtime": "launch",
               "cuda_driver": "launch"}
_DEVICE_KINDS = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}


@dataclass(eq=False)
class Event:
    """One complete event of a trace; `parent` is the host event around it (for a device
    event: the runtime call that launched it)."""
    name: str
    kind: str  # op, range, launch, kernel, memcpy, memset
    ts: float  # microseconds
    dur: float
    inputs: Optional[OpInputs] = None
    cost: Optional[Cost] = None
    parent: Optional["Event"] = None

    def ancestors(self) -> Iterator["Event"]:
        event = self.parent
        while event is not None:
            yield event
            event = event.parent

    @property
    def on_device(self) -> bool:
        return self.kind in _DEVICE_KINDS.values()


def _nest(events: List[Event]) -> None:
    """Parents on one thread: the innermost event whose span holds the start."""
    stack: List[Event] = []
    for event in sorted(events, key=lambda e: (e.ts, -e.dur)):
        while stack and event.ts >= stack[-1].ts + stack[-1].dur:
            stack.pop()
        event.parent = stack[-1] if stack else None
        stack.append(event)


def parse_trace(trace: dict, default_dtype: torch.dtype = torch.float32) -> List[Event]:
    """The ops, ranges, launches, kernels, copies and memsets of a Chrome trace exported by
    torch.profiler, each linked to its parent."""
    events, threads, launches, device = [], defaultdict(list), {}, []
    for raw in trace["traceEvents"]:
        kind = _HOST_KINDS.get(raw.get("cat")) or _DEVICE_KINDS.get(raw.get("cat"))
        if raw.get("ph") != "X" or kind is None:
            continue
        args = raw.get("args", {})
        event = Event(raw["name"], kind, float(raw["ts"]), float(raw.get("dur", 0.0)))
        if kind == "op" and "Input Dims" in args:
            event.inputs = OpInputs(args["Input Dims"], args.get("Input type", []),
                                    args.get("Concrete Inputs", []), default_dtype)
            event.cost = op_cost(event.name, event.inputs)
        if event.on_device:
            device.append((event, args.get("correlation")))
        else:
            threads[(raw.get("pid"), raw.get("tid"))].append(event)
        if kind == "launch":
            launches[args.get("correlation")] = event
        events.append(event)
    for thread in threads.values():
        _nest(thread)
    for event, correlation in device:
        event.parent = launches.get(correlation)
    return events


def layer_of(event: Event) -> str:
    """The innermost range around the event (for a kernel: around its launch)."""
    return next((e.name for e in event.ancestors() if e.kind == "range"), "-")


def roofline_op(event: Event) -> Optional[Event]:
    """The outermost op with a formula that is, or holds, the event: conv1d rather than the
    convolution it calls, the fused op rather than its CPU kernel's internal calls."""
    found = None
    for e in itertools.chain([event], event.ancestors()):
        if e.kind == "op" and e.cost is not None:
            found = e
    return found


def outermost_ops(events: Sequence[Event]) -> List[Event]:
    return [e for e in events if e.kind == "op" and not any(a.kind == "op" for a in e.ancestors())]


def device_time_by_op(device_events: Sequence[Event]) -> Dict[Event, float]:
    """Microseconds of device work each roofline op launched (all its kernels together)."""
    times: Dict[Event, float] = defaultdict(float)
    for event in device_events:
        op = roofline_op(event)
        if op is not None:
            times[op] += event.dur
    return dict(times)


def _top_names(weights: Counter, limit: int = 3) -> str:
    names = [name for name, _ in weights.most_common(limit)]
    more = len(weights) - len(names)
    return ", ".join(names) + (f" (+{more} more)" if more else "")


def top_table(events: Sequence[Event]) -> List[dict]:
    """Per name (op or kernel): total and mean us, share of all the events' time, calls, and
    the layers that ran it (most time first)."""
    total = sum(e.dur for e in events)
    groups: Dict[str, List[Event]] = defaultdict(list)
    for event in events:
        groups[event.name].append(event)
    rows = []
    for name, group in groups.items():
        time_us = sum(e.dur for e in group)
        layers: Counter = Counter()
        for event in group:
            layers[layer_of(event)] += event.dur
        rows.append(dict(name=name, total_us=time_us, mean_us=time_us / len(group),
                         share=time_us / total if total else 0.0, calls=len(group),
                         layers=_top_names(layers)))
    return sorted(rows, key=lambda r: -r["total_us"])


def _covered_us(events: Sequence[Event]) -> float:
    """Length of the union of the events' spans (kernels of several streams may overlap)."""
    covered, reached = 0.0, -math.inf
    for event in sorted(events, key=lambda e: e.ts):
        end = event.ts + event.dur
        covered += max(0.0, end - max(event.ts, reached))
        reached = max(reached, end)
    return covered


def gpu_time_split(device_events: Sequence[Event]) -> dict:
    """From the first device event's start to the last one's end: time some kernel runs
    (compute), time only copies or memsets run, and time nothing runs (idle)."""
    window = max(e.ts + e.dur for e in device_events) - min(e.ts for e in device_events)
    compute = _covered_us([e for e in device_events if e.kind == "kernel"])
    busy = _covered_us(device_events)
    return dict(window_us=window, compute_us=compute, memory_us=busy - compute,
                idle_us=window - busy)


def roofline_table(op_times: Dict[Event, float], peaks: Peaks) -> List[dict]:
    """One row per (layer, op, shapes, dtype), calls merged: the mean duration against the
    roofline bound max(FLOPs / peak FLOP/s, bytes / peak bandwidth); the fraction is
    bound / duration (1 = at the roofline)."""
    groups: Dict[tuple, dict] = {}
    for op, time_us in op_times.items():
        key = (layer_of(op), op.name, op.inputs.shapes_text(), op.inputs.dtype)
        group = groups.setdefault(key, dict(calls=0, total_us=0.0))
        group["calls"] += 1
        group["total_us"] += time_us
        group["flops"], group["bytes"] = op.cost
    rows = []
    for (layer, name, shapes, dtype), group in groups.items():
        mean_us = group["total_us"] / group["calls"]
        mean_s = mean_us * 1e-6
        compute_s = group["flops"] / peaks.flops_per_s(dtype)
        memory_s = group["bytes"] / (peaks.bandwidth_gbs * 1e9)
        bound_s = max(compute_s, memory_s)
        rows.append(dict(layer=layer, op=name, shapes=shapes, dtype=dtype_name(dtype),
                         calls=group["calls"], total_us=group["total_us"], mean_us=mean_us,
                         flops=group["flops"], bytes=group["bytes"],
                         tflops=group["flops"] / mean_s / 1e12, gbs=group["bytes"] / mean_s / 1e9,
                         bound_us=bound_s * 1e6, roofline_fraction=bound_s / mean_s,
                         limit="compute" if compute_s >= memory_s else "memory"))
    return sorted(rows, key=lambda r: -r["total_us"])


@dataclass
class Analysis:
    on_gpu: bool  # times are kernel times (else CPU op times)
    top: List[dict]
    roofline: List[dict]
    gpu_split: Optional[dict]
    roofline_share: float  # of all the timed events' time, what the roofline rows cover


def analyse(trace: dict, peaks: Peaks, default_dtype: torch.dtype = torch.float32) -> Analysis:
    events = parse_trace(trace, default_dtype)
    device_events = [e for e in events if e.on_device]
    if device_events:
        # GPU run: the kernels are what takes time; each is charged to the op that launched it.
        timed, op_times = device_events, device_time_by_op(device_events)
    else:
        # CPU run: the ops themselves, nested ones within their outermost.
        timed = outermost_ops(events)
        op_times = {e: e.dur for e in events if e.kind == "op" and roofline_op(e) is e}
    total = sum(e.dur for e in timed)
    return Analysis(on_gpu=bool(device_events), top=top_table(timed),
                    roofline=roofline_table(op_times, peaks),
                    gpu_split=gpu_time_split(device_events) if device_events else None,
                    roofline_share=sum(op_times.values()) / total if total else 0.0)


# --- output -----------------------------------------------------------------------------

# Widest name a table prints (short_name); the CSVs keep whole names.
NAME_WIDTH = 72
_NAMESPACE = re.compile(r"(?:\(anonymous namespace\)|[A-Za-z_]\w*)::")


def _matching_open(text: str, close: int, opening: str, closing: str) -> int:
    """Index of the bracket that opens the one at `close` (-1 if none); "->" is no bracket."""
    depth = 0
    for i in range(close, -1, -1):
        if text[i] == closing and not (closing == ">" and i > 0 and text[i - 1] == "-"):
            depth += 1
        elif text[i] == opening:
            depth -= 1
            if depth == 0:
                return i
    return -1


def _collapse_templates(text: str) -> str:
    """Every outermost template argument list replaced by <...>."""
    out, depth = [], 0
    for i, char in enumerate(text):
        if char == "<":
            if depth == 0:
                out.append("<...>")
            depth += 1
        elif char == ">" and depth and text[i - 1] != "-":
            depth -= 1
        elif depth == 0:
            out.append(char)
    return "".join(out)


def short_name(name: str, width: int = NAME_WIDTH) -> str:
    """A kernel's or op's name as a table prints it: whole where it fits in `width`; else a
    C++ signature's return type, parameter list and namespaces dropped, then its template
    arguments (<...>) where still too wide, and at last cut to `width` characters."""
    if len(name) <= width:
        return name
    text = name[len("void "):] if name.startswith("void ") else name
    if text.endswith(")"):
        start = _matching_open(text, len(text) - 1, "(", ")")
        if start > 0 and not text[start - 1].isspace():  # a parameter list, not "Memcpy DtoD (...)"
            text = text[:start]
    text = _NAMESPACE.sub("", text)
    if len(text) > width:
        text = _collapse_templates(text)
    return text if len(text) <= width else text[:width - 3] + "..."


# (key, header, format: a format string or a function of the value) of the tables; the CSVs
# have the same columns, with the values themselves.
BREAKDOWN_COLUMNS = [("part", "part", "{}"), ("ms", "ms/action", "{:.3f}"), ("share", "share", "{:.1%}"),
                     ("calls", "calls", "{:g}"), ("ms_per_call", "ms/call", "{:.3f}")]
TOP_COLUMNS = [("name", "name", short_name), ("total_us", "total us", "{:.1f}"), ("mean_us", "mean us", "{:.2f}"),
               ("share", "share", "{:.1%}"), ("calls", "calls", "{}"), ("layers", "layers", "{}")]
ROOFLINE_COLUMNS = [("layer", "layer", "{}"), ("op", "op", "{}"), ("shapes", "shapes", "{}"),
                    ("dtype", "dtype", "{}"), ("calls", "calls", "{}"),
                    ("total_us", "total us", "{:.1f}"), ("mean_us", "us/call", "{:.2f}"),
                    ("flops", "FLOPs", "{:.4g}"), ("bytes", "bytes", "{:.4g}"),
                    ("tflops", "TFLOP/s", "{:.3g}"), ("gbs", "GB/s", "{:.3g}"),
                    ("bound_us", "bound us", "{:.3g}"), ("roofline_fraction", "of roofline", "{:.2%}"),
                    ("limit", "bound by", "{}")]


def format_table(rows: Sequence[dict], columns=ROOFLINE_COLUMNS, limit: Optional[int] = None) -> str:
    shown = list(rows)[:limit]
    cells = [[header for _, header, _ in columns]] + [
        ["-" if row[key] is None else fmt(row[key]) if callable(fmt) else fmt.format(row[key])
         for key, _, fmt in columns] for row in shown]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    numeric = [bool(shown) and not isinstance(shown[0][key], str) for key, _, _ in columns]
    lines = ["  ".join(c.rjust(w) if n else c.ljust(w) for c, w, n in zip(line, widths, numeric)).rstrip()
             for line in cells]
    if limit is not None and len(rows) > limit:
        lines.append(f"... {len(rows) - limit} more rows")
    return "\n".join(lines)


def format_gpu_split(split: dict) -> str:
    window = split["window_us"]
    return (f"GPU time over {window:.1f} us (first to last device event): "
            + ", ".join(f"{name} {split[key]:.1f} us ({split[key] / window:.1%})" for name, key in
                        (("compute", "compute_us"), ("memcpy/memset", "memory_us"), ("idle", "idle_us"))))


def write_csv(rows: Sequence[dict], path, columns=ROOFLINE_COLUMNS) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([key for key, _, _ in columns])
        writer.writerows([[row[key] for key, _, _ in columns] for row in rows])


def plot_roofline(rows: Sequence[dict], peaks: Peaks, path, title: str) -> None:
    """Achieved FLOP/s against arithmetic intensity, one point per roofline row (area ~ its
    total time), under the measured rooflines."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [r for r in rows if r["flops"] > 0]  # a log axis has no room for cat's 0 FLOPs
    intensities = [r["flops"] / r["bytes"] for r in points] or [1.0]
    low, high = min(intensities + [0.1]) / 2, max(intensities + [1e3]) * 2
    xs = [low * (high / low) ** (i / 200) for i in range(201)]
    fig, ax = plt.subplots(figsize=(9, 6))
    for (dtype, tflops), style in zip(peaks.tflops.items(), ("-", "--", ":")):
        ax.plot(xs, [min(tflops, x * peaks.bandwidth_gbs / 1e3) for x in xs], "k" + style, lw=1,
                label=f"roofline {dtype_name(dtype)}: {tflops:.3g} TFLOP/s, {peaks.bandwidth_gbs:.0f} GB/s")
    longest = max((r["total_us"] for r in points), default=1.0)
    for op in sorted({r["op"] for r in points}):
        mine = [r for r in points if r["op"] == op]
        ax.scatter([r["flops"] / r["bytes"] for r in mine], [r["tflops"] for r in mine],
                   s=[10 + 300 * r["total_us"] / longest for r in mine], alpha=0.6, label=op)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOPs / byte)")
    ax.set_ylabel("achieved TFLOP/s")
    ax.set_title(title if points else title + "\n(no per-op rows: nothing with shapes was timed)",
                 fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cprofile_call(fn: Callable[[], object], path, top: int = 20) -> str:
    """cProfile of one call, saved as .prof; returns its top-`top` cumulative table."""
    profiler = cProfile.Profile()
    profiler.runcall(fn)
    profiler.dump_stats(str(path))
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(top)
    return text.getvalue()


def call_graph_png(prof_path, png_path) -> str:
    """gprof2dot | dot rendering of a .prof, where both tools are installed; says what it did."""
    tools = {name: shutil.which(name) for name in ("gprof2dot", "dot")}
    missing = [name for name, found in tools.items() if found is None]
    if missing:
        return f"call graph PNG skipped: {' and '.join(missing)} not on PATH"
    graph = subprocess.run([tools["gprof2dot"], "-f", "pstats", str(prof_path)], check=True,
                           capture_output=True).stdout
    subprocess.run([tools["dot"], "-Tpng", "-o", str(png_path)], input=graph, check=True)
    return f"call graph: {png_path}"


def plot_grouped_bars(rows: Sequence[dict], group: Sequence[str], label, value: str, ylabel: str, title: str,
                      path) -> None:
    """A log-scale bar chart of the benchmark scripts' rows: one cluster per distinct value of
    the `group` fields (in first-seen order, labelled by label(*those values)), one bar per
    method in each, height row[value] (NaN where a method has no row)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = lambda r: tuple(r[field] for field in group)
    clusters = list(dict.fromkeys(key(r) for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(clusters)), 4.5))
    width = 0.8 / len(methods)
    for k, method in enumerate(methods):
        heights = [next((r[value] for r in rows if key(r) == c and r["method"] == method), float("nan"))
                   for c in clusters]
        ax.bar([i + k * width for i in range(len(clusters))], heights, width, label=method)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(clusters))])
    ax.set_xticklabels([label(*c) for c in clusters], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
