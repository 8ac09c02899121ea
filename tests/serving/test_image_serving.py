"""`dpa serve` of a Diffusion Policy image checkpoint from camera frames: the spec declares
each camera as uint8 [n_obs_steps, C, H, W], the `dpa serve` process and ServerThread answer
real clients over 127.0.0.1 with the checkpoint's own predict_action on the same noise, and bad
frames get a 4xx naming the input. Small frames and 3 denoising steps; every wait bounded."""

import numpy as np
import pytest
import torch

pytest.importorskip("aiohttp")
pytest.importorskip("safetensors")
pytest.importorskip("omegaconf")
pytest.importorskip("torchvision")

from diffusion_policy_accelerated import load_checkpoint  # noqa: E402
from diffusion_policy_accelerated.serving import protocol  # noqa: E402
from diffusion_policy_accelerated.serving.client import PolicyClient, RequestRejected  # noqa: E402
from diffusion_policy_accelerated.serving.policies import PolicySource, load_policy  # noqa: E402
from diffusion_policy_accelerated.serving.server import ServerThread  # noqa: E402

from tests.serving.test_serving import raw_post  # noqa: E402
from tests.support.dp_image_checkpoint import CAMERA_SHAPE, as_float_obs, frames, make_image_checkpoint  # noqa: E402
from tests.support.serve_process import dpa_serve  # noqa: E402

TOLERANCE = dict(rtol=1e-4, atol=1e-4)
STEPS = 3


def expected_actions(path, obs, seed, device="cpu"):
    """load_checkpoint(...).predict_action on the frames as floats in [0, 1], with the noise the
    server draws for `seed`."""
    rows = next(iter(obs.values())).shape[0]
    noise = torch.randn((STEPS + 1, rows, 16, 2), generator=torch.Generator().manual_seed(seed))
    ck = load_checkpoint(path, device=device)
    floats = {k: v.to(device) for k, v in as_float_obs(obs).items()}
    return ck.predict_action(floats, noise=noise.to(device))["action"].cpu().numpy()


def single(obs):
    return {k: v[0] for k, v in obs.items()}


@pytest.fixture(scope="module")
def two_cameras(tmp_path_factory):
    path, *_ = make_image_checkpoint(tmp_path_factory.mktemp("image"), cameras=2, steps=STEPS)
    return path


def test_spec_declares_uint8_cameras(two_cameras):
    policy = load_policy(PolicySource("checkpoint", str(two_cameras), device="cpu"), max_rows=4)
    spec = policy.spec.to_json()
    assert spec["inputs"] == {"camera_0": {"shape": [2, *CAMERA_SHAPE], "dtype": "uint8"},
                              "camera_1": {"shape": [2, *CAMERA_SHAPE], "dtype": "uint8"},
                              "robot_eef_pose": {"shape": [2, 2], "dtype": "float32"}}
    assert spec["action"] == {"shape": [8, 2], "dtype": "float32"} and spec["cameras"] == ["camera_0", "camera_1"]
    # max_request_bytes counts frames as bytes: 4 rows of 2 cameras of 2 steps, and the pose.
    assert spec["max_request_bytes"] == 4 * (2 * 2 * int(np.prod(CAMERA_SHAPE)) + 2 * 2 * 4) + 4096


@pytest.mark.parametrize("cameras", [1, 3])
def test_dpa_serve_process_serves_frames(cameras, tmp_path):
    """`dpa serve --checkpoint` of a 1- and a 3-camera policy: a batch of 3 observations and a
    single one, seeded, equal load_checkpoint(...).predict_action on the same noise."""
    path, *_ = make_image_checkpoint(tmp_path, cameras=cameras, steps=STEPS)
    with dpa_serve("--device", "cpu", "--checkpoint", str(path), "--max-batch", "4") as served:
        with PolicyClient(served.url, timeout=60) as client:
            client.wait_ready(timeout=180)
            assert sorted(name for name, spec in client.spec.inputs.items() if spec.dtype == "uint8") == \
                [f"camera_{i}" for i in range(cameras)]
            obs = frames(cameras, batch=3, seed=cameras)
            action = client.act(obs, seed=5)
            assert action.shape == (3, 8, 2)
            np.testing.assert_allclose(action, expected_actions(path, obs, 5), **TOLERANCE)
            one = client.act(single(obs), seed=6)
            assert one.shape == (8, 2)
            np.testing.assert_allclose(one, expected_actions(path, {k: v[:1] for k, v in obs.items()}, 6)[0],
                                       **TOLERANCE)
    assert served.returncode == 0
    assert f"{cameras} camera" in served.log and "dpa serve: stopped" in served.log, served.log


def test_bad_frames_get_4xx_naming_the_input(two_cameras):
    policy = load_policy(PolicySource("checkpoint", str(two_cameras), device="cpu"), max_rows=4)
    good = frames(2, batch=2)
    with ServerThread(policy, port=0) as server:
        for change, status, text in [
            ({"camera_1": good["camera_1"].astype(np.float32) / 255}, 413,
             "observations take (camera inputs ['camera_0', 'camera_1'] are uint8 frames"),
            ({"camera_1": good["camera_1"][:, 0].astype(np.int16)}, 400,
             "input 'camera_1' must be uint8, got int16 (a camera input: uint8 frames"),
            ({"camera_0": good["camera_0"][:, :, :, :16]}, 400,
             "input 'camera_0' must be [2, 3, 32, 40] (one observation) or [n, 2, 3, 32, 40], got [2, 2, 3, 16, 40]"),
            ({"camera_0": np.moveaxis(good["camera_0"], 2, -1).copy()}, 400, "input 'camera_0' must be [2, 3, 32, 40]"),
            ({"camera_1": None}, 400, "missing ['camera_1']"),
            ({"camera_2": good["camera_1"]}, 400, "unexpected ['camera_2']"),
            ({"camera_1": good["camera_1"][:1]}, 400, "every input needs the same leading dimension"),
            ({"robot_eef_pose": np.full((2, 2, 2), np.nan, np.float32)}, 422, "input 'robot_eef_pose' has NaN"),
        ]:
            obs = {k: v for k, v in {**good, **change}.items() if v is not None}
            code, payload = raw_post(server.url, protocol.encode_request(obs))
            assert (code, text in payload["error"]) == (status, True), (change.keys(), payload)
        # The client refuses float frames before sending them (a cast to uint8 would zero them).
        with PolicyClient(server.url, timeout=60) as client:
            with pytest.raises(ValueError, match=r"observation\['camera_0'\] is a camera input: send uint8"):
                client.act({**good, "camera_0": good["camera_0"] / 255.0})
            with pytest.raises(RequestRejected, match="input 'camera_0' must be"):
                client.act({**good, "camera_0": good["camera_0"][..., :20]})
            assert client.act(good, seed=1).shape == (2, 8, 2)


def test_foreign_encoder_is_served_from_features(tmp_path, capfd):
    """An image checkpoint whose encoder cannot be rebuilt (here a stand-in without rgb_model)
    is served from encoder features, and says why."""
    from tests.adapters.test_checkpoint import make_checkpoint

    path, *_ = make_checkpoint(tmp_path, policy="image", scheduler="ddpm", steps=2)
    policy = load_policy(PolicySource("checkpoint", str(path), device="cpu"), max_rows=2)
    assert list(policy.inputs) == ["global_cond"] and "rgb_model" in policy.spec.info["features_only"]
    assert "served from encoder features, not camera frames" in capfd.readouterr().err


@pytest.mark.gpu
def test_frames_served_on_cuda_in_one_graph(two_cameras):
    policy = load_policy(PolicySource("checkpoint", str(two_cameras), device="cuda"), max_rows=4)
    policy.warm_up(log=lambda message: None)
    assert policy.predict.refused is None  # frames to floats, encoder and loop captured
    obs = frames(2, batch=3, seed=4)
    request = protocol.ActRequest(obs, 3, False, seed=8)
    action = policy.act([request])[0][0]
    np.testing.assert_allclose(action, expected_actions(two_cameras, obs, 8, device="cuda"), rtol=1e-3, atol=1e-3)
