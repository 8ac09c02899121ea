"""Train Diffusion Policy-sized U-Nets on the synthetic multimodal task and score them with the
sequential sampler, so that other samplers can be measured on trained policies.

The task (diffusion_policy_accelerated/tools/synthetic_task.py): from a start position, go to
one of 4 goals around it, picked uniformly at random; the condition holds the start and the
goals. Each U-Net is trained with DDPM epsilon prediction on Diffusion Policy's noise schedule,
saved, then sampled with DDPM-100 and DDIM-16 (`--eval-observations` x `--eval-samples`
actions) and scored: goal-reached rate and mode balance (normalised entropy of the goals each
observation's samples reach; a perfect policy scores the "chance" value, below 1 at a finite
number of samples).

    python scripts/train_synthetic.py --out trained/                    # both U-Nets, GPU defaults
    python scripts/train_synthetic.py --unet lowdim --tiny --device cpu  # ~4 min on 2 CPU cores
    python scripts/train_synthetic.py --unet lowdim --tiny --device cpu --steps 300  # ~1 min: runs, no more

Measured on 2 CPU cores with --tiny (1500 steps, batch 64, ~7 steps/s): 100% of goals reached
with DDPM-100 and 97% with DDIM-16, mode balance at its chance value; 1000 steps at --lr 3e-3
reach 94% / 82%, 300 steps 16% / 8%.

`--out DIR` writes DIR/<unet>.pt: {'state_dict', 'config' (the ConditionalUnet1D arguments),
'horizon', 'train', 'metrics'}; `synthetic_task.load_trained(path)` rebuilds the U-Net.
"""
import argparse
import json
import os
import time

import torch

from diffusion_policy_accelerated.model.configs import HORIZON, UNETS
from diffusion_policy_accelerated.model.unet import ConditionalUnet1D
from diffusion_policy_accelerated.tools import synthetic_task

# LeRobot runs its default U-Net at horizon 64, Diffusion Policy its lowdim one at 16.
HORIZONS = {"lowdim": HORIZON, "lerobot": 64}
# Steps and lr per U-Net at batch 256 (see --help); --tiny has its own.
DEFAULT_STEPS = {"lowdim": 6000, "lerobot": 4000}
DEFAULT_LR = {"lowdim": 3e-4, "lerobot": 2e-4}
TINY = dict(down_dims=[32, 64, 128], diffusion_step_embed_dim=64)
TINY_STEPS, TINY_LR, TINY_BATCH = 1500, 2e-3, 64
SCHEDULES = [("ddpm", 100), ("ddim", 16)]
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": None}


def log(message):
    print(message, flush=True)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--unet", nargs="+", choices=sorted(HORIZONS), default=["lowdim", "lerobot"],
                        help="U-Nets to train, in turn (default both)")
    parser.add_argument("--steps", type=int, help=f"training steps (default {DEFAULT_STEPS}; "
                        f"--tiny {TINY_STEPS})")
    parser.add_argument("--batch-size", type=int, help=f"default 256 (--tiny {TINY_BATCH})")
    parser.add_argument("--lr", type=float, help=f"peak AdamW lr (default {DEFAULT_LR}; --tiny {TINY_LR})")
    parser.add_argument("--horizon", type=int, help=f"action horizon (default {HORIZONS})")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES),
                        help="autocast dtype of training (default bfloat16 on CUDA, float32 = none "
                             "elsewhere); weights, optimizer and evaluation stay float32")
    parser.add_argument("--tiny", action="store_true",
                        help=f"a small U-Net ({TINY}) for a smoke run on a CPU")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-observations", type=int, default=64)
    parser.add_argument("--eval-samples", type=int, default=16, help="samples per observation")
    parser.add_argument("--out", help="directory for <unet>.pt (not saved without it)")
    parser.add_argument("--json", help="write the results table here")
    args = parser.parse_args(argv)
    for name in ("steps", "batch_size", "horizon", "eval_observations", "eval_samples"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.lr is not None and not args.lr > 0:
        parser.error(f"--lr must be positive, got {args.lr}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: CUDA is not available")
    return args


def train_one(name, args, device):
    config = dict(UNETS[name], **(TINY if args.tiny else {}))
    horizon = args.horizon or HORIZONS[name]
    steps = args.steps or (TINY_STEPS if args.tiny else DEFAULT_STEPS[name])
    batch_size = args.batch_size or (TINY_BATCH if args.tiny else 256)
    lr = args.lr or (TINY_LR if args.tiny else DEFAULT_LR[name])
    dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    torch.manual_seed(args.seed)
    unet = ConditionalUnet1D(**config).to(device)
    params = sum(p.numel() for p in unet.parameters())
    log(f"[{name}] U-Net down_dims {config['down_dims']} ({params / 1e6:.1f} M parameters), horizon "
        f"{horizon}, global_cond_dim {config['global_cond_dim']}: {steps} steps at batch {batch_size}, "
        f"lr {lr:g}, autocast {dtype_name}, on {device}")
    start = time.perf_counter()
    losses = synthetic_task.train(unet, steps, batch_size, lr, device, horizon, args.seed,
                                  autocast_dtype=DTYPES[dtype_name], progress=log)
    train_s = time.perf_counter() - start
    tail = losses[-max(1, steps // 20):]
    log(f"[{name}] trained in {train_s:.1f} s ({steps / train_s:.1f} steps/s); final loss "
        f"{sum(tail) / len(tail):.5f} (mean of the last {len(tail)} steps); EMA weights")

    rows = []
    for kind, schedule_steps in SCHEDULES:
        label = f"{kind.upper()}-{schedule_steps}"
        log(f"[{name}] evaluating {label}: {args.eval_observations} observations x "
            f"{args.eval_samples} samples, sequential sampler...")
        start = time.perf_counter()
        metrics = synthetic_task.evaluate_unet(unet, horizon, kind, schedule_steps,
                                               observations=args.eval_observations,
                                               samples=args.eval_samples, seed=args.seed + 1000)
        eval_s = time.perf_counter() - start
        log(f"[{name}] {label}: reached {metrics['reached_rate']:.1%}, balance "
            f"{metrics['mode_balance']:.3f} (chance {metrics['mode_balance_chance']:.3f}), goal counts "
            f"{metrics['goal_counts']}, {eval_s:.1f} s")
        rows.append(dict(unet=name, schedule=label, seconds=eval_s, **metrics))

    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"{name}.pt")
        synthetic_task.save_trained(
            path, unet, config, horizon=horizon, metrics=rows,
            train=dict(steps=steps, batch_size=batch_size, lr=lr, autocast=dtype_name, seed=args.seed,
                       seconds=train_s, final_loss=sum(tail) / len(tail), tiny=args.tiny))
        log(f"[{name}] saved {path}")
    return rows, train_s


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True
    rows, train_times = [], {}
    for name in args.unet:
        unet_rows, train_times[name] = train_one(name, args, device)
        rows += unet_rows

    log("")
    log("| U-Net | schedule | train s | reached | mode balance (chance) | single-mode obs | "
        "final error | path error |")
    log("|---|---|---|---|---|---|---|---|")
    for row in rows:
        log(f"| {row['unet']} | {row['schedule']} | {train_times[row['unet']]:.0f} | "
            f"{row['reached_rate']:.1%} | {row['mode_balance']:.3f} ({row['mode_balance_chance']:.3f}) | "
            f"{row['single_mode_rate']:.1%} | {row['final_error']:.3f} | {row['path_error']:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), train_seconds=train_times, rows=rows), f, indent=1)
    return rows


if __name__ == "__main__":
    main()
