#!/usr/bin/env bash
# Builds the extension on this machine for the lent GPU machines (their Python 3.12 and torch
# 2.11.0+cu130, sm_90a), so that a device call carries it instead of spending about two minutes
# of device time compiling:
#   bash scripts/build_for_device.sh
#   carry: [".whl", "diffusion_policy_accelerated/_C.cpython-312-x86_64-linux-gnu.so",
#           "diffusion_policy_accelerated/_C.sources"]
# _C.sources records scripts/extension_hash.sh of the sources built; scripts/gpu_check.sh
# uses the carried library only where that still matches the working tree (and it imports),
# and builds there otherwise. DPA_DEVICE_PYTHON: a Python 3.12 with torch 2.11.0 installed.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${DPA_DEVICE_PYTHON:-python3.12}
# The device image sets TORCH_CUDA_ARCH_LIST=9.0a (so its own builds are sm_90a), and
# gpu_check.sh hashes the list it builds with: the same here, or the carried build goes unused.
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} MAX_JOBS=${MAX_JOBS:-2}
start=$SECONDS
if ! "$python" setup.py -q build_ext --inplace >/tmp/dpa_device_build.log 2>&1; then
  tail -30 /tmp/dpa_device_build.log
  exit 1
fi
# Python's build flags include -g: host debug info is ~15 MB of the library's 19, and a device
# call carries at most 64 MiB (the wheels take 22). The kernels and their line info stay.
strip --strip-debug diffusion_policy_accelerated/_C.cpython-312-*.so
bash scripts/extension_hash.sh >diffusion_policy_accelerated/_C.sources
ls -l diffusion_policy_accelerated/_C.cpython-312-*.so
echo "built in $((SECONDS - start)) s for $("$python" -c 'import torch; print("torch", torch.__version__)')"
