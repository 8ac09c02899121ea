"""Denoise action chunks with a Diffusion Policy-sized U-Net, plain PyTorch vs this package.

    python -m diffusion_policy_accelerated.demo                  # lowdim U-Net, random weights
    python -m diffusion_policy_accelerated.demo --weights unet.pt --scheduler ddim --steps 16

`--weights` takes a `ConditionalUnet1D` state_dict saved with torch.save (the keys of
Diffusion Policy's model, e.g. `{k[6:]: v for k, v in ckpt['state_dicts']['ema_model'].items()
if k.startswith('model.')}`); without it the U-Net has random weights of the lowdim Push-T
size, which times exactly like a trained one.

Both paths draw the same noise, so their actions must agree (printed as the max difference).
"""
import argparse
import statistics
import time

import torch

from .model import ConditionalUnet1D
from .schedulers import DenoiseSchedule

# Diffusion Policy's lowdim Push-T U-Net: action dim 2, 2 observation steps of 20 features
# as global conditioning, horizon 16, and its noise scheduler.
LOWDIM_UNET = dict(input_dim=2, global_cond_dim=40, diffusion_step_embed_dim=256,
                   down_dims=[256, 512, 1024], kernel_size=5, n_groups=8, cond_predict_scale=True)
SCHEDULER_CONFIG = dict(num_train_timesteps=100, beta_start=0.0001, beta_end=0.02,
                        beta_schedule="squaredcos_cap_v2", clip_sample=True, set_alpha_to_one=True,
                        steps_offset=0, prediction_type="epsilon", variance_type="fixed_small")


def denoise(model, schedule, global_cond, noise, step_noise, fused):
    """One action chunk: the whole reverse-diffusion loop from pure noise."""
    model.use_fused_ops = fused
    step = schedule.step if fused else schedule.reference_step
    sample = noise
    for i, t in enumerate(schedule.timesteps):
        model_output = model(sample, t, global_cond=global_cond)
        sample = step(model_output, i, sample, step_noise[i] if schedule.needs_noise(i) else None)
    return sample


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--scheduler", default="ddpm", choices=["ddpm", "ddim"])
    parser.add_argument("--steps", type=int, help="denoising steps (default 100 DDPM / 16 DDIM; "
                        "on a CPU 10)")
    parser.add_argument("--actions", type=int, default=5, help="action chunks to time per path")
    parser.add_argument("--batch", type=int, default=1, help="robots served at once")
    parser.add_argument("--weights", help="ConditionalUnet1D state_dict (torch.save) to load")
    args = parser.parse_args(argv)

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    steps = args.steps or (10 if device.type == "cpu" else 100 if args.scheduler == "ddpm" else 16)
    torch.manual_seed(0)
    model = ConditionalUnet1D(**LOWDIM_UNET)
    if args.weights:
        model.load_state_dict(torch.load(args.weights, map_location="cpu"), strict=True)
    model = model.to(device, dtype).eval()
    schedule = DenoiseSchedule.from_diffusers(SCHEDULER_CONFIG, steps, kind=args.scheduler).to(device)
    conv_params = sum(m.weight.numel() for m in model.modules()
                      if isinstance(m, (torch.nn.Conv1d, torch.nn.ConvTranspose1d)))
    print(f"U-Net {LOWDIM_UNET['down_dims']} ({conv_params / 1e6:.1f} M conv params, "
          f"{'loaded' if args.weights else 'random'} weights), {args.scheduler.upper()} {steps} steps, "
          f"batch {args.batch}, {args.dtype} on {device}", flush=True)

    gen = torch.Generator(device).manual_seed(1)
    shape = (args.batch, 16, LOWDIM_UNET["input_dim"])
    timings = {False: [], True: []}
    max_diff = 0.0
    with torch.inference_mode():
        for action in range(args.actions + 1):  # the first round warms up and is not timed
            cond = torch.randn(args.batch, 40, device=device, dtype=dtype, generator=gen)
            noise = torch.randn(shape, device=device, dtype=dtype, generator=gen)
            step_noise = torch.randn((steps,) + shape, device=device, dtype=dtype, generator=gen)
            actions = {}
            for fused in (False, True):
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                actions[fused] = denoise(model, schedule, cond, noise, step_noise, fused)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if action > 0:
                    timings[fused].append(1e3 * (time.perf_counter() - start))
            max_diff = max(max_diff, (actions[True].float() - actions[False].float()).abs().max().item())
            if action > 0:
                print(f"  action {action}: plain {timings[False][-1]:8.1f} ms   "
                      f"fused ops {timings[True][-1]:8.1f} ms", flush=True)
    plain, fused = statistics.median(timings[False]), statistics.median(timings[True])
    print(f"median ms per action: plain PyTorch {plain:.1f}, fused ops {fused:.1f} "
          f"({plain / fused:.2f}x); max |action difference| {max_diff:.2e}")


if __name__ == "__main__":
    main()
