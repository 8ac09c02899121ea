"""Builds `diffusion_policy_accelerated._C`: the CPU kernels, and the CUDA kernels for what this
machine needs (kernels/library.py, plan_build): the archs of TORCH_CUDA_ARCH_LIST where it is
set, else those of the visible GPUs, else none (CPU-only). It prints the decision and records
it beside the library (<library file>.build.json), where the demo reads it.

Install with `pip install --no-build-isolation -e .` (the build needs the torch you run with;
add -v to see the decision and each file's [n/N] compile line). Environment:
TORCH_CUDA_ARCH_LIST picks GPU archs; DPA_CPU_ONLY=1 skips CUDA; MAX_JOBS limits parallel
compiles.

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
from diffusion_policy_accelerated.kernels.library import (CSRC, CXX_FLAGS, LD_FLAGS, NVCC_FLAGS,  # noqa: E402
                                                          current_build_plan, sources, write_build_record)


class PersistentBuildExtension(BuildExtension):
    """BuildExtension with its objects in build/ (per Python), where ninja finds them again:
    an editable install otherwise compiles in a temporary folder, from scratch every time."""

    def initialize_options(self):
        super().initialize_options()
        # Set before finalize_options, which fills only what is unset; --build-temp still wins.
        self.build_temp = str(root / "build" / f"temp.{sysconfig.get_platform()}-{sys.implementation.cache_tag}")

    def build_extensions(self):
        count = len(self.extensions[0].sources)
        print(f"diffusion_policy_accelerated: compiling {count} sources into {self.build_temp}: minutes the "
              "first time (the CPU kernels alone are about 440 s of CPU time, and each CUDA arch adds an nvcc "
              "compile of every CUDA source); later builds recompile only what changed; MAX_JOBS limits "
              "parallel compiles", flush=True)
        super().build_extensions()

    def run(self):
        super().run()  # builds, then (in place, as an editable install) copies the library to the package
        # Beside the library where it ends up: the package, or the build folder a wheel is made of.
        record = write_build_record(plan, self.get_ext_fullpath(self.extensions[0].name))
        print(f"diffusion_policy_accelerated: built: {plan.describe()} (recorded in {record})", flush=True)


plan = current_build_plan()
extra = {"cxx": CXX_FLAGS + (["-DDPA_WITH_CUDA"] if plan.with_cuda else [])}
if plan.with_cuda:
    # What torch's build reads; set here so that the archs printed are the archs built.
    os.environ["TORCH_CUDA_ARCH_LIST"] = plan.archs
    extra["nvcc"] = NVCC_FLAGS + ["-DDPA_WITH_CUDA"]
print(f"diffusion_policy_accelerated: building: {plan.describe()}; torch {torch.__version__}"
      + (f", CUDA_HOME={CUDA_HOME}" if plan.with_cuda else ""), flush=True)

setup(
    packages=find_packages(include=["diffusion_policy_accelerated", "diffusion_policy_accelerated.*"]),
    ext_modules=[(CUDAExtension if plan.with_cuda else CppExtension)(
        "diffusion_policy_accelerated._C",
        [str(Path(p).relative_to(root)) for p in sources(plan.with_cuda)],
        include_dirs=[str(CSRC)],
        extra_compile_args=extra,
        extra_link_args=LD_FLAGS)],
    cmdclass={"build_ext": PersistentBuildExtension},
)
