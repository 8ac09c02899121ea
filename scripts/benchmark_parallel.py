"""Parallel sampling (Picard iterations) against the sequential loop, on trained policies.

Trains (or loads) U-Nets on the synthetic multimodal task (tools/synthetic_task.py: several
goals per observation), then prints, in one run on one GPU:

  quality  per U-Net, schedule and dtype: the task metric (goal-reached rate, mode balance)
           of the sequential and the parallel sampler over many samples, the parallel
           sampler's iterations per action at batch 1 (mean, max), and the largest distance
           between the two samplers' actions for the same noise;
  sweep    ms per action and iterations of window x tolerance (bf16, DDPM-100, batch 1);
  speed    ms per action chunk of the sequential and the parallel sampler at batch 1 and 8
           (medians of CUDA-event timings of whole graph replays), the iterations, and each
           one's ratio to the sequential floor: steps x the convs' weight bytes / the copy
           bandwidth measured in the same run.

    python scripts/benchmark_parallel.py [--unet lowdim image lerobot] [--train-seconds 90]
        [--weights DIR] [--save DIR] [--window 16] [--tolerance 0.1] [--out DIR]

--weights reads <unet>.pt files (scripts/train_synthetic.py --out) instead of training;
--save writes the trained ones. Writes parallel.json and parallel.png to --out.

--sms N runs it all on N of the GPU's SMs (a CUDA green context, tools/sm_budget.py, with the
kernels' launch plans sized for them): a smaller GPU's compute, with the large GPU's memory
bandwidth and caches. With --speed-only (the quality does not depend on the SMs):

    for n in 16 32; do python scripts/benchmark_parallel.py --weights W --speed-only --sms $n --tag _$n; done
"""
import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from diffusion_policy_accelerated import ConditionalUnet1D, Picard
from diffusion_policy_accelerated.kernels.config import kernel_config
from diffusion_policy_accelerated.model.configs import HORIZON, UNETS
from diffusion_policy_accelerated.sampling.sampler import GraphedSampler
from diffusion_policy_accelerated.tools import synthetic_task as task
from diffusion_policy_accelerated.tools.profiling import (copy_bandwidth_gbs, median_ms, plot_grouped_bars,
                                                         read_bandwidth_gbs, wall_ms)
from diffusion_policy_accelerated.tools.sm_budget import confine_to_sms

# LeRobot 0.6's default horizon; Diffusion Policy's U-Nets run at 16.
HORIZONS = {"lowdim": HORIZON, "image": HORIZON, "lerobot": 64}
SCHEDULES = {"DDPM-100": ("ddpm", 100), "DDIM-16": ("ddim", 16)}


DEVICE = "cuda"
CONFIGS = dict(UNETS)


def time_ms(fn):
    """Median ms of fn(): CUDA events on a GPU, the wall clock on the CPU."""
    return median_ms(fn) if DEVICE == "cuda" else wall_ms(fn, warmup=1, reps=3, device="cpu")


def device_name():
    return torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU"


def log(message):
    print(message, file=sys.stderr, flush=True)


def trained_unet(name, args):
    horizon = HORIZONS[name]
    if args.weights:
        unet = task.load_trained(Path(args.weights) / f"{name}.pt", DEVICE)
        log(f"{name}: loaded {args.weights}/{name}.pt")
        return unet
    torch.manual_seed(0)
    unet = ConditionalUnet1D(**CONFIGS[name]).to(DEVICE)
    train = dict(batch_size=args.batch_size, lr=args.lr, device=DEVICE, horizon=horizon,
                 autocast_dtype=torch.bfloat16, progress=log)
    # A short probe, after one warm-up, sets the step count that fills --train-seconds (one
    # cosine schedule).
    task.train(unet, steps=3, seed=1, ema_decay=None, **train)
    start = time.perf_counter()
    task.train(unet, steps=20, seed=1, ema_decay=None, **dict(train, progress=None))
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    steps = max(100, int(args.train_seconds * 20 / (time.perf_counter() - start)))
    log(f"{name}: training on the synthetic task, {steps} steps of batch {args.batch_size} "
        f"(~{args.train_seconds:.0f} s, horizon {horizon})...")
    start = time.perf_counter()
    task.train(unet, steps=steps, seed=2, **train)
    log(f"{name}: trained in {time.perf_counter() - start:.0f} s")
    if args.save:
        Path(args.save).mkdir(parents=True, exist_ok=True)
        task.save_trained(Path(args.save) / f"{name}.pt", unet, CONFIGS[name])
    return unet.eval()


def samplers(unet, kind, steps, picard):
    schedule = task.make_schedule(kind, steps)
    return GraphedSampler(unet, schedule), GraphedSampler(unet, schedule, parallel=picard)


def quality(name, unet, picard, args):
    """The task metric of both samplers, iterations at batch 1, and their actions' distance."""
    horizon, rows = HORIZONS[name], []
    for schedule_name, (kind, steps) in SCHEDULES.items():
        for dtype in (torch.float32, torch.bfloat16):
            model = unet.to(dtype)
            sequential, parallel = samplers(model, kind, steps, picard)
            metric, actions = {}, {}
            for label, sampler in (("sequential", sequential), ("parallel", parallel)):
                def sample(cond, gen, sampler=sampler, label=label):
                    out = task.sample_actions(sampler, cond.to(dtype), horizon, gen)
                    actions[label] = out
                    return out
                metric[label] = task.evaluate_sampler(sample, global_cond_dim=model.global_cond_dim, horizon=horizon,
                                                      device=DEVICE, observations=args.observations,
                                                      samples=args.samples)
            distance = task.action_distance(actions["parallel"], actions["sequential"])
            iterations = []
            batch = task.sample_batch(args.single_calls, torch.Generator().manual_seed(7), "cpu", horizon,
                                      model.global_cond_dim)
            gen = torch.Generator(DEVICE).manual_seed(8)
            for i in range(args.single_calls):
                task.sample_actions(parallel, batch.global_cond[i:i + 1].to(DEVICE, dtype), horizon, gen)
                iterations.append(parallel.last_iterations)
            row = dict(unet=name, schedule=schedule_name, dtype=str(dtype)[6:], window=picard.window,
                       tolerance=picard.tolerance, steps=steps,
                       reached_sequential=metric["sequential"]["reached_rate"],
                       reached_parallel=metric["parallel"]["reached_rate"],
                       balance_sequential=metric["sequential"]["mode_balance"],
                       balance_parallel=metric["parallel"]["mode_balance"],
                       balance_chance=metric["sequential"]["mode_balance_chance"],
                       iterations_mean=statistics.mean(iterations), iterations_max=max(iterations),
                       max_abs_distance=distance["max_abs"], mean_abs_distance=distance["mean_abs"])
            rows.append(row)
            print(f"{name:7} {schedule_name:8} {row['dtype']:8} reached {row['reached_sequential']:6.1%} / "
                  f"{row['reached_parallel']:6.1%}  balance {row['balance_sequential']:.3f} / "
                  f"{row['balance_parallel']:.3f} (fair picks {row['balance_chance']:.3f})  iterations "
                  f"{row['iterations_mean']:5.1f} (max {row['iterations_max']:3d}) of {steps}  |da| max "
                  f"{distance['max_abs']:.2e} mean {distance['mean_abs']:.2e}", flush=True)
    unet.float()
    return rows


def call(sampler, batch, horizon, unet, dtype, gen):
    data = torch.zeros(batch, horizon, 2, device=DEVICE, dtype=dtype)
    mask = torch.zeros_like(data, dtype=torch.bool)
    cond = task.sample_batch(batch, gen, "cpu", horizon, unet.global_cond_dim).global_cond.to(DEVICE, dtype)
    noise = torch.randn(sampler.num_steps + 1, batch, horizon, 2, device=DEVICE, dtype=dtype)
    return lambda: sampler(data, mask, global_cond=cond, noise=noise)


def speed(name, unet, picard, args, bandwidth):
    horizon, rows = HORIZONS[name], []
    conv_params = sum(m.weight.numel() for m in unet.modules()
                      if isinstance(m, (torch.nn.Conv1d, torch.nn.ConvTranspose1d)))
    for schedule_name, (kind, steps) in SCHEDULES.items():
        for dtype in (torch.float32, torch.bfloat16):
            model = unet.to(dtype)
            floor = steps * conv_params * dtype.itemsize / (bandwidth * 1e9) * 1e3
            for batch in args.batch:
                sequential, parallel = samplers(model, kind, steps, picard)
                gen = torch.Generator().manual_seed(batch)
                with torch.inference_mode():
                    seq_ms = time_ms(call(sequential, batch, horizon, model, dtype, gen))
                    run = call(parallel, batch, horizon, model, dtype, gen)
                    par_ms = time_ms(run)
                iterations = parallel.last_iterations
                for method, ms, its in (("sequential", seq_ms, steps), ("parallel", par_ms, iterations)):
                    row = dict(unet=name, schedule=schedule_name, dtype=str(dtype)[6:], batch=batch, method=method,
                               ms_per_action=ms, iterations=its, floor_ms=floor, window=picard.window,
                               tolerance=picard.tolerance, device=device_name(),
                               torch=torch.__version__)
                    rows.append(row)
                print(f"{name:7} {schedule_name:8} {str(dtype)[6:]:8} B{batch:<3} sequential {seq_ms:8.2f} ms "
                      f"({seq_ms / floor:5.2f}x floor)  parallel {par_ms:8.2f} ms ({par_ms / floor:5.2f}x floor, "
                      f"{iterations} iterations)  {seq_ms / par_ms:5.2f}x", flush=True)
    unet.float()
    return rows


def sweep(name, unet, args):
    """window x tolerance, bf16, DDPM-100, batch 1: ms and iterations."""
    model, rows = unet.to(torch.bfloat16), []
    print(f"window x tolerance ({name}, bf16, DDPM-100, batch 1): ms per action / iterations", flush=True)
    for window in args.sweep_windows:
        cells = []
        for tolerance in args.sweep_tolerances:
            _, parallel = samplers(model, "ddpm", 100, Picard(window=window, tolerance=tolerance))
            with torch.inference_mode():
                ms = time_ms(call(parallel, 1, HORIZONS[name], model, torch.bfloat16, torch.Generator().manual_seed(0)))
            rows.append(dict(unet=name, window=window, tolerance=tolerance, ms_per_action=ms,
                             iterations=parallel.last_iterations))
            cells.append(f"{ms:6.2f} / {parallel.last_iterations:3d}")
        print(f"  window {window:3d}: " + "   ".join(f"tol {t}: {c}" for t, c in zip(args.sweep_tolerances, cells)),
              flush=True)
    unet.float()
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--unet", nargs="+", default=["lowdim", "lerobot"], choices=list(UNETS))
    parser.add_argument("--weights", help="a folder of <unet>.pt files (scripts/train_synthetic.py --out)")
    parser.add_argument("--save", help="write the trained U-Nets here")
    parser.add_argument("--train-seconds", type=float, default=90.0)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--tolerance", type=float, default=0.1)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--observations", type=int, default=64)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--single-calls", type=int, default=16, help="batch-1 calls whose iterations are counted")
    parser.add_argument("--sweep-unet", nargs="*", default=["lowdim"], help="the U-Nets swept over window x tolerance")
    parser.add_argument("--sweep-windows", type=int, nargs="*", default=[8, 16, 32])
    parser.add_argument("--sweep-tolerances", type=float, nargs="*", default=[0.05, 0.1, 0.2])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: the same algorithm eagerly (slow; for a check without a GPU)")
    parser.add_argument("--quality-only", action="store_true", help="skip the speed table")
    parser.add_argument("--speed-only", action="store_true", help="skip the quality table and the sweep")
    parser.add_argument("--sms", type=int, help="run on this many of the GPU's SMs (a green context)")
    parser.add_argument("--tiny", action="store_true", help="small U-Nets of the same conditioning (a quick check)")
    parser.add_argument("--out", default=".")
    parser.add_argument("--tag", default="", help="appended to the output files' names")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    if args.quality_only and args.speed_only:
        parser.error("--quality-only and --speed-only leave nothing to run")
    sms = None
    if args.sms is not None:
        if DEVICE != "cuda":
            parser.error("--sms needs a GPU (--device cuda)")
        try:
            sms = confine_to_sms(args.sms)  # before anything creates a stream
        except (ValueError, RuntimeError) as error:
            parser.error(f"--sms {args.sms}: {error}")
    if args.tiny:
        for name in CONFIGS:
            CONFIGS[name] = dict(UNETS[name], down_dims=[32, 64, 128], diffusion_step_embed_dim=32)
    picard = Picard(window=args.window, tolerance=args.tolerance)
    torch.backends.cuda.matmul.allow_tf32 = False
    # The floor counts weight bytes read: a GPU's copy rate counts bytes read and written,
    # a CPU's sum over a large buffer bytes read.
    bandwidth = copy_bandwidth_gbs() if DEVICE == "cuda" else read_bandwidth_gbs()
    print(f"{device_name()}  torch {torch.__version__}  copy bandwidth {bandwidth:.0f} GB/s  "
          f"window {picard.window}, tolerance {picard.tolerance}"
          + (f"  on {sms} of the GPU's {torch.cuda.get_device_properties(0).multi_processor_count} SMs" if sms else ""),
          flush=True)
    results = dict(copy_bandwidth_gbs=bandwidth, sms=sms, quality=[], speed=[], sweep=[])
    with kernel_config(sm_count=sms) if sms else contextlib.nullcontext():
        for name in args.unet:
            unet = trained_unet(name, args)
            if not args.speed_only:
                results["quality"] += quality(name, unet, picard, args)
                if name in args.sweep_unet:
                    results["sweep"] += sweep(name, unet, args)
            if not args.quality_only:
                results["speed"] += speed(name, unet, picard, args, bandwidth)
            del unet
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"parallel{args.tag}.json").write_text(json.dumps(results, indent=1))
    rows = results["speed"]
    if rows:
        plot_grouped_bars(rows, ("unet", "schedule", "dtype", "batch"), lambda u, s, d, b: f"{u}\n{s}\n{d} B={b}",
                          "ms_per_action", "ms per action chunk (log)",
                          f"Sequential vs parallel (Picard) sampling, {rows[0]['device']}"
                          + (f", {sms} SMs" if sms else ""), out / f"parallel{args.tag}.png")


if __name__ == "__main__":
    main()
