"""The extension's two ways in: the prebuilt module, and the documented JIT build."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diffusion_policy_accelerated.kernels import library, ops

ROOT = Path(__file__).resolve().parents[2]


def test_prebuilt_module_matches_this_torch():
    # A CPU-only torch cannot have the CUDA kernels; with a CUDA torch they are in exactly where
    # the build planned them (an arch list given, as CI's, or a GPU visible: kernels/library.py
    # records the plan beside the library).
    if torch.version.cuda is None:
        assert not ops.built_with_cuda()
        return
    plan = library.loaded_build()
    if plan is None:
        pytest.skip("the installed library was built without a build record")
    assert ops.built_with_cuda() == plan.with_cuda


def test_jit_build_loads_the_same_ops():
    """README's no-build-step path: DPA_FORCE_JIT compiles csrc/ with cpp_extension.load (CPU
    kernels here, to keep the test short; the CUDA sources are the ones setup.py compiles)."""
    code = ("import torch\n"
            "from diffusion_policy_accelerated import ops\n"
            "assert not ops.built_with_cuda()\n"
            "x, w = torch.randn(2, 4, 8), torch.randn(8, 4, 3)\n"
            "assert ops.conv1d_gn_mish(x, w, None, None, None, 4).shape == (2, 8, 8)\n")
    env = dict(os.environ, DPA_FORCE_JIT="1", DPA_CPU_ONLY="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "JIT-compiling" in result.stderr
