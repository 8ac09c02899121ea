#!/usr/bin/env bash
# Same-machine A/B of two builds of the kernels: timings taken on two device machines differ
# by more than most kernel changes do, so a change is only measured against the code before
# it on one machine, and interleaved (new, old, new) so that drift shows.
#   scripts/ab_builds.sh OLD_CSRC COMMAND...
# OLD_CSRC: a csrc/ folder of the other version, e.g. exported here with
#   mkdir -p old_src && git archive HEAD csrc | tar -x -C old_src     (then OLD_CSRC=old_src/csrc)
# (untracked, so it travels to the device with the working tree; delete it afterwards).
# COMMAND runs from the repository root after each build, e.g.
#   scripts/ab_builds.sh old_src/csrc python3 scripts/benchmark.py --ours-only --batch 1 --schedule DDPM-100
# The working tree's csrc/ is restored at the end, however the script ends.
set -uo pipefail
cd "$(dirname "$0")/.."
old=$1
shift
[[ -d $old ]] || { echo "no folder $old" >&2; exit 2; }
source scripts/carried_wheels.sh
export CC=${DPA_CC:-gcc} CXX=${DPA_CXX:-g++}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}
saved=$(mktemp -d)
cp -r csrc "$saved/"
trap 'rm -rf csrc && cp -r "$saved/csrc" csrc && rm -rf "$saved"' EXIT
status=0
for version in new old new; do
  rm -rf csrc
  if [[ $version == new ]]; then cp -r "$saved/csrc" csrc; else cp -r "$old" csrc; fi
  echo "== $version: building"
  start=$SECONDS
  if ! python3 -m pip install --no-build-isolation --no-deps -e . >/tmp/ab_build.log 2>&1; then
    tail -30 /tmp/ab_build.log; exit 1
  fi
  echo "== $version: built in $((SECONDS - start)) s"
  "$@" || status=1
done
exit $status
