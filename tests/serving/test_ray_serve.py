"""The Ray Serve deployment on a local Ray cluster (CPU replicas): the same protocol and client
as `dpa serve`, Ray Serve's batching, and a replica killed mid-run with every request still
answered. Bounded: two small replicas, a few hundred requests, timeouts on every wait."""
import concurrent.futures
import socket
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from diffusion_policy_accelerated.serving.client import PolicyClient, RequestRejected  # noqa: E402
from diffusion_policy_accelerated.serving.policies import PolicySource, load_policy  # noqa: E402
from diffusion_policy_accelerated.serving.ray_serve import build_app  # noqa: E402

from tests.serving.test_serving import COND, TOLERANCE, act_one, observation  # noqa: E402

SOURCE = PolicySource(device="cpu", scheduler="ddim", steps=2)
APP = "dpa"


def replica_names():
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"SERVE_REPLICA::{APP}#")]


@pytest.fixture(scope="module")
def url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(SOURCE, num_replicas=2, num_gpus=0, max_batch=8, max_wait_ms=20), name=APP,
                  route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def local_policy():
    """The replicas' policy, built here: what each seeded request must come back as."""
    return load_policy(SOURCE, max_rows=8)


def test_batched_answers_equal_the_policy(url, local_policy):
    def robot(i):
        with PolicyClient(url, timeout=30) as client:
            out = []
            for k in range(4):
                obs = observation(2 if i % 4 == 0 else None, seed=100 * i + k)
                out.append((obs, 100 * i + k, client.act(obs, seed=100 * i + k), client.last_timings["batch_rows"]))
            return out
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = [a for result in pool.map(robot, range(16)) for a in result]
    assert max(rows for *_, rows in answers) > 1, "Ray Serve never batched two requests"
    for obs, seed, action, _ in answers:
        np.testing.assert_allclose(action, act_one(local_policy, obs, seed), **TOLERANCE)
    with PolicyClient(url, timeout=30) as client:
        assert client.spec.inputs["global_cond"].shape == (COND,)
        with pytest.raises(RequestRejected, match="must be \\[40\\] \\(one observation\\)") as caught:
            client.act({"global_cond": np.zeros(COND + 1)})
        assert caught.value.status == 400
        # The non-finite guard: NaN in an input, and actions that overflow (a finite input past
        # what float32 products hold), are answered 422 naming which.
        with pytest.raises(RequestRejected, match="input 'global_cond' has NaN or infinite values") as caught:
            client.act({"global_cond": np.full(COND, np.nan, np.float32)})
        assert caught.value.status == 422
        with pytest.raises(RequestRejected, match="the actions computed for this request hold NaN or Inf") as caught:
            client.act({"global_cond": np.full(COND, 3e38, np.float32)})
        assert caught.value.status == 422


def test_replica_killed_mid_run_leaves_no_request_unanswered(url):
    """8 clients, 25 requests each; one replica is killed while they run. Every request is
    answered with an action (the client retries what died with the replica), and Ray Serve
    brings the deployment back to two replicas."""
    before = replica_names()
    assert len(before) == 2

    def robot(i):
        with PolicyClient(url, timeout=30, deadline=120) as client:
            actions = [client.act(observation(seed=i * 1000 + k)) for k in range(25)]
            return len(actions), client.retries
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = [pool.submit(robot, i) for i in range(8)]
        time.sleep(1.0)
        ray.kill(ray.get_actor(before[0], namespace="serve"), no_restart=True)
        answered = [f.result(timeout=240) for f in results]
    assert [n for n, _ in answered] == [25] * 8
    end = time.monotonic() + 120
    while time.monotonic() < end:
        names = replica_names()
        if len(names) == 2 and before[0] not in names:
            break
        time.sleep(1)
    assert len(names) == 2 and before[0] not in names, f"replicas after the kill: {names}"
