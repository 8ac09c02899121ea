#!/usr/bin/env bash
# Builds and tests the package against an older torch than requirements-dev.txt's, by default
# the oldest it supports (pyproject.toml: torch>=2.4), as CI does: LeRobot pins torch<2.11, and
# Jetsons run the torch of their JetPack. On the CPU: a CPU-only build and the op, model,
# sampler and checkpoint tests; then the CUDA sources' host files (the ATen calls) compiled
# against that torch's headers, where a CUDA toolkit is installed.
#
#   bash scripts/dev/check_min_torch.sh [TORCH TORCHVISION]     # default: 2.4.1 0.19.1
set -euo pipefail
cd "$(dirname "$0")/../.."
torch_version=${1:-2.4.1}
vision_version=${2:-0.19.1}
venv=$PWD/build/torch-$torch_version
if [ ! -x "$venv/bin/python" ]; then
  echo "torch $torch_version: a virtual environment in $venv"
  python3 -m venv "$venv"
fi
# requirements-dev.txt without its torch and torchvision pins.
"$venv/bin/python" -m pip install -q --disable-pip-version-check "torch==$torch_version" "torchvision==$vision_version" \
  -r <(grep -vE "^torch(vision)?==" requirements-dev.txt)
copy=$(mktemp -d)
trap 'rm -rf "$copy"' EXIT
git ls-files -z csrc diffusion_policy_accelerated tests setup.py pyproject.toml | xargs -0 cp --parents -t "$copy"
cd "$copy"
echo "torch $torch_version: CPU-only build"
DPA_CPU_ONLY=1 MAX_JOBS=${MAX_JOBS:-2} "$venv/bin/python" setup.py -q build_ext --inplace >build.log 2>&1 \
  || { tail -40 build.log; exit 1; }
echo "torch $torch_version: tests"
DPA_CPU_ONLY=1 "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/kernels/test_extension.py \
  tests/kernels/test_conv1d.py tests/kernels/test_conv1d_gn_mish.py tests/kernels/test_conv1d_gn_mish_shortcut.py \
  tests/kernels/test_residual_block.py tests/model tests/sampling/test_sampler.py \
  tests/sampling/test_picard.py tests/adapters/test_accelerate.py tests/adapters/test_checkpoint.py
cuda_include=${CUDA_HOME:-/usr/local/cuda}/include
if [ ! -f "$cuda_include/cuda_runtime.h" ]; then
  echo "torch $torch_version: no CUDA toolkit at ${CUDA_HOME:-/usr/local/cuda}: the CUDA host files not compiled"
  exit 0
fi
includes=$("$venv/bin/python" -c "
import sysconfig
import torch.utils.cpp_extension as ext
print(' '.join(['-I' + p for p in ext.include_paths()] + ['-I' + sysconfig.get_paths()['include']]))" 2>/dev/null)
abi=$("$venv/bin/python" -c "import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))")
mapfile -t hosts < <(find csrc -name "*.cpp" | sort)
echo "torch $torch_version: ${#hosts[@]} host sources compiled with the CUDA kernels' declarations (-DDPA_WITH_CUDA)"
for file in "${hosts[@]}"; do
  g++ -std=c++17 -fsyntax-only -DDPA_WITH_CUDA -D_GLIBCXX_USE_CXX11_ABI="$abi" -Icsrc $includes -I"$cuda_include" "$file" \
    || { echo "FAILED: $file against torch $torch_version"; exit 1; }
done
echo "torch $torch_version: built, tested, and its CUDA host files compiled"
