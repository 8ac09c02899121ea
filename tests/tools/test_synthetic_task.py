"""The synthetic multimodal task: its batches, its metric, and that a briefly trained tiny U-Net
sampled with the sequential sampler reaches its goals far more often than an untrained one."""
import math

import pytest
import torch

from diffusion_policy_accelerated.model.unet import ConditionalUnet1D
from diffusion_policy_accelerated.tools.synthetic_task import (
    NUM_GOALS, action_distance, encode_observation, evaluate, evaluate_unet, expert_trajectory,
    load_trained, make_schedule, min_global_cond_dim, sample_actions, sample_batch, save_trained,
    sequential_sampler, train)


def batch(n=8, seed=0, horizon=16, global_cond_dim=40):
    return sample_batch(n, torch.Generator().manual_seed(seed), "cpu", horizon, global_cond_dim)


@pytest.mark.parametrize("horizon,global_cond_dim", [(16, 40), (64, 132), (2, 10), (7, 25)])
def test_sample_batch_shapes_and_ranges(horizon, global_cond_dim):
    cond, actions, goals, mode, start = batch(32, horizon=horizon, global_cond_dim=global_cond_dim)
    assert cond.shape == (32, global_cond_dim) and cond.dtype == torch.float32
    assert actions.shape == (32, horizon, 2) and goals.shape == (32, NUM_GOALS, 2)
    assert mode.shape == (32,) and mode.dtype == torch.int64 and start.shape == (32, 2)
    assert actions.abs().max() <= 1 and goals.abs().max() <= 1
    # The expert starts at the start and ends at the goal of its mode.
    torch.testing.assert_close(actions[:, 0], start)
    torch.testing.assert_close(actions[:, -1], goals[torch.arange(32), mode])
    # The condition: [start, goals] for up to two observation steps, then zeros.
    features = torch.cat([start, goals.flatten(1)], 1)
    steps = min(2, global_cond_dim // 10)
    torch.testing.assert_close(cond[:, :10 * steps], features.repeat(1, steps))
    assert (cond[:, 10 * steps:] == 0).all()


def test_sample_batch_is_deterministic_and_multimodal():
    first, second, other = batch(256, seed=3), batch(256, seed=3), batch(256, seed=4)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    assert not torch.equal(first.actions, other.actions)
    # Modes uniform over the goals; goals apart by far more than the evaluation radius.
    counts = torch.bincount(first.mode, minlength=NUM_GOALS)
    assert counts.min() > 256 / NUM_GOALS / 2
    separation = torch.cdist(first.goals, first.goals) + 10 * torch.eye(NUM_GOALS)
    assert separation.min() > 0.3


def test_sample_batch_bad_arguments():
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="global_cond_dim must be >= 10"):
        sample_batch(4, gen, "cpu", 16, 9)
    with pytest.raises(ValueError, match="n must be >= 1"):
        sample_batch(0, gen, "cpu", 16, 40)
    with pytest.raises(ValueError, match="horizon must be >= 2"):
        sample_batch(4, gen, "cpu", 1, 40)
    with pytest.raises(TypeError, match="horizon must be an int"):
        sample_batch(4, gen, "cpu", 16.0, 40)
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        sample_batch(4, 0, "cpu", 16, 40)
    assert min_global_cond_dim() == 10
    with pytest.raises(ValueError, match="global_cond_dim must be >= 10"):
        encode_observation(torch.zeros(2, 2), torch.zeros(2, NUM_GOALS, 2), 8)


def expert_samples(task, samples, goal_of_sample):
    """[N, samples, H, 2]: sample j of every observation goes to goal goal_of_sample(j)."""
    horizon = task.actions.shape[1]
    return torch.stack([expert_trajectory(task.start, task.goals[:, goal_of_sample(j)], horizon)
                        for j in range(samples)], dim=1)


def test_evaluate_expert_and_failures():
    task = batch(16)
    uniform = evaluate(expert_samples(task, 8, lambda j: j % NUM_GOALS), task.goals, task.start)
    assert uniform["reached_rate"] == 1.0
    assert uniform["mode_balance"] == pytest.approx(1.0, abs=1e-6)
    assert uniform["goal_counts"] == [32] * NUM_GOALS and uniform["single_mode_rate"] == 0.0
    assert uniform["path_error"] == pytest.approx(0.0, abs=1e-6)
    assert 0.7 < uniform["mode_balance_chance"] < 1.0

    collapsed = evaluate(expert_samples(task, 8, lambda j: 2), task.goals, task.start)
    assert collapsed["reached_rate"] == 1.0 and collapsed["mode_balance"] == pytest.approx(0.0, abs=1e-6)
    assert collapsed["goal_counts"] == [0, 0, 128, 0] and collapsed["single_mode_rate"] == 1.0

    two = evaluate(expert_samples(task, 8, lambda j: j % 2), task.goals, task.start)
    assert two["mode_balance"] == pytest.approx(math.log(2) / math.log(NUM_GOALS), abs=1e-6)

    noise = torch.randn(16, 8, 16, 2, generator=torch.Generator().manual_seed(1))
    random = evaluate(noise, task.goals, task.start)
    assert random["reached_rate"] == 0.0 and random["mode_balance"] == 0.0

    # One sample per observation: the expert's own actions.
    single = evaluate(task.actions, task.goals, task.start)
    assert single["reached_rate"] == 1.0 and single["samples_per_observation"] == 1
    # Shifting the final action by more than the radius misses; the start check is its own.
    shifted = task.actions.clone()
    shifted[:, -1] += 0.15
    assert evaluate(shifted, task.goals, task.start)["reached_rate"] == 0.0
    assert evaluate(shifted, task.goals, task.start, goal_radius=0.25)["reached_rate"] == 1.0
    moved = task.actions.clone()
    moved[:, 0] += 0.15
    assert evaluate(moved, task.goals, task.start)["reached_rate"] == 0.0


def test_evaluate_and_distance_bad_arguments():
    task = batch(4)
    with pytest.raises(ValueError, match=r"actions must be shaped \[4, \*, \*, 2\]"):
        evaluate(torch.zeros(3, 16, 2), task.goals, task.start)
    with pytest.raises(ValueError, match="goals must be shaped"):
        evaluate(task.actions, task.goals[:, :, :1], task.start)
    with pytest.raises(ValueError, match="goal_radius must be a positive number"):
        evaluate(task.actions, task.goals, task.start, goal_radius=0)
    with pytest.raises(TypeError, match="actions must be a floating-point tensor"):
        evaluate(task.actions.long(), task.goals, task.start)
    a = torch.zeros(2, 16, 2)
    b = a.clone()
    b[1, 3, 0] = -0.5
    assert action_distance(a, b) == {"max_abs": 0.5, "mean_abs": pytest.approx(0.5 / 64)}
    with pytest.raises(ValueError, match="one shape"):
        action_distance(a, b[:1])


def tiny_unet(seed=0):
    torch.manual_seed(seed)
    return ConditionalUnet1D(2, global_cond_dim=20, diffusion_step_embed_dim=32, down_dims=[16, 32],
                             kernel_size=5, n_groups=8, cond_predict_scale=True)


def test_train_bad_arguments():
    unet = tiny_unet()
    with pytest.raises(ValueError, match="horizon must be a multiple of 2"):
        train(unet, 1, 4, 1e-3, "cpu", horizon=15)
    with pytest.raises(ValueError, match="steps must be >= 1"):
        train(unet, 0, 4, 1e-3, "cpu")
    with pytest.raises(ValueError, match="lr_schedule must be"):
        train(unet, 1, 4, 1e-3, "cpu", lr_schedule="linear")
    with pytest.raises(TypeError, match="unet must be"):
        train(torch.nn.Linear(2, 2), 1, 4, 1e-3, "cpu")
    with pytest.raises(ValueError, match="kind must be 'ddpm' or 'ddim'"):
        make_schedule("euler")


def test_training_beats_untrained_and_is_deterministic(tmp_path):
    horizon = 16
    # A stated, looser radius: a U-Net this small trained this briefly is far from precise,
    # but it heads for the goals, which an untrained one never does.
    radius = dict(goal_radius=0.25, start_radius=0.25)
    untrained = evaluate_unet(tiny_unet(), horizon, "ddim", 16, observations=16, samples=8, **radius)

    lines = []
    trained_unet = tiny_unet()
    losses = train(trained_unet, 250, 64, 3e-3, "cpu", horizon, seed=0, log_every=50, progress=lines.append)
    assert len(losses) == 250 and len(lines) >= 5 and "steps/s" in lines[-1]
    assert sum(losses[-25:]) < 0.25 * sum(losses[:25])
    trained = evaluate_unet(trained_unet, horizon, "ddim", 16, observations=16, samples=8, **radius)
    # Measured: untrained 0.0, trained 0.28-0.39 over seeds and nearby settings.
    assert untrained["reached_rate"] < 0.05
    assert trained["reached_rate"] > max(0.15, untrained["reached_rate"] + 0.15), (untrained, trained)
    assert trained["final_error"] < 0.75 * untrained["final_error"], (untrained, trained)

    # Same seed, same weights: same losses; a saved and reloaded U-Net samples the same actions.
    again = tiny_unet()
    assert train(again, 5, 8, 3e-3, "cpu", horizon, seed=1, progress=None) == \
        train(tiny_unet(), 5, 8, 3e-3, "cpu", horizon, seed=1, progress=None)
    path = tmp_path / "tiny.pt"
    save_trained(path, trained_unet, dict(input_dim=2, global_cond_dim=20, diffusion_step_embed_dim=32,
                                          down_dims=[16, 32], kernel_size=5, n_groups=8,
                                          cond_predict_scale=True), horizon=horizon)
    loaded = load_trained(path)
    cond = batch(4, global_cond_dim=20).global_cond
    actions = [sample_actions(sequential_sampler(unet, "ddpm", 10), cond, horizon,
                              torch.Generator().manual_seed(2)) for unet in (trained_unet, loaded)]
    assert action_distance(*actions)["max_abs"] == 0.0
