"""A/B of the single-kernel U-Net (GraphedSampler's dpa StreamProgram) against one launch per
conv, each with the streamed weights evict-first in L2 (the default) and evict-normal
(ops.set_weights_evict_first), and of the program's variants (ops set_program_options bits:
1 = relaxed polling with back-off instead of acquire polling, 2 = no L2 prefetch of a block's
weights while it waits), in one process: ms per DDPM-100 action, batch 1, medians of
CUDA-event timings.

    python scripts/ab_program.py [--unet lowdim image] [--dtype float32 bfloat16] [--options 0 2]
"""
import argparse

import torch
from diffusers import DDPMScheduler

from diffusion_policy_accelerated import ConditionalUnet1D, DenoiseSchedule, ops
from diffusion_policy_accelerated.sampler import GraphedSampler
from benchmark import HORIZON, SCHEDULER_CONFIG, UNETS, median_ms


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--unet", nargs="+", default=list(UNETS), choices=list(UNETS))
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--options", nargs="+", type=int, default=[0], help="program option sets to time")
    args = parser.parse_args()
    schedule = DenoiseSchedule.from_diffusers(DDPMScheduler(**SCHEDULER_CONFIG), 100).to("cuda")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    for unet_name in args.unet:
        for dtype_name in args.dtype:
            torch.manual_seed(0)
            unet = ConditionalUnet1D(**UNETS[unet_name]).cuda().eval().to(getattr(torch, dtype_name))
            data = torch.randn(1, HORIZON, 2, device="cuda")
            mask = torch.zeros_like(data, dtype=torch.bool)
            cond = torch.randn(1, UNETS[unet_name]["global_cond_dim"], device="cuda")
            noise = torch.randn(101, 1, HORIZON, 2, device="cuda")
            variants = [(f"{'evict-first' if first else 'evict-normal'}, {label}", single, options, first)
                        for first in (True, False)
                        for label, single, options in [("per-conv", False, 0)] +
                        [(f"single kernel, options {o}", True, o) for o in args.options]]
            reference = None
            for label, single, options, first in variants * 2:  # twice: drift shows up as a mismatch
                ops._C.set_program_options(options)
                ops.set_weights_evict_first(first)
                sampler = GraphedSampler(unet, schedule, single_kernel_unet=single)
                action = sampler(data, mask, global_cond=cond, noise=noise)
                reference = action if reference is None else reference
                ms = median_ms(lambda: sampler(data, mask, global_cond=cond, noise=noise))
                print(f"{unet_name:7} {dtype_name:9} {label:42} {ms:8.2f} ms/action "
                      f"{'same action' if torch.equal(action, reference) else 'ACTION DIFFERS'}", flush=True)
            ops._C.set_program_options(0)
            ops.set_weights_evict_first(True)


if __name__ == "__main__":
    main()
