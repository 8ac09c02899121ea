"""JPEG camera frames: a camera input sent as JPEG (per input, beside raw ones) gives the actions
of the raw frames it decodes to, over a real server on 127.0.0.1; a corrupt JPEG, one of the
wrong size, JPEG for a non-camera input or lengths that do not add up get a 400 naming the
input. Small frames, 3 denoising steps; every wait bounded."""
import json

import numpy as np
import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("safetensors")
pytest.importorskip("omegaconf")
torch = pytest.importorskip("torch")
io = pytest.importorskip("torchvision.io")

from diffusion_policy_accelerated.serving import protocol  # noqa: E402
from diffusion_policy_accelerated.serving.client import PolicyClient, RequestRejected  # noqa: E402
from diffusion_policy_accelerated.serving.jpeg import encode_jpeg_frames  # noqa: E402
from diffusion_policy_accelerated.serving.policies import PolicySource, load_policy  # noqa: E402
from diffusion_policy_accelerated.serving.server import ServerThread  # noqa: E402

from tests.serving.test_serving import raw_post  # noqa: E402
from tests.support.dp_image_checkpoint import CAMERA_SHAPE, frames, make_image_checkpoint  # noqa: E402

STEPS = 3


def camera_frames(batch, seed):
    """frames(2, ...) with smooth frames (gradients and a square, as a camera's frames compress;
    JPEG of noise can be larger than the frames)."""
    obs = frames(2, batch=batch, seed=seed)
    rng = np.random.default_rng(seed)
    h, w = CAMERA_SHAPE[1:]
    ramp = np.linspace(0, 1, h)[:, None] * np.linspace(0, 1, w)[None]
    for name in ("camera_0", "camera_1"):
        for index in np.ndindex(batch, 2):
            colour = rng.uniform(40, 200, (3, 1, 1))
            frame = colour * (0.5 + ramp)
            y, x = rng.integers(0, h - 10), rng.integers(0, w - 10)
            frame[:, y:y + 10, x:x + 10] = 255 - colour
            obs[name][index] = np.clip(frame, 0, 255).astype(np.uint8)
    return obs


def decoded(files):
    """The raw frames JPEG files (nested lists of bytes) decode to, as the server decodes them."""
    if isinstance(files, bytes):
        return io.decode_jpeg(torch.frombuffer(bytearray(files), dtype=torch.uint8)).numpy()
    return np.stack([decoded(f) for f in files])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path, *_ = make_image_checkpoint(tmp_path_factory.mktemp("jpeg"), cameras=2, steps=STEPS)
    policy = load_policy(PolicySource("checkpoint", str(path), device="cpu"), max_rows=4)
    with ServerThread(policy, port=0) as running:
        yield running


def test_jpeg_frames_act_as_the_frames_they_decode_to(server):
    obs = camera_frames(3, seed=2)
    with PolicyClient(server.url, timeout=60) as client:
        assert client.spec.inputs["camera_0"].shape == (2,) + CAMERA_SHAPE
        action = client.act(obs, seed=3, jpeg_quality=90)
        assert action.shape == (3, 8, 2)
        files = {name: encode_jpeg_frames(obs[name], 90, name) for name in ("camera_0", "camera_1")}
        raw = {**obs, **{name: decoded(f) for name, f in files.items()}}
        assert raw["camera_0"].shape == obs["camera_0"].shape and not np.array_equal(raw["camera_0"], obs["camera_0"])
        np.testing.assert_allclose(action, client.act(raw, seed=3), rtol=1e-5, atol=1e-5)
        # One camera as JPEG, the other raw; a single observation.
        one = client.act({k: v[0] for k, v in obs.items()}, seed=4, jpeg_quality={"camera_1": 75})
        files = encode_jpeg_frames(obs["camera_1"][0], 75, "camera_1")
        expected = client.act({**{k: v[0] for k, v in obs.items()}, "camera_1": decoded(files)}, seed=4)
        np.testing.assert_allclose(one, expected, rtol=1e-5, atol=1e-5)
        # JPEG is smaller on the wire than the frames (smooth frames: those of a camera).
        assert sum(len(f) for f in files) < obs["camera_1"][0].nbytes
        with pytest.raises(ValueError, match=r"jpeg_quality names \['robot_eef_pose'\], which are not camera"):
            client.act(obs, jpeg_quality={"robot_eef_pose": 90})
        with pytest.raises(ValueError, match="jpeg_quality for 'camera_0' must be an integer in"):
            client.act(obs, jpeg_quality=0)


def test_bad_jpeg_gets_400_naming_the_input(server):
    obs = camera_frames(2, seed=5)
    files = encode_jpeg_frames(obs["camera_0"], 90, "camera_0")
    # A header that declares 12000 x 12000 pixels: refused before decoding (gigabytes decoded).
    bomb = bytearray(files[1][1])
    sof = next(i for i in range(2, len(bomb) - 1) if bomb[i] == 0xFF and bomb[i + 1] in (0xC0, 0xC2))
    bomb[sof + 5:sof + 9] = (12000).to_bytes(2, "big") * 2
    small = encode_jpeg_frames(obs["camera_0"][..., :16, :], 90, "camera_0")
    rest = {k: v for k, v in obs.items() if k != "camera_0"}
    for jpeg, inputs, text in [
        ({"camera_0": [files[0], [files[1][0], b"not a jpeg at all"]]}, rest,
         "input 'camera_0' frame [1, 1] is not a JPEG file"),
        ({"camera_0": [files[0], [files[1][0], files[1][1][:200] + b"\xff\xd9"]]}, rest,
         "input 'camera_0' frame [1, 1] is not a decodable JPEG"),
        ({"camera_0": [files[0], [files[1][0], bytes(bomb)]]}, rest,
         "input 'camera_0' frame [1, 1]'s header declares [3, 12000, 12000], not the [3, 32, 40]"),
        ({"camera_0": small}, rest, "input 'camera_0' frame [0, 0]'s header declares [3, 16, 40], not the [3, 32, 40]"),
        ({"camera_0": files[0]}, rest, "every input needs the same leading dimension"),
        ({"camera_0": files, "robot_eef_pose": files}, {"camera_1": obs["camera_1"]},
         "input 'robot_eef_pose' is sent as JPEG, but only camera inputs"),
        ({"camera_0": [files[0] + [files[1][0]]]}, rest, "input 'camera_0': metadata 'jpeg' must give"),
    ]:
        code, payload = raw_post(server.url, protocol.encode_request(inputs, jpeg=jpeg))
        assert (code, text in payload["error"]) == (400, True), (text, payload)
    # Lengths that do not add up to the tensor.
    body = protocol.encode_tensors({**rest, "camera_0": np.zeros(100, np.uint8)},
                                   {"jpeg": json.dumps({"camera_0": [[50, 40], [5, 4]]})})
    code, payload = raw_post(server.url, body)
    assert code == 400 and "input 'camera_0' is sent as JPEG: its tensor must be the 4 files end to end" in \
        payload["error"], payload
    # Lengths whose int64 sum wraps to the tensor's size, lengths that are not plain ints, and
    # metadata nested deeper than JSON parsing goes: 400, not a crash or a 500 (which clients retry).
    for jpeg in ({"camera_0": [[2 ** 62, 2 ** 62], [2 ** 62, 2 ** 62 + 4]]}, {"camera_0": [[True, "3"], [1, 1]]},
                 {"camera_0": [[2.5, 1], [1, 1]]}):
        body = protocol.encode_tensors({**rest, "camera_0": np.zeros(4, np.uint8)}, {"jpeg": json.dumps(jpeg)})
        code, payload = raw_post(server.url, body)
        assert code == 400 and "input 'camera_0': metadata 'jpeg' must give a positive byte length" in \
            payload["error"], (jpeg, payload)
    body = protocol.encode_tensors({**rest, "camera_0": np.zeros(4, np.uint8)}, {"jpeg": "[" * 5000})
    code, payload = raw_post(server.url, body)
    assert code == 400 and "metadata 'jpeg' must be a JSON object" in payload["error"], payload
    with PolicyClient(server.url, timeout=60) as client:
        with pytest.raises(RequestRejected, match="input 'camera_0' frame .*'s header declares"):
            client.act({**obs, "camera_0": obs["camera_0"][..., :20]}, jpeg_quality=90)
        assert client.act(obs, seed=1, jpeg_quality=50).shape == (2, 8, 2)
