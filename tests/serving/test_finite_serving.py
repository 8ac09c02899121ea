"""`dpa serve`'s non-finite guard: a request whose inputs, or whose computed actions, hold NaN or
Inf is answered 422 naming which, alone: the other requests of its batch get their actions, and
the server goes on serving; --no-check-finite sends what was computed. Bounded like
test_serving.py: the demo's U-Net on the CPU, DDIM 2 steps, timeouts on every wait."""
import argparse
import concurrent.futures

import numpy as np
import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("safetensors")

from diffusion_policy_accelerated import NonFiniteError  # noqa: E402
from diffusion_policy_accelerated.cli import _source_arguments, source_from_args  # noqa: E402
from diffusion_policy_accelerated.serving import protocol  # noqa: E402
from diffusion_policy_accelerated.serving.client import PolicyClient, RequestRejected  # noqa: E402
from diffusion_policy_accelerated.serving.policies import PolicySource, load_policy  # noqa: E402
from diffusion_policy_accelerated.serving.server import ServerThread  # noqa: E402

from tests.serving.test_serving import TOLERANCE, act_one, act_request, observation, raw_get, raw_post  # noqa: E402

SOURCE = PolicySource(device="cpu", scheduler="ddim", steps=2)
# Finite, but past what the demo U-Net's FiLM products hold in float32: its actions overflow
# to NaN (that row's only).
OVERFLOW = 3e38


@pytest.fixture(scope="module")
def demo_policy():
    return load_policy(SOURCE, max_rows=8)


def overflowing(rows=None, row=0, seed=0):
    obs = observation(rows, seed)
    (obs["global_cond"] if rows is None else obs["global_cond"][row])[:] = OVERFLOW
    return obs


def test_served_policy_fails_only_the_request_with_non_finite_actions(demo_policy):
    """In one batch: a request whose second row overflows gets a NonFiniteError naming that
    row; the requests beside it get the actions they get alone."""
    good = [observation(seed=1), observation(2, seed=2)]
    actions, _ = demo_policy.act([act_request(good[0], 1), act_request(overflowing(3, row=1), 5),
                                  act_request(good[1], 2)])
    assert isinstance(actions[1], NonFiniteError) and actions[1].where == "actions"
    assert "hold NaN or Inf (rows [1] of 3), from finite inputs" in str(actions[1])
    for action, obs, seed in ((actions[0], good[0], 1), (actions[2], good[1], 2)):
        np.testing.assert_allclose(action, act_one(demo_policy, obs, seed), **TOLERANCE)


def test_server_answers_422_and_keeps_serving(demo_policy):
    """Concurrent clients: NaN and Inf inputs, overflowing inputs and good ones. The first two
    get 422 naming the input, the third 422 naming the actions; the good ones their seeded
    actions; then the server still serves, and /metrics counts the refused actions."""
    nan_input = observation(2, seed=3)
    nan_input["global_cond"][1, 7] = np.nan
    inf_input = observation(seed=4)
    inf_input["global_cond"][0] = -np.inf
    bad = [(nan_input, "input 'global_cond' has NaN or infinite values (rows [1] of 2)"),
           (inf_input, "input 'global_cond' has NaN or infinite values: no actions computed"),
           (overflowing(seed=5), "the actions computed for this request hold NaN or Inf, from finite inputs")]
    with ServerThread(demo_policy, port=0, max_wait_ms=100) as server:
        def send(i):
            if i % 2:
                obs, text = bad[(i // 2) % len(bad)]
                status, payload = raw_post(server.url, protocol.encode_request(obs, seed=i))
                return status == 422 and text in payload["error"], (status, payload)
            with PolicyClient(server.url, timeout=30) as client:
                obs = observation(seed=i)
                return np.allclose(client.act(obs, seed=i), act_one(demo_policy, obs, i), **TOLERANCE), i
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            outcomes = list(pool.map(send, range(18)))
        assert all(ok for ok, _ in outcomes), [what for ok, what in outcomes if not ok]
        with PolicyClient(server.url, timeout=30) as client:
            with pytest.raises(RequestRejected, match="hold NaN or Inf") as caught:
                client.act(overflowing(seed=6))
            assert caught.value.status == 422
            assert client.act(observation(seed=7)).shape == (16, 2)
            assert client.spec.info["check_finite"] is True
        metrics = raw_get(server.url, "/metrics")
    # 9 bad requests (3 of each) and the client's overflow; 4 of them refused after computing.
    assert 'dpa_requests_total{code="422"} 10' in metrics and "dpa_non_finite_actions_total 4" in metrics


def test_no_check_finite_sends_what_was_computed():
    policy = load_policy(PolicySource(device="cpu", scheduler="ddim", steps=2, check_finite=False), max_rows=2)
    assert policy.spec.info["check_finite"] is False
    with ServerThread(policy, port=0) as server:
        with PolicyClient(server.url, timeout=30) as client:
            obs = observation(2, seed=1)
            obs["global_cond"][0, 0] = np.nan
            action = client.act(obs)
    assert np.isnan(action[0]).all() and np.isfinite(action[1]).all()


def test_cli_flag_and_source_option():
    parser = argparse.ArgumentParser()
    _source_arguments(parser)
    assert source_from_args(parser.parse_args([])).check_finite is True
    assert source_from_args(parser.parse_args(["--no-check-finite"])).check_finite is False
    with pytest.raises(ValueError, match="check_finite must be a bool, got 'no'"):
        PolicySource(check_finite="no")
