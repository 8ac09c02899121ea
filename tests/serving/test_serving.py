"""`dpa serve`: the protocol's validation, the served policies, and a real server with real
clients over 127.0.0.1 (batching, ordering, malformed requests, disconnects, backpressure,
shutdown, the `dpa serve` process). Every server here is bounded: small policies, a few dozen
requests, timeouts on every wait."""
import concurrent.futures
import http.client
import json
import socket
import time

import numpy as np
import pytest
import torch

pytest.importorskip("aiohttp")
pytest.importorskip("safetensors")

from diffusion_policy_accelerated.serving import protocol  # noqa: E402
from diffusion_policy_accelerated.serving.client import PolicyClient, RequestRejected, ServerUnavailable  # noqa: E402
from diffusion_policy_accelerated.serving.policies import (  # noqa: E402
    PolicySource, ServedPolicy, batch_buckets, load_policy)
from diffusion_policy_accelerated.serving.protocol import ActRequest, RequestError, TensorSpec  # noqa: E402
from diffusion_policy_accelerated.serving.server import ServerThread  # noqa: E402

from tests.support import DEVICES  # noqa: E402
from tests.support.serve_process import dpa_serve  # noqa: E402

# Actions of a row computed in batches of different sizes: the same math, summed in other
# orders by the batch's kernels (fp32).
TOLERANCE = dict(rtol=1e-4, atol=1e-4)
COND = 40  # the demo U-Net's global_cond width


@pytest.fixture(scope="module")
def demo_policy():
    """The demo's U-Net on the CPU, DDIM 2 steps, batches of up to 8."""
    return load_policy(PolicySource(device="cpu", scheduler="ddim", steps=2), max_rows=8)


def observation(rows=None, seed=0):
    g = np.random.default_rng(seed)
    return {"global_cond": g.standard_normal((COND,) if rows is None else (rows, COND)).astype(np.float32)}


def slow_policy(demo_policy, seconds):
    """The demo policy, each batch taking at least `seconds`: time for requests to queue."""
    def predict(inputs, noise):
        time.sleep(seconds)
        return demo_policy.predict(inputs, noise)
    return ServedPolicy(name="slow demo", inputs=demo_policy.inputs, action_shape=demo_policy.spec.action.shape,
                        trajectory_shape=demo_policy.trajectory_shape, num_steps=demo_policy.num_steps,
                        device="cpu", predict=predict, max_rows=demo_policy.max_rows)


def raw_post(url, body, path="/v1/act", headers=None):
    """(status, parsed JSON or bytes) of one POST without the client's retries."""
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        connection.request("POST", path, body=body, headers=headers or {})
        response = connection.getresponse()
        payload = response.read()
        kind = response.getheader("Content-Type", "")
        return response.status, json.loads(payload) if kind.startswith("application/json") else payload
    finally:
        connection.close()


# --------------------------------------------------------------------------------------
# The protocol, without a server.
# --------------------------------------------------------------------------------------

SPEC = protocol.PolicySpec({"obs": TensorSpec((2, 3)), "goal": TensorSpec((4,))}, TensorSpec((8, 2)), max_rows=4)


def body_of(tensors, metadata=None):
    return protocol.encode_tensors(tensors, metadata)


def good(rows=None):
    lead = () if rows is None else (rows,)
    return {"obs": np.ones(lead + (2, 3), np.float32), "goal": np.zeros(lead + (4,), np.float32)}


@pytest.mark.parametrize("body,status,text", [
    (b"", 400, "the body is not a safetensors file"),
    (b"\x00" * 7, 400, "the body is not a safetensors file"),
    (b"not a tensor file at all", 400, "the body is not a safetensors file"),
    (body_of(good())[:-5], 400, "the body is not a safetensors file"),
    (b"x" * (SPEC.max_request_bytes + 1), 413, "more than the"),
    (body_of({"obs": good()["obs"]}), 400, "missing ['goal']"),
    (body_of({**good(), "extra": np.zeros(1, np.float32)}), 400, "unexpected ['extra']"),
    (body_of({**good(), "goal": np.zeros(4, np.float64)}), 400, "input 'goal' must be float32, got float64"),
    (body_of({**good(), "obs": np.ones((2, 3), np.int32)}), 400, "input 'obs' must be float32, got int32"),
    (body_of({**good(), "obs": np.ones((3, 2), np.float32)}), 400, "input 'obs' must be [2, 3] (one observation) or [n, 2, 3]"),
    (body_of({**good(), "obs": np.ones((1, 1, 2, 3), np.float32)}), 400, "input 'obs' must be [2, 3]"),
    (body_of({**good(2), "goal": np.zeros((3, 4), np.float32)}), 400, "every input needs the same leading dimension"),
    (body_of({**good(), "goal": np.zeros((1, 4), np.float32)}), 400, "every input needs the same leading dimension"),
    (body_of({**good(), "obs": np.full((2, 3), np.nan, np.float32)}), 422, "input 'obs' has NaN or infinite values: no"),
    (body_of({**good(), "goal": np.array([0, np.inf, 0, 0], np.float32)}), 422, "input 'goal' has NaN or infinite"),
    (body_of({**good(3), "goal": np.array([[0] * 4, [-np.inf] * 4, [np.nan] * 4], np.float32)}), 422,
     "input 'goal' has NaN or infinite values (rows [1, 2] of 3)"),
    (body_of(good(5)), 400, "a request holds 1 to 4 observations, got 5"),
    (body_of(good(0)), 400, "a request holds 1 to 4 observations, got 0"),
    (body_of(good(), {"seed": "x"}), 400, "metadata 'seed' must be an integer in [0, 2**63), got 'x'"),
    (body_of(good(), {"seed": "-1"}), 400, "metadata 'seed' must be an integer"),
    (body_of(good(), {"seed": str(2 ** 63)}), 400, "metadata 'seed' must be an integer"),
    (body_of(good(), {"sed": "1"}), 400, "unknown metadata ['sed']"),
])
def test_malformed_requests_are_named(body, status, text):
    with pytest.raises(RequestError) as caught:
        protocol.parse_act_request(body, SPEC)
    assert caught.value.status == status
    assert text in caught.value.message


IMAGE_SPEC = protocol.PolicySpec({"camera_0": TensorSpec((2, 3, 16, 20), "uint8"), "pose": TensorSpec((2, 2))},
                                 TensorSpec((8, 2)), max_rows=2)


def frames(rows=None, **change):
    lead = () if rows is None else (rows,)
    good = {"camera_0": np.zeros(lead + (2, 3, 16, 20), np.uint8), "pose": np.zeros(lead + (2, 2), np.float32)}
    return {k: v for k, v in {**good, **change}.items() if v is not None}


@pytest.mark.parametrize("body,status,text", [
    (body_of(frames(camera_0=np.zeros((2, 3, 16, 20), np.float32))), 400,
     "input 'camera_0' must be uint8, got float32 (a camera input: uint8 frames, 0-255, [n_obs_steps, C, H, W]"),
    (body_of(frames(camera_0=np.zeros((2, 3, 20, 16), np.uint8))), 400,
     "input 'camera_0' must be [2, 3, 16, 20] (one observation) or [n, 2, 3, 16, 20], got [2, 3, 20, 16] (a camera input"),
    (body_of(frames(camera_0=np.zeros((2, 16, 20, 3), np.uint8))), 400, "input 'camera_0' must be [2, 3, 16, 20]"),
    (body_of(frames(camera_0=np.zeros((1, 3, 16, 20), np.uint8))), 400, "input 'camera_0' must be [2, 3, 16, 20]"),
    (body_of(frames(camera_0=None)), 400, "missing ['camera_0']"),
    (body_of(frames(camera_1=np.zeros((2, 3, 16, 20), np.uint8))), 400, "unexpected ['camera_1']"),
    (body_of(frames(camera_0=np.zeros((2, 2, 3, 16, 20), np.float32))), 413,
     "(camera inputs ['camera_0'] are uint8 frames, 0-255, 1 byte per value: float frames are 4 times larger)"),
])
def test_malformed_frames_are_named(body, status, text):
    with pytest.raises(RequestError) as caught:
        protocol.parse_act_request(body, IMAGE_SPEC)
    assert (caught.value.status, text in caught.value.message) == (status, True), caught.value.message


@pytest.mark.parametrize("rows", [None, 1, 3, 4])
def test_well_formed_requests(rows):
    request = protocol.parse_act_request(body_of(good(rows), {"seed": "7"}), SPEC)
    assert (request.rows, request.single, request.seed) == (rows or 1, rows is None, 7)
    assert request.inputs["obs"].shape == (rows or 1, 2, 3) and request.inputs["goal"].shape == (rows or 1, 4)


def test_spec_round_trip_and_action_encoding():
    assert protocol.PolicySpec.from_json(json.loads(json.dumps(SPEC.to_json()))) == SPEC
    action = np.arange(16, dtype=np.float32).reshape(8, 2)
    decoded, timings = protocol.decode_action(protocol.encode_action(action, {"queue_ms": 1.5, "bucket": 4}))
    np.testing.assert_array_equal(decoded, action)
    assert timings == {"queue_ms": 1.5, "bucket": 4.0}
    with pytest.raises(ValueError, match="the server speaks 'other/1'"):
        protocol.PolicySpec.from_json({**SPEC.to_json(), "protocol": "other/1"})


@pytest.mark.parametrize("max_rows,buckets", [(1, [1]), (8, [1, 2, 4, 8]), (12, [1, 2, 4, 8, 12]),
                                              (64, [1, 2, 4, 8, 16, 32, 64])])
def test_batch_buckets(max_rows, buckets):
    assert batch_buckets(max_rows) == buckets


@pytest.mark.parametrize("value", [0, -1, 2.0, True, None])
def test_bad_max_rows(value):
    with pytest.raises(ValueError, match="max_rows must be a positive integer"):
        batch_buckets(value)


@pytest.mark.parametrize("kwargs,text", [
    (dict(kind="onnx"), "kind must be 'demo', 'checkpoint' or 'lerobot'"),
    (dict(kind="checkpoint"), "path: a checkpoint source needs one"),
    (dict(path="x.ckpt"), "path: a demo source takes no path"),
    (dict(dtype="float64"), "dtype must be one of"),
    (dict(scheduler="pndm"), "scheduler must be 'ddpm' or 'ddim'"),
    (dict(steps=0), "steps must be a positive integer or None"),
])
def test_bad_policy_sources(kwargs, text):
    with pytest.raises(ValueError, match=__import__("re").escape(text)):
        PolicySource(**kwargs)


# --------------------------------------------------------------------------------------
# Served policies: a row's action does not depend on the batch it lands in.
# --------------------------------------------------------------------------------------

def act_request(obs, seed=None):
    """The ActRequest the server makes of the demo policy's `obs`."""
    cond = obs["global_cond"]
    return ActRequest({"global_cond": cond.reshape(-1, COND)}, 1 if cond.ndim == 1 else cond.shape[0], cond.ndim == 1,
                      seed)


def act_one(policy, obs, seed):
    return policy.act([act_request(obs, seed)])[0][0]


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_rows_equal_whatever_the_batch(device):
    policy = load_policy(PolicySource(device=device, scheduler="ddpm", steps=3), max_rows=8)
    requests = [act_request(observation(rows, seed=i), 100 + i) for i, rows in enumerate([None, 3, None, 2, 4, None])]
    actions, timings = policy.act(requests)  # 12 rows: a batch of 7 then one of 5, both padded to 8
    assert timings["batch_rows"] == 12 and timings["bucket"] == 8
    for request, action in zip(requests, actions):
        assert action.shape == ((16, 2) if request.single else (request.rows, 16, 2))
        alone = policy.act([request])[0][0]
        np.testing.assert_allclose(action, alone, **TOLERANCE)
    # Unseeded rows get noise of their own.
    twice = policy.act([act_request({"global_cond": np.zeros((2, COND), np.float32)})])[0][0]
    assert not np.allclose(twice[0], twice[1])


def test_checkpoint_policy_serves_raw_observations(tmp_path):
    """A Diffusion Policy lowdim checkpoint: raw observations in, the checkpoint's own
    predict_action out (normaliser and action slicing included)."""
    from tests.adapters.test_checkpoint import OBS_DIM, make_checkpoint

    from diffusion_policy_accelerated import load_checkpoint

    path, *_ = make_checkpoint(tmp_path, scheduler="ddpm", steps=4)
    policy = load_policy(PolicySource("checkpoint", str(path), device="cpu"), max_rows=4)
    assert {k: v.shape for k, v in policy.inputs.items()} == {"obs": (2, OBS_DIM)}
    obs = np.random.default_rng(0).standard_normal((3, 2, OBS_DIM)).astype(np.float32)
    action = policy.act([ActRequest({"obs": obs}, 3, False, seed=5)])[0][0]
    noise = torch.randn((5, 3, 16, 2), generator=torch.Generator().manual_seed(5))
    expected = load_checkpoint(path, device="cpu").predict_action({"obs": torch.from_numpy(obs)}, noise=noise)
    np.testing.assert_allclose(action, expected["action"].numpy(), **TOLERANCE)


# --------------------------------------------------------------------------------------
# A real server and real clients over loopback.
# --------------------------------------------------------------------------------------

def test_concurrent_clients_are_batched_and_answered_in_order(demo_policy):
    """12 clients at once, 3 requests each, with seeds: each answer equals the same request
    computed alone, and some requests shared a batch."""
    with ServerThread(demo_policy, port=0, max_wait_ms=50) as server:
        def robot(i):
            with PolicyClient(server.url, timeout=30) as client:
                out = []
                for k in range(3):
                    obs = observation(None if i % 3 else 2, seed=10 * i + k)
                    out.append((obs, 10 * i + k, client.act(obs, seed=10 * i + k), client.last_timings["batch_rows"]))
                return out
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            answers = [a for result in pool.map(robot, range(12)) for a in result]
    assert max(rows for *_, rows in answers) > 1, "no two requests shared a batch"
    for obs, seed, action, _ in answers:
        alone = act_one(demo_policy, obs, seed)
        np.testing.assert_allclose(action, alone, **TOLERANCE)


MALFORMED = [
    (b"garbage", 400, "not a safetensors file"),
    (protocol.encode_tensors({"obs": np.zeros(COND, np.float32)}), 400, "missing ['global_cond']"),
    (protocol.encode_tensors({"global_cond": np.zeros(COND, np.float64)}), 400, "must be float32, got float64"),
    (protocol.encode_tensors({"global_cond": np.zeros(COND + 1, np.float32)}), 400, "must be [40] (one observation)"),
    (protocol.encode_tensors({"global_cond": np.full(COND, np.nan, np.float32)}), 422, "NaN or infinite"),
    (protocol.encode_tensors({"global_cond": np.zeros((9, COND), np.float32)}), 400, "1 to 8 observations, got 9"),
]


def test_malformed_requests_among_good_ones(demo_policy):
    """Malformed requests sent together with good ones get their own 4xx; the good ones in
    the same batch window are answered as usual, and the server goes on serving."""
    with ServerThread(demo_policy, port=0, max_wait_ms=100) as server:
        def send(i):
            if i % 2:
                body, status, text = MALFORMED[(i // 2) % len(MALFORMED)]
                got, payload = raw_post(server.url, body)
                return got == status and text in payload["error"]
            with PolicyClient(server.url, timeout=30) as client:
                obs = observation(seed=i)
                return np.allclose(client.act(obs, seed=i), act_one(demo_policy, obs, i), **TOLERANCE)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            assert all(pool.map(send, range(24)))
        status, payload = raw_post(server.url, b"x" * (demo_policy.spec.max_request_bytes + 1))
        assert status == 413 and "larger than" in payload["error"]
        assert raw_post(server.url, b"", path="/v1/nothing")[0] == 404
        with PolicyClient(server.url) as client:
            with pytest.raises(RequestRejected, match="must be float32, got float64") as caught:
                client._call("POST", "/v1/act", MALFORMED[2][0])
            assert caught.value.status == 400
            with pytest.raises(ValueError, match="inputs \\['obs'\\] the policy does not take"):
                client.act({"obs": np.zeros(3)})
            assert client.act(observation()).shape == (16, 2)
            status, health = client.health()
            assert status == 200 and health["status"] == "ok"
            spec = client.spec
            assert spec.inputs == {"global_cond": TensorSpec((COND,))} and spec.max_rows == 8
        metrics = raw_get(server.url, "/metrics")  # 12 malformed of the 24 (2 with NaN), and the client's float64
        assert 'dpa_requests_total{code="400"} 11' in metrics and 'dpa_requests_total{code="413"} 1' in metrics
        assert 'dpa_requests_total{code="422"} 2' in metrics


def raw_get(url, path):
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        connection.request("GET", path)
        return connection.getresponse().read().decode()
    finally:
        connection.close()


def test_clients_that_disconnect_are_dropped_alone(demo_policy):
    """A client that hangs up mid-upload, or after sending but before its batch runs, costs
    nothing and disturbs nobody."""
    with ServerThread(demo_policy, port=0, max_wait_ms=300) as server:
        host, port = server.url.removeprefix("http://").split(":")
        body = protocol.encode_request(observation())
        head = (f"POST /v1/act HTTP/1.1\r\nHost: {host}\r\nContent-Type: {protocol.CONTENT_TYPE}\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        with socket.create_connection((host, int(port))) as half:
            half.sendall(head + body[:len(body) // 2])
        with socket.create_connection((host, int(port))) as gone:
            gone.sendall(head + body)
        with PolicyClient(server.url, timeout=30) as client:
            obs = observation(seed=3)
            np.testing.assert_allclose(client.act(obs, seed=3), act_one(demo_policy, obs, 3), **TOLERANCE)
        time.sleep(0.5)
        assert "dpa_dropped_requests_total 1" in raw_get(server.url, "/metrics")


def test_backpressure_503_then_retries_succeed(demo_policy):
    """With one batch running and the queue full, a request is refused with 503 and
    Retry-After at once; the client's retries get it served once the queue drains."""
    with ServerThread(slow_policy(demo_policy, 0.4), port=0, max_wait_ms=0, max_queue_rows=8) as server:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            full = protocol.encode_request(observation(8))
            running = pool.submit(raw_post, server.url, full)
            time.sleep(0.15)  # the first batch is running; the queue is empty
            queued = pool.submit(raw_post, server.url, full)
            time.sleep(0.15)
            status, payload = raw_post(server.url, protocol.encode_request(observation()))
            assert status == 503 and "the queue is full (8 of 8 rows waiting)" in payload["error"]
            with PolicyClient(server.url, timeout=5, backoff=0.05) as client:
                assert client.act(observation()).shape == (16, 2)
                assert client.retries >= 1
            assert running.result(30)[0] == 200 and queued.result(30)[0] == 200


def test_shutdown_answers_every_queued_request(demo_policy):
    """Stopping the server while requests wait: each is answered (200), then new ones are
    refused, and a client gives up after its deadline with a clear error."""
    server = ServerThread(slow_policy(demo_policy, 0.3), port=0, max_wait_ms=0).__enter__()
    url = server.url
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        pending = [pool.submit(raw_post, url, protocol.encode_request(observation(seed=i))) for i in range(6)]
        time.sleep(0.2)
        server.close()
        assert [f.result(30)[0] for f in pending] == [200] * 6
    with PolicyClient(url, timeout=0.5, deadline=1.0) as client:
        with pytest.raises(ServerUnavailable, match="no answer within 1.0 s"):
            client.act(observation())


def test_shutdown_that_cannot_drain_answers_503(demo_policy):
    """A batch still running when the drain time is up, and the requests behind it, are
    answered 503 (safe to retry elsewhere) rather than left without an answer."""
    server = ServerThread(slow_policy(demo_policy, 1.5), port=0, max_wait_ms=0, max_queue_rows=8).__enter__()
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        running = pool.submit(raw_post, server.url, protocol.encode_request(observation(8)))
        time.sleep(0.3)
        queued = pool.submit(raw_post, server.url, protocol.encode_request(observation(seed=1)))
        time.sleep(0.2)
        server.close(drain_timeout=0.2)
        for future in (running, queued):
            status, payload = future.result(30)
            assert status == 503 and "the server stopped before this request" in payload["error"]


def test_a_failing_batch_fails_only_its_requests(demo_policy):
    """A batch whose computation raises answers its requests with 500; the next is served."""
    calls = []

    def predict(inputs, noise):
        calls.append(1)
        if len(calls) == 2:  # the first call is the warm-up
            raise RuntimeError("device lost")
        return demo_policy.predict(inputs, noise)
    flaky = ServedPolicy(name="flaky", inputs=demo_policy.inputs, action_shape=(16, 2), trajectory_shape=(16, 2),
                         num_steps=demo_policy.num_steps, device="cpu", predict=predict, max_rows=1)
    with ServerThread(flaky, port=0) as server:
        status, payload = raw_post(server.url, protocol.encode_request(observation()))
        assert status == 500 and "RuntimeError: device lost" in payload["error"]
        assert raw_post(server.url, protocol.encode_request(observation()))[0] == 200


def timed_policy(demo_policy, seconds, spans, seed=0):
    """The demo policy, each batch taking at least `seconds` and recording its (start, end)."""
    def predict(inputs, noise):
        start = time.monotonic()
        time.sleep(seconds)
        out = demo_policy.predict(inputs, noise)
        spans.append((start, time.monotonic()))
        return out
    return ServedPolicy(name="timed demo", inputs=demo_policy.inputs, action_shape=demo_policy.spec.action.shape,
                        trajectory_shape=demo_policy.trajectory_shape, num_steps=demo_policy.num_steps,
                        device="cpu", predict=predict, max_rows=demo_policy.max_rows, seed=seed)


@pytest.mark.parametrize("instances", [1, 2])
def test_instances_run_batches_side_by_side(demo_policy, instances):
    """A request that comes while a batch runs: with two instances its batch starts at once,
    beside the running one; with one it waits for the running batch to end. Either way every
    request gets its own seeded answer."""
    spans = []
    policies = [timed_policy(demo_policy, 0.6, spans, seed=i) for i in range(instances)]
    with ServerThread(policies, port=0, max_wait_ms=0) as server:
        spans.clear()  # the warm-up's
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(raw_post, server.url, protocol.encode_request(observation(seed=1), seed=1))
            time.sleep(0.2)  # the first batch is running
            second = pool.submit(raw_post, server.url, protocol.encode_request(observation(seed=2), seed=2))
            answers = [first.result(30), second.result(30)]
    for (status, body), seed in zip(answers, (1, 2)):
        assert status == 200
        action, _ = protocol.decode_action(body)
        np.testing.assert_allclose(action, act_one(demo_policy, observation(seed=seed), seed), **TOLERANCE)
    (start1, end1), (start2, end2) = sorted(spans)
    if instances == 2:
        assert start2 < end1, f"the second batch waited for the first: {spans}"
    else:
        assert start2 >= end1, f"one instance ran two batches at once: {spans}"


@pytest.mark.gpu
def test_cuda_instances_side_by_side():
    """Two CUDA instances (their own graphs and streams) acting at once from two threads, as
    the server's workers do, give each seeded request the action it gets alone."""
    source = PolicySource(device="cuda", scheduler="ddpm", steps=3)
    a, b = (load_policy(source, max_rows=8, seed=i) for i in (0, 1))
    a.warm_up(log=lambda message: None)
    b.warm_up(log=lambda message: None)
    requests = [[act_request(observation(rows, seed=10 * k + i), 10 * k + i) for i, rows in enumerate([3, None, 4])]
                for k in range(2)]
    alone = [[a.act([r])[0][0] for r in batch] for batch in requests]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        # Batches of 8 rows take the GEMM route (cuBLAS, with its workspace); 20 rounds, since
        # the race this guards against (graphs captured on one stream share that workspace)
        # showed in some runs only.
        for _ in range(20):
            together = list(pool.map(lambda pair: pair[0].act(pair[1])[0], zip((a, b), requests)))
            for got, expected in zip(together, alone):
                for action, single in zip(got, expected):
                    np.testing.assert_allclose(action, single, **TOLERANCE)


def test_instances_draw_noise_of_their_own(demo_policy):
    """Instances made with different seeds give unseeded rows different noise; the same
    seeded request gets the same action from either."""
    a, b = (load_policy(PolicySource(device="cpu", scheduler="ddpm", steps=2), max_rows=2, seed=i) for i in (0, 1))
    obs = observation()
    assert not np.allclose(a.act([act_request(obs)])[0][0], b.act([act_request(obs)])[0][0])
    np.testing.assert_allclose(a.act([act_request(obs, 9)])[0][0], b.act([act_request(obs, 9)])[0][0], **TOLERANCE)


def test_bad_instances(demo_policy):
    from diffusion_policy_accelerated.serving.batcher import Batcher

    other = load_policy(PolicySource(device="cpu", scheduler="ddim", steps=2), max_rows=4)
    for bad, error, text in [([], TypeError, "a non-empty sequence"), ([demo_policy, "x"], TypeError, "non-empty"),
                             ([demo_policy, demo_policy], ValueError, "the same instance is listed twice"),
                             ([demo_policy, other], ValueError, "the instances serve different specs")]:
        with pytest.raises(error, match=text):
            Batcher(bad)


def test_dpa_serve_process(tmp_path):
    """The `dpa serve` command with two instances: warms both up, serves, and exits 0 on
    SIGTERM."""
    with dpa_serve("--device", "cpu", "--scheduler", "ddim", "--steps", "2", "--max-batch", "4",
                   "--instances", "2") as served:
        with PolicyClient(served.url, timeout=30) as client:
            client.wait_ready(timeout=120)
            assert client.act(observation(3)).shape == (3, 16, 2)
    assert served.returncode == 0
    log = served.log
    assert "instance 2 of 2" in log and log.count("batch 4 ready (3/3") == 2 and "dpa serve: stopped" in log, log


def test_cli_usage(capsys):
    from diffusion_policy_accelerated.cli import main
    assert main([]) == 2 and main(["nonsense"]) == 2
    for bad in (["--checkpoint", "a.ckpt", "--lerobot", "folder"], ["--ray-replicas", "0"], ["--max-queue", "0"],
                ["--instances", "0"], ["--instances", "2", "--ray-replicas", "2"]):
        with pytest.raises(SystemExit):
            main(["serve", *bad])
    for bad, text in ((["--parallel-window", "0"], "Picard.window must be a positive int"),
                      (["--parallel-window", "8", "--parallel-tolerance", "-1"], "Picard.tolerance must be a finite")):
        with pytest.raises(SystemExit):
            main(["serve", *bad])
        assert text in capsys.readouterr().err


def test_parallel_demo_policy_is_served_with_its_settings():
    """--parallel-window reaches the served sampler, and /v1/spec's info says so."""
    from diffusion_policy_accelerated.serving.policies import PolicySource, load_policy
    policy = load_policy(PolicySource(device="cpu", steps=4, parallel_window=2, parallel_tolerance=0.5), max_rows=2)
    assert policy.spec.info["sampler"] == "parallel (Picard, window 2, tolerance 0.5)"
    assert load_policy(PolicySource(device="cpu", steps=4), max_rows=2).spec.info["sampler"] == "sequential"


@pytest.mark.parametrize("kwargs,text", [
    (dict(url="https://host:1"), "url must be http://host:port"),
    (dict(timeout=0), "timeout must be > 0 seconds"),
    (dict(backoff=0), "backoff must be > 0 seconds"),
])
def test_bad_client_options(kwargs, text):
    with pytest.raises(ValueError, match=__import__("re").escape(text)):
        PolicyClient(**{"url": "http://127.0.0.1:1", **kwargs})


@pytest.mark.parametrize("body", ["a string", {"camera_0": 1}, None])
def test_act_body_takes_only_the_bytes_request_body_makes(body):
    with PolicyClient("http://127.0.0.1:1") as client:  # refused before anything is sent
        with pytest.raises(TypeError, match="body must be the bytes request_body returns"):
            client.act_body(body)
