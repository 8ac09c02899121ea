"""`dpa serve` of a Diffusion Policy hybrid image checkpoint (robomimic encoder) from camera
frames, 1 camera: the spec declares the camera as uint8 [n_obs_steps, C, H, W], and a real
client over 127.0.0.1 gets the checkpoint's own predict_action on the same noise."""
import warnings

import numpy as np
import pytest
import torch

pytest.importorskip("aiohttp")
pytest.importorskip("safetensors")
pytest.importorskip("omegaconf")
pytest.importorskip("torchvision")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("robomimic.models.obs_nets")  # pip install --no-deps robomimic==0.3.0 termcolor

from diffusion_policy_accelerated import load_checkpoint  # noqa: E402
from diffusion_policy_accelerated.serving.client import PolicyClient  # noqa: E402
from diffusion_policy_accelerated.serving.policies import PolicySource, load_policy  # noqa: E402
from diffusion_policy_accelerated.serving.server import ServerThread  # noqa: E402

from tests.support.dp_hybrid_checkpoint import CAMERA_SHAPE, hybrid_frames, make_hybrid_checkpoint  # noqa: E402
from tests.support.dp_image_checkpoint import as_float_obs  # noqa: E402

STEPS = 3


def test_hybrid_checkpoint_served_from_frames(tmp_path):
    path, cfg, *_ = make_hybrid_checkpoint(tmp_path, cameras=1, steps=STEPS)
    policy = load_policy(PolicySource("checkpoint", str(path), device="cpu"), max_rows=4)
    spec = policy.spec.to_json()
    assert spec["inputs"] == {"gripper_qpos": {"shape": [2, 2], "dtype": "float32"},
                              "robot_eef_pos": {"shape": [2, 3], "dtype": "float32"},
                              "view_1_image": {"shape": [2, *CAMERA_SHAPE], "dtype": "uint8"}}
    assert spec["cameras"] == ["view_1_image"] and "features_only" not in spec
    obs = hybrid_frames(cfg["shape_meta"], batch=3, seed=1)
    noise = torch.randn((STEPS + 1, 3, 16, 2), generator=torch.Generator().manual_seed(5))
    want = load_checkpoint(path, device="cpu").predict_action(as_float_obs(obs), noise=noise)["action"].numpy()
    with ServerThread(policy, port=0) as server, PolicyClient(server.url, timeout=60) as client:
        action = client.act(obs, seed=5)
        assert action.shape == (3, 8, 2)
        np.testing.assert_allclose(action, want, rtol=1e-4, atol=1e-4)
        assert client.act({k: v[0] for k, v in obs.items()}, seed=6).shape == (8, 2)
