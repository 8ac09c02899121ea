"""`dpa serve --lerobot FOLDER` of a LeRobot DiffusionPolicy with cameras: camera frames and
state in, unnormalised actions out, LeRobot's own code around this package's sampler.

LeRobot 0.4 keeps a policy's normalisation out of the model: `save_pretrained` writes
config.json and model.safetensors, and training saves the processor pipelines beside them
(policy_preprocessor.json: rename, batch dimension, device, `NormalizerProcessorStep` with its
statistics in a .safetensors file; policy_postprocessor.json: `UnnormalizerProcessorStep`, then
to the CPU). LeRobot's inference loads both (`make_pre_post_processors(config,
pretrained_path=folder)`, whose loading this repeats without the factory's imports) and runs
preprocessor -> `select_action` -> postprocessor. `select_action` keeps the last n_obs_steps
observations in queues of one robot; a server answering many robots takes that history in each
request instead ([n_obs_steps, ...] per input, oldest first) and calls what `select_action`
calls once its queues are full: `policy.diffusion.generate_actions` on [B, n_obs_steps, ...],
the cameras stacked as `observation.images` [B, n_obs_steps, n_cameras, C, H, W] in
`config.image_features`' order, as `select_action` stacks them.

Per batch: frames uint8 -> float / 255 on the device (what LeRobot's environments and datasets
give the policy); LeRobot's preprocessor (its device step sent to the served device); LeRobot's
`generate_actions`, accelerated (`accelerate_lerobot`: on CUDA its encoders and denoising loop
are one graph per batch bucket), on the noise the server drew; LeRobot's postprocessor. The
pre- and postprocessing run eagerly around the graph (a few elementwise kernels per input).
"""
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, List

import torch

from .protocol import TensorSpec

INSTALL = "pip install --no-deps lerobot==0.4.4 && pip install -r requirements-lerobot.txt"
OBS_STATE, OBS_ENV_STATE, OBS_IMAGES = "observation.state", "observation.environment_state", "observation.images"
PREPROCESSOR, POSTPROCESSOR = "policy_preprocessor.json", "policy_postprocessor.json"


class LeRobotMissing(ImportError):
    """A LeRobot folder with cameras, and no LeRobot to run its encoder and processors."""


def lerobot_cameras(path) -> List[str]:
    """The VISUAL input features of the LeRobot folder's config.json, in its order; [] where
    there is none or the config cannot be read (load_lerobot_pretrained then says why)."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
        features = config["input_features"]
        return [k for k, v in features.items() if isinstance(v, dict) and v.get("type") == "VISUAL"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []


def import_lerobot() -> SimpleNamespace:
    """LeRobot's classes the server uses; LeRobotMissing (an ImportError) saying how to install them."""
    try:
        from lerobot.configs.policies import PreTrainedConfig
        from lerobot.policies.diffusion.configuration_diffusion import DiffusionConfig
        from lerobot.policies.diffusion.modeling_diffusion import DiffusionPolicy
        from lerobot.processor import PolicyProcessorPipeline
        from lerobot.processor.converters import (batch_to_transition, policy_action_to_transition,
                                                  transition_to_batch, transition_to_policy_action)
    except ImportError as error:
        raise LeRobotMissing(f"serving a LeRobot policy with cameras from camera frames needs LeRobot ({error}): "
                             f"{INSTALL}; or serve LeRobot's normalised global condition instead (dpa serve "
                             f"--lerobot-global-cond)") from error
    return SimpleNamespace(**{k: v for k, v in locals().items() if k != "error"})


def load_processors(lerobot: SimpleNamespace, folder: Path, device: torch.device):
    """LeRobot's pre- and postprocessor pipelines saved in `folder`, the preprocessor's device step
    (if any) sending the observations to `device`."""
    missing = [name for name in (PREPROCESSOR, POSTPROCESSOR) if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(f"path: {folder} has no {' or '.join(missing)}: LeRobot 0.4 saves a policy's "
                                f"normalisation statistics as processor pipelines beside model.safetensors (its "
                                f"training does; a folder from LeRobot < 0.4 is converted by python -m "
                                f"lerobot.processor.migrate_policy_normalization)")
    steps = json.loads((folder / PREPROCESSOR).read_text()).get("steps", [])
    overrides = {"device_processor": {"device": str(device)}} \
        if any(step.get("registry_name") == "device_processor" for step in steps) else {}
    for step in steps:
        if step.get("registry_name") == "rename_observations_processor" and step.get("config", {}).get("rename_map"):
            raise ValueError(f"path: {folder / PREPROCESSOR} renames observations "
                             f"({step['config']['rename_map']}); dpa serve takes inputs under the policy's own "
                             f"feature names: save the preprocessor without the rename map")
    pre = lerobot.PolicyProcessorPipeline.from_pretrained(
        str(folder), config_filename=PREPROCESSOR, overrides=overrides, to_transition=lerobot.batch_to_transition,
        to_output=lerobot.transition_to_batch)
    post = lerobot.PolicyProcessorPipeline.from_pretrained(
        str(folder), config_filename=POSTPROCESSOR, to_transition=lerobot.policy_action_to_transition,
        to_output=lerobot.transition_to_policy_action)
    return pre, post


def lerobot_frames_policy(source, cameras: List[str], device: torch.device, dtype: torch.dtype,
                          max_rows: int, info: Dict[str, object], seed: int,
                          guard: Dict[str, bool]) -> Dict[str, object]:
    """ServedPolicy's keyword arguments for the LeRobot folder of `source` (a PolicySource) with
    `cameras` (see the module doc). Arguments, not the policy: policies.py, which defines
    ServedPolicy, imports this module."""
    lerobot = import_lerobot()
    from ..adapters.lerobot import accelerate_lerobot

    folder = Path(source.path)
    config = lerobot.PreTrainedConfig.from_pretrained(str(folder))
    if not isinstance(config, lerobot.DiffusionConfig):
        raise ValueError(f"path: {folder / 'config.json'} is a {type(config).__name__}, not LeRobot's DiffusionConfig")
    config.device = str(device)
    pre, post = load_processors(lerobot, folder, device)
    policy = lerobot.DiffusionPolicy.from_pretrained(str(folder), config=config).eval()
    if source.steps is not None:
        policy.diffusion.num_inference_steps = source.steps
    # The server checks each request's actions itself (ServedPolicy's guard).
    accelerate_lerobot(policy, None if dtype == torch.float32 else dtype, parallel=source.parallel(),
                       check_finite=False)
    sampler = policy.diffusion.conditional_sample.sampler_now()
    image_keys = list(config.image_features)
    if image_keys != cameras:  # config.json read twice: by lerobot_cameras and by LeRobot
        raise ValueError(f"path: LeRobot reads the cameras {image_keys} from config.json, not {cameras}")
    To = int(config.n_obs_steps)
    inputs = {key: TensorSpec((To,) + tuple(config.image_features[key].shape), "uint8") for key in image_keys}
    low_dim = [OBS_STATE] + ([OBS_ENV_STATE] if config.env_state_feature is not None else [])
    inputs.update({OBS_STATE: TensorSpec((To,) + tuple(config.robot_state_feature.shape))})
    if config.env_state_feature is not None:
        inputs[OBS_ENV_STATE] = TensorSpec((To,) + tuple(config.env_state_feature.shape))
    horizon, action_dim = int(config.horizon), int(config.action_feature.shape[0])

    def predict(x: Dict[str, torch.Tensor], noise: torch.Tensor) -> torch.Tensor:
        obs = pre({key: value.float() / 255 if key in image_keys else value for key, value in x.items()})
        batch = {key: obs[key] for key in low_dim}
        batch[OBS_IMAGES] = torch.stack([obs[key] for key in image_keys], dim=-4)
        return post(policy.diffusion.generate_actions(batch, noise=noise))

    predict.graphed = policy.diffusion.generate_actions  # a GraphedPolicyCall (.refused: why it runs eagerly)
    info.update(source=source.path, policy_class="LeRobot DiffusionPolicy", steps=sampler.num_steps,
                scheduler=sampler.schedule.kind, cameras=image_keys, frames="uint8 [n_obs_steps, C, H, W], 0-255",
                normalised=False, actions="unnormalised (LeRobot's postprocessor applied)")
    print(f"dpa serve: LeRobot policy {folder} served from camera frames {image_keys} with LeRobot "
          f"{getattr(sys.modules.get('lerobot'), '__version__', '')}'s encoder and processors", file=sys.stderr,
          flush=True)
    return dict(name=f"LeRobot DiffusionPolicy ({source.path}), {len(image_keys)} camera"
                     f"{'s' if len(image_keys) > 1 else ''}", inputs=inputs,
                action_shape=(int(config.n_action_steps), action_dim), trajectory_shape=(horizon, action_dim),
                num_steps=sampler.num_steps, device=device, predict=predict, max_rows=max_rows, info=info, seed=seed,
                **guard)
