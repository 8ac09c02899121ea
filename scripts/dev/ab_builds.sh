#!/usr/bin/env bash
# Same-machine A/B of two versions of the kernels: timings taken on two machines differ by
# more than most kernel changes do, so a change is only measured against the code before it
# on one machine, and interleaved (new, old, new) so that drift shows.
#   scripts/dev/ab_builds.sh OLD COMMAND...
# OLD is one of:
#   - a csrc/ folder of the other version, built here before each run, e.g.
#       mkdir -p build/old_src && git archive OLD_COMMIT csrc | tar -x -C build/old_src
#     (OLD=build/old_src/csrc);
#   - that version's built extension library (build_offline.sh in a checkout of it, copied to
#     e.g. build/old_C.so): nothing is built, the two libraries take turns, and the working
#     tree's own must be in place; only for a version whose library takes the working tree's
#     set_kernel_config arguments (KernelConfig's fields; cpu_conv was added after 90b42c0),
#     else the whole package, below;
#   - a folder holding that version's whole `diffusion_policy_accelerated` package (its Python
#     and its built library), for a change in the Python and the ops' schemas as well:
#       mkdir -p build/old_tree && git archive OLD_COMMIT diffusion_policy_accelerated | tar -x -C build/old_tree
#     and its library copied into build/old_tree/diffusion_policy_accelerated/; the old runs
#     import it first (PYTHONPATH), the new ones the working tree's.
# COMMAND runs from the repository root after each build, e.g.
#   scripts/dev/ab_builds.sh build/old_src/csrc python3 scripts/benchmark.py --ours-only --batch 1 --schedule DDPM-100
# The working tree's csrc/ (or library) is restored at the end, however the script ends.
set -uo pipefail
cd "$(dirname "$0")/../.."
old=$1
shift
source scripts/dev/offline_wheels.sh
saved=$(mktemp -d)
status=0
if [[ -f $old && $old == *.so ]]; then
  library=diffusion_policy_accelerated/_C$(python3 -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
  [[ -f $library ]] || { echo "no built $library to compare with" >&2; exit 2; }
  cp "$library" "$saved/new.so"
  trap 'cp "$saved/new.so" "$library" && rm -rf "$saved"' EXIT
  for version in new old new; do
    if [[ $version == new ]]; then cp "$saved/new.so" "$library"; else cp "$old" "$library"; fi
    echo "== $version: library $(cmp -s "$library" "$saved/new.so" && echo "of the working tree" || echo "$old")"
    "$@" || status=1
  done
  exit $status
fi
if [[ -d $old/diffusion_policy_accelerated ]]; then
  old_path=$(cd "$old" && pwd)
  for version in new old new; do
    if [[ $version == new ]]; then
      echo "== new: the working tree's package"
      "$@" || status=1
    else
      echo "== old: the package in $old"
      PYTHONPATH=$old_path${PYTHONPATH:+:$PYTHONPATH} "$@" || status=1
    fi
  done
  exit $status
fi
[[ -d $old ]] || { echo "no folder or library $old" >&2; exit 2; }
export CC=${DPA_CC:-gcc} CXX=${DPA_CXX:-g++}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}
cp -r csrc "$saved/"
trap 'rm -rf csrc && cp -r "$saved/csrc" csrc && rm -rf "$saved"' EXIT
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
