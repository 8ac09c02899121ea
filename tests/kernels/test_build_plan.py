"""What the build compiles (kernels/library.py, plan_build): decided from the machine's
settings and visible GPUs, which the tests pass in, so no GPU is needed; recorded beside the
library and said by the demo."""
import re
import subprocess
import sys

import pytest
import torch

from diffusion_policy_accelerated.kernels import library
from diffusion_policy_accelerated.kernels.library import BuildPlan, plan_build, read_build_record, write_build_record

H100, A100, ORIN, RTX4090 = ("NVIDIA H100", (9, 0)), ("NVIDIA A100", (8, 0)), ("Orin", (8, 7)), ("RTX 4090", (8, 9))
CUDA_MACHINE = dict(cpu_only=False, torch_cuda="13.0", cuda_home="/usr/local/cuda", arch_list=None, gpus=[])


@pytest.mark.parametrize("machine,with_cuda,archs,reason", [
    (dict(gpus=[H100]), True, "9.0", "the visible GPU: NVIDIA H100 (9.0)"),
    (dict(gpus=[ORIN]), True, "8.7", "the visible GPU: Orin (8.7)"),
    (dict(gpus=[H100, A100, H100]), True, "8.0;9.0", "the visible GPUs: NVIDIA A100 (8.0), NVIDIA H100 (9.0)"),
    # A GPU newer than this torch compiles for: the newest arch it has, with its PTX for the driver.
    (dict(gpus=[("B200", (10, 0))], max_capability=(9, 0)), True, "9.0+PTX", "the visible GPU: B200 (10.0)"),
    (dict(gpus=[H100], max_capability=(12, 0)), True, "9.0", "the visible GPU"),
    # An arch list is taken as given, GPU or not (CI, image builders).
    (dict(arch_list="8.0;9.0"), True, "8.0;9.0", "TORCH_CUDA_ARCH_LIST=8.0;9.0"),
    (dict(arch_list="8.6", gpus=[H100]), True, "8.6", "TORCH_CUDA_ARCH_LIST=8.6"),
    (dict(arch_list="native", gpus=[RTX4090]), True, "8.9", "the visible GPU"),
    (dict(), False, None, "no GPU was visible to the build; set TORCH_CUDA_ARCH_LIST"),
    (dict(arch_list="native"), False, None, "no GPU was visible"),
    (dict(cpu_only=True, arch_list="9.0", gpus=[H100]), False, None, "DPA_CPU_ONLY is set"),
    (dict(torch_cuda=None, gpus=[H100]), False, None, "torch is a CPU build"),
    (dict(cuda_home=None, arch_list="9.0"), False, None, "no CUDA toolkit found"),
])
def test_plan_build(machine, with_cuda, archs, reason):
    plan = plan_build(**{**CUDA_MACHINE, **machine})
    assert (plan.with_cuda, plan.archs) == (with_cuda, archs)
    assert reason in plan.reason


def test_descriptions_say_what_was_built():
    assert plan_build(**{**CUDA_MACHINE, "gpus": [H100]}).describe() == \
        "CPU + CUDA kernels for sm_90 (the visible GPU: NVIDIA H100 (9.0))"
    assert BuildPlan(True, "8.0;8.6+PTX", "x").describe() == "CPU + CUDA kernels for sm_80, sm_86 (+PTX) (x)"
    assert plan_build(**CUDA_MACHINE).describe().startswith("CPU-only build: no GPU was visible")


@pytest.mark.parametrize("archs,capability,text", [
    ("9.0", (9, 0), ""),
    ("8.0", (8, 6), ""),                       # a cubin runs on later minors of its major
    ("8.0;8.6+PTX", (8, 9), ""),
    ("8.6", (8, 0), "cannot run on this GPU (8.0)"),
    ("8.0", (9, 0), "cannot run on this GPU (9.0); rebuild with TORCH_CUDA_ARCH_LIST=9.0"),
    ("8.0+PTX", (9, 0), "built without 9.0"),  # PTX runs, without Hopper's clusters and PDL
    ("9.0+PTX", (10, 0), ""),
    (None, (9, 0), "this build has no CUDA kernels"),
])
def test_note_for_the_gpu_it_runs_on(archs, capability, text):
    note = BuildPlan(archs is not None, archs, "x").note_for(capability)
    assert (note == "") if not text else (text in note)


def test_build_record_round_trip(tmp_path):
    plan = BuildPlan(True, "9.0", "the visible GPU: NVIDIA H100 (9.0)")
    lib = tmp_path / "_C.cpython-311-x86_64-linux-gnu.so"
    record = write_build_record(plan, lib)
    assert record == tmp_path / ("_C.cpython-311-x86_64-linux-gnu.so" + library.BUILD_RECORD)
    assert read_build_record(lib) == plan
    assert read_build_record(tmp_path / "_C.cpython-312-x86_64-linux-gnu.so") is None  # another library's
    record.write_text("{not json")
    assert read_build_record(lib) is None
    assert read_build_record(tmp_path / "missing") is None


def test_this_machine_follows_its_settings(monkeypatch):
    monkeypatch.setenv("DPA_CPU_ONLY", "1")
    assert library.current_build_plan() == BuildPlan(False, None, "DPA_CPU_ONLY is set")
    monkeypatch.delenv("DPA_CPU_ONLY")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    plan = library.current_build_plan()
    if torch.version.cuda is None or plan.reason == "no CUDA toolkit found":
        assert not plan.with_cuda
    else:
        assert (plan.with_cuda, plan.archs) == (True, "8.0;9.0")


def test_demo_says_what_the_build_contains():
    result = subprocess.run([sys.executable, "-m", "diffusion_policy_accelerated", "demo", "--device", "cpu",
                             "--steps", "1", "--actions", "1"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    first = result.stdout.splitlines()[0]
    assert re.match(r"build: (CPU-only build|CPU \+ CUDA kernels)", first), first
