"""Denoise action chunks with a Diffusion Policy-sized U-Net, plain PyTorch vs this package.

    python -m diffusion_policy_accelerated.tools.demo                  # lowdim U-Net, random weights
    python -m diffusion_policy_accelerated.tools.demo --weights unet.pt --scheduler ddim --steps 16

`--weights` takes a `ConditionalUnet1D` state_dict saved with torch.save (the keys of
Diffusion Policy's model, e.g. `{k[6:]: v for k, v in ckpt['state_dicts']['ema_model'].items()
if k.startswith('model.')}`); without it the U-Net has random weights of the lowdim Push-T
size, which times exactly like a trained one.

"accelerated" is `GraphedSampler`: the fused ops, the FiLM encoders hoisted out of the loop
and, on a GPU, the whole loop as one CUDA graph replay. Both paths get the same noise, so
their actions must agree (printed as the max difference; the plain path runs with
PyTorch's defaults, so on a GPU its cuDNN convs may use TF32).
"""
import argparse
import statistics
import time

import torch

from ..kernels.library import loaded_build
from ..kernels.ops import built_with_cuda
from ..model.configs import HORIZON, SCHEDULER_CONFIG, UNETS
from ..model.unet import ConditionalUnet1D
from ..sampling.sampler import GraphedSampler
from ..model.schedulers import DenoiseSchedule

LOWDIM_UNET = UNETS["lowdim"]


def plain_denoise(model, schedule, global_cond, noise):
    """Diffusion Policy's loop in plain PyTorch: eager U-Net, diffusers' step math."""
    model.use_fused_ops = False
    sample = noise[0]
    for i, t in enumerate(schedule.timesteps):
        model_output = model(sample, t, global_cond=global_cond)
        sample = schedule.reference_step(model_output, i, sample,
                                         noise[i + 1] if schedule.needs_noise(i) else None)
    model.use_fused_ops = True
    return sample


def build_line() -> str:
    """What the loaded library was built with (kernels/library.py records it at build time)."""
    plan = loaded_build()
    if plan is not None:
        return plan.describe()
    return ("CPU + CUDA kernels" if built_with_cuda() else "CPU-only build") + " (its build recorded no details)"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() and built_with_cuda() else "cpu",
                        help="default: cuda where there is a GPU and the build has CUDA kernels, else cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--scheduler", default="ddpm", choices=["ddpm", "ddim"])
    parser.add_argument("--steps", type=int, help="denoising steps (default 100 DDPM / 16 DDIM; "
                        "on a CPU 10)")
    parser.add_argument("--actions", type=int, default=5, help="action chunks to time per path")
    parser.add_argument("--batch", type=int, default=1, help="robots served at once")
    parser.add_argument("--weights", help="ConditionalUnet1D state_dict (torch.save) to load")
    args = parser.parse_args(argv)

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    print(f"build: {build_line()}", flush=True)
    if device.type == "cuda" and not built_with_cuda():
        parser.error(f"--device {args.device}: this build has no CUDA kernels; reinstall on the GPU machine (or with "
                     f"TORCH_CUDA_ARCH_LIST set to its arch) to build them")
    plan = loaded_build()
    note = plan.note_for(torch.cuda.get_device_capability(device)) if device.type == "cuda" and plan else ""
    if note:
        print(f"note: {note}", flush=True)
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

    sampler = GraphedSampler(model, schedule)
    gen = torch.Generator(device).manual_seed(1)
    shape = (args.batch, HORIZON, LOWDIM_UNET["input_dim"])
    no_inpainting = torch.zeros(shape, dtype=torch.bool, device=device)
    methods = {"plain PyTorch": lambda cond, noise: plain_denoise(model, schedule, cond, noise),
               "accelerated": lambda cond, noise: sampler(torch.zeros(shape, device=device, dtype=dtype),
                                                         no_inpainting, global_cond=cond, noise=noise)}
    timings = {name: [] for name in methods}
    max_diff = 0.0
    with torch.inference_mode():
        for action in range(args.actions + 1):  # the first round warms up and is not timed
            cond = torch.randn(args.batch, 40, device=device, dtype=dtype, generator=gen)
            noise = torch.randn((steps + 1,) + shape, device=device, dtype=dtype, generator=gen)
            actions = {}
            for name, run in methods.items():
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                actions[name] = run(cond, noise)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if action > 0:
                    timings[name].append(1e3 * (time.perf_counter() - start))
            max_diff = max(max_diff, (actions["accelerated"].float() - actions["plain PyTorch"].float())
                           .abs().max().item())
            if action > 0:
                print("  action {}: ".format(action) + "   ".join(
                    f"{name} {times[-1]:8.1f} ms" for name, times in timings.items()), flush=True)
    plain, fast = (statistics.median(timings[name]) for name in methods)
    print(f"median ms per action: plain PyTorch {plain:.1f}, accelerated {fast:.2f} "
          f"({plain / fast:.2f}x); max |action difference| {max_diff:.2e}")


if __name__ == "__main__":
    main()
