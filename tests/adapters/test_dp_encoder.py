"""DiffusionUnetImagePolicy checkpoints from camera frames: the rebuilt MultiImageObsEncoder
(adapters/dp_encoder.py) against Diffusion Policy's module tree (tests/support/dp_policies.py),
and load_checkpoint(...).predict_action against Diffusion Policy's predict_action."""
import pytest
import torch

pytest.importorskip("omegaconf")
pytest.importorskip("torchvision")

from diffusion_policy_accelerated.adapters.checkpoint import load_checkpoint  # noqa: E402
from diffusion_policy_accelerated.adapters.dp_encoder import build_obs_encoder  # noqa: E402
from tests.support.dp_image_checkpoint import (  # noqa: E402
    as_float_obs, dp_predict_action, encoder_cfg, frames, image_shape_meta, make_image_checkpoint, reference_encoder)
from tests.support.dp_policies import real_robot_encoder  # noqa: E402

TOLERANCE = dict(atol=1e-4, rtol=1e-4)

ENCODER_CASES = {
    "real robot: resize, crop, imagenet, group norm, 1 camera": dict(cameras=1),
    "3 cameras": dict(cameras=3),
    "no resize, crop only": dict(cameras=2, resize_shape=None),
    "shared model (keeps BatchNorm)": dict(cameras=2, share_rgb_model=True, use_group_norm=True),
    "no crop without random_crop, no imagenet norm": dict(cameras=1, random_crop=False, imagenet_norm=False),
    "no resize or crop, BatchNorm": dict(cameras=1, resize_shape=None, crop_shape=None, use_group_norm=False),
}


@pytest.mark.parametrize("case", ENCODER_CASES)
def test_rebuilt_encoder_equals_diffusion_policys(case):
    options = dict(ENCODER_CASES[case])
    shape_meta = image_shape_meta(options.pop("cameras"))
    cfg = encoder_cfg(**options)
    reference = reference_encoder(shape_meta, cfg)
    rebuilt = build_obs_encoder({"obs_encoder": {**cfg, "shape_meta": shape_meta}, "shape_meta": shape_meta},
                                reference.state_dict())
    assert sorted(rebuilt.state_dict()) == sorted(reference.state_dict())  # loaded strictly
    g = torch.Generator().manual_seed(1)
    obs = {k: torch.rand((4,) + tuple(v["shape"]), generator=g) * 2 - 1 for k, v in shape_meta["obs"].items()}
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(obs), reference(obs), **TOLERANCE)
    assert rebuilt.feature_dim == reference(obs).shape[-1]


def test_real_robot_encoder_at_its_own_sizes():
    """DP's real-robot configuration at its frame size (240 x 320, crop 216 x 288), 2 cameras."""
    reference, width, shapes = real_robot_encoder(2)
    reference.eval()
    shape_meta = {"obs": {k: {"shape": list(s), "type": "rgb" if len(s) == 3 else "low_dim"} for k, s in shapes.items()}}
    cfg = encoder_cfg(resize_shape=(240, 320), crop_shape=(216, 288))
    rebuilt = build_obs_encoder({"obs_encoder": {**cfg, "shape_meta": shape_meta}}, reference.state_dict())
    obs = {k: torch.rand((2,) + s, generator=torch.Generator().manual_seed(2)) for k, s in shapes.items()}
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(obs), reference(obs), **TOLERANCE)
    assert rebuilt.feature_dim == width


@pytest.mark.parametrize("cameras,obs_mode", [(1, "global"), (3, "global"), (1, "inpaint")])
def test_predict_action_from_frames_equals_diffusion_policy(cameras, obs_mode, tmp_path):
    path, cfg, encoder, ref, state = make_image_checkpoint(tmp_path, cameras, obs_mode=obs_mode)
    ck = load_checkpoint(path, device="cpu")
    assert ck.camera_keys == [f"camera_{i}" for i in range(cameras)]
    obs = as_float_obs(frames(cameras, batch=3, steps=3))
    result = ck.predict_action(obs, generator=torch.Generator().manual_seed(9))
    expected = dp_predict_action(ck, cfg, encoder, ref, state, obs, seed=9)
    assert result["action"].shape == (3, 8, 2)
    torch.testing.assert_close(result["action"], expected, **TOLERANCE)


def test_bad_observations_are_named(tmp_path):
    path, *_ = make_image_checkpoint(tmp_path, 2)
    ck = load_checkpoint(path, device="cpu")
    good = as_float_obs(frames(2, batch=1))
    for change, error, text in [
        ({"camera_1": None}, ValueError, "missing ['camera_1']"),
        ({"extra": torch.zeros(1, 2, 3)}, ValueError, "unexpected ['extra']"),
        ({"camera_0": torch.zeros(1, 2, 3, 16, 40)}, ValueError, "obs_dict['camera_0'] must be [B, >= 2, 3, 32, 40]"),
        ({"camera_0": torch.zeros(1, 1, 3, 32, 40)}, ValueError, "obs_dict['camera_0'] must be [B, >= 2"),
        ({"camera_0": torch.zeros(1, 2, 3, 32, 40, dtype=torch.uint8)}, TypeError, "must be floating point"),
        ({"robot_eef_pose": torch.zeros(2, 2, 2)}, ValueError, "holds 2 observations"),
    ]:
        obs = {k: v for k, v in {**good, **change}.items() if v is not None}
        with pytest.raises(error) as caught:
            ck.predict_action(obs)
        assert text in str(caught.value)


def test_encoder_that_does_not_fit_is_refused(tmp_path):
    path, cfg, encoder, ref, state = make_image_checkpoint(tmp_path, 1)
    policy_cfg = {**cfg["policy"], "obs_encoder": {**cfg["policy"]["obs_encoder"], "shape_meta": cfg["shape_meta"]}}
    weights = {k[len("obs_encoder."):]: v for k, v in state.items() if k.startswith("obs_encoder.")}
    for change, text in [
        ({"rgb_model": {"_target_": "diffusion_policy.model.vision.model_getter.get_r3m", "name": "resnet18"}},
         "R3M and other backbones are not rebuilt"),
        ({"_target_": "x.RobomimicObsEncoder"}, "must be Diffusion Policy's MultiImageObsEncoder"),
        ({"use_group_norm": False}, "missing [key_model_map.camera_0.bn1.running_mean"),
        ({"share_rgb_model": True}, "unexpected [key_model_map.camera_0."),
        ({"rgb_model": {"_target_": "diffusion_policy.model.vision.model_getter.get_resnet", "name": "resnet34"}},
         "missing [key_model_map.camera_0.layer1.2."),
        ({"crop_shape": [40, 28]}, "must be smaller than its [24, 32] frames"),
        ({"mystery": 1}, "arguments ['mystery']"),
        ({"crop_shape": 96}, "crop_shape must be [h, w], positive ints, got 96"),
        ({"resize_shape": [24, "32"]}, "resize_shape must be [h, w], positive ints"),
        ({"shape_meta": {"obs": {"camera_0": {"type": "rgb"}}}}, "shape_meta.obs.camera_0 must be a mapping with a"),
    ]:
        bad = {**policy_cfg, "obs_encoder": {**policy_cfg["obs_encoder"], **change}}
        with pytest.raises(ValueError) as caught:
            build_obs_encoder(bad, weights)
        assert text in str(caught.value), str(caught.value)


def test_hybrid_stand_in_without_encoder_weights_says_why(tmp_path):
    from tests.adapters.test_checkpoint import make_checkpoint

    path, *_ = make_checkpoint(tmp_path, policy="hybrid_image")
    with pytest.raises(ValueError, match="robomimic observation encoder cannot be rebuilt.*predict_action_from_features"):
        load_checkpoint(path, device="cpu").predict_action({"image": torch.zeros(1, 2, 3, 8, 8),
                                                            "agent_pos": torch.zeros(1, 2, 2)})


@pytest.mark.gpu
def test_predict_action_from_frames_on_cuda(tmp_path):
    path, cfg, encoder, ref, state = make_image_checkpoint(tmp_path, 2)
    ck = load_checkpoint(path, device="cuda")
    obs = as_float_obs(frames(2, batch=2))
    noise = torch.randn((4, 2, 16, 2), generator=torch.Generator().manual_seed(3))
    got = ck.predict_action({k: v.cuda() for k, v in obs.items()}, noise=noise.cuda())["action"].cpu()
    want = load_checkpoint(path, device="cpu").predict_action(obs, noise=noise)["action"]
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
