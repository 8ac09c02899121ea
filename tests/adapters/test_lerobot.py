"""LeRobot's DiffusionPolicy against its own code: the U-Net key mapping, accelerate(policy) and
load_lerobot_pretrained. Needs LeRobot's real modeling code (requirements-lerobot.txt, installed
by .ci/run); skipped without it."""
import copy
import json
import warnings

import pytest
import torch

modeling = pytest.importorskip("lerobot.policies.diffusion.modeling_diffusion",
                               reason="LeRobot is not installed (requirements-lerobot.txt)")
from lerobot.configs.types import FeatureType, PolicyFeature  # noqa: E402
from lerobot.policies.diffusion.configuration_diffusion import DiffusionConfig  # noqa: E402

import diffusion_policy_accelerated as dpa  # noqa: E402
from diffusion_policy_accelerated.adapters import lerobot as dpa_lerobot  # noqa: E402
from tests.support import DEVICES  # noqa: E402

# fp32 actions against LeRobot's fp32 loop on the same noise (DDIM with few steps: with many,
# LeRobot's own fp32 loop is that far from fp64 at the last steps' alphas).
TOLERANCE = dict(atol=1e-4, rtol=1e-4)
# Large enough that the ResNet's last feature map is 3 x 3: at 32 x 32 it is 1 x 1, its spatial
# softmax keypoints constant, and the actions would not depend on the image at all.
IMAGE = (3, 96, 96)


def make_policy(scheduler="DDIM", steps=10, down_dims=(16, 32, 64), film_scale=True, n_groups=8, image=False,
                device="cpu", seed=0, scale=3.0, separate_encoders=False, cameras=1, **image_options):
    """A small LeRobot DiffusionPolicy: state (2) and environment state (3), or an image, with
    the U-Net's weights scaled up (`scale`) so that every layer matters. The encoder's settings
    are given, not LeRobot's defaults, which 0.6 changed (GroupNorm and one encoder for all
    cameras were 0.4's)."""
    inputs = {"observation.state": PolicyFeature(type=FeatureType.STATE, shape=(2,))}
    if image:
        for camera in range(cameras):
            key = "observation.image" if cameras == 1 else f"observation.images.cam{camera}"
            inputs[key] = PolicyFeature(type=FeatureType.VISUAL, shape=IMAGE)
    else:
        inputs["observation.environment_state"] = PolicyFeature(type=FeatureType.ENV, shape=(3,))
    config = DiffusionConfig(input_features=inputs,
                             output_features={"action": PolicyFeature(type=FeatureType.ACTION, shape=(2,))},
                             down_dims=down_dims, diffusion_step_embed_dim=16, n_groups=n_groups,
                             use_film_scale_modulation=film_scale, noise_scheduler_type=scheduler,
                             num_inference_steps=steps, spatial_softmax_num_keypoints=4,
                             pretrained_backbone_weights=None, use_group_norm=True,
                             use_separate_rgb_encoder_per_camera=separate_encoders, horizon=16, n_action_steps=8,
                             device=device, **image_options)
    torch.manual_seed(seed)
    policy = modeling.DiffusionPolicy(config).to(device).eval()
    with torch.no_grad():
        for parameter in policy.diffusion.unet.parameters():
            parameter.mul_(scale)
    return policy


def observations(policy, batch, device, seed=1, steps=True):
    """A batch for generate_actions ([B, n_obs_steps, ...]) or, steps=False, for select_action."""
    g = torch.Generator().manual_seed(seed)
    shape = (batch, policy.config.n_obs_steps) if steps else (batch,)
    obs = {"observation.state": torch.randn(*shape, 2, generator=g)}
    cameras = [key for key in policy.config.input_features if key.startswith("observation.image")]
    if cameras:
        images = torch.rand(*shape, len(cameras), *IMAGE, generator=g)
        if steps:  # generate_actions takes the cameras stacked, as select_action stacks them
            obs["observation.images"] = images
        else:
            obs.update({key: images[:, i] for i, key in enumerate(cameras)})
    else:
        obs["observation.environment_state"] = torch.randn(*shape, 3, generator=g)
    return {k: v.to(device) for k, v in obs.items()}


@pytest.mark.parametrize("film_scale,n_groups,down_dims", [(True, 8, (16, 32, 64)), (False, 4, (16, 32)),
                                                           (True, 8, (8, 16, 32, 64))])
def test_unet_maps_key_for_key_and_computes_the_same(film_scale, n_groups, down_dims):
    policy = make_policy(film_scale=film_scale, n_groups=n_groups, down_dims=down_dims)
    theirs = policy.diffusion.unet
    ours = dpa_lerobot.unet_from_lerobot(theirs)
    # The same tensors, not copies.
    assert {p.data_ptr() for p in ours.parameters()} == {p.data_ptr() for p in theirs.parameters()}
    # And a strict load of the mapped state_dict into a fresh U-Net.
    fresh = dpa.ConditionalUnet1D(**{k: getattr(ours, k) for k in ("input_dim", "global_cond_dim")},
                                  diffusion_step_embed_dim=16, down_dims=list(down_dims), kernel_size=5,
                                  n_groups=n_groups, cond_predict_scale=film_scale)
    fresh.load_state_dict(dpa_lerobot.dpa_state_dict(theirs.state_dict()), strict=True)
    g = torch.Generator().manual_seed(3)
    sample = torch.randn(3, 16, 2, generator=g)
    cond = torch.randn(3, ours.global_cond_dim, generator=g)
    t = torch.tensor([0, 37, 99])
    with torch.no_grad():
        expected = theirs(sample, t, global_cond=cond)
        ours.use_fused_ops = fresh.use_fused_ops = False
        assert torch.equal(ours(sample, t, global_cond=cond), expected)
        assert torch.equal(fresh(sample, t, global_cond=cond), expected)
        ours.use_fused_ops = True
        torch.testing.assert_close(ours(sample, t, global_cond=cond), expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("image", [False, True], ids=["state", "image"])
def test_ddim_actions_equal_lerobots(device, image):
    """generate_actions with the same initial noise, and select_action from the same seed
    (LeRobot draws the initial noise itself): LeRobot's actions, its vision encoder included."""
    reference = make_policy(image=image, device=device)
    policy = dpa.accelerate(copy.deepcopy(reference))
    obs = observations(reference, 5, device)
    noise = torch.randn(5, 16, 2, generator=torch.Generator().manual_seed(4)).to(device)
    with torch.no_grad():
        expected = reference.diffusion.generate_actions(dict(obs), noise=noise)
        actions = policy.diffusion.generate_actions(dict(obs), noise=noise)
    assert actions.shape == (5, 8, 2) and actions.dtype == expected.dtype
    torch.testing.assert_close(actions, expected, **TOLERANCE)
    step = observations(reference, 5, device, steps=False)
    reference.reset(), policy.reset()
    torch.manual_seed(7)
    expected = reference.select_action(dict(step))
    torch.manual_seed(7)
    torch.testing.assert_close(policy.select_action(dict(step)), expected, **TOLERANCE)
    # The rest of the chunk comes from LeRobot's queue, as before.
    assert len(policy._queues["action"]) == len(reference._queues["action"]) == 7


def test_ddpm_and_num_inference_steps_are_followed():
    """DDPM samples (its per-step noise has LeRobot's distribution, from one draw), and a changed
    policy.diffusion.num_inference_steps is followed on the next call."""
    policy = dpa.accelerate(make_policy(scheduler="DDPM", steps=None))
    obs = observations(policy, 2, "cpu")
    with torch.no_grad():
        actions = policy.diffusion.generate_actions(dict(obs))
    sampler = policy.diffusion.conditional_sample.sampler
    assert sampler.schedule.kind == "ddpm" and sampler.num_steps == 100
    assert actions.shape == (2, 8, 2) and torch.isfinite(actions).all()
    reference = make_policy(steps=10)
    accelerated = dpa.accelerate(copy.deepcopy(reference))
    reference.diffusion.num_inference_steps = accelerated.diffusion.num_inference_steps = 4
    noise = torch.randn(2, 16, 2)
    with torch.no_grad():
        torch.testing.assert_close(accelerated.diffusion.generate_actions(dict(obs), noise=noise),
                                   reference.diffusion.generate_actions(dict(obs), noise=noise), **TOLERANCE)
    assert accelerated.diffusion.conditional_sample.sampler.num_steps == 4


def test_state_dict_and_save_pretrained_stay_lerobots(tmp_path):
    reference = make_policy()
    policy = dpa.accelerate(copy.deepcopy(reference))
    assert list(policy.state_dict()) == list(reference.state_dict())
    assert sum(p.numel() for p in policy.parameters()) == sum(p.numel() for p in reference.parameters())
    policy.save_pretrained(tmp_path)
    loaded = modeling.DiffusionPolicy.from_pretrained(tmp_path)
    for (key, value), (_, expected) in zip(loaded.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(value.cpu(), expected.cpu()), key


@pytest.mark.gpu
def test_policy_moved_after_accelerate():
    """policy.to("cuda") after accelerate moves the shared weights; the sampler follows them
    (and captures a CUDA graph there)."""
    reference = make_policy()
    policy = dpa.accelerate(copy.deepcopy(reference)).to("cuda")
    reference = reference.to("cuda")
    obs = observations(reference, 3, "cuda")
    noise = torch.randn(3, 16, 2, device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(policy.diffusion.generate_actions(dict(obs), noise=noise),
                                   reference.diffusion.generate_actions(dict(obs), noise=noise), **TOLERANCE)
    assert policy.diffusion.conditional_sample.sampler.use_cuda_graph


@pytest.mark.parametrize("device", DEVICES)
def test_bfloat16(device):
    """accelerate(policy, dtype=torch.bfloat16): a bf16 copy of the U-Net (LeRobot's own cannot
    run in bf16: its timestep embedding follows torch's default dtype); actions stay fp32."""
    reference = make_policy(device=device, scale=1.0)
    policy = dpa.accelerate(copy.deepcopy(reference), dtype=torch.bfloat16)
    obs = observations(reference, 3, device)
    noise = torch.randn(3, 16, 2).to(device)
    with torch.no_grad():
        expected = reference.diffusion.generate_actions(dict(obs), noise=noise)
        actions = policy.diffusion.generate_actions(dict(obs), noise=noise)
    assert actions.dtype == torch.float32
    # bf16 weights move actions (in [-1, 1]) by a few 1e-2, as on the benchmark's U-Nets.
    assert (actions - expected).abs().max() < 0.1


@pytest.mark.parametrize("device", DEVICES)
def test_image_policy_whole_graph_with_a_channels_last_encoder(device):
    """generate_actions (the ResNet encoder, the global condition, the loop) as one CUDA graph
    per batch size, the encoder's weights channels-last; fresh observations on every call."""
    reference = make_policy(image=True, device=device)
    policy = dpa.accelerate(copy.deepcopy(reference), encoder_channels_last=True)
    for call, batch in enumerate([2, 3, 2]):
        obs = observations(reference, batch, device, seed=call)
        noise = torch.randn(batch, 16, 2).to(device)
        with torch.no_grad():
            torch.testing.assert_close(policy.diffusion.generate_actions(dict(obs), noise=noise),
                                       reference.diffusion.generate_actions(dict(obs), noise=noise), **TOLERANCE)
    if device == "cuda":
        assert len(policy.diffusion.generate_actions._graphs) == 2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cameras", [1, 3])
def test_resize_and_crop_run_in_one_graph(device, cameras):
    """LeRobot's resize_shape and crop_ratio (torchvision's Resize and CenterCrop in eval; with a
    resize, LeRobot derives the crop from the ratio and ignores crop_shape) with one and three
    cameras: LeRobot's actions, and on CUDA one graph, captured without a warning."""
    reference = make_policy(image=True, cameras=cameras, resize_shape=(80, 80), crop_ratio=0.9, device=device)
    assert reference.config.crop_shape == (72, 72)  # the crop is there to be captured
    policy = dpa.accelerate(copy.deepcopy(reference))
    obs = observations(reference, 2, device)
    noise = torch.randn(2, 16, 2).to(device)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # a capture that fails warns
        torch.testing.assert_close(policy.diffusion.generate_actions(dict(obs), noise=noise),
                                   reference.diffusion.generate_actions(dict(obs), noise=noise), **TOLERANCE)
    if device == "cuda":
        call = policy.diffusion.generate_actions
        assert call.refused is None and len(call._graphs) == 1


def test_the_image_moves_the_actions():
    """The image tests compare actions that depend on the image: two observations that differ
    only in it get different actions, accelerated as in LeRobot."""
    reference = make_policy(image=True)
    policy = dpa.accelerate(copy.deepcopy(reference))
    obs = observations(reference, 2, "cpu")
    other = {**obs, "observation.images": torch.rand(obs["observation.images"].shape,
                                                     generator=torch.Generator().manual_seed(9))}
    noise = torch.randn(2, 16, 2)
    with torch.no_grad():
        for model in (reference, policy):
            moved = model.diffusion.generate_actions(dict(other), noise=noise)
            assert (moved - model.diffusion.generate_actions(dict(obs), noise=noise)).abs().max() > 1e-2


@pytest.mark.parametrize("device", DEVICES)
def test_an_encoder_per_camera(device):
    """LeRobot 0.6's default: a ResNet per camera (rgb_encoder a ModuleList), channels-last
    here; LeRobot's actions."""
    reference = make_policy(image=True, separate_encoders=True, device=device)
    assert isinstance(reference.diffusion.rgb_encoder, torch.nn.ModuleList)
    policy = dpa.accelerate(copy.deepcopy(reference), encoder_channels_last=True)
    obs = observations(reference, 2, device)
    noise = torch.randn(2, 16, 2).to(device)
    with torch.no_grad():
        torch.testing.assert_close(policy.diffusion.generate_actions(dict(obs), noise=noise),
                                   reference.diffusion.generate_actions(dict(obs), noise=noise), **TOLERANCE)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("whole_graph", [True, False], ids=["whole graph", "loop graph"])
def test_non_finite_observations_and_actions_raise(device, whole_graph):
    """check_finite (the default): a NaN in select_action's observation, and a NaN weight in
    the U-Net, raise dpa.NonFiniteError naming them instead of returning actions; after a
    reset the policy acts again. check_finite=False returns LeRobot's own NaN actions."""
    policy = dpa.accelerate(make_policy(device=device), whole_graph=whole_graph)
    step = observations(policy, 2, device, steps=False)
    bad = {**step, "observation.state": step["observation.state"].clone()}
    bad["observation.state"][1, 0] = float("nan")
    with torch.no_grad():
        policy.select_action(dict(step))  # on CUDA: the graph is captured, then replayed below
        policy.reset()
        with pytest.raises(dpa.NonFiniteError, match=r"generate_actions: NaN or Inf in the observations: "
                                                     r"batch\['observation.state'\] \(rows \[1\] of 2\)") as caught:
            policy.select_action(dict(bad))
        assert caught.value.where == "observations"
        policy.reset()
        assert torch.isfinite(policy.select_action(dict(step))).all()
        policy.diffusion.unet.final_conv[1].weight[0, 0, 0] = float("nan")
        policy.reset()
        with pytest.raises(dpa.NonFiniteError, match=r"actions, from finite observations: result \(rows \[0, 1\] of "
                                                     r"2\).*not finite: unet\.final_conv\.1\.weight"):
            policy.select_action(dict(step))
        unchecked = dpa.accelerate(make_policy(device=device), whole_graph=whole_graph, check_finite=False)
        assert torch.isnan(unchecked.select_action(dict(bad))[1]).all()


def test_load_pretrained_non_finite_guard(tmp_path):
    make_policy().save_pretrained(tmp_path)
    loaded = dpa.load_lerobot_pretrained(tmp_path, device="cpu")
    global_cond = torch.randn(3, loaded.global_cond_dim)
    global_cond[2, 0] = float("inf")
    with pytest.raises(dpa.NonFiniteError, match=r"predict_action_chunk: NaN or Inf in the observations: "
                                                 r"global_cond \(rows \[2\] of 3\)"):
        loaded.predict_action_chunk(global_cond)
    unchecked = dpa.load_lerobot_pretrained(tmp_path, device="cpu", check_finite=False)
    actions = unchecked.predict_action_chunk(global_cond)
    assert torch.isfinite(actions[:2]).all() and not torch.isfinite(actions[2]).all()


def test_encoder_options_without_images_are_refused():
    policy = make_policy()
    with pytest.raises(ValueError, match=r"encoder_dtype: the policy has no observation encoder "
                                         r"\(policy.diffusion.rgb_encoder\)"):
        dpa.accelerate(policy, encoder_dtype=torch.float16)
    assert "conditional_sample" not in vars(policy.diffusion)


@pytest.mark.parametrize("change,error,text", [
    ("train", ValueError, "the policy is in training mode"),
    ("twice", ValueError, "this policy is already accelerated"),
    ("dtype", TypeError, "dtype must be a floating-point torch.dtype or None, got torch.int32"),
    ("unet", TypeError, "policy.diffusion.unet is a Linear without"),
])
def test_bad_policies(change, error, text):
    policy = make_policy()
    kwargs = {}
    if change == "train":
        policy.train()
    elif change == "twice":
        dpa.accelerate(policy)
    elif change == "dtype":
        kwargs["dtype"] = torch.int32
    else:
        policy.diffusion.unet = torch.nn.Linear(2, 2)
    with pytest.raises(error, match=text):
        dpa.accelerate(policy, **kwargs)


def test_wrong_initial_noise_is_refused():
    policy = dpa.accelerate(make_policy())
    with pytest.raises(ValueError, match=r"noise must be the initial trajectory \[batch_size, horizon, action_dim\] = \[2, 16, 2\]"):
        policy.diffusion.conditional_sample(2, global_cond=torch.zeros(2, 10), noise=torch.zeros(2, 8, 2))


@pytest.mark.parametrize("device", DEVICES)
def test_load_pretrained_without_lerobot(tmp_path, device):
    """A folder save_pretrained wrote, as this package's U-Net and schedule: the same actions
    as LeRobot's loop for the same global condition and initial noise."""
    reference = make_policy(device=device)
    reference.save_pretrained(tmp_path)
    loaded = dpa.load_lerobot_pretrained(tmp_path, device=device)
    assert (loaded.horizon, loaded.n_obs_steps, loaded.n_action_steps, loaded.action_dim) == (16, 2, 8, 2)
    assert loaded.schedule.kind == "ddim" and len(loaded.schedule.timesteps) == 10
    obs = observations(reference, 4, device)
    noise = torch.randn(4, 16, 2).to(device)
    with torch.no_grad():
        global_cond = reference.diffusion._prepare_global_conditioning(dict(obs))
        expected = reference.diffusion.generate_actions(dict(obs), noise=noise)
    torch.testing.assert_close(loaded.predict_action_chunk(global_cond, noise=noise), expected, **TOLERANCE)


@pytest.mark.parametrize("damage,error,text", [
    ("no config", FileNotFoundError, "has no config.json"),
    ("no weights", FileNotFoundError, "has no model.safetensors"),
    ("not json", ValueError, "is not a JSON config"),
    ("other policy", ValueError, 'is not a LeRobot diffusion policy\'s config (its "type" is \'act\''),
    ("scheduler", ValueError, "noise_scheduler_type must be 'DDPM' or 'DDIM', got 'PNDM'"),
    ("horizon", ValueError, "config.json's horizon must be an int, got '16'"),
    ("corrupt weights", ValueError, "is not a readable safetensors file"),
    ("no unet", ValueError, "holds no diffusion.unet.* weights"),
])
def test_load_pretrained_bad_folders(tmp_path, damage, error, text):
    make_policy().save_pretrained(tmp_path)
    config_path, weights_path = tmp_path / "config.json", tmp_path / "model.safetensors"
    config = json.loads(config_path.read_text())
    if damage == "no config":
        config_path.unlink()
    elif damage == "no weights":
        weights_path.unlink()
    elif damage == "not json":
        config_path.write_text("{not json")
    elif damage in ("other policy", "scheduler", "horizon"):
        config.update({"other policy": {"type": "act"}, "scheduler": {"noise_scheduler_type": "PNDM"},
                       "horizon": {"horizon": "16"}}[damage])
        config_path.write_text(json.dumps(config))
    elif damage == "corrupt weights":
        weights_path.write_bytes(weights_path.read_bytes()[:100])
    else:
        from safetensors.torch import save_file
        save_file({"other.weight": torch.zeros(2)}, str(weights_path))
    with pytest.raises(error, match=__import__("re").escape(text)):
        dpa.load_lerobot_pretrained(tmp_path, device="cpu")


def test_weight_updates_are_followed():
    """New weights loaded into the accelerated policy in place (load_state_dict) reach the
    sampler's tables too: the actions are those of a LeRobot policy with the new weights."""
    policy = dpa.accelerate(make_policy(seed=0))
    other = make_policy(seed=1)
    obs = observations(other, 2, "cpu")
    noise = torch.randn(2, 16, 2)
    with torch.no_grad():
        policy.diffusion.generate_actions(dict(obs), noise=noise)  # tables of the old weights
        policy.load_state_dict(other.state_dict())
        torch.testing.assert_close(policy.diffusion.generate_actions(dict(obs), noise=noise),
                                   other.diffusion.generate_actions(dict(obs), noise=noise), **TOLERANCE)


def _benchmark_script():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "benchmark_lerobot.py"
    spec = importlib.util.spec_from_file_location("dpa_benchmark_lerobot", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_benchmark_script_on_cpu(tmp_path, capsys):
    """scripts/benchmark_lerobot.py end to end with a small U-Net: every method's row, ours
    equal to LeRobot's eager actions on the same noise (DDIM), the JSON and the plot."""
    script = _benchmark_script()
    rows = script.main(["--device", "cpu", "--down-dims", "16", "32", "64", "--horizon", "16", "--batch", "1", "3",
                        "--schedule", "DDIM", "--steps", "2", "--reps", "1", "--out", str(tmp_path)])
    assert [(r["batch"], r["method"]) for r in rows] == [(b, m) for b in (1, 3)
                                                         for m in ("LeRobot eager", "ours fp32", "ours bf16")]
    for row in rows:
        assert row["ms"] > 0
        if row["method"] == "ours fp32":
            assert row["action_error_vs_eager"] < 1e-4
        elif row["method"] == "ours bf16":
            assert 0 < row["action_error_vs_eager"] < 0.2
    assert json.loads((tmp_path / "benchmark_lerobot.json").read_text()) == rows
    assert (tmp_path / "benchmark_lerobot.png").read_bytes()[:4] == b"\x89PNG"
    assert "LeRobot eager" in capsys.readouterr().out
    for bad in (["--batch", "0"], ["--steps", "0"], ["--down-dims", "0"]):
        with pytest.raises(SystemExit):
            script.main(["--device", "cpu", *bad])


def test_benchmark_script_compile_row(tmp_path):
    """--compile: LeRobot's compile_model=True policy, with the eager policy's weights (the
    same actions on the same noise)."""
    rows = _benchmark_script().main(["--device", "cpu", "--down-dims", "16", "32", "--horizon", "8", "--batch", "1",
                                     "--schedule", "DDIM", "--steps", "2", "--reps", "1", "--compile",
                                     "--out", str(tmp_path)])
    compiled = [r for r in rows if r["method"] == "LeRobot compile"]
    assert len(compiled) == 1 and compiled[0]["action_error_vs_eager"] < 1e-4
