"""One denoising step's kernels in order, as the CUDA graph of GraphedSampler's loop runs them
(torch profiler over a replay): each kernel's duration and the idle time before it, then the
step's time, the idle time between its kernels, and the time per kernel. The step is the one
in the middle of the loop, from after one denoise_step kernel to the end of the next. Kernels
on the side stream overlap the main chain, and a kernel launched as a programmatic dependent
starts before the one ahead of it ends and waits for it: its duration includes that wait. The
durations then add up to more than the step; the idle time is what no kernel ran.

    python scripts/dev/step_timeline.py [--unet lerobot] [--horizon 64] [--dtype bfloat16] [--batch 1]
"""
import argparse
import re
import statistics
from collections import defaultdict

import torch
from diffusers import DDPMScheduler

from diffusion_policy_accelerated import ConditionalUnet1D, DenoiseSchedule
from diffusion_policy_accelerated.model.configs import SCHEDULER_CONFIG, UNETS
from diffusion_policy_accelerated.sampling.sampler import GraphedSampler


def short_name(name: str) -> str:
    """A kernel's name without its return type, namespaces, template arguments and parameters."""
    name = re.sub(r"^void ", "", name).replace("(anonymous namespace)::", "").replace("dpa::", "")
    return re.split(r"[<(]", name)[0]


def step_kernels(kernels):
    """The kernels of the loop's middle step: after one denoise_step up to the next one."""
    ends = [i for i, (_, _, name) in enumerate(kernels) if "denoise_step" in name]
    if len(ends) < 3:
        raise SystemExit(f"found {len(ends)} denoise_step kernels; the loop needs 3 or more steps")
    middle = len(ends) // 2
    return kernels[ends[middle - 1]], kernels[ends[middle - 1] + 1:ends[middle] + 1]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--unet", default="lerobot", choices=list(UNETS))
    parser.add_argument("--horizon", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10, help="denoising steps in the loop (3 or more)")
    args = parser.parse_args(argv)
    if args.steps < 3:
        parser.error(f"--steps must be 3 or more, got {args.steps}")
    for name in ("batch", "horizon"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be 1 or more, got {getattr(args, name)}")
    if not torch.cuda.is_available():
        parser.exit(1, "step_timeline.py needs a CUDA GPU\n")

    torch.manual_seed(0)
    config = UNETS[args.unet]
    unet = ConditionalUnet1D(**config).cuda().eval().to(getattr(torch, args.dtype))
    schedule = DenoiseSchedule.from_diffusers(DDPMScheduler(**SCHEDULER_CONFIG), args.steps).to("cuda")
    sampler = GraphedSampler(unet, schedule)
    data = torch.randn(args.batch, args.horizon, config["input_dim"], device="cuda")
    mask = torch.zeros_like(data, dtype=torch.bool)
    cond = torch.randn(args.batch, config["global_cond_dim"], device="cuda")
    for _ in range(3):  # capture, then warm replays
        sampler(data, mask, global_cond=cond)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        sampler(data, mask, global_cond=cond)
        torch.cuda.synchronize()
    kernels = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                      if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda k: k[0])
    before, step = step_kernels(kernels)

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.unet} U-Net, horizon {args.horizon}, "
          f"batch {args.batch}, {args.dtype}; µs")
    print(f"{'kernel':44} {'idle before':>11} {'duration':>9}")
    end, gaps, per_kernel, count = before[1], [], defaultdict(float), defaultdict(int)
    for start, stop, name in step:
        short = short_name(name)
        idle = max(start - end, 0.0)
        if start > end:
            gaps.append(idle)
        print(f"{short[:44]:44} {idle:11.2f} {stop - start:9.2f}")
        end = max(end, stop)
        per_kernel[short] += stop - start
        count[short] += 1
    print(f"step: {end - before[1]:.1f}; idle between kernels: {sum(gaps):.1f} in {len(gaps)} gaps "
          f"(median {statistics.median(gaps) if gaps else 0.0:.2f})")
    for short, total in sorted(per_kernel.items(), key=lambda kv: -kv[1]):
        print(f"  {short[:44]:44} {count[short]:3} kernels {total:8.1f}")


if __name__ == "__main__":
    main()
