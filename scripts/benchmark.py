"""Milliseconds per action chunk, side by side, for Diffusion Policy's lowdim and image U-Nets:

  eager     PyTorch U-Net + diffusers' scheduler, step by step (what Diffusion Policy does)
  graph     the same loop in pure PyTorch, captured whole as one CUDA graph
  compile   torch.compile(mode="max-autotune") U-Net + diffusers (only with --compile: minutes)
  ours      GraphedSampler (fused ops, hoisted FiLM, one graph), fp32 / bf16 / fp16 weights

Per row: ms per action, µs per step, speed-ups over eager / graph / compile, the ratio to the
floor, and for half-precision weights the largest action difference from ours in fp32 on the
same noise and observations. The floor: the weight bytes one step must read (every conv of the U-Net) over the
device-to-device copy bandwidth measured in the same run. Medians of CUDA-event timings after
warm-up; TF32 is off for the PyTorch baselines. Writes JSON and a PNG plot.

    python scripts/benchmark.py [--unet lowdim image lerobot] [--batch 1 8 64] [--horizon 16] [--compile]
                                [--out DIR] [--ours-only] [--gemm-min-positions N] [--gemm-min-work N]
                                [--taps-major-min-work N] [--taps-major-min-work-batch-1 N] [--portable]

--ours-only skips the baselines (a quick A/B of our variants); --portable runs ours as GPUs
before Hopper do (no thread-block clusters or programmatic dependent launch).
"""
import argparse
import json
from pathlib import Path

import torch
from diffusers import DDIMScheduler, DDPMScheduler

from diffusion_policy_accelerated import ConditionalUnet1D, DenoiseSchedule
from diffusion_policy_accelerated.model.configs import HORIZON, SCHEDULER_CONFIG, UNETS
from diffusion_policy_accelerated.tools.profiling import copy_bandwidth_gbs, median_ms, plot_grouped_bars
from diffusion_policy_accelerated.kernels.config import kernel_config
from diffusion_policy_accelerated.sampling.sampler import GraphedSampler

SCHEDULES = {"DDPM-100": (DDPMScheduler, 100), "DDIM-16": (DDIMScheduler, 16)}


def dp_loop(unet, scheduler, steps, data, mask, global_cond, generator):
    """Diffusion Policy's conditional_sample, verbatim in structure."""
    trajectory = torch.randn(data.shape, device=data.device, dtype=data.dtype, generator=generator)
    scheduler.set_timesteps(steps)
    for t in scheduler.timesteps:
        trajectory[mask] = data[mask]
        model_output = unet(trajectory, t, global_cond=global_cond)
        trajectory = scheduler.step(model_output, t, trajectory, generator=generator).prev_sample
    trajectory[mask] = data[mask]
    return trajectory


def loop_inputs(unet_name, batch, horizon, steps):
    """One configuration's seeded inputs on CUDA: the trajectory's data, its mask (nothing
    conditioned), the global condition, the noise of every step, and the generator they came
    from (the eager loop draws its noise from it)."""
    gen = torch.Generator("cuda").manual_seed(0)
    data = torch.randn(batch, horizon, 2, device="cuda", generator=gen)
    mask = torch.zeros_like(data, dtype=torch.bool)
    global_cond = torch.randn(batch, UNETS[unet_name]["global_cond_dim"], device="cuda", generator=gen)
    noise = torch.randn((steps + 1,) + tuple(data.shape), device="cuda", generator=gen)
    return data, mask, global_cond, noise, gen


def graphed_pytorch_loop(unet, schedule, data, mask, global_cond, noise):
    """The loop in pure PyTorch ops (plain U-Net, diffusers' step math) as one CUDA graph."""
    timesteps = schedule.timesteps.to(data.device)

    def loop():
        trajectory = noise[0]
        for i in range(len(timesteps)):
            trajectory = torch.where(mask, data, trajectory)
            eps = unet(trajectory, timesteps[i], global_cond=global_cond)
            trajectory = schedule.reference_step(eps, i, trajectory,
                                                 noise[i + 1] if schedule.needs_noise(i) else None)
        return torch.where(mask, data, trajectory)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        loop()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loop()
    return graph.replay


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--unet", nargs="+", default=["lowdim", "image"], choices=list(UNETS))
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--horizon", type=int, nargs="+", default=[HORIZON])
    parser.add_argument("--schedule", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    parser.add_argument("--compile", action="store_true", help="add torch.compile max-autotune (slow)")
    parser.add_argument("--out", default=".", help="folder for benchmark.json and benchmark.png")
    parser.add_argument("--ours-only", action="store_true", help="skip eager, graph and compile")
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16", "float16"],
                        choices=["float32", "bfloat16", "float16"], help="the dtypes ours runs in")
    parser.add_argument("--gemm-min-positions", type=int,
                        help="run ours with this KernelConfig.gemm_min_positions (to measure a crossover)")
    parser.add_argument("--gemm-min-work", type=int,
                        help="run ours with this KernelConfig.gemm_min_work (2**62: no GEMMs below "
                             "gemm_min_positions by work)")
    parser.add_argument("--gemm-min-work-positions", type=int,
                        help="run ours with this KernelConfig.gemm_min_work_positions (the fewest positions "
                             "gemm_min_work applies from)")
    parser.add_argument("--taps-major-min-work", type=int,
                        help="run ours with this KernelConfig.taps_major_min_work (2**62: no taps-major "
                             "GEMMs below gemm_min_positions)")
    parser.add_argument("--taps-major-min-work-batch-1", type=int,
                        help="run ours with this KernelConfig.taps_major_min_work_batch_1 (2**62: no taps-major "
                             "GEMMs at batch 1 below 16 positions)")
    parser.add_argument("--portable", action="store_true",
                        help="run ours without thread-block clusters and programmatic dependent launch "
                             "(the path of GPUs before Hopper)")
    args = parser.parse_args()
    changes = {name: value for name, value in (("gemm_min_positions", args.gemm_min_positions),
                                                ("gemm_min_work", args.gemm_min_work),
                                                ("gemm_min_work_positions", args.gemm_min_work_positions),
                                                ("taps_major_min_work", args.taps_major_min_work),
                                                ("taps_major_min_work_batch_1", args.taps_major_min_work_batch_1))
               if value is not None}
    if args.portable:
        changes.update(clusters=False, pdl=False)
    with kernel_config(**changes):
        run(args)


def run(args):
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.benchmark = True
    bandwidth = copy_bandwidth_gbs()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  TF32 off (baselines)  "
          f"copy bandwidth {bandwidth:.0f} GB/s", flush=True)
    header = (f"{'U-Net':7} {'schedule':9} {'T':>4} {'B':>3} {'method':15} {'ms/action':>10} {'us/step':>9} "
              f"{'vs eager':>8} {'vs graph':>8} {'vs compile':>10} {'x floor':>8} {'max|da| fp32':>12}")
    print(header, flush=True)
    rows = []
    for unet_name in args.unet:
        torch.manual_seed(0)
        base = ConditionalUnet1D(**UNETS[unet_name]).cuda().eval()
        conv_params = sum(m.weight.numel() for m in base.modules()
                          if isinstance(m, (torch.nn.Conv1d, torch.nn.ConvTranspose1d)))
        for schedule_name in args.schedule:
            scheduler_cls, steps = SCHEDULES[schedule_name]
            scheduler = scheduler_cls(**SCHEDULER_CONFIG)
            schedule = DenoiseSchedule.from_diffusers(scheduler, steps).to("cuda")
            compiled = torch.compile(base, mode="max-autotune") if args.compile and not args.ours_only else None
            for horizon, batch in ((h, b) for h in args.horizon for b in args.batch):
                data, mask, global_cond, noise, gen = loop_inputs(unet_name, batch, horizon, steps)
                methods = {}
                with torch.inference_mode():
                    base.use_fused_ops = False
                    if not args.ours_only:
                        methods["eager"] = lambda: dp_loop(base, scheduler, steps, data, mask, global_cond, gen)
                        methods["graph"] = graphed_pytorch_loop(base, schedule, data, mask, global_cond, noise)
                    if compiled is not None:
                        methods["compile"] = lambda: dp_loop(compiled, scheduler, steps, data, mask, global_cond, gen)
                    results = {}
                    for name, fn in methods.items():
                        results[name] = median_ms(fn, reps=3 if name == "eager" else 7)
                    base.use_fused_ops = True
                    actions = {}
                    for dtype in (getattr(torch, name) for name in args.dtype):
                        unet = base if dtype == torch.float32 else \
                            ConditionalUnet1D(**UNETS[unet_name]).cuda().eval().to(dtype)
                        if unet is not base:
                            unet.load_state_dict(base.state_dict())
                        sampler = GraphedSampler(unet, schedule)
                        label = f"ours {str(dtype)[6:]}"
                        results[label] = median_ms(lambda: sampler(data, mask, global_cond=global_cond, noise=noise))
                        actions[dtype] = sampler(data, mask, global_cond=global_cond, noise=noise)
                        floor_ms = conv_params * dtype.itemsize / (bandwidth * 1e9) * 1e3 * steps
                        results[label + "/floor"] = floor_ms
                fp32_floor = conv_params * 4 / (bandwidth * 1e9) * 1e3 * steps
                for name, ms in results.items():
                    if name.endswith("/floor"):
                        continue
                    floor = results.get(name + "/floor", fp32_floor)
                    ratio = lambda other: f"{results[other] / ms:7.2f}x" if other in results else f"{'-':>8}"
                    dtype = {"ours bfloat16": torch.bfloat16, "ours float16": torch.float16}.get(name)
                    # Same noise and observations: how far half-precision weights move the action.
                    error = None if dtype is None or torch.float32 not in actions else \
                        (actions[dtype] - actions[torch.float32]).abs().max().item()
                    row = dict(unet=unet_name, schedule=schedule_name, horizon=horizon, batch=batch, method=name,
                               ms_per_action=ms, us_per_step=1e3 * ms / steps, floor_ms=floor,
                               action_error_vs_fp32=error,
                               device=torch.cuda.get_device_name(), torch=torch.__version__)
                    rows.append(row)
                    print(f"{unet_name:7} {schedule_name:9} {horizon:4} {batch:3} {name:15} {ms:10.2f} {row['us_per_step']:9.1f} "
                          f"{ratio('eager'):>8} {ratio('graph'):>8} {ratio('compile'):>10} {ms / floor:7.1f}x"
                          + ("" if error is None else f" {error:12.2e}"), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "benchmark.json").write_text(json.dumps(dict(copy_bandwidth_gbs=bandwidth, rows=rows), indent=1))
    plot(rows, out / "benchmark.png")


def plot(rows, path):
    # Sorted, as the table's configurations were before: U-Net, schedule, horizon, batch.
    rows = sorted(rows, key=lambda r: (r["unet"], r["schedule"], r["horizon"], r["batch"]))
    plot_grouped_bars(rows, ("unet", "schedule", "horizon", "batch"), lambda u, s, t, b: f"{u}\n{s}\nT={t} B={b}",
                      "ms_per_action", "ms per action chunk (log)",
                      f"Diffusion Policy denoising loop, {rows[0]['device']}", path)


if __name__ == "__main__":
    main()
