"""LeRobot's DiffusionPolicy as its users run it, side by side with accelerate(policy):
milliseconds per action chunk from `policy.diffusion.generate_actions` (the vision encoder,
the global condition and the denoising loop: what `select_action` waits for when its queue
is empty).

  LeRobot eager     LeRobot's own modeling code, launch by launch
  LeRobot compile   the same with LeRobot's option `compile_model=True` (torch.compile of the
                    U-Net, its default mode "reduce-overhead"; only with --compile: minutes)
  ours fp32 / bf16  accelerate(policy) / accelerate(policy, dtype=torch.bfloat16): the whole
                    call as one CUDA graph replay

The policy is LeRobot's Push-T configuration (one 96x96 camera cropped to 84x84, ResNet18
with GroupNorm and 32 spatial-softmax keypoints, a 2-dim state, 2 observation steps; U-Net
512/1024/2048, kernel 5, 8 groups, FiLM scale) with random weights, at `--horizon` (LeRobot
0.6's default is 64) and n_action_steps = horizon / 2. x floor: ms over the U-Net's conv
weight bytes per step times the steps, at the copy bandwidth measured in the same run.
max|da|: the largest action difference from LeRobot eager on the same observations and
initial noise (DDIM only: DDPM's per-step noise is drawn differently). Wall-clock medians of
synchronised calls after warm-up, PyTorch's default precision settings (cuDNN may use TF32).
Needs LeRobot's modeling code (requirements-lerobot.txt). Writes JSON and a PNG plot.

    python scripts/benchmark_lerobot.py [--horizon 16 64] [--batch 1 8] [--schedule DDPM DDIM]
                                        [--steps N] [--compile] [--out DIR]
"""
import argparse
import copy
import json
from pathlib import Path

import torch
from lerobot.configs.types import FeatureType, PolicyFeature
from lerobot.policies.diffusion.configuration_diffusion import DiffusionConfig
from lerobot.policies.diffusion.modeling_diffusion import DiffusionPolicy

from diffusion_policy_accelerated import accelerate
from diffusion_policy_accelerated.tools.profiling import copy_bandwidth_gbs, plot_grouped_bars, wall_ms

IMAGE, STATE, ACTION = (3, 96, 96), 2, 2
DEFAULT_STEPS = {"DDPM": 100, "DDIM": 16}


def make_policy(horizon, scheduler, steps, down_dims, device, compile_model=False):
    """LeRobot's Push-T DiffusionPolicy (random weights, seed 0) in eval mode on `device`."""
    config = DiffusionConfig(
        input_features={"observation.image": PolicyFeature(type=FeatureType.VISUAL, shape=IMAGE),
                        "observation.state": PolicyFeature(type=FeatureType.STATE, shape=(STATE,))},
        output_features={"action": PolicyFeature(type=FeatureType.ACTION, shape=(ACTION,))},
        horizon=horizon, n_action_steps=horizon // 2, down_dims=tuple(down_dims), noise_scheduler_type=scheduler,
        num_inference_steps=steps, pretrained_backbone_weights=None, compile_model=compile_model,
        device=str(device))
    torch.manual_seed(0)
    return DiffusionPolicy(config).to(device).eval()


def observations(policy, batch, device, seed):
    """generate_actions' batch: [B, n_obs_steps, ...] state and [B, n_obs_steps, 1, C, H, W] images."""
    g = torch.Generator().manual_seed(seed)
    steps = (batch, policy.config.n_obs_steps)
    return {"observation.state": torch.randn(*steps, STATE, generator=g).to(device),
            "observation.images": torch.rand(*steps, 1, *IMAGE, generator=g).to(device)}


def conv_weight_bytes(policy, dtype):
    return sum(m.weight.numel() for m in policy.diffusion.unet.modules()
               if isinstance(m, (torch.nn.Conv1d, torch.nn.ConvTranspose1d))) * dtype.itemsize


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--horizon", type=int, nargs="+", default=[64])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--schedule", nargs="+", default=["DDPM"], choices=list(DEFAULT_STEPS))
    parser.add_argument("--steps", type=int, help="denoising steps (default: DDPM 100, DDIM 16)")
    parser.add_argument("--compile", action="store_true", help="add LeRobot's compile_model=True (slow)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--down-dims", type=int, nargs="+", default=[512, 1024, 2048],
                        help="the U-Net's widths (smaller ones for a quick run on a CPU)")
    parser.add_argument("--reps", type=int, default=10, help="timed calls per row (eager: a third)")
    parser.add_argument("--out", default=".", help="folder for benchmark_lerobot.json and .png")
    args = parser.parse_args(argv)
    for name, values in (("--horizon", args.horizon), ("--batch", args.batch), ("--down-dims", args.down_dims)):
        if any(v < 1 for v in values):
            parser.error(f"{name} takes positive integers, got {values}")
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be a positive integer, got {args.steps}")
    if args.reps < 1:
        parser.error(f"--reps must be a positive integer, got {args.reps}")
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    bandwidth = copy_bandwidth_gbs() if cuda else None
    name = torch.cuda.get_device_name(device) if cuda else "CPU"
    print(f"{name}  torch {torch.__version__}  LeRobot's Push-T DiffusionPolicy, U-Net {args.down_dims}"
          + (f"  copy bandwidth {bandwidth:.0f} GB/s" if cuda else ""), flush=True)
    print(f"{'schedule':9} {'T':>4} {'B':>3} {'method':16} {'ms/chunk':>9} {'vs eager':>8} {'x floor':>8} "
          f"{'max|da|':>9}", flush=True)
    rows = []
    for scheduler in args.schedule:
        steps = args.steps or DEFAULT_STEPS[scheduler]
        label = f"{scheduler}-{steps}"
        for horizon in args.horizon:
            eager = make_policy(horizon, scheduler, steps, args.down_dims, device)
            policies = {"LeRobot eager": eager}
            if args.compile:
                # The same seed, so the same weights (its state_dict's U-Net keys have torch.compile's
                # `_orig_mod.`, so eager's would not load into it).
                policies["LeRobot compile"] = make_policy(horizon, scheduler, steps, args.down_dims, device,
                                                          compile_model=True)
            policies["ours fp32"] = accelerate(copy.deepcopy(eager))
            policies["ours bf16"] = accelerate(copy.deepcopy(eager), dtype=torch.bfloat16)
            for batch in args.batch:
                obs = observations(eager, batch, device, seed=batch)
                noise = torch.randn(batch, horizon, ACTION, generator=torch.Generator().manual_seed(7)).to(device)
                results, actions = {}, {}
                with torch.no_grad():
                    for method, policy in policies.items():
                        reps = max(1, args.reps // 3) if method == "LeRobot eager" else args.reps
                        results[method] = wall_ms(lambda: policy.diffusion.generate_actions(obs), reps=reps,
                                                  device=device)
                        actions[method] = policy.diffusion.generate_actions(obs, noise=noise)
                for method, ms in results.items():
                    dtype = torch.bfloat16 if method == "ours bf16" else torch.float32
                    floor_ms = (conv_weight_bytes(eager, dtype) * steps / (bandwidth * 1e9) * 1e3) if cuda else None
                    error = None
                    if scheduler == "DDIM" and method != "LeRobot eager":
                        error = (actions[method].float() - actions["LeRobot eager"]).abs().max().item()
                    row = dict(schedule=label, horizon=horizon, batch=batch, method=method, ms=ms,
                               floor_ms=floor_ms, action_error_vs_eager=error, device=name,
                               torch=torch.__version__, down_dims=args.down_dims)
                    rows.append(row)
                    print(f"{label:9} {horizon:4} {batch:3} {method:16} {ms:9.2f} "
                          f"{results['LeRobot eager'] / ms:7.1f}x "
                          + (f"{ms / floor_ms:7.1f}x" if floor_ms else f"{'-':>8}")
                          + ("" if error is None else f" {error:9.1e}"), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "benchmark_lerobot.json").write_text(json.dumps(rows, indent=1))
    plot_grouped_bars(rows, ("schedule", "horizon", "batch"), lambda s, t, b: f"{s}\nT={t} B={b}", "ms",
                      "ms per action chunk (log)", f"LeRobot DiffusionPolicy generate_actions, {name}",
                      out / "benchmark_lerobot.png")
    print(f"wrote {out / 'benchmark_lerobot.json'} and benchmark_lerobot.png")
    return rows


if __name__ == "__main__":
    main()
