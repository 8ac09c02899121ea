"""The same comparison as benchmark.py on the CPU, where there is no CUDA graph: Diffusion
Policy's U-Nets, plain PyTorch against the fused ops, side by side in one run.

  forward   one U-Net forward: plain PyTorch modules (use_fused_ops = False) / ours
  action    one action chunk: Diffusion Policy's loop (plain U-Net + diffusers' step, what it
            runs) / GraphedSampler (fused ops, FiLM hoisted out of the loop)
  floor     the larger of the forward's conv FLOPs over the CPU's measured fp32 matmul rate
            and its conv weights' bytes over the measured read rate (a sum over a buffer larger
            than the caches; batch 1 is bound by reading the weights)

Medians of wall-clock times after warm-up, plain and ours timed in turn; torch's default
threads. Writes JSON.

    python scripts/benchmark_cpu.py [--unet lowdim] [--batch 1 8 64] [--dtype float32 bfloat16]
                                    [--steps 16] [--json out.json]
"""
import argparse
import json
import statistics
import time

import torch
from diffusers import DDIMScheduler

from benchmark import dp_loop

from diffusion_policy_accelerated import ConditionalUnet1D, DenoiseSchedule
from diffusion_policy_accelerated.model.configs import HORIZON, SCHEDULER_CONFIG, UNETS
from diffusion_policy_accelerated.tools.costs import conv1d_cost, conv_transpose1d_cost
from diffusion_policy_accelerated.tools.profiling import matmul_tflops, read_bandwidth_gbs
from diffusion_policy_accelerated.kernels.config import CPU_CONV_ROUTES, kernel_config
from diffusion_policy_accelerated.sampling.sampler import GraphedSampler


def interleaved_ms(first, second, reps):
    """Median ms of first() and of second(), timed in turn (ABAB...) after a warm-up of each,
    so that the CPU's drift (other load, clocks) falls on both alike."""
    first(), second()
    times = ([], [])
    for _ in range(reps):
        for fn, out in zip((first, second), times):
            start = time.perf_counter()
            fn()
            out.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times[0]), statistics.median(times[1])


def with_fused_ops(unet, enabled, fn):
    def run():
        unet.use_fused_ops = enabled
        try:
            return fn()
        finally:
            unet.use_fused_ops = True
    return run


def conv_flops(unet, batch, horizon):
    """FLOPs of every conv of one forward (the bulk of the U-Net's work)."""
    flops = []

    def count(module, args, out):
        cost = conv_transpose1d_cost if isinstance(module, torch.nn.ConvTranspose1d) else conv1d_cost
        flops.append(cost(tuple(args[0].shape), tuple(module.weight.shape), torch.float32,
                          stride=module.stride[0], padding=module.padding[0])[0])

    hooks = [m.register_forward_hook(count) for m in unet.modules()
             if isinstance(m, (torch.nn.Conv1d, torch.nn.ConvTranspose1d))]
    try:
        like = dict(dtype=next(unet.parameters()).dtype)
        with torch.inference_mode():
            unet.use_fused_ops = False
            unet(torch.randn(batch, horizon, unet.input_dim, **like), 0,
                 global_cond=torch.randn(batch, unet.global_cond_dim, **like) if unet.global_cond_dim else None)
    finally:
        unet.use_fused_ops = True
        for hook in hooks:
            hook.remove()
    return sum(flops)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--unet", nargs="+", default=["lowdim"], choices=list(UNETS))
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--horizon", type=int, default=HORIZON)
    parser.add_argument("--steps", type=int, default=16, help="DDIM steps of an action")
    parser.add_argument("--reps", type=int, default=9, help="forwards timed per path (actions: a third)")
    parser.add_argument("--cpu-conv", default="auto", choices=list(CPU_CONV_ROUTES),
                        help="ours with this KernelConfig.cpu_conv ('aten': the conv plain PyTorch runs)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    with kernel_config(cpu_conv=args.cpu_conv):
        run(args)


def run(args):
    peak = matmul_tflops(1024, torch.float32, "cpu")
    bandwidth = read_bandwidth_gbs(512 << 20, "cpu")
    print(f"CPU, {torch.get_num_threads()} threads, torch {torch.__version__}, fp32 matmul "
          f"{1e3 * peak:.0f} GFLOP/s, read {bandwidth:.0f} GB/s; DDIM-{args.steps}, horizon {args.horizon}; "
          f"ours: cpu_conv {args.cpu_conv!r}", flush=True)
    print(f"{'U-Net':7} {'dtype':9} {'B':>3} {'fwd plain ms':>12} {'fwd ours ms':>11} {'speed-up':>8} "
          f"{'action DP ms':>12} {'action ours ms':>14} {'speed-up':>8} {'fwd floor ms':>12}", flush=True)
    rows = []
    for unet_name in args.unet:
        for dtype_name in args.dtype:
            dtype = getattr(torch, dtype_name)
            torch.manual_seed(0)
            unet = ConditionalUnet1D(**UNETS[unet_name]).eval().to(dtype)
            scheduler = DDIMScheduler(**SCHEDULER_CONFIG)
            sampler = GraphedSampler(unet, DenoiseSchedule.from_diffusers(scheduler, args.steps))
            for batch in args.batch:
                # Random, never zeros: a zero trajectory makes GroupNorm's groups constant and
                # the convs run on denormals, several times slower.
                data = torch.randn(batch, args.horizon, unet.input_dim, dtype=dtype)
                mask = torch.zeros_like(data, dtype=torch.bool)
                cond = torch.randn(batch, unet.global_cond_dim, dtype=dtype)
                weight_bytes = sum(m.weight.numel() * dtype.itemsize for m in unet.modules()
                                   if isinstance(m, (torch.nn.Conv1d, torch.nn.ConvTranspose1d)))
                floor = 1e3 * max(conv_flops(unet, batch, args.horizon) / (peak * 1e12),
                                  weight_bytes / (bandwidth * 1e9))
                forward = lambda: unet(data, 5, global_cond=cond)  # noqa: E731
                with torch.inference_mode():
                    forward_plain, forward_ours = interleaved_ms(
                        with_fused_ops(unet, False, forward), forward, args.reps)
                    action_plain, action_ours = interleaved_ms(
                        with_fused_ops(unet, False, lambda: dp_loop(unet, scheduler, args.steps, data, mask, cond, None)),
                        lambda: sampler(data, mask, global_cond=cond), max(1, args.reps // 3))
                row = dict(unet=unet_name, dtype=dtype_name, batch=batch, forward_plain_ms=forward_plain,
                           forward_ours_ms=forward_ours, action_plain_ms=action_plain,
                           action_ours_ms=action_ours, forward_floor_ms=floor, steps=args.steps,
                           threads=torch.get_num_threads(), torch=torch.__version__, cpu_conv=args.cpu_conv)
                rows.append(row)
                print(f"{unet_name:7} {dtype_name:9} {batch:3} {forward_plain:12.1f} {forward_ours:11.1f} "
                      f"{forward_plain / forward_ours:7.2f}x {action_plain:12.1f} {action_ours:14.1f} "
                      f"{action_plain / action_ours:7.2f}x {floor:12.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
