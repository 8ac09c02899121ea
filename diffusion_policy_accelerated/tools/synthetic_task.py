"""A synthetic multimodal trajectory task for training and scoring `ConditionalUnet1D` policies.

Measuring a sampler (a parallel one against the sequential loop, say) on random weights says
nothing about whether it still solves a task; this module gives any U-Net configuration a task
that trains in minutes and a metric that shows both failure modes of a diffusion policy:
missing the target and collapsing onto one mode.

The task, in normalised coordinates (every position lies in [-0.95, 0.95]^2, inside the
[-1, 1] that Diffusion Policy's schedules clip samples to):

- an observation is a start position, uniform in [-0.4, 0.4]^2, and `num_goals` (K = 4) goals
  around it at one radius r, uniform in [0.35, 0.55]: goal k at angle 2 pi k / K (right, up,
  left, down), so two goals are at least r sqrt(2) >= 0.49 apart. The directions are fixed on
  purpose: with the goal pattern rotated at random per observation (or each goal at its own
  radius and angle) a tiny U-Net learnt about 3x slower on the CPU (DDIM-16 after 600 steps:
  18% of goals reached against 54%), since picking a goal then needs a product of condition
  and noise features; the mode choice, which is what a sampler can get wrong, is the same;
- the expert trajectory (`horizon` actions, each a 2-D position) goes from the start to ONE goal
  picked uniformly at random: action i is start + ease(tau) (goal - start) plus a bend of
  `BEND` times the distance along the left normal, scaled by sin(pi tau), tau = i / (horizon - 1),
  ease the smoothstep 3 tau^2 - 2 tau^3; so the first action is the start, the last the goal,
  and the action distribution of one observation has K modes;
- the condition (Diffusion Policy's "global" conditioning) is the observation's features
  [start, goal 0, ..., goal K-1] (2 + 2K = 10 floats), repeated for up to `OBS_STEPS` = 2
  observation steps as far as `global_cond_dim` allows, then zeros up to `global_cond_dim`.

`train` fits a U-Net with DDPM epsilon-prediction on Diffusion Policy's noise schedule
(configs.SCHEDULER_CONFIG); `sample_actions` / `evaluate_unet` sample it with the package's
sequential `GraphedSampler` and `evaluate` scores the actions.
"""
import math
import time
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Union

import torch

from ..model.configs import SCHEDULER_CONFIG
from ..model.schedulers import DenoiseSchedule, alphas_cumprod_from_config
from ..model.unet import ConditionalUnet1D
from ..sampling.sampler import GraphedSampler

__all__ = [
    "NUM_GOALS", "OBS_STEPS", "BEND", "GOAL_RADIUS", "START_RADIUS", "TaskBatch",
    "min_global_cond_dim", "encode_observation", "expert_trajectory", "sample_batch",
    "evaluate", "action_distance", "train", "make_schedule", "sequential_sampler",
    "sample_actions", "evaluate_sampler", "evaluate_unet", "save_trained", "load_trained",
]

NUM_GOALS = 4
OBS_STEPS = 2
BEND = 0.2
START_RANGE = 0.4
GOAL_RADIUS_RANGE = (0.35, 0.55)
MAX_GOALS = 8  # goals stay > 2 GOAL_RADIUS apart: 2 * 0.35 * sin(pi / 8) = 0.27
# evaluate's defaults: under half the least distance between two goals (0.49 for K = 4, 0.27
# for K = 8), so a final action is near at most one goal.
GOAL_RADIUS = 0.1
START_RADIUS = 0.1


class TaskBatch(NamedTuple):
    """What `sample_batch` returns (a tuple: it unpacks in this order)."""
    global_cond: torch.Tensor  # [n, global_cond_dim]
    actions: torch.Tensor      # [n, horizon, 2] expert actions
    goals: torch.Tensor        # [n, K, 2]
    mode: torch.Tensor         # [n] int64: the goal the expert went to
    start: torch.Tensor        # [n, 2]


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _check_tensor(name: str, value, shape: Sequence[Optional[int]]) -> torch.Tensor:
    """value must be a floating tensor whose shape matches `shape` (None: any size)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if not value.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {value.dtype}")
    if value.dim() != len(shape) or any(want is not None and got != want
                                        for got, want in zip(value.shape, shape)):
        wanted = ", ".join("*" if want is None else str(want) for want in shape)
        raise ValueError(f"{name} must be shaped [{wanted}], got {list(value.shape)}")
    return value


def min_global_cond_dim(num_goals: int = NUM_GOALS) -> int:
    """The least `global_cond_dim` that holds one observation step: start and goals."""
    return 2 + 2 * num_goals


def encode_observation(start: torch.Tensor, goals: torch.Tensor, global_cond_dim: int) -> torch.Tensor:
    """[n, 2] starts and [n, K, 2] goals -> [n, global_cond_dim] condition vectors: the
    features [start, goals...] repeated for as many of OBS_STEPS steps as fit, then zeros."""
    _check_tensor("start", start, (None, 2))
    _check_tensor("goals", goals, (start.shape[0], None, 2))
    features = torch.cat([start, goals.flatten(1)], dim=1)
    width = features.shape[1]
    _check_int("global_cond_dim", global_cond_dim, 1)
    if global_cond_dim < width:
        raise ValueError(f"global_cond_dim must be >= {width} (start and {goals.shape[1]} goals, "
                         f"2 floats each), got {global_cond_dim}")
    steps = min(OBS_STEPS, global_cond_dim // width)
    cond = features.new_zeros(start.shape[0], global_cond_dim)
    cond[:, :steps * width] = features.repeat(1, steps)
    return cond


def expert_trajectory(start: torch.Tensor, goal: torch.Tensor, horizon: int) -> torch.Tensor:
    """[..., 2] starts and goals -> [..., horizon, 2]: the eased, bent path from each start to
    its goal (module docstring); action 0 is the start, action horizon - 1 the goal."""
    _check_int("horizon", horizon, 2)
    if start.shape != goal.shape or start.shape[-1:] != (2,):
        raise ValueError(f"start and goal must be [..., 2] of one shape, got {list(start.shape)} "
                         f"and {list(goal.shape)}")
    tau = torch.linspace(0, 1, horizon, device=start.device, dtype=start.dtype)
    ease = tau * tau * (3 - 2 * tau)
    bump = torch.sin(math.pi * tau)
    delta = goal - start
    normal = torch.stack([-delta[..., 1], delta[..., 0]], dim=-1)  # left normal, |normal| = |delta|
    return (start[..., None, :] + ease[:, None] * delta[..., None, :]
            + BEND * bump[:, None] * normal[..., None, :])


def sample_batch(n: int, generator: Optional[torch.Generator] = None, device=None, horizon: int = 16,
                 global_cond_dim: int = 40, num_goals: int = NUM_GOALS) -> TaskBatch:
    """n observations with one expert trajectory each (module docstring), as a TaskBatch
    (global_cond, actions, goals, mode, start), float32 on `device`.

    Everything is drawn from `generator` (the default generator when None) on the generator's
    device and then moved to `device` (default: the generator's device), so a batch depends only
    on the generator's state and device.
    """
    _check_int("n", n, 1)
    _check_int("horizon", horizon, 2)
    _check_int("num_goals", num_goals, 2)
    if num_goals > MAX_GOALS:
        raise ValueError(f"num_goals must be <= {MAX_GOALS} (closer goals than that are not told apart "
                         f"by evaluate's radius), got {num_goals}")
    _check_int("global_cond_dim", global_cond_dim, 1)
    if global_cond_dim < min_global_cond_dim(num_goals):
        raise ValueError(f"global_cond_dim must be >= {min_global_cond_dim(num_goals)} (a start and "
                         f"{num_goals} goals, 2 floats each), got {global_cond_dim}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    draw_device = generator.device if generator is not None else torch.device("cpu")
    like = dict(generator=generator, device=draw_device)
    start = (torch.rand(n, 2, **like) * 2 - 1) * START_RANGE
    angles = torch.arange(num_goals, device=draw_device) * (2 * math.pi / num_goals)
    low, high = GOAL_RADIUS_RANGE
    radius = low + (high - low) * torch.rand(n, 1, **like)
    goals = start[:, None, :] + radius[..., None] * torch.stack([angles.cos(), angles.sin()], dim=-1)
    mode = torch.randint(num_goals, (n,), **like)
    chosen = goals[torch.arange(n, device=draw_device), mode]
    actions = expert_trajectory(start, chosen, horizon)
    cond = encode_observation(start, goals, global_cond_dim)
    device = draw_device if device is None else torch.device(device)
    return TaskBatch(*(t.to(device) for t in (cond, actions, goals, mode, start)))


def _normalised_entropy(counts: torch.Tensor) -> torch.Tensor:
    """counts [..., K] -> entropy of counts / counts.sum() over log K ([...]; 0 where no count)."""
    total = counts.sum(-1, keepdim=True)
    p = counts / total.clamp(min=1)
    entropy = -(p * p.clamp(min=1e-12).log()).sum(-1)
    return entropy / math.log(counts.shape[-1])


def _chance_balance(samples: int, num_goals: int, draws: int = 4096) -> float:
    """E[mode_balance] of `samples` fair draws among `num_goals` goals (Monte Carlo, fixed seed):
    what a perfect policy scores on average, below 1 for finite samples."""
    gen = torch.Generator().manual_seed(0)
    picks = torch.randint(num_goals, (draws, samples), generator=gen)
    counts = torch.nn.functional.one_hot(picks, num_goals).sum(1).float()
    return float(_normalised_entropy(counts).mean())


def evaluate(actions: torch.Tensor, goals: torch.Tensor, start: torch.Tensor, *,
             goal_radius: float = GOAL_RADIUS, start_radius: float = START_RADIUS) -> Dict[str, object]:
    """Scores action trajectories on the task.

    actions: [N, S, horizon, 2] (S samples for each of N observations) or [N, horizon, 2] (S = 1);
    goals: [N, K, 2]; start: [N, 2]. A sample *reaches* goal k when its first action is within
    `start_radius` of the start and its final action within `goal_radius` of goal k (the nearest).

    Returns a dict:
    - reached_rate: the fraction of all N * S samples that reach a goal;
    - mode_balance: the mean over observations of the normalised entropy H(p) / log K of p, the
      histogram of the goals that observation's samples reached (over its reached samples; an
      observation with none scores 0). 1.0: every goal reached equally often; 0: all samples to
      one goal. It needs S >= K to reach 1, and fair random picks score below 1 at finite S;
    - mode_balance_chance: the expected mode_balance of S fair picks (a perfect policy's score);
    - single_mode_rate: the fraction of observations with >= 2 reached samples all at one goal;
    - goal_counts: reached samples per goal index, summed over observations (list of K ints);
    - start_error, final_error: mean distance of the first action to the start and of the final
      action to the nearest goal, over all samples;
    - path_error: mean over reached samples of the mean distance of each action to the expert
      trajectory towards the goal reached (nan if none reached);
    - observations, samples_per_observation.
    """
    _check_tensor("start", start, (None, 2))
    observations = start.shape[0]
    goals = _check_tensor("goals", goals, (observations, None, 2))
    if isinstance(actions, torch.Tensor) and actions.dim() == 3:
        actions = actions[:, None]
    actions = _check_tensor("actions", actions, (observations, None, None, 2))
    if actions.shape[2] < 2:
        raise ValueError(f"actions must have a horizon of at least 2, got {actions.shape[2]}")
    for name, value in (("goal_radius", goal_radius), ("start_radius", start_radius)):
        if not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name} must be a positive number, got {value!r}")
    actions = actions.detach().float().cpu()
    goals, start = goals.detach().float().cpu(), start.detach().float().cpu()
    samples, horizon, num_goals = actions.shape[1], actions.shape[2], goals.shape[1]

    start_error = (actions[:, :, 0] - start[:, None]).norm(dim=-1)            # [N, S]
    goal_distance = (actions[:, :, -1, None] - goals[:, None]).norm(dim=-1)  # [N, S, K]
    final_error, nearest = goal_distance.min(dim=-1)
    reached = (start_error <= start_radius) & (final_error <= goal_radius)
    counts = torch.zeros(observations, num_goals)
    counts.scatter_add_(1, nearest, reached.float())
    reached_per_obs = counts.sum(-1)

    experts = expert_trajectory(start[:, None].expand(-1, num_goals, -1), goals, horizon)  # [N, K, H, 2]
    followed = experts[torch.arange(observations)[:, None], nearest]                      # [N, S, H, 2]
    path_error = (actions - followed).norm(dim=-1).mean(-1)                              # [N, S]
    return {
        "reached_rate": float(reached.float().mean()),
        "mode_balance": float(_normalised_entropy(counts).mean()),
        "mode_balance_chance": _chance_balance(samples, num_goals),
        "single_mode_rate": float(((reached_per_obs >= 2) & (counts.max(-1).values == reached_per_obs))
                                  .float().mean()),
        "goal_counts": [int(c) for c in counts.sum(0).tolist()],
        "start_error": float(start_error.mean()),
        "final_error": float(final_error.mean()),
        "path_error": float(path_error[reached].mean()) if reached.any() else float("nan"),
        "observations": observations,
        "samples_per_observation": samples,
    }


def action_distance(a: torch.Tensor, b: torch.Tensor) -> Dict[str, float]:
    """{'max_abs', 'mean_abs'} of a - b, two sets of actions of one shape (e.g. two samplers'
    actions for the same noise), computed in float64."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise TypeError(f"a and b must be torch.Tensors, got {type(a).__name__} and {type(b).__name__}")
    if a.shape != b.shape or a.numel() == 0:
        raise ValueError(f"a and b must be non-empty and of one shape, got {list(a.shape)} and {list(b.shape)}")
    diff = (a.detach().double().cpu() - b.detach().double().cpu()).abs()
    return {"max_abs": float(diff.max()), "mean_abs": float(diff.mean())}


def _unet_device(unet: ConditionalUnet1D) -> torch.device:
    return next(unet.parameters()).device


def _check_unet(unet, horizon: int) -> None:
    if not isinstance(unet, ConditionalUnet1D):
        raise TypeError(f"unet must be a diffusion_policy_accelerated ConditionalUnet1D, got "
                        f"{type(unet).__name__}")
    if unet.input_dim != 2:
        raise ValueError(f"unet must have input_dim=2 (2-D positions), got {unet.input_dim}")
    if unet.global_cond_dim is None or unet.global_cond_dim < min_global_cond_dim():
        raise ValueError(f"unet must have global_cond_dim >= {min_global_cond_dim()}, got "
                         f"{unet.global_cond_dim}")
    if unet.local_cond_dim is not None:
        raise ValueError("unet must be built without local_cond_dim (the task has no local condition)")
    if horizon % unet.horizon_multiple:
        raise ValueError(f"horizon must be a multiple of {unet.horizon_multiple} for this U-Net "
                         f"(down_dims {unet.down_dims}), got {horizon}")


def train(unet: ConditionalUnet1D, steps: int, batch_size: int = 256, lr: float = 1e-4, device=None,
          horizon: int = 16, seed: int = 0, *, warmup_steps: Optional[int] = None,
          lr_schedule: str = "cosine", weight_decay: float = 1e-6, ema_decay: Optional[float] = 0.999,
          grad_clip: Optional[float] = 1.0, autocast_dtype: Optional[torch.dtype] = None,
          log_every: Optional[int] = None, log_seconds: float = 15.0,
          progress: Optional[Callable[[str], None]] = print) -> List[float]:
    """Trains `unet` in place on the task: DDPM epsilon prediction with SCHEDULER_CONFIG's noise
    schedule (100 train timesteps, squaredcos_cap_v2), timesteps uniform, MSE loss.

    AdamW (betas 0.95 / 0.999, `weight_decay`, as Diffusion Policy), `warmup_steps` of linear
    warm-up (default: 5% of the steps, at most 500), then `lr_schedule` 'cosine' (to 0) or
    'constant'; gradients clipped to norm `grad_clip` (None: not clipped). With `ema_decay`,
    an exponential moving average of the weights is kept (decay min(ema_decay,
    (1 + step) / (10 + step))) and copied into `unet` at the end: the U-Net is left holding the
    EMA weights, as Diffusion Policy evaluates them. `autocast_dtype` (e.g. torch.bfloat16)
    runs the forward pass under autocast. The U-Net runs its plain PyTorch path (the fused ops
    have no backward). Every `log_every` steps (default steps / 20), and at least every
    `log_seconds`, `progress` gets a line with the step, the mean loss since the last line, the
    lr and steps/s.

    Batches, timesteps and noise come from a generator on `device` seeded with `seed`, so a run
    is deterministic given the seed and device (up to nondeterministic GPU kernels). Returns the
    loss of every step.
    """
    _check_int("steps", steps, 1)
    _check_int("batch_size", batch_size, 1)
    _check_int("seed", seed, 0)
    _check_int("horizon", horizon, 2)
    _check_unet(unet, horizon)
    if not lr > 0:
        raise ValueError(f"lr must be positive, got {lr!r}")
    if lr_schedule not in ("cosine", "constant"):
        raise ValueError(f"lr_schedule must be 'cosine' or 'constant', got {lr_schedule!r}")
    if ema_decay is not None and not 0 < ema_decay < 1:
        raise ValueError(f"ema_decay must be in (0, 1) or None, got {ema_decay!r}")
    if autocast_dtype is not None and autocast_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"autocast_dtype must be torch.bfloat16, torch.float16 or None, got {autocast_dtype!r}")
    warmup_steps = min(500, steps // 20) if warmup_steps is None else _check_int("warmup_steps", warmup_steps, 0)
    log_every = max(1, steps // 20) if log_every is None else _check_int("log_every", log_every, 1)

    device = _unet_device(unet) if device is None else torch.device(device)
    unet.to(device).train()
    params = [p for p in unet.parameters() if p.requires_grad]
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.95, 0.999), weight_decay=weight_decay,
                                  **({"fused": True} if fused else {}))

    def lr_at(step):  # step counts from 0
        if step < warmup_steps:
            return lr * (step + 1) / warmup_steps
        if lr_schedule == "constant":
            return lr
        progress_fraction = (step - warmup_steps) / max(1, steps - warmup_steps)
        return lr * 0.5 * (1 + math.cos(math.pi * progress_fraction))

    ema = [p.detach().clone() for p in params] if ema_decay is not None else None
    alphas_cumprod = alphas_cumprod_from_config(SCHEDULER_CONFIG).to(device)
    num_train_timesteps = alphas_cumprod.shape[0]
    generator = torch.Generator(device).manual_seed(seed)
    scaler = torch.amp.GradScaler(device.type) if autocast_dtype == torch.float16 else None
    losses = torch.empty(steps, device=device)
    logged_step, logged_time = 0, time.perf_counter()
    start_time = logged_time

    def log(step):
        nonlocal logged_step, logged_time
        now = time.perf_counter()
        mean_loss = float(losses[logged_step:step].mean())
        if progress is not None:
            progress(f"  step {step:6d}/{steps}  loss {mean_loss:.5f}  lr {lr_at(step - 1):.2e}  "
                     f"{(step - logged_step) / max(now - logged_time, 1e-9):7.1f} steps/s  "
                     f"{now - start_time:6.1f} s")
        logged_step, logged_time = step, now

    for step in range(steps):
        batch = sample_batch(batch_size, generator, device, horizon, unet.global_cond_dim)
        x0 = batch.actions
        timesteps = torch.randint(num_train_timesteps, (batch_size,), generator=generator, device=device)
        noise = torch.randn(x0.shape, generator=generator, device=device)
        alpha_bar = alphas_cumprod[timesteps][:, None, None]
        noisy = alpha_bar.sqrt() * x0 + (1 - alpha_bar).sqrt() * noise
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            prediction = unet(noisy, timesteps, global_cond=batch.global_cond)
        loss = torch.nn.functional.mse_loss(prediction.float(), noise)
        optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
        else:
            loss.backward()
        if grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(params, grad_clip, foreach=True)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        if ema is not None:
            decay = min(ema_decay, (1 + step) / (10 + step))
            torch._foreach_lerp_(ema, [p.detach() for p in params], 1 - decay)
        losses[step] = loss.detach()
        done = step + 1
        if done % log_every == 0 or done == steps or time.perf_counter() - logged_time > log_seconds:
            log(done)
    if ema is not None:
        with torch.no_grad():
            for p, averaged in zip(params, ema):
                p.copy_(averaged)
    unet.eval()
    return losses.tolist()


def make_schedule(kind: str = "ddim", steps: Optional[int] = None) -> DenoiseSchedule:
    """SCHEDULER_CONFIG's DDPM or DDIM (eta 0) schedule of `steps` inference steps (default
    100 for DDPM, 16 for DDIM)."""
    if kind not in ("ddpm", "ddim"):
        raise ValueError(f"kind must be 'ddpm' or 'ddim', got {kind!r}")
    steps = (100 if kind == "ddpm" else 16) if steps is None else _check_int("steps", steps, 1)
    return DenoiseSchedule.from_diffusers(SCHEDULER_CONFIG, steps, kind=kind)


def sequential_sampler(unet: ConditionalUnet1D, kind: str = "ddim", steps: Optional[int] = None) -> GraphedSampler:
    """The package's sequential sampler of `unet` for make_schedule(kind, steps); `unet` is put
    in eval mode. Build a new one after changing the weights."""
    if not isinstance(unet, ConditionalUnet1D):
        raise TypeError(f"unet must be a ConditionalUnet1D, got {type(unet).__name__}")
    unet.eval()
    return GraphedSampler(unet, make_schedule(kind, steps))


def sample_actions(sampler: GraphedSampler, global_cond: torch.Tensor, horizon: int,
                   generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """[n, horizon, 2] actions for global_cond [n, global_cond_dim], Diffusion Policy's lowdim
    "global" conditioning: condition_data zeros, condition_mask all False. The initial noise
    (and DDPM's step noise) comes from `generator`, which must be on the sampler's device."""
    if not isinstance(sampler, GraphedSampler):
        raise TypeError(f"sampler must be a GraphedSampler (see sequential_sampler), got {type(sampler).__name__}")
    _check_tensor("global_cond", global_cond, (None, sampler.unet.global_cond_dim))
    _check_int("horizon", horizon, 2)
    shape = (global_cond.shape[0], horizon, sampler.unet.input_dim)
    condition_data = torch.zeros(shape, device=sampler.device, dtype=sampler.dtype)
    condition_mask = torch.zeros(shape, device=sampler.device, dtype=torch.bool)
    return sampler(condition_data, condition_mask, global_cond=global_cond.to(sampler.device),
                   generator=generator)


def evaluate_sampler(sample_fn: Callable[[torch.Tensor, torch.Generator], torch.Tensor], *,
                     global_cond_dim: int, horizon: int, device=None, observations: int = 64,
                     samples: int = 16, seed: int = 0, **evaluate_kwargs) -> Dict[str, object]:
    """`evaluate` of `sample_fn(global_cond [observations * samples, global_cond_dim], generator)
    -> actions [observations * samples, horizon, 2]` on `observations` task observations (drawn
    on the CPU from `seed`, so the same for every device and sampler), each repeated `samples`
    times in consecutive rows. `generator` is on `device`, seeded with seed + 1: two samplers
    that draw their noise alike from it get the same noise."""
    _check_int("observations", observations, 1)
    _check_int("samples", samples, 1)
    _check_int("seed", seed, 0)
    device = torch.device("cpu" if device is None else device)
    task = sample_batch(observations, torch.Generator().manual_seed(seed), "cpu", horizon, global_cond_dim)
    cond = task.global_cond.repeat_interleave(samples, dim=0).to(device)
    generator = torch.Generator(device).manual_seed(seed + 1)
    actions = sample_fn(cond, generator)
    expected = (observations * samples, horizon, 2)
    if not isinstance(actions, torch.Tensor) or tuple(actions.shape) != expected:
        got = list(actions.shape) if isinstance(actions, torch.Tensor) else type(actions).__name__
        raise ValueError(f"sample_fn must return actions shaped {list(expected)}, got {got}")
    return evaluate(actions.reshape(observations, samples, horizon, 2), task.goals, task.start,
                    **evaluate_kwargs)


def evaluate_unet(unet: ConditionalUnet1D, horizon: int, kind: str = "ddim", steps: Optional[int] = None,
                  *, observations: int = 64, samples: int = 16, seed: int = 0,
                  **evaluate_kwargs) -> Dict[str, object]:
    """`evaluate_sampler` with the sequential sampler of `unet` (make_schedule(kind, steps)) on
    the U-Net's device and dtype."""
    _check_unet(unet, horizon)
    sampler = sequential_sampler(unet, kind, steps)
    return evaluate_sampler(lambda cond, gen: sample_actions(sampler, cond, horizon, gen),
                            global_cond_dim=unet.global_cond_dim, horizon=horizon, device=sampler.device,
                            observations=observations, samples=samples, seed=seed, **evaluate_kwargs)


def save_trained(path, unet: ConditionalUnet1D, config: Dict[str, object], **extra) -> None:
    """Saves {'state_dict': unet's (on the CPU), 'config': the constructor arguments, **extra}."""
    state = {k: v.detach().cpu() for k, v in unet.state_dict().items()}
    torch.save({"state_dict": state, "config": dict(config), **extra}, path)


def load_trained(path, device: Union[str, torch.device] = "cpu") -> ConditionalUnet1D:
    """The U-Net `save_trained` wrote (eval mode, on `device`); the file's other entries are in
    torch.load(path)."""
    saved = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(saved, dict) or "state_dict" not in saved or "config" not in saved:
        raise ValueError(f"{path} is not a file save_trained wrote (no 'state_dict' and 'config')")
    unet = ConditionalUnet1D(**saved["config"])
    unet.load_state_dict(saved["state_dict"])
    return unet.to(device).eval()
