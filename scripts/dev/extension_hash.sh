#!/usr/bin/env bash
# Prints a hash of what the compiled extension is built from (its sources, the build settings,
# the GPU archs asked for): a library built elsewhere (build_offline.sh) is used only where
# this matches.
cd "$(dirname "$0")/../.."
# The C locale: the files' order (and so the hash) must not depend on the machine's collation.
export LC_ALL=C
{ find csrc -type f | sort | xargs cat; cat setup.py pyproject.toml diffusion_policy_accelerated/kernels/library.py
  echo "${TORCH_CUDA_ARCH_LIST:-9.0}"; } | sha256sum | cut -d' ' -f1
