"""A policy as a server runs it: named float32 observations of fixed shapes in, an action chunk
out, for many robots at once in one sampler call.

`ServedPolicy.act(requests)` stacks the requests' rows, pads them to the next batch-size bucket
(powers of two up to `max_rows`), so that each bucket's CUDA graph is captured once, at
warm-up, and never again while serving, draws the noise (a request's `seed` fixes its rows'
noise whatever batch it lands in; their actions then agree to rounding, since each bucket's
kernels sum in their own order), runs the sampler and splits the actions back out.

`PolicySource` says where a policy comes from (the demo's U-Net, a Diffusion Policy
checkpoint or a LeRobot pretrained folder) in a form that can be sent to another process: Ray
Serve builds one policy per replica from it.
"""
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from ..sampling.finite import NonFiniteError
from ..sampling.picard import Picard
from .protocol import ActRequest, PolicySpec, TensorSpec, non_finite_rows

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# The dtypes of served inputs: float32 observations, uint8 camera frames.
INPUT_DTYPES = {"float32": torch.float32, "uint8": torch.uint8}
# What a request's rows are turned into: {input name: [bucket, *shape] tensor of the input's
# dtype on the policy's device}, the noise [steps + 1, bucket, *trajectory shape] -> actions
# [bucket, Ta, Da].
Predict = Callable[[Dict[str, torch.Tensor], torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class PolicySource:
    """Where a served policy comes from. `kind`: 'demo' (the demo's lowdim Push-T U-Net with random
    weights, seed 0; global_cond in, the whole 16-step trajectory out), 'checkpoint' (a
    Diffusion Policy workspace .ckpt: raw lowdim observations in, an image policy's camera
    frames (uint8) and low-dim observations (the hybrid image policy's too), or, where the
    encoder cannot be rebuilt, its encoder features), or 'lerobot' (a LeRobot pretrained folder:
    LeRobot's normalised global condition in, normalised actions out; a folder with cameras:
    camera frames (uint8) and state in, unnormalised actions out, with LeRobot installed
    (lerobot_policy.py), or, with `lerobot_global_cond`, the global condition as without
    cameras). `steps` overrides the number of denoising steps; `scheduler` ('ddpm' / 'ddim') is
    the demo's; `parallel_window` (None: sequential) samples by Picard iteration with that
    window and `parallel_tolerance` (sampling/picard.py); `check_finite`: the server's
    non-finite guard (ServedPolicy)."""
    kind: str = "demo"
    path: Optional[str] = None
    device: Optional[str] = None
    dtype: str = "float32"
    steps: Optional[int] = None
    scheduler: str = "ddpm"
    parallel_window: Optional[int] = None
    parallel_tolerance: float = 0.1
    check_finite: bool = True
    lerobot_global_cond: bool = False

    def __post_init__(self):
        if self.kind not in ("demo", "checkpoint", "lerobot"):
            raise ValueError(f"kind must be 'demo', 'checkpoint' or 'lerobot', got {self.kind!r}")
        if (self.path is None) != (self.kind == "demo"):
            raise ValueError(f"path: a {self.kind} source " + ("takes no path" if self.kind == "demo" else "needs one"))
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.scheduler not in ("ddpm", "ddim"):
            raise ValueError(f"scheduler must be 'ddpm' or 'ddim', got {self.scheduler!r}")
        if self.steps is not None and (isinstance(self.steps, bool) or not isinstance(self.steps, int)
                                       or self.steps < 1):
            raise ValueError(f"steps must be a positive integer or None, got {self.steps!r}")
        if not isinstance(self.check_finite, bool):
            raise ValueError(f"check_finite must be a bool, got {self.check_finite!r}")
        if not isinstance(self.lerobot_global_cond, bool):
            raise ValueError(f"lerobot_global_cond must be a bool, got {self.lerobot_global_cond!r}")
        if self.lerobot_global_cond and self.kind != "lerobot":
            raise ValueError(f"lerobot_global_cond is for a 'lerobot' source, not a {self.kind!r} one")
        self.parallel()  # checks the window and tolerance

    def parallel(self) -> Optional[Picard]:
        """The parallel sampler's settings, or None (sequential)."""
        if self.parallel_window is None:
            return None
        return Picard(window=self.parallel_window, tolerance=self.parallel_tolerance)


def batch_buckets(max_rows: int) -> List[int]:
    """The batch sizes graphs are captured for: powers of two below max_rows, and max_rows."""
    if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1:
        raise ValueError(f"max_rows must be a positive integer, got {max_rows!r}")
    return [1 << i for i in range(max_rows.bit_length()) if 1 << i < max_rows] + [max_rows]


class ServedPolicy:
    """A sampler behind named observation inputs (see the module doc). `act` is not
    thread-safe: a server calls it from one worker thread. Instances that a server runs side
    by side must not share a model or sampler (load_policy makes each its own): their CUDA
    graphs' buffers would be used by two threads at once.

    `check_finite` (the non-finite guard): a request whose actions hold NaN or Inf gets a
    NonFiniteError instead (HTTP 422), the other requests of its batch their actions; the check
    reads the actions' host copy, which is made anyway (no other synchronisation). The server
    refuses inputs that hold NaN or Inf before they reach a batch (protocol.py)."""

    def __init__(self, *, name: str, inputs: Dict[str, TensorSpec], action_shape: Tuple[int, int],
                 trajectory_shape: Tuple[int, int], num_steps: int, device: torch.device, predict: Predict,
                 max_rows: int = 64, info: Optional[Dict[str, object]] = None, seed: int = 0,
                 check_finite: bool = True):
        self.name = name
        self.inputs = dict(inputs)
        self.trajectory_shape = tuple(trajectory_shape)
        self.num_steps = num_steps
        self.device = torch.device(device)
        self.predict = predict
        self.buckets = batch_buckets(max_rows)
        self.check_finite = check_finite
        self.spec = PolicySpec(self.inputs, TensorSpec(tuple(action_shape)), max_rows,
                               {"policy": name, "device": str(self.device), "check_finite": check_finite,
                                **(info or {})})
        # The noise of rows without a seed: one stream per instance (instances of one server
        # take different seeds), on the policy's device.
        self.generator = torch.Generator(self.device).manual_seed(seed)
        # A CUDA stream of its own, so that instances of one server run their batches side by
        # side (the device's default stream would serialise them).
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    @property
    def max_rows(self) -> int:
        return self.buckets[-1]

    def bucket(self, rows: int) -> int:
        return next(b for b in self.buckets if b >= rows)

    def warm_up(self, log=lambda message: print(message, file=sys.stderr, flush=True)) -> None:
        """Run every bucket once, capturing its CUDA graph (on CUDA) before the first request."""
        for i, bucket in enumerate(self.buckets):
            start = time.perf_counter()
            self._run({name: np.zeros((bucket,) + spec.shape, spec.dtype) for name, spec in self.inputs.items()},
                      [(bucket, None)])
            log(f"dpa serve: batch {bucket} ready ({i + 1}/{len(self.buckets)}, "
                f"{time.perf_counter() - start:.1f} s)")

    def act(self, requests: Sequence[ActRequest]) -> Tuple[List[Union[np.ndarray, NonFiniteError]], Dict[str, float]]:
        """The action chunks of `requests` ([rows, Ta, Da] each, or [Ta, Da] for a single
        observation), in order, and the batch's timings; with check_finite, a NonFiniteError in
        place of a request's chunk that holds NaN or Inf. Rows past max_rows run as further
        batches."""
        actions, batches, start = [], [], time.perf_counter()
        groups, rows = [[]], 0
        for request in requests:
            if rows + request.rows > self.max_rows and groups[-1]:
                groups.append([])
                rows = 0
            groups[-1].append(request)
            rows += request.rows
        for group in groups:
            inputs = {name: np.concatenate([r.inputs[name] for r in group]) for name in self.inputs}
            out = self._run(inputs, [(r.rows, r.seed) for r in group])
            batches.append(out.shape[0])
            offset = 0
            for request in group:
                chunk = out[offset:offset + request.rows]
                actions.append(self._checked(chunk[0] if request.single else chunk, request.single))
                offset += request.rows
        timings = {"compute_ms": 1e3 * (time.perf_counter() - start), "batch_rows": sum(r.rows for r in requests),
                   "bucket": max(self.bucket(b) for b in batches)}
        return actions, timings

    def _checked(self, action: np.ndarray, single: bool) -> Union[np.ndarray, NonFiniteError]:
        if not self.check_finite or np.isfinite(action).all():
            return action
        return NonFiniteError(f"the actions computed for this request hold NaN or Inf{non_finite_rows(action, single)}, "
                              f"from finite inputs: the policy's weights, or an overflow in its arithmetic (a float16 "
                              f"or bfloat16 --dtype? inputs far outside the training range?), made them; not sent "
                              f"(dpa serve --no-check-finite sends them)", "actions", ["action"])

    def _run(self, inputs: Dict[str, np.ndarray], seeds: Sequence[Tuple[int, Optional[int]]]) -> np.ndarray:
        if self.stream is None:
            return self._run_on_stream(inputs, seeds)
        # After whatever the device's default stream was given before (loading the weights,
        # updating them in place): this stream does not wait for it by itself.
        self.stream.wait_stream(torch.cuda.default_stream(self.device))
        with torch.cuda.stream(self.stream):
            return self._run_on_stream(inputs, seeds)

    def _run_on_stream(self, inputs: Dict[str, np.ndarray], seeds: Sequence[Tuple[int, Optional[int]]]) -> np.ndarray:
        rows = sum(n for n, _ in seeds)
        bucket = self.bucket(rows)
        batch = {}
        for name, spec in self.inputs.items():
            padded = torch.zeros((bucket,) + spec.shape, dtype=INPUT_DTYPES[spec.dtype])
            padded[:rows] = torch.from_numpy(inputs[name])
            batch[name] = padded.to(self.device, non_blocking=True)
        noise = torch.randn((self.num_steps + 1, bucket) + self.trajectory_shape, device=self.device,
                            generator=self.generator)
        offset = 0
        for n, seed in seeds:
            if seed is not None:
                draw = torch.randn((self.num_steps + 1, n) + self.trajectory_shape,
                                   generator=torch.Generator().manual_seed(seed))
                noise[:, offset:offset + n] = draw.to(self.device)
            offset += n
        with torch.inference_mode():
            actions = self.predict(batch, noise)
        return actions[:rows].float().cpu().numpy()


def policy_device(source: PolicySource) -> torch.device:
    """Where `source` is served: its device, or CUDA where there is one."""
    return torch.device(source.device or ("cuda" if torch.cuda.is_available() else "cpu"))


def load_policy(source: PolicySource, max_rows: int = 64, seed: int = 0) -> ServedPolicy:
    """The ServedPolicy of `source`, on policy_device(source); `seed` starts the noise of
    rows whose request names no seed."""
    device = policy_device(source)
    dtype = DTYPES[source.dtype]
    settings = source.parallel()
    info = {"dtype": source.dtype, "torch": torch.__version__,
            "sampler": "sequential" if settings is None else
            f"parallel (Picard, window {settings.window}, tolerance {settings.tolerance})",
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"}
    # The library's own guard is off: ServedPolicy checks each request's actions on their host
    # copy (with source.check_finite), where the library's would fail a whole batch.
    guard = dict(check_finite=source.check_finite)
    if source.kind == "demo":
        return _demo_policy(source, device, dtype, max_rows, info, seed, guard)
    if source.kind == "checkpoint":
        from ..adapters.checkpoint import IMAGE_POLICIES, LOWDIM_POLICY, load_checkpoint

        ckpt = load_checkpoint(source.path, device=device, dtype=dtype, num_inference_steps=source.steps,
                               parallel=source.parallel(), check_finite=False)
        info.update(source=source.path, policy_class=ckpt.policy_class, steps=ckpt.sampler.num_steps,
                    scheduler=ckpt.schedule.kind)
        trajectory = (ckpt.trajectory_length, ckpt.unet_config["input_dim"])
        common = dict(action_shape=(ckpt.n_action_steps, ckpt.action_dim), trajectory_shape=trajectory,
                      num_steps=ckpt.sampler.num_steps, device=device, max_rows=max_rows, info=info, seed=seed,
                      **guard)
        if ckpt.policy_class == LOWDIM_POLICY:
            # Raw observations: the checkpoint's normaliser runs in the server.
            return ServedPolicy(name=f"{ckpt.policy_class} ({source.path})",
                                inputs={"obs": TensorSpec((ckpt.n_obs_steps, ckpt.obs_dim))},
                                predict=lambda x, noise: ckpt.predict_action({"obs": x["obs"]}, noise=noise)["action"],
                                **common)
        why_features = "its observation encoder is not rebuilt"
        if ckpt.policy_class in IMAGE_POLICIES:
            try:
                ckpt.obs_encoder  # rebuilt here, or why not
            except (ValueError, ImportError) as error:  # ImportError: no torchvision, which rebuilds it
                why_features = f"its observation encoder cannot be rebuilt: {error}"
            else:
                return _frames_policy(ckpt, source, common)
        print(f"dpa serve: {ckpt.policy_class} is served from encoder features, not camera frames: {why_features}",
              file=sys.stderr, flush=True)
        info.update(features_only=why_features)
        if ckpt.obs_as_global_cond:
            return ServedPolicy(name=f"{ckpt.policy_class} ({source.path}), encoder features",
                                inputs={"global_cond": TensorSpec((ckpt.unet_config["global_cond_dim"],))},
                                predict=lambda x, noise: ckpt.predict_action_from_features(x["global_cond"], noise=noise),
                                **common)
        return ServedPolicy(name=f"{ckpt.policy_class} ({source.path}), encoder features",
                            inputs={"obs_features": TensorSpec((ckpt.n_obs_steps, ckpt.obs_feature_dim))},
                            predict=lambda x, noise: ckpt.predict_action_from_features(
                                obs_features=x["obs_features"], noise=noise), **common)
    from ..adapters.lerobot import load_lerobot_pretrained
    from .lerobot_policy import lerobot_cameras, lerobot_frames_policy

    cameras = lerobot_cameras(source.path)
    if cameras and not source.lerobot_global_cond:
        return ServedPolicy(**lerobot_frames_policy(source, cameras, device, dtype, max_rows, info, seed, guard))
    policy = load_lerobot_pretrained(source.path, device=device, dtype=dtype, num_inference_steps=source.steps,
                                     parallel=source.parallel(), check_finite=False)
    info.update(source=source.path, steps=policy.sampler.num_steps, scheduler=policy.sampler.schedule.kind,
                normalised=True)
    if cameras:
        # Asked for (lerobot_global_cond): the client runs LeRobot's encoder and preprocessor and
        # sends the global condition LeRobot's model builds from its normalised frames and state.
        info.update(cameras_not_served=cameras)
        print(f"dpa serve: this LeRobot policy's cameras {cameras} are not served as frames (--lerobot-global-cond): "
              f"send LeRobot's normalised global condition (its encoder's features and the state)", file=sys.stderr,
              flush=True)
    return ServedPolicy(name=f"LeRobot DiffusionPolicy ({source.path}), normalised global condition",
                        inputs={"global_cond": TensorSpec((policy.global_cond_dim,))},
                        action_shape=(policy.n_action_steps, policy.action_dim),
                        trajectory_shape=(policy.horizon, policy.action_dim), num_steps=policy.sampler.num_steps,
                        device=device, max_rows=max_rows, info=info, seed=seed, **guard,
                        predict=lambda x, noise: policy.predict_action_chunk(x["global_cond"], noise=noise))


def _frames_policy(ckpt, source: PolicySource, common: Dict[str, object]) -> ServedPolicy:
    """A DiffusionUnetImagePolicy or DiffusionUnetHybridImagePolicy checkpoint served from camera
    frames (see the module doc)."""
    cameras = ckpt.camera_keys
    To = ckpt.n_obs_steps
    inputs = {key: TensorSpec((To,) + shape, "uint8" if key in cameras else "float32")
              for key, shape in ckpt.obs_shapes.items()}

    def predict(x: Dict[str, torch.Tensor], noise: torch.Tensor) -> torch.Tensor:
        obs = {key: value.float() / 255 if key in cameras else value for key, value in x.items()}
        return ckpt.predict_action(obs, noise=noise)["action"]

    if ckpt.device.type == "cuda":
        from ..sampling.policy_graph import GraphedPolicyCall

        # Frames to floats, normalisation, the encoder and the denoising loop: one graph per bucket.
        # (eval: a module in training mode runs eagerly)
        owner = torch.nn.ModuleDict({"obs_encoder": ckpt.obs_encoder, "unet": ckpt.unet}).eval()
        predict = GraphedPolicyCall(predict, owner, lambda: ckpt.sampler, "the served image policy's predict_action")
    common["info"].update(cameras=cameras, frames="uint8 [n_obs_steps, C, H, W], 0-255")
    return ServedPolicy(name=f"{ckpt.policy_class} ({source.path}), {len(cameras)} camera"
                             f"{'s' if len(cameras) > 1 else ''}", inputs=inputs, predict=predict, **common)


def _demo_policy(source: PolicySource, device: torch.device, dtype: torch.dtype, max_rows: int,
                 info: Dict[str, object], seed: int, guard: Dict[str, bool]) -> ServedPolicy:
    from ..model.configs import HORIZON, SCHEDULER_CONFIG, UNETS
    from ..model.unet import ConditionalUnet1D
    from ..sampling.sampler import GraphedSampler
    from ..model.schedulers import DenoiseSchedule

    config = UNETS["lowdim"]
    steps = source.steps or (100 if source.scheduler == "ddpm" else 16)
    torch.manual_seed(0)  # the demo's weights
    unet = ConditionalUnet1D(**config).to(device, dtype).eval()
    sampler = GraphedSampler(unet, DenoiseSchedule.from_diffusers(SCHEDULER_CONFIG, steps, kind=source.scheduler),
                             parallel=source.parallel())
    shape = (HORIZON, config["input_dim"])

    def predict(inputs: Dict[str, torch.Tensor], noise: torch.Tensor) -> torch.Tensor:
        cond = inputs["global_cond"]
        zeros = torch.zeros((cond.shape[0],) + shape, device=device)
        return sampler(zeros, torch.zeros_like(zeros, dtype=torch.bool), global_cond=cond, noise=noise)

    info.update(source="demo (random weights)", steps=steps, scheduler=source.scheduler)
    return ServedPolicy(name="demo: Diffusion Policy's lowdim Push-T U-Net, random weights",
                        inputs={"global_cond": TensorSpec((config["global_cond_dim"],))}, action_shape=shape,
                        trajectory_shape=shape, num_steps=sampler.num_steps, device=device, predict=predict,
                        max_rows=max_rows, info=info, seed=seed, **guard)
