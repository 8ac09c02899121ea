"""Where the single-kernel U-Net forward (dpa StreamProgram) spends its time, stage by stage:
each block stamps the global timer at points of its work (StreamProgram.run_traced), and for
every stage this prints, from the moment the previous stage's last output tile was finished:
when the blocks were released (median), had staged their input (median), had streamed their
weights (median and last), had counted their partial sums (last); when the finishing blocks
had started, had added up their tiles' partial sums and had the GroupNorm statistics (last);
and when the stage's last tile was finished. Medians over several traced runs.

    python scripts/trace_program.py [--unet lowdim] [--dtype float32] [--batch 1] [--runs 5]
                                    [--options 0]   (ops set_program_options bits)
"""
import argparse
import re
import statistics

import torch
from benchmark import HORIZON, SCHEDULER_CONFIG, UNETS
from diffusers import DDPMScheduler

from diffusion_policy_accelerated import ConditionalUnet1D, DenoiseSchedule
from diffusion_policy_accelerated.sampler import GraphedSampler

START, WAITED, STAGED, COMPUTED, ARRIVED, FINISHING, SUMMED, NORMALIZED, FINISHED = range(9)
COLUMNS = [("release", 8), ("staged", 7), ("streamed", 9), ("last", 6), ("counted", 8), ("finishing", 10),
           ("summed", 7), ("stats", 6), ("finished", 9)]


def weight_mb(name, element_size):
    total = 0
    for cin, cout, k in re.findall(r"(\d+)->(\d+) k(\d+)", name):
        total += int(cin) * int(cout) * int(k)
    return total * element_size / 1e6


def stage_rows(trace):
    """Per stage, µs after the previous stage's last tile: (released, staged, computed median,
    computed last, arrived last, finishing started last, summed last, normalized last,
    finished); and the whole forward's µs. Events a stage's blocks did not reach (stats: no
    GroupNorm) are nan."""
    trace = trace.double()
    rows = []
    first = previous = trace[0, :, START][trace[0, :, START] > 0].min()
    for s in range(trace.shape[0]):
        t = trace[s]
        used = t[:, START] > 0
        finished = t[:, FINISHED][t[:, FINISHED] > 0].max()

        def rel(event, reduce):
            values = t[used & (t[:, event] > 0), event] - previous
            if values.numel() == 0:
                return float("nan")
            return float(values.median() if reduce == "median" else values.max()) / 1e3

        rows.append((rel(WAITED, "median"), rel(STAGED, "median"), rel(COMPUTED, "median"),
                     rel(COMPUTED, "max"), rel(ARRIVED, "max"), rel(FINISHING, "max"), rel(SUMMED, "max"),
                     rel(NORMALIZED, "max"), float(finished - previous) / 1e3))
        previous = finished
    return rows, float(previous - first) / 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--unet", default="lowdim", choices=list(UNETS))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--options", type=int, default=0, help="ops set_program_options bits")
    args = parser.parse_args()
    from diffusion_policy_accelerated import ops
    ops._C.set_program_options(args.options)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    unet = ConditionalUnet1D(**UNETS[args.unet]).cuda().eval().to(dtype)
    schedule = DenoiseSchedule.from_diffusers(DDPMScheduler(**SCHEDULER_CONFIG), 100).to("cuda")
    sampler = GraphedSampler(unet, schedule, use_cuda_graph=False, single_kernel_unet=True)
    program = sampler._program((args.batch, HORIZON, False))
    program.sample.normal_()
    program.film.normal_()
    for _ in range(3):
        program.run()
    runs = [stage_rows(program.program.run_traced().cpu()) for _ in range(args.runs)]
    names = program.program.stage_names()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.unet} U-Net, {args.dtype}, "
          f"batch {args.batch}, program options {args.options}: {len(names)} stages, forward "
          f"{statistics.median(r[1] for r in runs):.1f} us (traced, median of {args.runs})")
    print(f"{'stage':58} {'MB':>6} " + " ".join(f"{c:>{w}}" for c, w in COLUMNS))
    for s, name in enumerate(names):
        values = [statistics.median(r[0][s][i] for r in runs) for i in range(len(COLUMNS))]
        print(f"{s:2} {name[:55]:55} {weight_mb(name, dtype.itemsize):6.2f} "
              + " ".join(f"{v:{w}.2f}" for v, (_, w) in zip(values, COLUMNS)))


if __name__ == "__main__":
    main()
