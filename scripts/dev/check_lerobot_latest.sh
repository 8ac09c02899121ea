#!/usr/bin/env bash
# Tests the LeRobot adapter against LeRobot's current release, as CI does beside the 0.4.4 of
# its main environment: lerobot 0.6.x needs Python >= 3.12, so it gets a virtual environment of
# that Python (build/lerobot-<version>), a CPU-only build of the package in a copy of the
# sources (build/lerobot-<version>/src: its objects are kept, so a second run only relinks), and
# tests/adapters/test_lerobot.py, which must run, not skip.
#
#   bash scripts/dev/check_lerobot_latest.sh [PYTHON]   # default: python3.12 on PATH, else pyenv's newest 3.12
#
# LEROBOT_VERSION (default 0.6.1) picks the release; requirements-lerobot-latest.txt lists what
# its diffusion policy imports (LeRobot itself is installed with --no-deps).
set -euo pipefail
cd "$(dirname "$0")/../.."
lerobot_version=${LEROBOT_VERSION:-0.6.1}
# The first interpreter that runs and is 3.12 or newer (a pyenv shim of a version not selected
# does not run).
python=
for candidate in ${1:-python3.12 $(ls -d "$HOME"/.pyenv/versions/3.12*/bin/python3 2>/dev/null | sort -rV)}; do
  if "$candidate" -c "import sys; sys.exit(sys.version_info < (3, 12))" 2>/dev/null; then
    python=$candidate
    break
  fi
done
if [ -z "$python" ]; then
  echo "LeRobot $lerobot_version needs Python >= 3.12: give its interpreter (tried: ${1:-python3.12 and ~/.pyenv/versions/3.12*})"
  exit 1
fi
start=$(date +%s)
venv=$PWD/build/lerobot-$lerobot_version
if [ ! -x "$venv/bin/python" ]; then
  echo "LeRobot $lerobot_version: a virtual environment of $("$python" --version) in $venv"
  # The interpreter's own packages stay visible: where torch 2.11 is installed there already
  # (pyenv's on the CI machine), pip keeps it instead of downloading it again.
  "$python" -m venv --system-site-packages "$venv"
fi
"$venv/bin/python" -m pip install -q --disable-pip-version-check -r requirements-lerobot-latest.txt
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps "lerobot==$lerobot_version"
"$venv/bin/python" -c "import lerobot.policies.diffusion.modeling_diffusion" \
  || { echo "LeRobot $lerobot_version does not import (requirements-lerobot-latest.txt)"; exit 1; }
# The tracked sources and the untracked ones git does not ignore, over the previous copy with
# their times kept (so that ninja recompiles only what changed); files deleted since go too.
src=$venv/src
rm -rf "$src/csrc" "$src/diffusion_policy_accelerated" "$src/tests" "$src/scripts"
mkdir -p "$src"
git ls-files -z --cached --others --exclude-standard csrc diffusion_policy_accelerated tests scripts setup.py \
  pyproject.toml | xargs -0 cp -p --parents -t "$src"
cd "$src"
echo "LeRobot $lerobot_version: CPU-only build for $("$venv/bin/python" --version)"
DPA_CPU_ONLY=1 MAX_JOBS=${MAX_JOBS:-2} "$venv/bin/python" setup.py -q build_ext --inplace >build.log 2>&1 \
  || { tail -40 build.log; exit 1; }
echo "LeRobot $lerobot_version: tests/adapters/test_lerobot.py"
# -rs lists skips: a skipped module (LeRobot not importing) is a failure here.
DPA_CPU_ONLY=1 "$venv/bin/python" -m pytest -q -rs -p no:cacheprovider tests/adapters/test_lerobot.py | tee pytest.log
if grep -q "LeRobot is not installed" pytest.log; then
  echo "LeRobot $lerobot_version: the tests skipped instead of running"
  exit 1
fi
echo "LeRobot $lerobot_version: tests/adapters/test_lerobot.py passed ($(($(date +%s) - start)) s)"
