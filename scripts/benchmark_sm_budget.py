"""Milliseconds per action chunk on a share of the GPU's SMs: a smaller GPU measured on a large one.

Each SM budget runs in a process of its own confined to that many SMs by a CUDA green context
(torch.cuda.green_contexts), made current before the process creates any stream, so that every
kernel, cuBLAS call and CUDA graph of it runs there. The driver rounds the budget to its SM
granularity (multiples of 8 on Hopper): the table gives the SMs asked for and those the context
got. A budget of the device's SM count or more runs on the whole GPU, without a green context.
Per budget, U-Net and batch, side by side:

  graph            the denoising loop in pure PyTorch (plain U-Net, diffusers' step math),
                   captured whole as one CUDA graph (scripts/benchmark.py)
  ours             GraphedSampler, fp32, KernelConfig(sm_count=the context's SMs)
  ours portable    the same without thread-block clusters and programmatic dependent launch
                   (what GPUs before Hopper run)
  ours unplanned   ours with its launch plans sized for the whole GPU (sm_count unset), to
                   show what the planner's budget buys

and a probe: an fp32 8192^3 matmul graphed, whose speed against the largest budget's (the whole
GPU's where it is one) shows that the context does confine the work.

    python -m scripts.benchmark_sm_budget [--sms 16 48 108 132] [--unet lowdim image] [--batch 1]
                                          [--schedule DDPM-100] [--out DIR]
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

from diffusion_policy_accelerated import ConditionalUnet1D, DenoiseSchedule
from diffusion_policy_accelerated.kernels.config import kernel_config
from diffusion_policy_accelerated.model.configs import HORIZON, SCHEDULER_CONFIG, UNETS
from diffusion_policy_accelerated.sampling.sampler import GraphedSampler
from diffusion_policy_accelerated.tools.profiling import median_ms
from diffusion_policy_accelerated.tools.sm_budget import confine_to_sms
from scripts.benchmark import SCHEDULES, graphed_pytorch_loop, loop_inputs

METHODS = ("graph", "ours", "ours portable", "ours unplanned")


def probe_ms():
    """ms of a graphed fp32 8192^3 matmul: compute-bound, so its time scales with the SMs."""
    a = torch.randn(8192, 8192, device="cuda")
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        a @ a
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        a @ a
    return median_ms(graph.replay, reps=5)


def worker(args):
    """One SM budget, in this process: prints one JSON line of results."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device_sms = torch.cuda.get_device_properties(0).multi_processor_count
    try:
        got = confine_to_sms(args.worker)
    except (ValueError, RuntimeError) as error:
        raise SystemExit(str(error))
    print(f"  {args.worker} SMs asked, {got} given: probe", file=sys.stderr, flush=True)
    result = dict(sms_asked=args.worker, sms=got, device_sms=device_sms, probe_ms=probe_ms(), rows=[])
    scheduler_cls, steps = SCHEDULES[args.schedule]
    schedule = DenoiseSchedule.from_diffusers(scheduler_cls(**SCHEDULER_CONFIG), steps).to("cuda")
    configs = {"ours": dict(sm_count=got), "ours portable": dict(sm_count=got, clusters=False, pdl=False),
               "ours unplanned": dict()}
    for unet_name in args.unet:
        torch.manual_seed(0)
        unet = ConditionalUnet1D(**UNETS[unet_name]).cuda().eval()
        for batch in args.batch:
            print(f"  {got} SMs: {unet_name} batch {batch}", file=sys.stderr, flush=True)
            data, mask, cond, noise, _ = loop_inputs(unet_name, batch, HORIZON, steps)
            times = {}
            with torch.inference_mode():
                unet.use_fused_ops = False
                times["graph"] = median_ms(graphed_pytorch_loop(unet, schedule, data, mask, cond, noise))
                unet.use_fused_ops = True
                for method, changes in configs.items():
                    if method == "ours unplanned" and got == device_sms:
                        continue  # the same as ours
                    with kernel_config(**changes):
                        sampler = GraphedSampler(unet, schedule)
                        times[method] = median_ms(lambda: sampler(data, mask, global_cond=cond, noise=noise))
            result["rows"].append(dict(unet=unet_name, batch=batch, **times))
    print(json.dumps(result), flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sms", type=int, nargs="+", default=[16, 48, 108, 132], help="SM budgets")
    parser.add_argument("--unet", nargs="+", default=["lowdim", "image"], choices=list(UNETS))
    parser.add_argument("--batch", type=int, nargs="+", default=[1])
    parser.add_argument("--schedule", default="DDPM-100", choices=list(SCHEDULES))
    parser.add_argument("--out", default=".", help="folder for sm_budget.json and sm_budget.png")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)  # one budget, in a child process
    args = parser.parse_args(argv)
    for name, values in (("--sms", args.sms), ("--batch", args.batch)):
        if any(v < 1 for v in values):
            parser.error(f"{name} takes positive integers, got {values}")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    if args.worker is not None:
        return worker(args)

    from torch.cuda import green_contexts
    if not green_contexts.SUPPORTED and min(args.sms) < torch.cuda.get_device_properties(0).multi_processor_count:
        parser.error("this PyTorch build has no CUDA green contexts (torch.cuda.green_contexts.SUPPORTED)")
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  {args.schedule}  horizon {HORIZON}  fp32  "
          f"TF32 off", flush=True)
    results = []
    for budget in args.sms:
        command = [sys.executable, "-m", __spec__.name, "--worker", str(budget), "--unet", *args.unet,
                   "--batch", *map(str, args.batch), "--schedule", args.schedule]
        done = subprocess.run(command, stdout=subprocess.PIPE, text=True)
        if done.returncode != 0:
            raise SystemExit(f"the {budget}-SM run failed (exit {done.returncode})")
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    whole = max(results, key=lambda r: r["sms"])  # the probe's reference: the largest budget run
    print(f"{'SMs':>9} {'probe x':>8} {'U-Net':7} {'B':>3} " + " ".join(f"{m:>15}" for m in METHODS)
          + f" {'graph/ours':>10} {'portable/ours':>13}")
    for result in results:
        # The probe's speed against the whole GPU's, which tracks the SMs the context has.
        speed = whole["probe_ms"] / result["probe_ms"]
        for row in result["rows"]:
            cells = " ".join(f"{row[m]:15.2f}" if m in row else f"{'-':>15}" for m in METHODS)
            print(f"{result['sms']:>4} ({result['sms_asked']:>3}) {speed:7.2f}x {row['unet']:7} {row['batch']:3} {cells} "
                  f"{row['graph'] / row['ours']:9.2f}x {row['ours portable'] / row['ours']:12.2f}x")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, schedule=args.schedule, horizon=HORIZON)
    (out / "sm_budget.json").write_text(json.dumps(dict(meta, results=results), indent=1))
    plot(results, meta, out / "sm_budget.png")


def plot(results, meta, path):
    """ms per action against the SMs, one panel per U-Net and batch, one line per method."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((row["unet"], row["batch"]) for r in results for row in r["rows"]))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4), squeeze=False)
    for ax, (unet, batch) in zip(axes[0], panels):
        for method in METHODS:
            points = [(r["sms"], row[method]) for r in results for row in r["rows"]
                      if (row["unet"], row["batch"]) == (unet, batch) and method in row]
            if points:
                ax.plot(*zip(*sorted(points)), marker="o", label=method)
        ax.set_xlabel("SMs")
        ax.set_ylabel("ms per action chunk")
        ax.set_yscale("log")
        ax.set_title(f"{unet}, batch {batch}, {meta['schedule']}", fontsize=9)
        ax.legend(fontsize=8)
    fig.suptitle(f"{meta['device']}, SMs confined by green contexts", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
