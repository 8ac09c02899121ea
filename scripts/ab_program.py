"""A/B of the ways the sampler runs a U-Net forward, in one process: one launch per conv
with GroupNorm convs as one thread-block cluster per group (the default) or as split-K
blocks (ops.set_clusters(False)), and the single-kernel U-Net (GraphedSampler's dpa
StreamProgram) with each of the program variants asked for (ops set_program_options bits:
1 = relaxed polling with back-off instead of acquire polling, 2 = no L2 prefetch of a
block's weights while it waits); with --evict-normal each again with the streamed weights
evict-normal in L2 (ops.set_weights_evict_first(False)). ms per DDPM-100 action, batch 1,
medians of CUDA-event timings, every variant twice. Runs on builds without the cluster
switch too (the old side of scripts/ab_builds.sh), timing their split-K path.

    python scripts/ab_program.py [--unet lowdim image] [--dtype float32 bfloat16] [--options 0 2]
                                 [--cluster-only]
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
    parser.add_argument("--options", nargs="*", type=int, default=[0],
                        help="program option sets to time (none: no single-kernel variant)")
    parser.add_argument("--evict-normal", action="store_true", help="also time weights evict-normal in L2")
    parser.add_argument("--cluster-only", action="store_true",
                        help="time only the default route (a cluster per group where the build has it): "
                             "a third of the device time")
    args = parser.parse_args()
    # Builds from before the switch (scripts/ab_builds.sh's old side) have only split-K.
    has_clusters = hasattr(ops._C, "set_clusters")
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
            variants = [(f"{'evict-first' if first else 'evict-normal'}, {label}", single, options, first,
                         clusters)
                        for first in ((True, False) if args.evict_normal else (True,))
                        for label, single, options, clusters in
                        [("per-conv, cluster per group", False, 0, True)] * has_clusters +
                        [("per-conv, split-K", False, 0, False)] * (not (args.cluster_only and has_clusters)) +
                        [(f"single kernel, options {o}", True, o, False)
                         for o in ([] if args.cluster_only else args.options)]]
            reference = None
            for label, single, options, first, clusters in variants * 2:  # twice: drift shows up
                ops._C.set_program_options(options)
                ops.set_weights_evict_first(first)
                if has_clusters:
                    ops.set_clusters(clusters)
                sampler = GraphedSampler(unet, schedule, single_kernel_unet=single)
                action = sampler(data, mask, global_cond=cond, noise=noise)
                reference = action if reference is None else reference
                ms = median_ms(lambda: sampler(data, mask, global_cond=cond, noise=noise))
                difference = (action - reference).abs().max().item()
                print(f"{unet_name:7} {dtype_name:9} {label:45} {ms:8.2f} ms/action  "
                      f"largest difference from the first {difference:.1e}", flush=True)
            ops._C.set_program_options(0)
            ops.set_weights_evict_first(True)
            if has_clusters:
                ops.set_clusters(True)


if __name__ == "__main__":
    main()
