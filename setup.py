"""Builds `diffusion_policy_accelerated._C`: CPU + CUDA kernels when a CUDA build of torch and
the CUDA toolkit are both present, CPU kernels only otherwise (it says which).

Install with `pip install --no-build-isolation -e .` (the build needs the torch you run with).
Environment: TORCH_CUDA_ARCH_LIST picks GPU archs (default: _extension.DEFAULT_CUDA_ARCHS); DPA_CPU_ONLY=1 skips CUDA;
MAX_JOBS limits parallel compiles.
"""
import os
import sys
from pathlib import Path

from setuptools import find_packages, setup
import torch
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

root = Path(__file__).resolve().parent
# The build settings live with the JIT loader so both build the same thing; setuptools'
# PEP 517 backend does not put the project on sys.path by itself.
sys.path.insert(0, str(root))
from diffusion_policy_accelerated._extension import (CXX_FLAGS, DEFAULT_CUDA_ARCHS, NVCC_FLAGS,  # noqa: E402
                                                     cuda_build_reason, sources)

with_cuda = cuda_build_reason() is None
extra = {"cxx": CXX_FLAGS + (["-DDPA_WITH_CUDA"] if with_cuda else [])}
if with_cuda:
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCHS)
    extra["nvcc"] = NVCC_FLAGS + ["-DDPA_WITH_CUDA"]
    print(f"diffusion_policy_accelerated: building CPU + CUDA kernels (torch {torch.__version__}, "
          f"CUDA_HOME={CUDA_HOME}, archs {os.environ['TORCH_CUDA_ARCH_LIST']})", flush=True)
else:
    print(f"diffusion_policy_accelerated: building CPU kernels only ({cuda_build_reason()})", flush=True)

setup(
    packages=find_packages(include=["diffusion_policy_accelerated", "diffusion_policy_accelerated.*"]),
    ext_modules=[(CUDAExtension if with_cuda else CppExtension)(
        "diffusion_policy_accelerated._C",
        [str(Path(p).relative_to(root)) for p in sources(with_cuda)],
        extra_compile_args=extra)],
    cmdclass={"build_ext": BuildExtension},
)
