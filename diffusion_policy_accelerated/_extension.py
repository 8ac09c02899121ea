"""Loads the compiled ops: the prebuilt `_C` module, or a JIT build of the same sources.

Importing the module runs its static `TORCH_LIBRARY` registrations, after which the ops
live under `torch.ops.dpa`.
"""
import os
import sys
from pathlib import Path

import torch

_CSRC = Path(__file__).resolve().parent.parent / "csrc"


def _jit_build():
    from torch.utils.cpp_extension import CUDA_HOME, load

    with_cuda = torch.version.cuda is not None and CUDA_HOME is not None
    sources = sorted(str(p) for p in _CSRC.glob("*.cpp"))
    if with_cuda:
        sources += sorted(str(p) for p in _CSRC.glob("*.cu"))
    if not sources:
        raise ImportError(
            f"diffusion_policy_accelerated: no prebuilt extension and no sources at {_CSRC}; "
            "install with `pip install --no-build-isolation -e .`")
    print(f"diffusion_policy_accelerated: no prebuilt extension, JIT-compiling {len(sources)} "
          f"sources ({'CPU+CUDA' if with_cuda else 'CPU only'}); this takes a few minutes once, "
          "then is cached", file=sys.stderr, flush=True)
    flags = ["-O3", "-ffp-contract=off"] + (["-DDPA_WITH_CUDA"] if with_cuda else [])
    return load(
        name="diffusion_policy_accelerated_C",
        sources=sources,
        extra_cflags=flags,
        extra_cuda_cflags=["-O3", "-DDPA_WITH_CUDA", "-fmad=true", "-lineinfo"],
        with_cuda=with_cuda,
        verbose=bool(os.environ.get("DPA_JIT_VERBOSE")),
    )


def _load():
    if os.environ.get("DPA_FORCE_JIT"):
        return _jit_build()
    try:
        from . import _C
        return _C
    except ImportError:
        return _jit_build()


C = _load()
