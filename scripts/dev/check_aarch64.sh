#!/usr/bin/env bash
# Compiles the CPU sources for aarch64 (a Jetson's CPU, Graviton, Ampere Altra) with Debian's
# GCC 12 cross compiler, as a CPU-only build would there: their vector code takes per-ISA
# branches (x86's AVX2 and AVX-512 entry points, NEON's 4 lanes elsewhere), and an x86-only
# build would not notice a branch that breaks the other. Compiles only; nothing runs.
#
#   bash scripts/dev/check_aarch64.sh [python]     # python: the one whose torch to compile against
#
# Needs apt-get (Debian or Ubuntu): the cross compiler's packages are downloaded and unpacked
# into build/aarch64-gcc, not installed, so root is not needed.
set -euo pipefail
cd "$(dirname "$0")/../.."
python=${1:-python3}
root=$PWD/build/aarch64-gcc
packages="g++-12-aarch64-linux-gnu gcc-12-aarch64-linux-gnu cpp-12-aarch64-linux-gnu binutils-aarch64-linux-gnu
  libgcc-12-dev-arm64-cross libgomp1-arm64-cross libc6-arm64-cross libc6-dev-arm64-cross linux-libc-dev-arm64-cross
  libstdc++6-arm64-cross libstdc++-12-dev-arm64-cross libasan8-arm64-cross libatomic1-arm64-cross
  libhwasan0-arm64-cross liblsan0-arm64-cross libtsan2-arm64-cross libubsan1-arm64-cross libitm1-arm64-cross"
gxx=$root/usr/bin/aarch64-linux-gnu-g++-12
if [ ! -x "$gxx" ]; then
  command -v apt-get >/dev/null || { echo "check_aarch64.sh: needs apt-get to fetch the cross compiler"; exit 1; }
  echo "fetching Debian's aarch64 cross compiler into $root"
  mkdir -p "$root/debs"
  (cd "$root/debs" && apt-get download $packages 2>&1 | grep -vE "^Get:|unsandboxed" || true)
  for deb in "$root"/debs/*.deb; do dpkg -x "$deb" "$root"; done
fi
# The cross assembler's own libraries were unpacked beside it, not installed.
export LD_LIBRARY_PATH=$root/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
includes=$("$python" - <<'EOF'
import sysconfig
import torch.utils.cpp_extension as ext
print(" ".join(["-I" + p for p in ext.include_paths()] + ["-I" + sysconfig.get_paths()["include"]]))
EOF
)
flags=$("$python" -c "from diffusion_policy_accelerated.kernels.library import CXX_FLAGS; print(' '.join(CXX_FLAGS))")
mapfile -t files < <("$python" -c "
from diffusion_policy_accelerated.kernels.library import sources
print('\n'.join(sources(with_cuda=False)))")
echo "compiling ${#files[@]} CPU sources for aarch64 ($("$gxx" --version | head -1); $flags)"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
failed=0
for file in "${files[@]}"; do
  # -B: the unpacked compiler finds its own cc1plus and assembler, not the host's.
  if ! "$gxx" -B"$root/usr/lib/gcc-cross/aarch64-linux-gnu/12" -B"$root/usr/bin/aarch64-linux-gnu-" \
      --sysroot="$root/usr/aarch64-linux-gnu" -std=c++17 $flags -Wall -Icsrc $includes \
      -c "$file" -o "$out/$(basename "$file").o"; then
    echo "FAILED: $file"
    failed=1
  fi
done
[ "$failed" -eq 0 ] || exit 1
echo "aarch64: all ${#files[@]} CPU sources compiled"
