#!/usr/bin/env bash
# Nsight Compute on the single-kernel U-Net forward (dpa StreamProgram, lowdim, batch 1):
# its throughput, occupancy, spills and where its warps stall (per reason).
#   bash scripts/ncu_program.sh [float32|bfloat16]   (report and CSVs under ${DPA_WORK:-/tmp})
set -uo pipefail
dtype=${1:-float32}
work=${DPA_WORK:-/tmp}
ncu --clock-control none --kernel-name regex:program_kernel --launch-skip 3 --launch-count 1 \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
  --section SourceCounters --section Occupancy --section LaunchStats --section SchedulerStats \
  --import-source yes -f -o "$work/program" python3 - "$dtype" <<'PY' >"$work/ncu_program_run.txt" 2>&1
import sys, torch
sys.path.insert(0, "scripts")
from benchmark import UNETS, SCHEDULER_CONFIG
from diffusers import DDPMScheduler
from diffusion_policy_accelerated import ConditionalUnet1D, DenoiseSchedule
from diffusion_policy_accelerated.sampler import GraphedSampler
dtype = getattr(torch, sys.argv[1])
unet = ConditionalUnet1D(**UNETS["lowdim"]).cuda().eval().to(dtype)
schedule = DenoiseSchedule.from_diffusers(DDPMScheduler(**SCHEDULER_CONFIG), 100).to("cuda")
program = GraphedSampler(unet, schedule, use_cuda_graph=False, single_kernel_unet=True)._program((1, 16, False))
for _ in range(5):
    program.run()
torch.cuda.synchronize()
PY
tail -3 "$work/ncu_program_run.txt"
ncu --import "$work/program.ncu-rep" --page details 2>&1 | grep -vE "^ *-+ *-+|^\s*$" | sed 's/^ *//' | cut -c1-150
ncu --import "$work/program.ncu-rep" --page raw --csv \
  --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio >"$work/ncu_program_stalls.csv" 2>&1
python3 - "$work/ncu_program_stalls.csv" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
header, values = rows[0], rows[-1]
stalls = [(float(v), h) for h, v in zip(header, values) if "stalled" in h and v.replace(".", "", 1).isdigit()]
print("== stall reasons (warps per issue-active cycle)")
for v, h in sorted(stalls, reverse=True)[:12]:
    print(f"{v:8.3f}  {h.replace('smsp__average_warps_issue_stalled_', '').replace('_per_issue_active.ratio', '')}")
PY
