"""Builds `diffusion_policy_accelerated._C`: CPU + CUDA kernels when a CUDA build of torch and
the CUDA toolkit are both present, CPU kernels only otherwise (it says which).

Install with `pip install --no-build-isolation -e .` (the build needs the torch you run with;
add -v to watch each file compile). Environment: TORCH_CUDA_ARCH_LIST picks GPU archs (default:
_extension.DEFAULT_CUDA_ARCHS); DPA_CPU_ONLY=1 skips CUDA; MAX_JOBS limits parallel compiles.

Objects are kept in build/ between installs, and ninja recompiles only what changed, so
reinstalling after an edit (or with no change) takes seconds, not the first build's minutes.
"""
import os
import sys
import sysconfig
from pathlib import Path

from setuptools import find_packages, setup
import torch
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

root = Path(__file__).resolve().parent
# The build settings live with the JIT loader so both build the same thing; setuptools'
# PEP 517 backend does not put the project on sys.path by itself.
sys.path.insert(0, str(root))
from diffusion_policy_accelerated._extension import (CSRC, CXX_FLAGS, DEFAULT_CUDA_ARCHS, LD_FLAGS,  # noqa: E402
                                                     NVCC_FLAGS, cuda_build_reason, sources)


class PersistentBuildExtension(BuildExtension):
    """BuildExtension with its objects in build/ (per Python), where ninja finds them again:
    an editable install otherwise compiles in a temporary folder, from scratch every time."""

    def initialize_options(self):
        super().initialize_options()
        # Set before finalize_options, which fills only what is unset; --build-temp still wins.
        self.build_temp = str(root / "build" / f"temp.{sysconfig.get_platform()}-{sys.implementation.cache_tag}")

    def build_extensions(self):
        count = len(self.extensions[0].sources)
        print(f"diffusion_policy_accelerated: compiling {count} sources into {self.build_temp} (the "
              "first CUDA build takes about 7 minutes on 2 cores for the default archs; later builds "
              "recompile only what changed; MAX_JOBS limits parallel compiles)", flush=True)
        super().build_extensions()


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
        include_dirs=[str(CSRC)],
        extra_compile_args=extra,
        extra_link_args=LD_FLAGS)],
    cmdclass={"build_ext": PersistentBuildExtension},
)
