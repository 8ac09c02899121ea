"""The portable launch path (no thread-block clusters, no programmatic dependent launch: what
GPUs before Hopper run) in half precision at batch 1, horizon 16, DDPM-100, with and without
`KernelConfig.portable_half_gemm_min_positions` (GEMMs from 8 positions, or --positions): ms
per action chunk, off / on / off / on, for the lowdim and image U-Nets in bf16 and fp16, on each
SM budget (a CUDA green context per budget, in a process of its own, as
scripts/benchmark_sm_budget.py).

    python -m scripts.dev.portable_half_routes [--sms 16 48 132] [--positions 8]
"""
import argparse
import subprocess
import sys

import torch

from scripts.benchmark import SCHEDULES, loop_inputs

from diffusion_policy_accelerated import ConditionalUnet1D, DenoiseSchedule
from diffusion_policy_accelerated.model.configs import HORIZON, SCHEDULER_CONFIG, UNETS
from diffusion_policy_accelerated.tools.profiling import median_ms
from diffusion_policy_accelerated.tools.sm_budget import confine_to_sms
from diffusion_policy_accelerated.kernels.config import KernelConfig, kernel_config


def worker(budget, rule):
    got = confine_to_sms(budget)
    from diffusion_policy_accelerated.sampling.sampler import GraphedSampler
    scheduler_cls, steps = SCHEDULES["DDPM-100"]
    schedule = DenoiseSchedule.from_diffusers(scheduler_cls(**SCHEDULER_CONFIG), steps).to("cuda")
    for name in ("lowdim", "image"):
        for dtype in (torch.bfloat16, torch.float16):
            torch.manual_seed(0)
            unet = ConditionalUnet1D(**UNETS[name]).cuda().eval().to(dtype)
            data, mask, cond, noise, _ = loop_inputs(name, 1, HORIZON, steps)
            data, cond, noise = data.to(dtype), cond.to(dtype), noise.to(dtype)
            times = []
            with torch.inference_mode():
                for positions in (1 << 62, rule, 1 << 62, rule):
                    with kernel_config(sm_count=got, clusters=False, pdl=False,
                                       portable_half_gemm_min_positions=positions):
                        sampler = GraphedSampler(unet, schedule)
                        times.append(median_ms(lambda: sampler(data, mask, global_cond=cond, noise=noise)))
            print(f"{got:4} SMs  {name:7} {str(dtype)[6:]:9} off / on / off / on: "
                  + " / ".join(f"{t:.2f}" for t in times), flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sms", type=int, nargs="+", default=[16, 48, 132], help="SM budgets")
    parser.add_argument("--positions", type=int, default=KernelConfig().portable_half_gemm_min_positions,
                        help="portable_half_gemm_min_positions for 'on' (default: the configuration's)")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)  # one budget, in a child process
    args = parser.parse_args(argv)
    if args.positions < 1:
        parser.error(f"--positions must be at least 1, got {args.positions}")
    if any(budget < 1 for budget in args.sms):
        parser.error(f"--sms takes positive integers, got {args.sms}")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    if args.worker is not None:
        return worker(args.worker, args.positions)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  portable launches, batch 1, horizon "
          f"{HORIZON}, DDPM-100, on: GEMMs from {args.positions} positions", flush=True)
    for budget in args.sms:
        subprocess.run([sys.executable, "-m", __spec__.name, "--worker", str(budget), "--positions", str(args.positions)],
                       check=True)


if __name__ == "__main__":
    main()
