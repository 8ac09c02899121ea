"""`dpa serve --lerobot` of a LeRobot DiffusionPolicy with cameras, from camera frames: the spec
declares each camera as uint8 [n_obs_steps, C, H, W] and the state as float32, the server runs
LeRobot's preprocessor, its generate_actions (accelerated) and its postprocessor, and the
actions equal stock LeRobot's on the same observations and initial noise (DDIM, whose steps add
no noise). Bad frames get a 4xx naming the input; without LeRobot the folder is refused at
start-up, saying how to install it. Small frames, 3 DDIM steps; every wait bounded."""
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("aiohttp")
pytest.importorskip("safetensors")
modeling = pytest.importorskip("lerobot.policies.diffusion.modeling_diffusion",
                               reason="LeRobot is not installed (requirements-lerobot.txt)")

from diffusion_policy_accelerated.serving import lerobot_policy, protocol  # noqa: E402
from diffusion_policy_accelerated.serving.client import PolicyClient, RequestRejected  # noqa: E402
from diffusion_policy_accelerated.serving.policies import PolicySource, load_policy  # noqa: E402
from diffusion_policy_accelerated.serving.server import ServerThread  # noqa: E402

from tests.serving.test_serving import raw_post  # noqa: E402
from tests.support.lerobot_folder import ACTION_DIM, FRAME, HORIZON, STEPS, TO, camera_names, make_folder  # noqa: E402
from tests.support.serve_process import dpa_serve  # noqa: E402

TOLERANCE = dict(rtol=1e-4, atol=1e-4)


def observations(cameras, batch, env_state=False, seed=1):
    """Frames of noise with a bright square somewhere (spatial softmax sees where; plain noise
    gives a random encoder nearly the same keypoints whatever the frame)."""
    rng = np.random.default_rng(seed)
    obs = {}
    for name in camera_names(cameras):
        frames = rng.integers(0, 64, (batch, TO) + FRAME, dtype=np.uint8)
        for index in np.ndindex(batch, TO):
            y, x = rng.integers(0, FRAME[1] - 24), rng.integers(0, FRAME[2] - 24)
            frames[index][:, y:y + 24, x:x + 24] = rng.integers(192, 256, (3, 1, 1), dtype=np.uint8)
        obs[name] = frames
    obs["observation.state"] = rng.normal(size=(batch, TO, 2)).astype(np.float32)
    if env_state:
        obs["observation.environment_state"] = rng.normal(size=(batch, TO, 3)).astype(np.float32)
    return obs


def expected_actions(folder, obs, seed, accelerated=False, device="cpu"):
    """Stock LeRobot: its preprocessor, generate_actions on the initial noise the server draws
    for `seed` (DDIM: the steps add none), its postprocessor."""
    lerobot = lerobot_policy.import_lerobot()
    rows = next(iter(obs.values())).shape[0]
    noise = torch.randn((STEPS + 1, rows, HORIZON, ACTION_DIM), generator=torch.Generator().manual_seed(seed))
    config = lerobot.PreTrainedConfig.from_pretrained(str(folder))
    config.device = device
    policy = modeling.DiffusionPolicy.from_pretrained(str(folder), config=config).eval()
    if accelerated:
        import diffusion_policy_accelerated as dpa

        dpa.accelerate(policy)
    pre, post = lerobot_policy.load_processors(lerobot, folder, torch.device(device))
    cameras = list(config.image_features)
    with torch.no_grad():
        batch = pre({k: torch.from_numpy(v).float() / 255 if k in cameras else torch.from_numpy(v)
                     for k, v in obs.items()})
        batch = {k: v for k, v in batch.items() if k in ("observation.state", "observation.environment_state")} | {
            "observation.images": torch.stack([batch[k] for k in cameras], dim=-4)}
        return post(policy.diffusion.generate_actions(batch, noise=noise[0].to(device))).numpy()


def single(obs):
    return {k: v[0] for k, v in obs.items()}


@pytest.fixture(scope="module")
def two_cameras(tmp_path_factory):
    return make_folder(tmp_path_factory.mktemp("lerobot2"), cameras=2, env_state=True)


def test_spec_declares_cameras_and_unnormalised_actions(two_cameras):
    policy = load_policy(PolicySource("lerobot", str(two_cameras), device="cpu"), max_rows=4)
    spec = policy.spec.to_json()
    assert spec["inputs"] == {"observation.images.cam_0": {"shape": [TO, *FRAME], "dtype": "uint8"},
                              "observation.images.cam_1": {"shape": [TO, *FRAME], "dtype": "uint8"},
                              "observation.state": {"shape": [TO, 2], "dtype": "float32"},
                              "observation.environment_state": {"shape": [TO, 3], "dtype": "float32"}}
    assert spec["action"] == {"shape": [8, ACTION_DIM], "dtype": "float32"}
    assert spec["normalised"] is False and spec["actions"].startswith("unnormalised")
    assert spec["cameras"] == camera_names(2) and spec["steps"] == STEPS and spec["scheduler"] == "ddim"
    # Served in-process too: the same actions as stock LeRobot, and as LeRobot accelerated.
    obs = observations(2, 3, env_state=True, seed=2)
    action = policy.act([protocol.ActRequest(obs, 3, False, seed=4)])[0][0]
    np.testing.assert_allclose(action, expected_actions(two_cameras, obs, 4), **TOLERANCE)
    np.testing.assert_allclose(action, expected_actions(two_cameras, obs, 4, accelerated=True), **TOLERANCE)


@pytest.mark.parametrize("cameras", [1, 2])
def test_dpa_serve_process_serves_lerobot_frames(cameras, tmp_path):
    """`dpa serve --lerobot` of a 1- and a 2-camera policy: a batch of 3 observations and a
    single one, seeded, equal stock LeRobot's actions on the same initial noise."""
    folder = make_folder(tmp_path, cameras=cameras)
    with dpa_serve("--device", "cpu", "--lerobot", str(folder), "--max-batch", "4") as served:
        with PolicyClient(served.url, timeout=60) as client:
            client.wait_ready(timeout=180)
            assert [name for name, spec in client.spec.inputs.items() if spec.dtype == "uint8"] == \
                camera_names(cameras)
            obs = observations(cameras, 3, seed=cameras)
            action = client.act(obs, seed=5)
            assert action.shape == (3, 8, ACTION_DIM)
            np.testing.assert_allclose(action, expected_actions(folder, obs, 5), **TOLERANCE)
            one = client.act(single(obs), seed=6)
            assert one.shape == (8, ACTION_DIM)
            np.testing.assert_allclose(one, expected_actions(folder, {k: v[:1] for k, v in obs.items()}, 6)[0],
                                       **TOLERANCE)
    assert served.returncode == 0
    log = served.log
    assert "served from camera frames" in log and f"{cameras} camera" in log and "dpa serve: stopped" in log, log


def test_bad_lerobot_frames_get_4xx_naming_the_input(two_cameras):
    policy = load_policy(PolicySource("lerobot", str(two_cameras), device="cpu"), max_rows=4)
    good = observations(2, 2, env_state=True)
    cam0, cam1 = camera_names(2)
    with ServerThread(policy, port=0) as server:
        for change, status, text in [
            ({cam1: good[cam1][:, 0].astype(np.int16)}, 400, f"input '{cam1}' must be uint8, got int16"),
            ({cam0: good[cam0][..., :16]}, 400, f"input '{cam0}' must be [2, 3, 96, 96] (one observation)"),
            ({cam0: np.moveaxis(good[cam0], 2, -1).copy()}, 400, f"input '{cam0}' must be [2, 3, 96, 96]"),
            ({cam1: None}, 400, f"missing ['{cam1}']"),
            ({"observation.images.cam_2": good[cam1]}, 400, "unexpected ['observation.images.cam_2']"),
            ({"observation.state": good["observation.state"][:, :1]}, 400, "input 'observation.state' must be [2, 2]"),
        ]:
            obs = {k: v for k, v in {**good, **change}.items() if v is not None}
            code, payload = raw_post(server.url, protocol.encode_request(obs))
            assert (code, text in payload["error"]) == (status, True), (change.keys(), payload)
        with PolicyClient(server.url, timeout=60) as client:
            with pytest.raises(ValueError, match=rf"observation\['{cam0}'\] is a camera input: send uint8"):
                client.act({**good, cam0: good[cam0] / 255.0})
            with pytest.raises(RequestRejected, match=f"input '{cam1}' must be"):
                client.act({**good, cam1: good[cam1][..., :20]})
            assert client.act(good, seed=1).shape == (2, 8, ACTION_DIM)


def hide_lerobot(monkeypatch):
    for name in [name for name in sys.modules if name == "lerobot" or name.startswith("lerobot.")]:
        monkeypatch.setitem(sys.modules, name, None)


def test_without_lerobot_cameras_are_refused_or_served_as_global_cond(two_cameras, monkeypatch, capfd):
    hide_lerobot(monkeypatch)
    with pytest.raises(lerobot_policy.LeRobotMissing, match="pip install --no-deps lerobot==0.4.4 && pip install "
                                                            "-r requirements-lerobot.txt"):
        load_policy(PolicySource("lerobot", str(two_cameras), device="cpu"), max_rows=2)
    # Asked for: LeRobot's normalised global condition, as for a folder without cameras.
    policy = load_policy(PolicySource("lerobot", str(two_cameras), device="cpu", lerobot_global_cond=True), max_rows=2)
    assert list(policy.inputs) == ["global_cond"] and policy.spec.info["cameras_not_served"] == camera_names(2)
    assert policy.spec.info["normalised"] is True
    assert "--lerobot-global-cond" in capfd.readouterr().err


def test_dpa_serve_without_lerobot_fails_at_start_up(two_cameras):
    code = ("import sys; sys.modules['lerobot'] = None; from diffusion_policy_accelerated.cli import main; "
            f"sys.exit(main(['serve', '--device', 'cpu', '--port', '0', '--lerobot', {str(two_cameras)!r}]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "dpa serve: serving a LeRobot policy with cameras from camera frames needs LeRobot" in done.stderr
    assert "pip install --no-deps lerobot==0.4.4" in done.stderr and "Traceback" not in done.stderr


def test_folder_without_processors_is_refused(tmp_path):
    folder = make_folder(tmp_path / "f", cameras=1)
    (folder / "policy_preprocessor.json").unlink()
    with pytest.raises(FileNotFoundError, match="has no policy_preprocessor.json: LeRobot 0.4 saves"):
        load_policy(PolicySource("lerobot", str(folder), device="cpu"), max_rows=2)
    with pytest.raises(ValueError, match="lerobot_global_cond is for a 'lerobot' source"):
        PolicySource("demo", lerobot_global_cond=True)


@pytest.mark.gpu
def test_lerobot_frames_served_on_cuda_in_one_graph(two_cameras):
    policy = load_policy(PolicySource("lerobot", str(two_cameras), device="cuda"), max_rows=4)
    policy.warm_up(log=lambda message: None)
    assert policy.predict.graphed.refused is None  # the encoders and the loop captured
    obs = observations(2, 3, env_state=True, seed=4)
    action = policy.act([protocol.ActRequest(obs, 3, False, seed=8)])[0][0]
    np.testing.assert_allclose(action, expected_actions(two_cameras, obs, 8, device="cuda"), rtol=1e-3, atol=1e-3)
