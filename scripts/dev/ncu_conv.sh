#!/usr/bin/env bash
# Nsight Compute on the fused Conv1dBlock kernel at given shapes (batch 1): where a
# streaming kernel's time goes (DRAM throughput, occupancy, warp stalls). One process per
# shape; the first calls are skipped so the profiled one is warm (code, L2-resident input).
#   bash scripts/dev/ncu_conv.sh "256 256 16" "1024 1024 4 bfloat16"
# (C_in C_out L [dtype, default float32], kernel size 5)
set -uo pipefail
for shape in "$@"; do
  read -r cin cout length dtype <<<"$shape"
  dtype=${dtype:-float32}
  echo "== conv1d_gn_mish C_in=$cin C_out=$cout L=$length $dtype"
  # Without cache control the weights are cold (as in the U-Net) but x and the workspace are
  # warm in L2, as they are between layers.
  ncu --clock-control none --cache-control none --kernel-name regex:stream_conv --launch-skip 5 \
    --launch-count 1 --section SpeedOfLight --section Occupancy --section WarpStateStats \
    --section LaunchStats --section SourceCounters --section MemoryWorkloadAnalysis \
    python3 - "$cin" "$cout" "$length" "$dtype" <<'PY' 2>&1 | grep -vE "^==PROF==|^ *-+ *-+|^\s*$" | sed 's/^ *//' | cut -c1-140
import sys, torch
from diffusion_policy_accelerated.kernels import ops
cin, cout, length = map(int, sys.argv[1:4])
dtype = getattr(torch, sys.argv[4])
x = torch.randn(1, cin, length, device="cuda", dtype=dtype)
# Six weight copies, more than L2 holds for the large layers: the profiled (sixth) call
# streams its weights from HBM.
ws = [(torch.randn(cout, cin, 5, device="cuda") / (5 * cin) ** 0.5).to(dtype) for _ in range(6)]
b = torch.randn(cout, device="cuda", dtype=dtype)
counters = torch.zeros(cout, dtype=torch.int32, device="cuda")
for w in ws:
    ops.conv1d_gn_mish(x, w, b, b, b, 8, counters=counters)
torch.cuda.synchronize()
PY
done
