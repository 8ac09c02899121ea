"""Loads the compiled ops: the prebuilt `_C` module, or a JIT build of the same sources.

Importing the module runs its static `TORCH_LIBRARY` registrations, after which the ops
live under `torch.ops.dpa`. setup.py builds from the same settings (archs, flags), decided by
`plan_build`, and records the decision beside the library (BUILD_RECORD), so that what a
build contains can be said where it runs (`loaded_build`; the demo prints it).
"""
import json
import os
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence, Tuple

import torch

CSRC = Path(__file__).resolve().parents[2] / "csrc"
# The build decision, written by setup.py next to the `_C` library it built.
# Beside each library file, its name plus this: one record a library (a checkout can hold
# libraries of several Pythons).
BUILD_RECORD = ".build.json"
# No FMA contraction: denoise_step is bit-exact. OpenMP: ATen's at::parallel_for is a header
# whose threads are an `omp parallel` region, so without it the CPU ops ran on one thread
# (torch links its own libgomp, which the extension then shares).
CXX_FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp"]
LD_FLAGS = ["-fopenmp"]
NVCC_FLAGS = ["-O3", "-lineinfo"]

Capability = Tuple[int, int]


@dataclass(frozen=True)
class BuildPlan:
    """What a build compiles: the CPU kernels always, the CUDA kernels for `archs` (a
    TORCH_CUDA_ARCH_LIST value) when `with_cuda`; `reason` says why."""
    with_cuda: bool
    archs: Optional[str]
    reason: str

    def describe(self) -> str:
        if not self.with_cuda:
            return f"CPU-only build: {self.reason}"
        return f"CPU + CUDA kernels for {_sm_names(self.archs)} ({self.reason})"

    def note_for(self, capability: Capability) -> str:
        """"" where the CUDA kernels run on a GPU of `capability` as they were meant to, else
        what is wrong: no CUDA kernels, none this GPU can load, or no Hopper code on Hopper."""
        arch = f"{capability[0]}.{capability[1]}"
        if not self.with_cuda:
            return (f"this build has no CUDA kernels; rebuild on this machine (or with "
                    f"TORCH_CUDA_ARCH_LIST={arch}) to use the GPU")
        if not any(_loads_on(entry, capability) for entry in _arch_entries(self.archs)):
            return (f"this build's CUDA kernels ({_sm_names(self.archs)}) cannot run on this "
                    f"GPU ({arch}); rebuild with TORCH_CUDA_ARCH_LIST={arch}")
        if capability[0] == 9 and not any(_capability(arch) == (9, 0) for arch, _ in _arch_entries(self.archs)):
            return ("built without 9.0: on this Hopper GPU the kernels take the portable path "
                    "(no clusters, no programmatic dependent launch); rebuild with TORCH_CUDA_ARCH_LIST=9.0")
        return ""


def _arch_entries(archs: str):
    """[(arch, embeds PTX)] of a TORCH_CUDA_ARCH_LIST value ("8.0;9.0+PTX")."""
    entries = [a.strip() for a in re.split(r"[;\s]+", archs) if a.strip()]
    return [(a[:-len("+PTX")], True) if a.endswith("+PTX") else (a, False) for a in entries]


def _capability(arch: str) -> Capability:
    major, minor = re.match(r"(\d+)\.(\d+)", arch).groups()
    return int(major), int(minor)


def _loads_on(entry, capability: Capability) -> bool:
    """CUDA's rule: a cubin runs on GPUs of its major version and a minor at least its own; PTX
    is compiled by the driver for any GPU at least its arch."""
    arch, ptx = entry
    built = _capability(arch)
    return built <= capability if ptx else (built[0] == capability[0] and built[1] <= capability[1])


def _sm_names(archs: str) -> str:
    return ", ".join("sm_" + arch.replace(".", "") + (" (+PTX)" if ptx else "") for arch, ptx in _arch_entries(archs))


def plan_build(*, cpu_only: bool, torch_cuda: Optional[str], cuda_home: Optional[str],
               arch_list: Optional[str], gpus: Sequence[Tuple[str, Capability]],
               max_capability: Optional[Capability] = None) -> BuildPlan:
    """The build this machine's user needs. CPU-only where asked (DPA_CPU_ONLY), where torch
    is a CPU build or there is no CUDA toolkit; with an arch list (TORCH_CUDA_ARCH_LIST, as CI
    and image builders give), exactly that; else the visible GPUs' archs, each compiled for
    itself (an H100: 9.0, which keeps Hopper's clusters and programmatic dependent launch);
    else, no GPU visible, CPU-only. `gpus`: (name, compute capability) of each visible GPU;
    `max_capability`: the newest arch this torch (and so its toolkit) compiles for: a newer
    GPU gets that arch's PTX, which its driver compiles."""
    if cpu_only:
        return BuildPlan(False, None, "DPA_CPU_ONLY is set")
    if torch_cuda is None:
        return BuildPlan(False, None, "torch is a CPU build")
    if cuda_home is None:
        return BuildPlan(False, None, "no CUDA toolkit found")
    if arch_list and arch_list != "native":
        return BuildPlan(True, arch_list, f"TORCH_CUDA_ARCH_LIST={arch_list}")
    if not gpus:
        return BuildPlan(False, None, "no GPU was visible to the build; set TORCH_CUDA_ARCH_LIST (e.g. 9.0 for an H100) to "
                                      "build the CUDA kernels for a GPU elsewhere")
    ptx = {}  # arch compiled -> whether its PTX goes in too
    for _, capability in gpus:
        clamped = min(capability, max_capability) if max_capability else capability
        ptx[clamped] = ptx.get(clamped, False) or clamped != capability
    names = sorted({f"{name} ({c[0]}.{c[1]})" for name, c in gpus})
    chosen = ";".join(f"{c[0]}.{c[1]}" + ("+PTX" if ptx[c] else "") for c in sorted(ptx))
    return BuildPlan(True, chosen, ("the visible GPU" if len(names) == 1 else "the visible GPUs") + ": " + ", ".join(names))


def current_build_plan() -> BuildPlan:
    """plan_build for this machine: its environment, torch, toolkit and visible GPUs."""
    from torch.utils.cpp_extension import CUDA_HOME

    arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip() or None
    looks_for_gpus = (torch.version.cuda is not None and CUDA_HOME is not None and not os.environ.get("DPA_CPU_ONLY")
                      and (arch_list is None or arch_list == "native"))
    gpus, newest = [], None
    if looks_for_gpus and torch.cuda.is_available():
        gpus = [(torch.cuda.get_device_name(i), torch.cuda.get_device_capability(i))
                for i in range(torch.cuda.device_count())]
        compiled = [int(m) for m in re.findall(r"sm_(\d+)", " ".join(torch.cuda.get_arch_list()))]
        newest = max(((n // 10, n % 10) for n in compiled), default=None)
    return plan_build(cpu_only=bool(os.environ.get("DPA_CPU_ONLY")), torch_cuda=torch.version.cuda,
                      cuda_home=CUDA_HOME, arch_list=arch_list, gpus=gpus, max_capability=newest)


def write_build_record(plan: BuildPlan, library_path) -> Path:
    """Records `plan` beside the library at `library_path` (setup.py, after a build)."""
    path = Path(str(library_path) + BUILD_RECORD)
    path.write_text(json.dumps({**asdict(plan), "torch": torch.__version__}, indent=1) + "\n")
    return path


def read_build_record(library_path) -> Optional[BuildPlan]:
    """The plan recorded beside the prebuilt library at `library_path`, or None (none recorded)."""
    try:
        record = json.loads(Path(str(library_path) + BUILD_RECORD).read_text())
        return BuildPlan(bool(record["with_cuda"]), record["archs"], str(record["reason"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def sources(with_cuda):
    """csrc's sources: each op's shared and cpu/ files, and with CUDA its cuda/ files."""
    files = [p for p in sorted(CSRC.rglob("*.cpp")) + sorted(CSRC.rglob("*.cu"))
             if with_cuda or "cuda" not in p.relative_to(CSRC).parts]
    return [str(p) for p in files]


# What the loaded library contains (load_extension sets it): the prebuilt library's recorded
# plan, or the JIT build's.
_loaded_plan: Optional[BuildPlan] = None


def loaded_build() -> Optional[BuildPlan]:
    """The build plan of the loaded library; None before it loads, or for a prebuilt library
    whose build recorded none."""
    return _loaded_plan


def jit_build():
    global _loaded_plan
    from torch.utils.cpp_extension import load

    plan = current_build_plan()
    files = sources(plan.with_cuda)
    if not files:
        raise ImportError(
            f"diffusion_policy_accelerated: no prebuilt extension and no sources at {CSRC}; "
            "install with `pip install --no-build-isolation -e .`")
    if plan.with_cuda:
        os.environ["TORCH_CUDA_ARCH_LIST"] = plan.archs
    print(f"diffusion_policy_accelerated: no prebuilt extension, JIT-compiling {len(files)} sources, "
          f"{plan.describe()}; this takes minutes once, then is cached (DPA_JIT_VERBOSE=1 shows each compile)",
          file=sys.stderr, flush=True)
    cuda_define = ["-DDPA_WITH_CUDA"] if plan.with_cuda else []
    module = load(
        name="diffusion_policy_accelerated_C" + ("" if plan.with_cuda else "_cpu"),
        sources=files,
        extra_include_paths=[str(CSRC)],
        extra_cflags=CXX_FLAGS + cuda_define,
        extra_ldflags=LD_FLAGS,
        extra_cuda_cflags=NVCC_FLAGS + cuda_define,
        with_cuda=plan.with_cuda,
        verbose=bool(os.environ.get("DPA_JIT_VERBOSE")),
    )
    _loaded_plan = plan
    return module


def load_extension():
    global _loaded_plan
    if os.environ.get("DPA_FORCE_JIT"):
        return jit_build()
    try:
        from .. import _C
    except ImportError:
        return jit_build()
    _loaded_plan = read_build_record(_C.__file__)
    return _C
