"""Loads the compiled ops: the prebuilt `_C` module, or a JIT build of the same sources.

Importing the module runs its static `TORCH_LIBRARY` registrations, after which the ops
live under `torch.ops.dpa`. setup.py builds from the same settings (archs, flags).
"""
import os
import sys
from pathlib import Path

import torch

CSRC = Path(__file__).resolve().parent.parent / "csrc"
# Ampere (A100; RTX 30xx; Jetson Orin, 8.7: a robot's GPU, given code of its own rather than
# 8.6's), Ada (RTX 40xx, L4) and Hopper (H100/H200); the PTX of 9.0 lets newer GPUs JIT it.
DEFAULT_CUDA_ARCHS = "8.0;8.6;8.7;8.9;9.0+PTX"
# No FMA contraction: denoise_step is bit-exact. OpenMP: ATen's at::parallel_for is a header
# whose threads are an `omp parallel` region, so without it the CPU ops ran on one thread
# (torch links its own libgomp, which the extension then shares).
CXX_FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp"]
LD_FLAGS = ["-fopenmp"]
NVCC_FLAGS = ["-O3", "-lineinfo"]


def cuda_build_reason():
    """None when the CUDA kernels can be built here, else why not."""
    from torch.utils.cpp_extension import CUDA_HOME

    if os.environ.get("DPA_CPU_ONLY"):
        return "DPA_CPU_ONLY is set"
    if torch.version.cuda is None:
        return "torch is a CPU build"
    if CUDA_HOME is None:
        return "no CUDA toolkit found"
    return None


def sources(with_cuda):
    """csrc's sources: each op's shared and cpu/ files, and with CUDA its cuda/ files."""
    files = [p for p in sorted(CSRC.rglob("*.cpp")) + sorted(CSRC.rglob("*.cu"))
             if with_cuda or "cuda" not in p.relative_to(CSRC).parts]
    return [str(p) for p in files]


def jit_build():
    from torch.utils.cpp_extension import load

    with_cuda = cuda_build_reason() is None
    files = sources(with_cuda)
    if not files:
        raise ImportError(
            f"diffusion_policy_accelerated: no prebuilt extension and no sources at {CSRC}; "
            "install with `pip install --no-build-isolation -e .`")
    if with_cuda:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCHS)
    print(f"diffusion_policy_accelerated: no prebuilt extension, JIT-compiling {len(files)} sources "
          f"({'CPU + CUDA' if with_cuda else 'CPU only: ' + cuda_build_reason()}); this takes a few "
          "minutes once, then is cached", file=sys.stderr, flush=True)
    cuda_define = ["-DDPA_WITH_CUDA"] if with_cuda else []
    return load(
        name="diffusion_policy_accelerated_C" + ("" if with_cuda else "_cpu"),
        sources=files,
        extra_include_paths=[str(CSRC)],
        extra_cflags=CXX_FLAGS + cuda_define,
        extra_ldflags=LD_FLAGS,
        extra_cuda_cflags=NVCC_FLAGS + cuda_define,
        with_cuda=with_cuda,
        verbose=bool(os.environ.get("DPA_JIT_VERBOSE")),
    )


def load_extension():
    if os.environ.get("DPA_FORCE_JIT"):
        return jit_build()
    try:
        from . import _C
        return _C
    except ImportError:
        return jit_build()
