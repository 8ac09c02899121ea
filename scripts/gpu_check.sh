#!/usr/bin/env bash
# Everything the GPU has to confirm, in one device call: build, the whole test suite on the
# GPU, compute-sanitizer memcheck on a small workload, then the benchmark tables.
# Logs go to $OUT (the device tool brings that folder back). Missing Python packages (the
# device has no network) can be carried as wheels in .whl/ (see README "GPU check").
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dpa_gpu_check}
mkdir -p "$OUT"
status=0
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

echo "== build"
# The device image sets CXX=/opt/gcc/bin/g++, whose link step copies parts of its own
# libstdc++ (iostream, locale) into the extension; mixed with the process's libstdc++ they
# segfault when an error message formats a number. The system compiler links it dynamically.
export CC=${DPA_CC:-gcc} CXX=${DPA_CXX:-g++}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}
if ! python3 -m pip install --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"; exit 1
fi
grep -E "building|warning" "$OUT/build.log" | grep -v "cannot be found" | head -20

echo "== tests"
python3 -m pytest -q -p no:cacheprovider tests >"$OUT/tests.log" 2>&1 || status=1
grep -E "FAILED|ERROR|passed|failed" "$OUT/tests.log" | tail -25

echo "== compute-sanitizer memcheck"
compute-sanitizer --tool memcheck --error-exitcode 9 --print-limit 20 \
  python3 scripts/sanitize_case.py >"$OUT/sanitizer.log" 2>&1 || status=1
tail -4 "$OUT/sanitizer.log"

echo "== benchmark: Conv1dBlock shapes (DPA_SWEEP=1 also times both CUDA routes)"
python3 scripts/bench_conv_blocks.py --batch 1 8 64 ${DPA_SWEEP:+--sweep-paths} \
  --json "$OUT/conv_blocks.json" >"$OUT/conv_blocks.txt" 2>&1 || status=1
grep -E "^(NVIDIA|U-Net|batch 1)" "$OUT/conv_blocks.txt"

echo "== demo: lowdim U-Net, DDPM 100 steps, batch 1"
python3 -m diffusion_policy_accelerated.demo --actions 3 2>&1 | tail -1 || status=1

echo "== benchmark: ms per action chunk, side by side"
python3 scripts/benchmark.py --out "$OUT" ${DPA_BENCH_ARGS:-} 2>&1 | tee "$OUT/benchmark.txt" || status=1
exit $status
