#!/usr/bin/env bash
# Everything a GPU has to confirm, in one run (CONTRIBUTING.md): build, the whole test suite
# on the GPU, compute-sanitizer memcheck on a small workload, the benchmark tables, the
# profiler. DPA_STAGES picks stages (default: all, in this order):
#   tests sanitize parallel blocks demo bench policy lerobot serve profile ncu
# DPA_TESTS narrows the tests stage to some files, DPA_TEST_WORKERS spreads it over that many
# pytest-xdist processes; DPA_TESTS_TIMEOUT and DPA_SANITIZE_TIMEOUT
# (seconds) bound those stages, so that a hung kernel leaves its logs behind. Logs, JSON,
# plots and traces go to $WORK, packed at the end into $OUT/results.tgz. Python packages a
# machine without network lacks can be brought as wheels in .whl/ (offline_wheels.sh).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/dpa_gpu_check}
WORK=${DPA_WORK:-/tmp/dpa_gpu_work}
STAGES=${DPA_STAGES:-tests sanitize parallel blocks demo bench policy lerobot serve profile ncu}
mkdir -p "$OUT" "$WORK"
status=0
pack() { tar czf "$OUT/results.tgz" -C "$WORK" . ; }
trap pack EXIT
want() { [[ " $STAGES " == *" $1 "* ]]; }
source scripts/dev/offline_wheels.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

echo "== build"
# Some CUDA images set CXX to a compiler of their own whose link step copies parts of its
# libstdc++ (iostream, locale) into the extension; mixed with the process's libstdc++ they
# segfault when an error message formats a number. The system compiler links it dynamically.
export CC=${DPA_CC:-gcc} CXX=${DPA_CXX:-g++}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}
start=$SECONDS
# A library built on another machine (build_offline.sh) is used where it was built from
# these very sources and imports here; it saves this machine the compile.
prebuilt=diffusion_policy_accelerated/_C.sources
prebuilt_usable() {
  [[ -f $prebuilt ]] || return 1
  if [[ "$(cat $prebuilt)" != "$(bash scripts/dev/extension_hash.sh)" ]]; then
    echo "the prebuilt library is of other sources (hash $(bash scripts/dev/extension_hash.sh) here," \
      "TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST): building"; return 1
  fi
  if ! PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} python3 -c "import torch, diffusion_policy_accelerated._C" \
      2>"$WORK/prebuilt_import.log"; then
    echo "the prebuilt library does not import here: building"; tail -3 "$WORK/prebuilt_import.log"; return 1
  fi
}
if prebuilt_usable; then
  # Importable by every later process on the machine, as the editable install would be.
  python3 -c "import site, sys; open(site.getsitepackages()[0] + '/dpa_prebuilt.pth', 'w').write(sys.argv[1])" "$PWD"
  echo "using the prebuilt library of these sources"
else
  if ! python3 -m pip install --no-build-isolation --no-deps -e . >"$WORK/build.log" 2>&1; then
    tail -40 "$WORK/build.log"; exit 1
  fi
  grep -E "building|warning" "$WORK/build.log" | grep -v "cannot be found" | head -20
  echo "built in $((SECONDS - start)) s"
fi

if want tests; then
  echo "== tests"
  # A hung kernel must not take the whole run (and its logs) with it: the suite is
  # stopped after DPA_TESTS_TIMEOUT seconds, and a test still running after 120 s has its
  # Python stack dumped into the log, which names the test that hung.
  # DPA_TEST_WORKERS=N: N pytest-xdist processes, each with its share of the cores for its
  # CPU ops (with a thread per core each, the CPU tests crawl: seen with 8 workers on 16 cores).
  workers=() threads=()
  if [[ -n ${DPA_TEST_WORKERS:-} ]]; then
    [[ $DPA_TEST_WORKERS =~ ^[1-9][0-9]*$ ]] || { echo "DPA_TEST_WORKERS must be a positive integer"; exit 2; }
    workers=(-n "$DPA_TEST_WORKERS")
    threads=(OMP_NUM_THREADS=$(( $(nproc) / DPA_TEST_WORKERS > 1 ? $(nproc) / DPA_TEST_WORKERS : 1 )))
  fi
  env "${threads[@]}" timeout "${DPA_TESTS_TIMEOUT:-420}" python3 -m pytest -q -p no:cacheprovider \
    -o faulthandler_timeout=120 "${workers[@]}" ${DPA_TESTS:-tests} >"$WORK/tests.log" 2>&1 || status=1
  grep -E "FAILED|ERROR|passed|failed|Timeout|File .*tests/" "$WORK/tests.log" | tail -25
fi

if want sanitize; then
  echo "== compute-sanitizer memcheck"
  timeout "${DPA_SANITIZE_TIMEOUT:-240}" compute-sanitizer --tool memcheck --error-exitcode 9 --print-limit 20 \
    python3 scripts/dev/sanitize_case.py >"$WORK/sanitizer.log" 2>&1 || status=1
  tail -4 "$WORK/sanitizer.log"
fi

if want parallel; then
  echo "== parallel sampling: trained policies, sequential against Picard iterations (DPA_PARALLEL_ARGS)"
  python3 scripts/benchmark_parallel.py --out "$WORK" ${DPA_PARALLEL_ARGS:-} 2>"$WORK/parallel_progress.log" \
    | tee "$WORK/benchmark_parallel.txt" || { status=1; tail -20 "$WORK/parallel_progress.log"; }
fi

if want blocks; then
  echo "== benchmark: Conv1dBlock shapes (DPA_SWEEP=1 also times both CUDA routes)"
  python3 scripts/bench_conv_blocks.py --batch ${DPA_BLOCK_BATCHES:-1 8 64} ${DPA_SWEEP:+--sweep-paths} \
    --json "$WORK/conv_blocks.json" >"$WORK/conv_blocks.txt" 2>&1 || status=1
  grep -E "^(NVIDIA|U-Net|batch)|  1 " "$WORK/conv_blocks.txt"
  echo "-- the same at batch 1 without programmatic dependent launch"
  python3 scripts/bench_conv_blocks.py --batch 1 --no-pdl >"$WORK/conv_blocks_no_pdl.txt" 2>&1 || status=1
  grep -E "^(NVIDIA|batch)|  1 " "$WORK/conv_blocks_no_pdl.txt" | cut -c1-80
fi

if want demo; then
  echo "== demo: lowdim U-Net, DDPM 100 steps, batch 1"
  python3 -m diffusion_policy_accelerated demo --actions 3 2>&1 | tail -1 || status=1
fi

if want bench; then
  echo "== benchmark: ms per action chunk, side by side"
  python3 scripts/benchmark.py --out "$WORK" ${DPA_BENCH_ARGS:-} 2>&1 | tee "$WORK/benchmark.txt" || status=1
fi

if want policy; then
  echo "== benchmark: predict_action end to end, lowdim, image and transformer policies (DPA_POLICY_ARGS)"
  python3 -m scripts.benchmark_policy --out "$WORK" ${DPA_POLICY_ARGS:-} 2>&1 | tee "$WORK/benchmark_policy.txt" \
    || status=1
fi

if want lerobot; then
  echo "== benchmark: LeRobot's DiffusionPolicy as its users run it, and accelerated (DPA_LEROBOT_ARGS)"
  if python3 -c "import lerobot.policies.diffusion.modeling_diffusion" 2>/dev/null; then
    python3 scripts/benchmark_lerobot.py --out "$WORK" ${DPA_LEROBOT_ARGS:-} 2>&1 | tee "$WORK/benchmark_lerobot.txt" \
      || status=1
  else
    echo "LeRobot does not import here (CONTRIBUTING.md: its wheels for a machine without network): skipped"
  fi
fi

if want serve; then
  echo "== serving: dpa serve under 1-64 concurrent clients on loopback (DPA_SERVE_ARGS)"
  python3 -m scripts.load_test --json "$WORK/load_test.json" --plot "$WORK/serving.png" ${DPA_SERVE_ARGS:-} \
    2>"$WORK/serve_server.log" | tee "$WORK/load_test.txt" || status=1
fi

if want profile; then
  echo "== profile: lowdim U-Net, batch 1, DDPM 20 steps (eager, graph, ours, ours unGraphed)"
  # 20 steps keep the eager trace small; --no-graph gives ours' per-op roofline rows.
  for mode in eager graph ours "ours --no-graph"; do
    name=${mode// /}
    python3 scripts/profile_action.py --mode $mode --steps 20 --out "$WORK/profile" ${DPA_PROFILE_ARGS:-} \
      >"$WORK/profile_$name.txt" 2>&1 || status=1
    sed -n '1,22p' "$WORK/profile_$name.txt" | cut -c1-150
  done
fi
if want ncu; then
  echo "== Nsight Compute: DRAM bytes of every conv kernel of a lowdim forward against the formulas"
  python3 scripts/ncu_unet.py --csv "$WORK/ncu_unet.csv" 2>&1 | tee "$WORK/ncu_unet.txt" || status=1
  echo "== Nsight Compute: fused Conv1dBlock kernel, a small and a large layer"
  bash scripts/dev/ncu_conv.sh "256 256 16" "1024 1024 4" >"$WORK/ncu.txt" 2>&1 || status=1
  grep -E "^(==|Duration|DRAM Throughput|Memory Throughput|Registers|Achieved Occupancy)" "$WORK/ncu.txt"
fi
exit $status
