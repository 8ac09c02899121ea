#!/usr/bin/env bash
# Builds the extension here for a GPU machine that should not spend its time compiling (or
# cannot: no network, no toolkit), for that machine's Python and torch:
#   DPA_TARGET_PYTHON=python3.12 TORCH_CUDA_ARCH_LIST=9.0 bash scripts/dev/build_offline.sh
# then copy diffusion_policy_accelerated/_C.cpython-*.so and _C.sources into the same place
# in the GPU machine's checkout. _C.sources records scripts/dev/extension_hash.sh of the
# sources built; scripts/dev/gpu_check.sh uses the library only where that still matches the
# checkout (and it imports), and builds there otherwise. DPA_TARGET_PYTHON: a Python with the
# GPU machine's torch installed.
set -euo pipefail
cd "$(dirname "$0")/../.."
python=${DPA_TARGET_PYTHON:-python3}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-2}
start=$SECONDS
echo "building for $("$python" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__)')," \
  "archs $TORCH_CUDA_ARCH_LIST (log: /tmp/dpa_offline_build.log)"
if ! "$python" setup.py -q build_ext --inplace >/tmp/dpa_offline_build.log 2>&1; then
  tail -30 /tmp/dpa_offline_build.log
  exit 1
fi
library=$(ls -t diffusion_policy_accelerated/_C.cpython-*.so | head -1)
# Python's build flags include -g: host debug info is most of the library. The kernels and
# their line info stay.
strip --strip-debug "$library"
bash scripts/dev/extension_hash.sh >diffusion_policy_accelerated/_C.sources
ls -l "$library"
echo "built in $((SECONDS - start)) s"
