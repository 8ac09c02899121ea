"""Builds `diffusion_policy_accelerated._C`: CPU + CUDA kernels when a CUDA build of torch and
the CUDA toolkit are both present, CPU kernels only otherwise (it says which).

Install with `pip install --no-build-isolation -e .` (the build needs the torch you run with).
Environment: TORCH_CUDA_ARCH_LIST picks GPU archs (default below); DPA_CPU_ONLY=1 skips CUDA;
MAX_JOBS limits parallel compiles.
"""
import os
from pathlib import Path

from setuptools import find_packages, setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
import torch

# Ampere (A100, RTX 30xx, Jetson Orin is 8.7 and runs the 8.0 code), Ada (RTX 40xx, L4) and
# Hopper (H100/H200); the PTX of 9.0 lets newer GPUs JIT it.
DEFAULT_CUDA_ARCHS = "8.0;8.6;8.9;9.0+PTX"

root = Path(__file__).parent
csrc = root / "csrc"
with_cuda = (torch.version.cuda is not None and CUDA_HOME is not None
             and not os.environ.get("DPA_CPU_ONLY"))
sources = sorted(str(p.relative_to(root)) for p in csrc.glob("*.cpp"))
cxx_flags = ["-O3", "-ffp-contract=off"]
extension = CppExtension
extra = {}
if with_cuda:
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCHS)
    sources += sorted(str(p.relative_to(root)) for p in csrc.glob("*.cu"))
    cxx_flags.append("-DDPA_WITH_CUDA")
    extra["nvcc"] = ["-O3", "-DDPA_WITH_CUDA", "-lineinfo"]
    extension = CUDAExtension
    print(f"diffusion_policy_accelerated: building CPU + CUDA kernels (torch {torch.__version__}, "
          f"CUDA_HOME={CUDA_HOME}, archs {os.environ['TORCH_CUDA_ARCH_LIST']})", flush=True)
else:
    why = ("DPA_CPU_ONLY is set" if os.environ.get("DPA_CPU_ONLY") else
           "torch is a CPU build" if torch.version.cuda is None else "no CUDA toolkit found")
    print(f"diffusion_policy_accelerated: building CPU kernels only ({why})", flush=True)
extra["cxx"] = cxx_flags

setup(
    packages=find_packages(include=["diffusion_policy_accelerated", "diffusion_policy_accelerated.*"]),
    ext_modules=[extension("diffusion_policy_accelerated._C", sources, extra_compile_args=extra)],
    cmdclass={"build_ext": BuildExtension},
)
