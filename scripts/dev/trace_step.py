"""Where one denoising step's time goes between the conv launches: GraphedSampler's loop
(batch 1, one launch per conv) captured with every streaming conv launch traced
(ops._C.start_launch_trace: each block stamps the global timer), then replayed. For each
conv launch of one step in the middle of the loop it prints, in µs after the previous conv
launch's last block was done: when its blocks had waited for their input (median) and when
its last block was done. The step's first launch follows the denoise step (which also
inpaints) and shows it in its "waited" column; the
step's total is the last launch's done minus the previous step's. Medians over the steps in
the middle of the loop and over replays.

    python scripts/dev/trace_step.py [--unet lowdim] [--dtype float32] [--horizon 16] [--steps 10]
"""
import argparse
import statistics

import torch
from diffusers import DDPMScheduler

from diffusion_policy_accelerated import ConditionalUnet1D, DenoiseSchedule
from diffusion_policy_accelerated.kernels import ops
from diffusion_policy_accelerated.model.configs import HORIZON, SCHEDULER_CONFIG, UNETS
from diffusion_policy_accelerated.sampling.sampler import GraphedSampler
from trace_conv import WAITED


def launch_times(trace, blocks):
    """(median waited, last stamp) in ns for each launch."""
    times, offset = [], 0
    for n in blocks:
        t = trace[offset:offset + n]
        offset += n
        waited = t[t[:, WAITED] > 0, WAITED]
        times.append((float(waited.median()) if waited.numel() else float("nan"), float(t[t > 0].max())))
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--unet", default="lowdim", choices=list(UNETS))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--horizon", type=int, default=HORIZON)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--replays", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    unet = ConditionalUnet1D(**UNETS[args.unet]).cuda().eval().to(getattr(torch, args.dtype))
    schedule = DenoiseSchedule.from_diffusers(DDPMScheduler(**SCHEDULER_CONFIG), args.steps).to("cuda")
    sampler = GraphedSampler(unet, schedule)
    data = torch.randn(1, args.horizon, UNETS[args.unet]["input_dim"], device="cuda")
    mask = torch.zeros_like(data, dtype=torch.bool)
    cond = torch.randn(1, UNETS[args.unet]["global_cond_dim"], device="cuda")
    buffer = torch.zeros(400_000, 9, dtype=torch.int64, device="cuda")
    ops._C.start_launch_trace(buffer)
    try:
        sampler(data, mask, global_cond=cond)  # warm-up launches, then the captured ones
    finally:
        blocks = ops._C.stop_launch_trace()
    captured = blocks[len(blocks) // 2:]  # the warm-up ran the same launches eagerly
    first_row = sum(blocks[:len(blocks) // 2])
    per_step = len(captured) // args.steps
    middle = range(args.steps // 2 - 2, args.steps // 2 + 2)
    waited = [[] for _ in range(per_step)]
    done = [[] for _ in range(per_step)]
    step_us = []
    for _ in range(args.replays):
        buffer.zero_()
        sampler(data, mask, global_cond=cond)
        torch.cuda.synchronize()
        times = launch_times(buffer[first_row:].cpu().double(), captured)
        for s in middle:
            for i in range(per_step):
                previous_done = times[s * per_step + i - 1][1]
                waited[i].append((times[s * per_step + i][0] - previous_done) / 1e3)
                done[i].append((times[s * per_step + i][1] - previous_done) / 1e3)
            step_us.append((times[(s + 1) * per_step - 1][1] - times[s * per_step - 1][1]) / 1e3)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.unet} {args.dtype}, horizon {args.horizon}, batch 1: "
          f"{per_step} conv launches per step; µs after the previous launch's last block, medians")
    print(f"{'launch':>6} {'blocks':>6} {'waited':>8} {'done':>8}")
    for i in range(per_step):
        print(f"{i:6} {captured[i]:6} {statistics.median(waited[i]):8.2f} {statistics.median(done[i]):8.2f}")
    print(f"sum of the launches' done: {sum(statistics.median(d) for d in done):.1f} µs; "
          f"step: {statistics.median(step_us):.1f} µs")


if __name__ == "__main__":
    main()
