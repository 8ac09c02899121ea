"""`accelerate(policy)`: Diffusion Policy's U-Net and transformer policies, sampling through this
package.

Diffusion Policy's `DiffusionUnetLowdimPolicy`, `DiffusionUnetImagePolicy` and
`DiffusionUnetHybridImagePolicy` keep the noise predictor in `policy.model`, the diffusers
scheduler in `policy.noise_scheduler`, and the denoising loop in `policy.conditional_sample`,
which their `predict_action` calls after normalising and encoding the observations.
`accelerate` replaces the first with this package's `ConditionalUnet1D` (same weights) and the
last with a `GraphedSampler`, so observation encoding, normalisation and action slicing stay
Diffusion Policy's own code. The policies are recognised by those attributes (duck typing):
the diffusion_policy package is never imported.

A policy whose `model` is another denoiser, where the U-Net kernels do not apply (the
transformer policies `DiffusionTransformerLowdimPolicy` and
`DiffusionTransformerHybridImagePolicy`, whose `TransformerForDiffusion` is called as
`model(trajectory, t, cond)`), takes the generic path: its `conditional_sample` becomes a
`GenericSampler` (sampling/generic.py) that runs the same loop with the model as it is and
this package's schedules and fused denoise step; on CUDA the whole `predict_action` is still
one graph replay per input shape.
"""
import inspect
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn as nn

from ..model.unet import ConditionalUnet1D
from ..sampling.finite import FiniteGuard, check_finite_option
from ..sampling.generic import GenericSampler
from ..sampling.policy_graph import GraphedPolicyCall, check_encoder_options, set_encoder_precision
from ..sampling.picard import Picard
from ..sampling.sampler import FollowingSampler, GraphedSampler
from ..model.schedulers import DDIM_STEP_OPTIONS, DenoiseSchedule

__all__ = ["accelerate", "unet_from_diffusion_policy"]

POLICY_ATTRIBUTES = ("model", "noise_scheduler", "num_inference_steps", "conditional_sample")
UNET_ATTRIBUTES = ("diffusion_step_encoder", "down_modules", "mid_modules", "up_modules",
                   "final_conv")


def unet_from_diffusion_policy(dp_model: nn.Module) -> ConditionalUnet1D:
    """This package's `ConditionalUnet1D` built with the constructor arguments of `dp_model`
    (Diffusion Policy's `ConditionalUnet1D`), read off its module structure, holding its
    weights (loaded strictly), on its device, in its dtype and training mode."""
    missing = [name for name in UNET_ATTRIBUTES if not hasattr(dp_model, name)]
    if missing:
        raise TypeError(
            f"policy.model is a {type(dp_model).__name__} without {missing}, not Diffusion Policy's "
            f"ConditionalUnet1D (accelerate() runs other denoisers, TransformerForDiffusion among them, "
            f"as they are: the generic path)")
    try:
        first_block = dp_model.down_modules[0][0]
        first_conv = first_block.blocks[0].block[0]
        step_embed_dim = dp_model.diffusion_step_encoder[1].in_features
        film = first_block.cond_encoder[1]
        local_encoder = dp_model.local_cond_encoder
        config = dict(
            input_dim=dp_model.final_conv[1].out_channels,
            local_cond_dim=(None if local_encoder is None
                            else local_encoder[0].blocks[0].block[0].in_channels),
            # The FiLM encoders read cat(timestep embedding, global_cond).
            global_cond_dim=film.in_features - step_embed_dim or None,
            diffusion_step_embed_dim=step_embed_dim,
            down_dims=[level[0].blocks[0].block[0].out_channels for level in dp_model.down_modules],
            kernel_size=first_conv.kernel_size[0],
            n_groups=first_block.blocks[0].block[1].num_groups,
            # Predicting a FiLM scale doubles the encoder's output: a scale and a bias per channel.
            cond_predict_scale=film.out_features == 2 * first_conv.out_channels,
        )
    except (AttributeError, IndexError, TypeError) as error:
        raise TypeError(f"policy.model ({type(dp_model).__name__}) does not have the module "
                        f"layout of Diffusion Policy's ConditionalUnet1D: {error}") from error
    unet = ConditionalUnet1D(**config)
    unet.load_state_dict(dp_model.state_dict(), strict=True)
    parameter = next(dp_model.parameters())
    return unet.to(device=parameter.device, dtype=parameter.dtype).train(dp_model.training)


def _ddim_step_options(step_kwargs: dict) -> Tuple[float, bool]:
    """(eta, use_clipped_model_output) from the keyword arguments Diffusion Policy passes to
    `scheduler.step`; a DDPM schedule rejects non-default values when it is built."""
    unknown = sorted(set(step_kwargs) - set(DDIM_STEP_OPTIONS))
    if unknown:
        raise ValueError(
            f"scheduler.step keyword arguments {unknown} (from policy.kwargs) are not supported by "
            f"accelerate(); only DDIMScheduler's {list(DDIM_STEP_OPTIONS)} are")
    return (float(step_kwargs.get("eta", 0.0)),
            bool(step_kwargs.get("use_clipped_model_output", False)))


class _AcceleratedConditionalSample:
    """Stands in for the policy's `conditional_sample` method, with its signature.

    Diffusion Policy reads `num_inference_steps` and the step options on every call, and the
    sampler keeps tensors on the U-Net's device and in its dtype and tables of its weights; so
    a change to any of these (say `policy.to("cuda")` or a weight update after accelerate())
    builds a new sampler (and, on CUDA, captures new graphs) instead of sampling with a stale
    schedule or tables.
    """

    def __init__(self, policy, unet: ConditionalUnet1D, parallel=None):
        self.policy = policy
        self.unet = unet
        self.following = FollowingSampler(unet, parallel)
        self._sampler_for(getattr(policy, "kwargs", {}))

    @property
    def sampler(self) -> GraphedSampler:
        return self.following.sampler

    def _sampler_for(self, step_kwargs: dict) -> GraphedSampler:
        eta, use_clipped_model_output = _ddim_step_options(step_kwargs)
        key = (self.policy.num_inference_steps, id(self.policy.noise_scheduler), eta, use_clipped_model_output)
        return self.following.get(key, lambda: DenoiseSchedule.from_diffusers(
            self.policy.noise_scheduler, self.policy.num_inference_steps, eta=eta,
            use_clipped_model_output=use_clipped_model_output), next(self.unet.parameters()).device)

    def sampler_now(self) -> GraphedSampler:
        """The sampler the next call will use (built anew where the policy changed)."""
        return self._sampler_for(getattr(self.policy, "kwargs", {}))

    def __call__(self, condition_data: torch.Tensor, condition_mask: torch.Tensor,
                 local_cond: Optional[torch.Tensor] = None,
                 global_cond: Optional[torch.Tensor] = None,
                 generator: Optional[torch.Generator] = None, **step_kwargs) -> torch.Tensor:
        # The sampler casts the inputs to the U-Net's dtype and the result back to
        # condition_data's, and draws the initial noise in condition_data's dtype as
        # Diffusion Policy does.
        return self._sampler_for(step_kwargs)(condition_data, condition_mask, local_cond=local_cond,
                                              global_cond=global_cond, generator=generator)


class _GenericConditionalSample(_AcceleratedConditionalSample):
    """Stands in for the `conditional_sample` of a policy whose model is not Diffusion Policy's
    U-Net (the transformer policies): the generic path. Diffusion Policy's loop calls
    `model(trajectory, t, <conditioning>)` and then `scheduler.step`; a GenericSampler runs
    the same loop with the model as it is, passing the conditioning by the names of the
    policy's own `conditional_sample` (the transformer policies': `cond`), given positionally
    or by name, with that method's defaults. The schedule, device and weights are followed as
    for the U-Net."""

    def __init__(self, policy, conditioning: Dict[str, Any]):
        self.policy = policy
        self.unet = policy.model  # the module whose device _sampler_for follows
        self.conditioning = conditioning
        self.following = FollowingSampler(policy.model, build=GenericSampler)
        self._sampler_for(getattr(policy, "kwargs", {}))

    def __call__(self, condition_data: torch.Tensor, condition_mask: torch.Tensor, *args,
                 generator: Optional[torch.Generator] = None, **kwargs) -> torch.Tensor:
        names = list(self.conditioning)
        if len(args) > len(names):
            raise TypeError(f"conditional_sample takes {len(names)} conditioning arguments after condition_mask "
                            f"({names}), got {len(args)} positional ones")
        conditioning = {**self.conditioning, **dict(zip(names, args))}
        for name in names:
            if name in kwargs:
                if name in names[:len(args)]:
                    raise TypeError(f"conditional_sample got multiple values for argument {name!r}")
                conditioning[name] = kwargs.pop(name)
        # What is left are scheduler.step's options (policy.kwargs).
        return self._sampler_for(kwargs)(condition_data, condition_mask, generator=generator, **conditioning)


def _generic_conditional_sample(policy, dtype: Optional[torch.dtype], parallel) -> _GenericConditionalSample:
    """The generic path's conditional_sample for `policy`, after checking that it can take it:
    `policy.model` a module, accelerate()'s U-Net options not asked for, and the policy's own
    `conditional_sample` shaped like Diffusion Policy's, (condition_data, condition_mask,
    <conditioning>..., generator=None, **kwargs)."""
    model = policy.model
    name = type(model).__name__
    if not isinstance(model, nn.Module):
        raise TypeError(f"policy.model is a {name}, not a torch.nn.Module: accelerate() runs Diffusion Policy's "
                        f"ConditionalUnet1D with this package's kernels, and any other denoiser module as it is")
    if not any(p.is_floating_point() for p in model.parameters()):
        raise ValueError(f"policy.model ({name}) has no floating-point parameter: the denoising loop runs on the "
                         f"device and in the dtype of the model's")
    if dtype is not None:
        raise ValueError(f"dtype: policy.model is a {name}, which accelerate() runs as it is, in its own dtype (the "
                         f"generic path); dtype converts Diffusion Policy's ConditionalUnet1D only")
    if parallel is not None:
        raise ValueError(f"parallel: Picard sampling needs Diffusion Policy's ConditionalUnet1D; policy.model is a "
                         f"{name}, which the generic path samples step by step")
    try:
        signature = inspect.signature(policy.conditional_sample)
    except (TypeError, ValueError):  # a callable without a signature Python can read
        signature = None
    named = [] if signature is None else [p for p in signature.parameters.values()
                                          if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if len(named) < 2 or named[1].kind != named[1].POSITIONAL_OR_KEYWORD or "generator" not in [p.name for p in named]:
        raise TypeError(f"{type(policy).__name__}.conditional_sample{signature or ' (no signature)'} is not shaped "
                        f"like Diffusion Policy's (condition_data, condition_mask, <conditioning>..., generator=None, "
                        f"**kwargs): accelerate() cannot tell which arguments condition policy.model ({name})")
    return _GenericConditionalSample(policy, {p.name: None if p.default is p.empty else p.default
                                              for p in named[2:] if p.name != "generator"})


def accelerate(policy, dtype: Optional[torch.dtype] = None, *, whole_graph: bool = True,
               encoder_dtype: Optional[torch.dtype] = None, encoder_channels_last: Optional[bool] = None,
               parallel=None, check_finite: bool = True):
    """Make a Diffusion Policy U-Net policy (lowdim, image or hybrid image), transformer policy
    (lowdim or hybrid image) or a LeRobot DiffusionPolicy (see
    `diffusion_policy_accelerated.adapters.lerobot`) sample with this package, in place, and
    return it.

    `policy.model` becomes this package's `ConditionalUnet1D` with the same weights (so
    `policy.state_dict()` keeps its keys), converted to `dtype` if given (e.g.
    `torch.bfloat16`; the policy's inputs and actions keep their dtype), and
    `policy.conditional_sample` a `GraphedSampler` (one CUDA graph replay per call on CUDA,
    the same loop eagerly on the CPU), so `policy.predict_action(obs_dict)` returns what it
    did. The original U-Net stays reachable as `policy._dpa_original_model`.

    A policy whose `model` is not Diffusion Policy's U-Net (the transformer policies,
    `DiffusionTransformerLowdimPolicy` and `DiffusionTransformerHybridImagePolicy`) keeps its
    model as it is, and `policy.conditional_sample` becomes a `GenericSampler` running the
    same loop with this package's schedules and fused denoise step (the generic path); `dtype`
    and `parallel` are for the U-Net and refused there.

    With `whole_graph` (the default), `policy.predict_action` itself runs as one CUDA graph per
    input shape on CUDA: normalisation, the observation encoder, the denoising loop and the
    action slicing in one replay (policy_graph.py; a policy whose encoder cannot be captured
    warns once and runs it eagerly). The graphs hold the policy's modules as they are at the
    first call: moving, converting or loading weights afterwards is followed, replacing a
    submodule (`policy.obs_encoder = ...`) is not; accelerate a fresh policy for that.
    The image policies' `obs_encoder` runs with channels-last weights (`encoder_channels_last`,
    default: where there is an encoder) and, with `encoder_dtype` (torch.float16 /
    torch.bfloat16), under autocast.

    `parallel` samples by Picard iteration (sampling/picard.py: True for the defaults, or a
    `Picard(window, tolerance)`): the same actions up to the tolerance, in fewer dependent
    steps where the GPU has room (small batches); None keeps the sequential loop.

    `check_finite` (default True): `predict_action` (LeRobot: `policy.diffusion.generate_actions`,
    which `select_action` and `predict_action_chunk` call) raises `dpa.NonFiniteError` instead
    of returning actions where its observations (the floating-point tensors it is given) or its
    actions hold NaN or Inf, naming which input or output, which rows, and which of the policy's
    weights are not finite if any. The flags are computed on the device, inside the graph on
    CUDA, and read with one small copy, which waits for the call's actions to be computed: the
    call no longer returns while the GPU still works on it. A caller that queues more GPU work
    behind the call instead of reading the actions turns the check off (sampling/finite.py).

    The policy must be in eval mode and its scheduler a DDPMScheduler or DDIMScheduler with
    options `DenoiseSchedule` supports. Moving the policy afterwards (`policy.to("cuda")`),
    changing `num_inference_steps` or the scheduler, and updating `policy.model`'s weights in
    place (`load_state_dict`) are followed: the next call builds a new sampler.
    """
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating-point torch.dtype or None, got {dtype!r}")
    if not isinstance(whole_graph, bool):
        raise TypeError(f"whole_graph must be a bool, got {whole_graph!r}")
    parallel = Picard.of(parallel)
    check_finite = check_finite_option(check_finite)
    from . import lerobot

    if lerobot.is_lerobot_policy(policy):
        return lerobot.accelerate_lerobot(policy, dtype, whole_graph=whole_graph, encoder_dtype=encoder_dtype,
                                          encoder_channels_last=encoder_channels_last, parallel=parallel,
                                          check_finite=check_finite)
    missing = [name for name in POLICY_ATTRIBUTES if not hasattr(policy, name)]
    if missing:
        raise TypeError(f"{type(policy).__name__} has no {missing}: accelerate() takes a Diffusion "
                        f"Policy U-Net policy (DiffusionUnetLowdimPolicy, DiffusionUnetImagePolicy "
                        f"or DiffusionUnetHybridImagePolicy), transformer policy (DiffusionTransformerLowdimPolicy "
                        f"or DiffusionTransformerHybridImagePolicy) or LeRobot's DiffusionPolicy")
    if "_dpa_original_model" in vars(policy):
        raise ValueError("this policy is already accelerated (its original U-Net is "
                         "policy._dpa_original_model); accelerate a fresh policy instead")
    if policy.training:
        raise ValueError("the policy is in training mode: call policy.eval() before accelerate(), "
                         "which is for inference")
    encoder = getattr(policy, "obs_encoder", None)
    channels_last = check_encoder_options(encoder, "policy.obs_encoder", encoder_dtype, encoder_channels_last)
    if all(hasattr(policy.model, name) for name in UNET_ATTRIBUTES):
        unet = unet_from_diffusion_policy(policy.model).eval()
        if dtype is not None:
            unet = unet.to(dtype=dtype)
        conditional_sample = _AcceleratedConditionalSample(policy, unet, parallel)
    else:  # another denoiser (TransformerForDiffusion): the generic path, with the model as it is
        unet = policy.model
        conditional_sample = _generic_conditional_sample(policy, dtype, parallel)
    # Kept out of the module tree (not a registered submodule), so that the policy's
    # state_dict, parameters and .to() see only the U-Net that is used.
    vars(policy)["_dpa_original_model"] = policy.model
    policy.model = unet
    # An instance attribute shadows the class's method, which is what predict_action calls.
    policy.conditional_sample = conditional_sample
    if isinstance(encoder, nn.Module):
        set_encoder_precision(encoder, encoder_dtype, channels_last)
    if whole_graph and hasattr(policy, "predict_action"):
        vars(policy)["predict_action"] = GraphedPolicyCall(
            policy.predict_action, policy, conditional_sample.sampler_now, "predict_action", check_finite)
    elif check_finite and hasattr(policy, "predict_action"):
        vars(policy)["predict_action"] = FiniteGuard(policy.predict_action, "predict_action", policy)
    return policy
