"""Parallel sampling (Picard iterations): the picard_window / picard_update ops against a
reference written from their definition (csrc/picard/picard.h), CPU and CUDA, their bad
inputs and opcheck; and the sampler: with tolerance 0 it is the sequential sampler's
trajectory for the same noise (fp32 tolerance 1e-5, with inpainting, local conditioning and
odd batches), its CUDA graph (a loop node) replays what it computes eagerly, and its
settings are checked."""
import pytest
import torch

from diffusion_policy_accelerated import ConditionalUnet1D, DenoiseSchedule, Picard
from diffusion_policy_accelerated.kernels import ops
from diffusion_policy_accelerated.model.configs import SCHEDULER_CONFIG
from diffusion_policy_accelerated.sampling.sampler import GraphedSampler
from tests.support import DEVICES, check_bad_input



def schedule(kind="ddpm", steps=12, **options):
    config = dict(SCHEDULER_CONFIG, _class_name="DDPMScheduler" if kind == "ddpm" else "DDIMScheduler")
    return DenoiseSchedule.from_diffusers(config, steps, **options)


def problem(steps=12, batch=3, window=5, width=7, device="cpu", dtype=torch.float32, seed=0, inpaint=True):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)
    mask = torch.rand(batch, 4, 2, generator=g) < 0.2 if inpaint else None
    return dict(trajectory=randn(steps + 1, batch, 4, 2), start=torch.randint(0, steps, (batch,), generator=g,
                dtype=torch.int32).to(device), film_table=randn(steps, width), film_observation=randn(batch, width),
                model_output=randn(window * batch, 2, 4).transpose(1, 2), noise=randn(steps, batch, 4, 2),
                condition_data=randn(batch, 4, 2) if inpaint else None,
                condition_mask=None if mask is None else mask.to(device), window=window)


def reference_window(p):
    x, k, w = p["trajectory"], p["start"].tolist(), p["window"]
    steps, batch = x.shape[0] - 1, x.shape[1]
    rows = [(min(k[b] + r, steps - 1), b) for r in range(w) for b in range(batch)]
    states = torch.stack([x[i, b] for i, b in rows])
    films = torch.stack([p["film_table"][i] + p["film_observation"][b] for i, b in rows])
    return states, films


def reference_update(p, sched, thresholds):
    """picard.h's update, in float64 from the op's own denoise steps."""
    x, k_all, w = p["trajectory"].clone(), p["start"].clone(), p["window"]
    steps, batch = x.shape[0] - 1, x.shape[1]
    for b in range(batch):
        k = int(k_all[b])
        if k >= steps:
            continue
        prev, cum, errors, last = x[k, b].double(), x[k, b].double(), [], min(k + w, steps)
        for i in range(k, last):
            r = i - k
            f = ops.denoise_step(p["model_output"][r * batch + b], prev.to(x.dtype), p["noise"][i, b], sched.table, i,
                                 scheduler=sched.kind, clip_sample_range=sched.clip_sample_range,
                                 condition_data=None if p["condition_data"] is None else p["condition_data"][b],
                                 condition_mask=None if p["condition_mask"] is None else p["condition_mask"][b])
            cum = cum + f.double() - prev
            old = x[i + 1, b].double()
            x[i + 1, b] = cum.to(x.dtype)
            errors.append(float((x[i + 1, b].double() - old).square().sum()))
            prev = old
        converged = 0
        while k + converged < last and errors[converged] <= float(thresholds[k + converged]) * prev.numel():
            converged += 1
        next_k = min(k + converged + 1, steps)
        out = p["model_output"][(last - 1 - k) * batch + b]  # the window's last output steps the new states
        for j in range(last + 1, min(next_k + w - 1, steps) + 1):
            x[j, b] = ops.denoise_step(out, x[j - 1, b], p["noise"][j - 1, b], sched.table, j - 1,
                                       scheduler=sched.kind, clip_sample_range=sched.clip_sample_range,
                                       condition_data=None if p["condition_data"] is None else p["condition_data"][b],
                                       condition_mask=None if p["condition_mask"] is None else p["condition_mask"][b])
        k_all[b] = next_k
    return x, k_all


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_picard_window(device, dtype):
    for p in (problem(device=device, dtype=dtype), problem(batch=1, window=12, device=device, dtype=dtype, seed=1)):
        p["start"][0] = p["trajectory"].shape[0] - 1  # a finished row reads the last step
        states, films = ops.picard_window(p["trajectory"], p["start"], p["window"], p["film_table"],
                                          p["film_observation"])
        want_states, want_films = reference_window(p)
        assert torch.equal(states, want_states)
        torch.testing.assert_close(films, want_films, rtol=0, atol=1e-2 if dtype != torch.float32 else 1e-6)
        _, without = ops.picard_window(p["trajectory"], p["start"], p["window"], p["film_table"])
        assert torch.equal(without, reference_window(dict(p, film_observation=torch.zeros_like(p["film_observation"])))[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["ddpm", "ddim"])
@pytest.mark.parametrize("inpaint", [True, False], ids=["inpainting", "no mask"])
def test_picard_update(device, kind, inpaint):
    sched = schedule(kind).to(device)
    for seed, thresholds in ((0, torch.zeros(12)), (1, torch.full((12,), 1e6)), (2, torch.rand(12).where(
            torch.arange(12) % 2 == 0, torch.tensor(1e6)))):
        p = problem(device=device, seed=seed, inpaint=inpaint)
        if kind == "ddim":
            p["noise"] = None
        p["start"][-1] = 12  # finished: untouched
        thresholds = thresholds.to(device)
        want_x, want_k = reference_update(dict(p, noise=p["noise"] if p["noise"] is not None else
                                               torch.zeros_like(p["trajectory"][1:])), sched, thresholds)
        state = torch.tensor([5, 0, 0], dtype=torch.int32, device=device)
        ops.picard_update(p["trajectory"], p["start"], state, p["model_output"], p["noise"], sched.table, thresholds,
                          scheduler=kind, clip_sample_range=sched.clip_sample_range,
                          condition_data=p["condition_data"], condition_mask=p["condition_mask"])
        torch.testing.assert_close(p["trajectory"], want_x, rtol=1e-6, atol=1e-6)
        assert torch.equal(p["start"].cpu(), want_k.cpu())
        assert state.tolist() == [6, 0, 0]


@pytest.mark.gpu
@pytest.mark.parametrize("batch,window", [(1, 16), (5, 3), (64, 8)])
def test_picard_update_cuda_equals_cpu(batch, window):
    """Odd and large batches, a window past the end; poisoned states beyond it stay poisoned."""
    sched = schedule(steps=20)
    p = problem(steps=20, batch=batch, window=window, seed=3)
    thresholds = torch.rand(20) * 1e-2
    outs = []
    for device in ("cpu", "cuda"):
        q = {k: v.to(device, copy=True) if isinstance(v, torch.Tensor) else v for k, v in p.items()}
        q["trajectory"][-1] = float("nan")
        state = torch.zeros(3, dtype=torch.int32, device=device)
        ops.picard_update(q["trajectory"], q["start"], state, q["model_output"], q["noise"],
                          sched.to(device).table, thresholds.to(device), scheduler="ddpm",
                          clip_sample_range=1.0, condition_data=q["condition_data"],
                          condition_mask=q["condition_mask"])
        outs.append((q["trajectory"].cpu(), q["start"].cpu(), state.cpu()))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-6, atol=1e-6, equal_nan=True)
    assert torch.equal(outs[1][1], outs[0][1]) and torch.equal(outs[1][2], outs[0][2])


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    p = problem(device=device)
    torch.library.opcheck(torch.ops.dpa.picard_window, (p["trajectory"], p["start"], 5, p["film_table"],
                                                       p["film_observation"]))
    sched = schedule().to(device)
    torch.library.opcheck(torch.ops.dpa.picard_update, (
        p["trajectory"], p["start"], torch.zeros(3, dtype=torch.int32, device=device), p["model_output"],
        p["noise"], sched.table, torch.zeros(12, device=device), 0, 0, 1.0, False),
        dict(condition_data=p["condition_data"], condition_mask=p["condition_mask"]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("change,error,text", [
    (dict(start=torch.zeros(3, dtype=torch.int64)), TypeError, "start must be int32"),
    (dict(start=torch.zeros(2, dtype=torch.int32)), ValueError, "start must be a contiguous [batch] = [3]"),
    (dict(thresholds=torch.zeros(11)), ValueError, "thresholds must be a contiguous float32 [steps] = [12]"),
    (dict(model_output=torch.zeros(14, 4, 2)), ValueError, "model_output must be [window * batch, ...]"),
    (dict(model_output=torch.zeros(15, 4, 3)), ValueError, "model_output must be [15, 4, 2]"),
    (dict(noise=torch.zeros(13, 3, 4, 2)), ValueError, "noise must be a contiguous [steps, batch, ...] tensor"),
    (dict(state=torch.zeros(2, dtype=torch.int32)), ValueError, "state must be a contiguous int32 [3] tensor"),
    (dict(trajectory=torch.zeros(13, 3, 4, 2, dtype=torch.float64)), TypeError, "trajectory must be float32"),
    (dict(table=torch.zeros(11, 8)), ValueError, "table must have 12 rows"),
])
def test_bad_update_inputs(device, change, error, text):
    p = problem()
    args = dict(trajectory=p["trajectory"], start=p["start"], state=torch.zeros(3, dtype=torch.int32),
                model_output=p["model_output"], noise=p["noise"], table=schedule().table,
                thresholds=torch.zeros(12), scheduler="ddpm")
    args = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    check_bad_input(ops.picard_update, args, change, error, text, device)


@pytest.mark.parametrize("change,error,text", [
    (dict(window=0), ValueError, "window must be >= 1"),
    (dict(film_table=torch.zeros(11, 7)), ValueError, "film_table must be [steps, width] = [12, width]"),
    (dict(film_observation=torch.zeros(3, 6)), ValueError, "film_observation must be [batch, width] = [3, 7]"),
    (dict(trajectory=torch.zeros(1, 3, 4, 2)), ValueError, "trajectory must be [steps + 1, batch, ...]"),
])
def test_bad_window_inputs(change, error, text):
    p = problem()
    args = dict(trajectory=p["trajectory"], start=p["start"], window=5, film_table=p["film_table"],
                film_observation=p["film_observation"])
    check_bad_input(ops.picard_window, args, change, error, text, "cpu")


def unet(device):
    torch.manual_seed(0)
    return ConditionalUnet1D(2, local_cond_dim=3, global_cond_dim=6, down_dims=[16, 32], kernel_size=3,
                             cond_predict_scale=True).to(device).eval()


def inputs(batch, device, steps, horizon=8):
    g = torch.Generator().manual_seed(batch)
    data = torch.randn(batch, horizon, 2, generator=g)
    mask = torch.zeros(batch, horizon, 2, dtype=torch.bool)
    mask[:, :2] = True  # Diffusion Policy's inpainting of the observed steps
    return dict(condition_data=data.to(device), condition_mask=mask.to(device),
                local_cond=torch.randn(batch, horizon, 3, generator=g).to(device),
                global_cond=torch.randn(batch, 6, generator=g).to(device),
                noise=torch.randn(steps + 1, batch, horizon, 2, generator=g).to(device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind,steps", [("ddpm", 24), ("ddim", 10)])
@pytest.mark.parametrize("batch", [1, 3])
def test_tolerance_zero_is_the_sequential_trajectory(device, kind, steps, batch):
    model, sched = unet(device), schedule(kind, steps)
    args = inputs(batch, device, steps)
    sequential = GraphedSampler(model, sched)(**args)
    for window in (1, 4, steps, 100):
        parallel = GraphedSampler(model, sched, parallel=Picard(window=window, tolerance=0))
        out = parallel(**args)
        torch.testing.assert_close(out, sequential, rtol=1e-5, atol=1e-5)
        assert 1 <= parallel.last_iterations <= steps


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("prediction_type", ["sample", "v_prediction"])
def test_tolerance_zero_with_other_predictions(device, prediction_type):
    """Sample and v prediction (their first guesses differ from epsilon's): tolerance 0 gives the
    sequential trajectory."""
    config = dict(SCHEDULER_CONFIG, _class_name="DDPMScheduler", prediction_type=prediction_type)
    sched, model, args = DenoiseSchedule.from_diffusers(config, 12), unet(device), inputs(2, device, 12)
    sequential = GraphedSampler(model, sched)(**args)
    parallel = GraphedSampler(model, sched, parallel=Picard(window=4, tolerance=0))
    torch.testing.assert_close(parallel(**args), sequential, rtol=1e-5, atol=1e-5)


def test_the_collector_stays_off_until_the_last_capture_ends():
    """Captures in two threads overlap: the first to end must not turn Python's collector back on
    while the other still captures (the pause is counted)."""
    import gc

    from diffusion_policy_accelerated.sampling.sampler import _collector_paused

    assert gc.isenabled()
    with _collector_paused():
        with _collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


@pytest.mark.gpu
def test_a_dropped_sampler_collected_during_a_capture():
    """A parallel sampler sits in a reference cycle (its loop holds it), so its graph is freed by
    Python's collector, whenever an allocation triggers it; one freed during another sampler's
    capture invalidated that capture (seen in the suite). The collector runs on almost every
    allocation here."""
    import gc

    model, sched = unet("cuda"), schedule("ddpm", 24)
    args = inputs(3, "cuda", 24)
    dropped = GraphedSampler(model, sched, parallel=Picard(window=4, tolerance=0))
    want = dropped(**args)
    del dropped
    threshold = gc.get_threshold()
    gc.set_threshold(1)
    try:
        got = GraphedSampler(model, sched, parallel=Picard(window=4, tolerance=0))(**args)
    finally:
        gc.set_threshold(*threshold)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_a_loose_tolerance_takes_fewer_iterations(device):
    model, sched = unet(device), schedule("ddpm", 40)
    args = inputs(2, device, 40)
    counts = []
    for tolerance in (0.0, 1.0, 1e6):
        sampler = GraphedSampler(model, sched, parallel=Picard(window=10, tolerance=tolerance))
        sampler(**args)
        counts.append(sampler.last_iterations)
    assert counts[0] >= counts[1] >= counts[2]
    assert counts[2] == 4  # every state accepted: the window moves by its length, 40 / 10


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_graph_loop_replays_the_eager_loop(dtype):
    """The CUDA graph (a loop node; the iterations counted on the device) against the same
    loop run eagerly, on new inputs at every call."""
    model, sched = unet("cuda").to(dtype), schedule("ddpm", 30)
    graphed = GraphedSampler(model, sched, parallel=Picard(window=8, tolerance=0.2))
    eager = GraphedSampler(model, sched, parallel=Picard(window=8, tolerance=0.2), use_cuda_graph=False)
    for batch in (1, 3, 1):
        args = inputs(batch, "cuda", 30)
        out = graphed(**args)
        want = eager(**args)
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        assert graphed.last_iterations == eager.last_iterations


@pytest.mark.parametrize("value,error,text", [
    (dict(window=0), ValueError, "Picard.window must be a positive int"),
    (dict(window=2.5), ValueError, "Picard.window must be a positive int"),
    (dict(tolerance=-1), ValueError, "Picard.tolerance must be a finite number >= 0"),
    (dict(tolerance=float("nan")), ValueError, "Picard.tolerance must be a finite number >= 0"),
    (dict(window=4, step=2), TypeError, "parallel: unknown settings ['step']"),
    ("fast", TypeError, "parallel must be None, a bool, a Picard or a dict of its fields, got str"),
])
def test_bad_settings(value, error, text):
    with pytest.raises(error, match=text.replace("[", r"\[").replace("]", r"\]")):
        GraphedSampler(unet("cpu"), schedule(), parallel=value)


def test_on_a_trained_policy_the_task_metric_holds_in_fewer_iterations():
    """On a tiny U-Net trained on the synthetic multimodal task (tools/synthetic_task.py), the
    parallel sampler (window 8, tolerance 0.1) on the same noise as the sequential one: the
    goal-reached rate within 0.1 of it, the actions close (mean |da| below 0.05), in far fewer
    iterations than DDPM's 50 steps. Convergence depends on the learned denoiser, which random
    weights do not have."""
    from diffusion_policy_accelerated.tools import synthetic_task as task

    horizon = 16
    torch.manual_seed(0)
    model = ConditionalUnet1D(2, global_cond_dim=20, diffusion_step_embed_dim=32, down_dims=[16, 32], kernel_size=5,
                              cond_predict_scale=True)
    task.train(model, 250, 64, 3e-3, "cpu", horizon, seed=0, progress=None)
    sched = task.make_schedule("ddpm", 50)
    radius = dict(goal_radius=0.25, start_radius=0.25)
    metric, actions, parallel = {}, {}, GraphedSampler(model, sched, parallel=Picard(window=8, tolerance=0.1))
    for name, sampler in (("sequential", GraphedSampler(model, sched)), ("parallel", parallel)):
        def sample(cond, gen, sampler=sampler, name=name):
            actions[name] = task.sample_actions(sampler, cond, horizon, gen)
            return actions[name]
        metric[name] = task.evaluate_sampler(sample, global_cond_dim=20, horizon=horizon, observations=16, samples=8,
                                             **radius)
    assert metric["sequential"]["reached_rate"] > 0.15, metric  # it learned something
    assert abs(metric["parallel"]["reached_rate"] - metric["sequential"]["reached_rate"]) <= 0.1, metric
    assert task.action_distance(actions["parallel"], actions["sequential"])["mean_abs"] < 0.05
    assert parallel.last_iterations <= 30  # 23 measured, of 50 steps
