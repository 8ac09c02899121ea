"""End-to-end predict_action latency (what a robot waits for), side by side, for Diffusion
Policy's Push-T lowdim and image policies (ResNet18-GroupNorm encoder per camera, 96x96 images
centre-cropped to 84x84, 2 observation steps, horizon 16), its Push-T hybrid image policy
("hybrid": robomimic's own ObservationEncoder, a VisualCore of ResNet18Conv, SpatialSoftmax
with 32 keypoints and 64 features, with DP's GroupNorm and fixed-crop swaps; the U-Net
512/1024/2048 with 128-wide step embedding; needs robomimic) and its Push-T lowdim
transformer policy ("transformer": TransformerForDiffusion with 8 layers, 4 heads, width 256,
causal attention, observations as condition tokens, horizon 10), which accelerate() runs by
the generic path (the transformer as it is, in the graph with this package's denoise step):

  eager         the policy as Diffusion Policy runs it: encoder, PyTorch U-Net and diffusers'
                scheduler, launch by launch
  loop graph    accelerate(policy, whole_graph=False, encoder_channels_last=False): the
                denoising loop as one CUDA graph, normalisation and encoder eager
  whole, NCHW   accelerate(policy, encoder_channels_last=False): normalisation, encoder, loop
                and action slicing in one replay
  whole graph   accelerate(policy): the same, the encoder's weights channels-last (image policies)
  whole, unchecked
                the whole graph without the non-finite guard (check_finite=False): the guard's cost
  + fp16 enc, + bf16 enc
                the whole graph with encoder_dtype=torch.float16 / bfloat16
  sampler       the accelerated sampler alone, on the global condition computed beforehand:
                what the whole graph is held against ("over sampler")

max|da|: the largest action difference from the eager policy on the same observations and
noise (DDIM draws only the initial noise, so this is rounding and TF32).

The policies are the stand-ins of tests/support/dp_policies.py and dp_transformer.py (Diffusion
Policy is not on PyPI), with random weights. Wall-clock medians after warm-up of synchronised
calls, so host work counts.
PyTorch's default precision settings, as a policy runs by default: cuDNN's convolutions (the
encoder's) may use TF32, matrix products do not (--no-tf32: neither).
Writes JSON and a PNG plot.

    python -m scripts.benchmark_policy [--policy lowdim image1 image3 hybrid transformer] [--batch 1 8]
                                       [--schedule DDIM-16 DDPM-100] [--no-tf32] [--out DIR]

(run from the repository's root, as a module: it builds the policies from tests/support's copy
of Diffusion Policy's module tree)
"""
import argparse
import copy
import json
from pathlib import Path

import torch
from diffusers import DDIMScheduler, DDPMScheduler

from diffusion_policy_accelerated import ConditionalUnet1D, accelerate
from diffusion_policy_accelerated.model.configs import HORIZON, SCHEDULER_CONFIG, UNETS
from diffusion_policy_accelerated.tools.profiling import plot_grouped_bars, wall_ms
from tests.support.dp_policies import ImagePolicy, LowdimPolicy, ResNetObsEncoder, Sizes
from tests.support.dp_transformer import TransformerForDiffusion, TransformerLowdimPolicy

SCHEDULES = {"DDIM-16": (DDIMScheduler, 16), "DDPM-100": (DDPMScheduler, 100)}
POLICIES = {"lowdim": 0, "image1": 1, "image3": 3, "hybrid": 1, "transformer": 0}  # cameras
SIZES = Sizes(horizon=HORIZON, n_obs_steps=2, n_action_steps=8, action_dim=2, obs_dim=20)
IMAGE, CROP = (3, 96, 96), 84
# Diffusion Policy's Push-T hybrid policy's observations (its train_diffusion_unet_hybrid workspace).
HYBRID_SHAPE_META = {"obs": {"image": {"shape": list(IMAGE), "type": "rgb"},
                             "agent_pos": {"shape": [2], "type": "low_dim"}}, "action": {"shape": [2]}}
# Diffusion Policy's Push-T lowdim transformer (its train_diffusion_transformer_lowdim workspace).
TRANSFORMER_HORIZON = 10
TRANSFORMER = dict(n_layer=8, n_head=4, n_emb=256, p_drop_emb=0.0, p_drop_attn=0.01, causal_attn=True,
                   time_as_cond=True, n_cond_layers=0)


def make_policy(name, schedule):
    """The Push-T policy `name` as Diffusion Policy runs it (its U-Net with PyTorch's ops)."""
    torch.manual_seed(0)
    cameras = POLICIES[name]
    scheduler_cls, steps = SCHEDULES[schedule]
    scheduler = scheduler_cls(**SCHEDULER_CONFIG)
    if name == "transformer":
        model = TransformerForDiffusion(input_dim=SIZES.action_dim, output_dim=SIZES.action_dim,
                                        horizon=TRANSFORMER_HORIZON, n_obs_steps=SIZES.n_obs_steps,
                                        cond_dim=SIZES.obs_dim, obs_as_cond=True, **TRANSFORMER)
        return TransformerLowdimPolicy(model, scheduler, TRANSFORMER_HORIZON, SIZES.obs_dim, SIZES.action_dim,
                                       SIZES.n_action_steps, SIZES.n_obs_steps, num_inference_steps=steps,
                                       obs_as_cond=True).cuda().eval()
    if cameras == 0:
        unet = ConditionalUnet1D(**UNETS["lowdim"])
        policy = LowdimPolicy(unet, scheduler, "global", steps, SIZES)
    elif name == "hybrid":
        try:
            from tests.support.dp_hybrid_checkpoint import robomimic_encoder
            encoder = robomimic_encoder(HYBRID_SHAPE_META, crop_shape=(CROP, CROP))
        except ImportError as error:
            raise SystemExit(f"--policy hybrid needs robomimic ({error}): pip install --no-deps robomimic==0.3.0 "
                             f"termcolor") from error
        feature_dim = encoder.output_shape()[0]
        # DP's hybrid Push-T U-Net (train_diffusion_unet_hybrid_workspace.yaml), which LeRobot's default copies.
        unet = ConditionalUnet1D(**{**UNETS["lerobot"], "global_cond_dim": feature_dim * SIZES.n_obs_steps})
        policy = ImagePolicy(unet, scheduler, "global", steps, SIZES, encoder, feature_dim,
                             {key: tuple(value["shape"]) for key, value in HYBRID_SHAPE_META["obs"].items()})
    else:
        keys = [f"camera{i}" for i in range(cameras)]
        feature_dim = 512 * cameras + 2
        unet = ConditionalUnet1D(**{**UNETS["image"], "global_cond_dim": feature_dim * SIZES.n_obs_steps})
        policy = ImagePolicy(unet, scheduler, "global", steps, SIZES, ResNetObsEncoder(keys, CROP), feature_dim,
                             {**{key: IMAGE for key in keys}, "agent_pos": (2,)})
    unet.use_fused_ops = False
    return policy.cuda().eval()


def make_obs(name, batch, seed):
    generator = torch.Generator().manual_seed(seed)
    steps = (batch, SIZES.n_obs_steps)
    if POLICIES[name] == 0:
        obs = {"obs": torch.randn(*steps, SIZES.obs_dim, generator=generator)}
    elif name == "hybrid":
        obs = {"image": torch.rand(*steps, *IMAGE, generator=generator),
               "agent_pos": torch.randn(*steps, 2, generator=generator)}
    else:
        obs = {f"camera{i}": torch.rand(*steps, *IMAGE, generator=generator) for i in range(POLICIES[name])}
        obs["agent_pos"] = torch.randn(*steps, 2, generator=generator)
    return {key: value.cuda() for key, value in obs.items()}


def call(policy, obs):
    with torch.no_grad():
        return policy.predict_action(obs)["action"]


def predict(policy, obs, seed=0):
    """A seeded call: the same noise for every method (timed calls are not reseeded, as a
    robot's are not: torch.manual_seed alone costs ~0.1 ms of host time)."""
    torch.manual_seed(seed)
    return call(policy, obs)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--schedule", nargs="+", default=["DDIM-16"], choices=list(SCHEDULES))
    parser.add_argument("--no-tf32", action="store_true", help="no TF32 in cuDNN's convolutions either")
    parser.add_argument("--out", default=".", help="folder for benchmark_policy.json and .png")
    args = parser.parse_args()
    if args.no_tf32:
        torch.backends.cudnn.allow_tf32 = False
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  TF32: cuDNN "
          f"{'on' if torch.backends.cudnn.allow_tf32 else 'off'}, matmul "
          f"{'on' if torch.backends.cuda.matmul.allow_tf32 else 'off'}", flush=True)
    print(f"{'policy':7} {'schedule':9} {'B':>3} {'method':16} {'ms/call':>8} {'vs eager':>8} {'over sampler':>12} "
          f"{'max|da|':>9}", flush=True)
    rows = []
    for name in args.policy:
        for schedule in args.schedule:
            eager = make_policy(name, schedule)
            variants = {"loop graph": dict(whole_graph=False, encoder_channels_last=False)}
            if POLICIES[name]:
                variants["whole, NCHW"] = dict(encoder_channels_last=False)
            variants["whole graph"] = {}
            variants["whole, unchecked"] = dict(check_finite=False)
            if POLICIES[name]:
                variants.update({"+ fp16 enc": dict(encoder_dtype=torch.float16),
                                 "+ bf16 enc": dict(encoder_dtype=torch.bfloat16)})
            policies = {"eager": eager, **{label: accelerate(copy.deepcopy(eager), **options)
                                           for label, options in variants.items()}}
            for batch in args.batch:
                obs = make_obs(name, batch, seed=batch)
                results, actions = {}, {}
                for label, policy in policies.items():
                    results[label] = wall_ms(lambda: call(policy, obs), reps=5 if label == "eager" else 20)
                    actions[label] = predict(policy, obs)
                results["sampler"] = wall_ms(sampler_alone(policies["whole graph"], obs))
                for label, ms in results.items():
                    error = None
                    if label in actions and label != "eager":
                        error = (actions[label] - actions["eager"]).abs().max().item()
                    row = dict(policy=name, schedule=schedule, batch=batch, method=label, ms=ms,
                               over_sampler_ms=ms - results["sampler"], action_error_vs_eager=error,
                               device=torch.cuda.get_device_name(), torch=torch.__version__,
                               cudnn_tf32=torch.backends.cudnn.allow_tf32)
                    rows.append(row)
                    print(f"{name:7} {schedule:9} {batch:3} {label:16} {ms:8.2f} {results['eager'] / ms:7.1f}x "
                          f"{row['over_sampler_ms']:+12.2f}" + ("" if error is None else f" {error:9.1e}"), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "benchmark_policy.json").write_text(json.dumps(rows, indent=1))
    plot(rows, out / "benchmark_policy.png")


def sampler_alone(policy, obs):
    """The accelerated policy's sampler (its own graph) on the condition predict_action would
    build from `obs`, computed here once."""
    with torch.no_grad():
        if isinstance(policy, TransformerLowdimPolicy):
            nobs = policy.normalizer["obs"].normalize(obs["obs"])
            data = torch.zeros(nobs.shape[0], policy.horizon, policy.action_dim, device="cuda")
            mask = torch.zeros_like(data, dtype=torch.bool)
            sampler, cond = policy.conditional_sample.sampler, nobs[:, :policy.n_obs_steps]
            return lambda: sampler(data, mask, cond=cond)
        if isinstance(policy, LowdimPolicy):
            nobs = policy.normalizer["obs"].normalize(obs["obs"])
            global_cond = nobs[:, :policy.n_obs_steps].reshape(nobs.shape[0], -1)
        else:
            nobs = policy.normalizer.normalize(obs)
            frames = {key: value[:, :policy.n_obs_steps].flatten(0, 1) for key, value in nobs.items()}
            global_cond = policy.obs_encoder(frames).reshape(next(iter(obs.values())).shape[0], -1)
    data = torch.zeros(global_cond.shape[0], policy.horizon, policy.action_dim, device="cuda")
    mask = torch.zeros_like(data, dtype=torch.bool)
    sampler = policy.conditional_sample.sampler

    return lambda: sampler(data, mask, global_cond=global_cond)


def plot(rows, path):
    plot_grouped_bars(rows, ("policy", "schedule", "batch"), lambda p, s, b: f"{p}\n{s}\nB={b}", "ms",
                      "ms per predict_action (log)",
                      f"Diffusion Policy predict_action end to end, {rows[0]['device']}", path)


if __name__ == "__main__":
    main()
