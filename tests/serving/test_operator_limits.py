"""`dpa serve` as an operator runs it: the connection limit, the read and idle timeouts
(serving/connections.py), and the drain timeout on SIGTERM with the exit status that says
whether every queued request was answered. Real servers and raw sockets over 127.0.0.1; every
wait is bounded."""
import concurrent.futures
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("safetensors")

from diffusion_policy_accelerated.cli import EXIT_CUT_OFF, main  # noqa: E402
from diffusion_policy_accelerated.serving import protocol  # noqa: E402
from diffusion_policy_accelerated.serving.client import PolicyClient  # noqa: E402
from diffusion_policy_accelerated.serving.connections import ConnectionGuard  # noqa: E402
from diffusion_policy_accelerated.serving.policies import PolicySource, load_policy  # noqa: E402
from diffusion_policy_accelerated.serving.server import PolicyServer, ServerThread  # noqa: E402
from tests.support.serve_process import free_port  # noqa: E402

COND = 40  # the demo U-Net's global_cond width


@pytest.fixture(scope="module")
def demo_policy():
    """The demo's U-Net on the CPU, DDIM 2 steps, batches of up to 2."""
    return load_policy(PolicySource(device="cpu", scheduler="ddim", steps=2), max_rows=2)


def observation(seed=0):
    return {"global_cond": np.random.default_rng(seed).standard_normal(COND).astype(np.float32)}


def address(url):
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def request(url, method, path, body=None, timeout=30):
    """(status, headers, parsed JSON or bytes) of one request on a connection of its own."""
    connection = http.client.HTTPConnection(*address(url), timeout=timeout)
    try:
        connection.request(method, path, body=body)
        response = connection.getresponse()
        payload = response.read()
        kind = response.getheader("Content-Type", "")
        return (response.status, dict(response.getheaders()),
                json.loads(payload) if kind.startswith("application/json") else payload)
    finally:
        connection.close()


def read_until_closed(sock, limit_s):
    """Everything the server sends until it closes the connection, and when it closed (s)."""
    sock.settimeout(limit_s)
    start, data = time.monotonic(), b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return data, time.monotonic() - start
        data += chunk


def act_head(url, length):
    host, _ = address(url)
    return (f"POST /v1/act HTTP/1.1\r\nHost: {host}\r\nContent-Type: {protocol.CONTENT_TYPE}\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def test_a_stalled_body_gets_408_while_others_are_served(demo_policy):
    """A client that sends its headers and half its body, then stalls with the socket open,
    gets 408 and is disconnected once the read timeout is up; clients meanwhile are served,
    and the metrics count each request once."""
    read_timeout = 1.0
    with ServerThread(demo_policy, port=0, read_timeout=read_timeout, idle_timeout=30) as server:
        body = protocol.encode_request(observation())
        with socket.create_connection(address(server.url)) as stalled, PolicyClient(server.url, timeout=30) as client:
            stalled.sendall(act_head(server.url, len(body)) + body[:len(body) // 2])
            answers = [client.act(observation(i), seed=i).shape for i in range(3)]
            data, closed_after = read_until_closed(stalled, read_timeout + 10)
        assert answers == [(16, 2)] * 3
        assert data.startswith(b"HTTP/1.1 408 ") and b"did not arrive within 1 s" in data, data
        assert closed_after < read_timeout + 2.0
        metrics = request(server.url, "GET", "/metrics")[2].decode()
    assert 'dpa_requests_total{code="200"} 3' in metrics and 'dpa_requests_total{code="408"} 1' in metrics
    assert "dpa_timed_out_requests_total 1" in metrics


def test_partial_headers_and_idle_connections_are_closed(demo_policy):
    """Headers that stop midway get 408 after the read timeout; a connection that sends nothing
    is closed, without an answer, after the idle timeout; a keep-alive client between requests
    is not (its next request is served)."""
    with ServerThread(demo_policy, port=0, read_timeout=0.5, idle_timeout=1.5) as server:
        with socket.create_connection(address(server.url)) as partial, \
                socket.create_connection(address(server.url)) as idle, PolicyClient(server.url, timeout=30) as client:
            start = time.monotonic()
            partial.sendall(b"POST /v1/act HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le")
            data, closed_after = read_until_closed(partial, 10)
            assert data.startswith(b"HTTP/1.1 408 Request Timeout") and b"--read-timeout" in data, data
            assert 0.4 < closed_after < 2.5
            assert client.act(observation()).shape == (16, 2)
            time.sleep(0.5)  # the client's connection is idle for less than the timeout
            assert client.act(observation()).shape == (16, 2)
            data, _ = read_until_closed(idle, 10)
            assert data == b"" and 1.2 < time.monotonic() - start < 6.0


def test_connections_over_the_limit_are_refused_with_503(demo_policy):
    """With the limit reached, one more connection is answered 503 with Retry-After and closed;
    once a connection closes, requests are served again; the open connections are counted."""
    with ServerThread(demo_policy, port=0, max_connections=2, idle_timeout=30) as server:
        held = [socket.create_connection(address(server.url)) for _ in range(2)]
        try:
            time.sleep(0.2)
            status, headers, payload = request(server.url, "GET", "/health")
            assert status == 503 and headers.get("Retry-After") == "1"
            assert "too many connections (dpa serve --max-connections 2)" in payload["error"]
        finally:
            for sock in held:
                sock.close()
        # The server learns of the closes as its event loop gets to them.
        deadline = time.monotonic() + 10
        while request(server.url, "GET", "/health")[0] != 200:
            assert time.monotonic() < deadline, "closed connections still count"
            time.sleep(0.05)
        status, _, body = request(server.url, "POST", "/v1/act", protocol.encode_request(observation()))
        assert status == 200 and protocol.decode_action(body)[0].shape == (16, 2)
        metrics = request(server.url, "GET", "/metrics")[2].decode()
    refused = float(next(line for line in metrics.splitlines() if line.startswith("dpa_refused_connections_total ")
                         ).split()[1])
    assert refused >= 1 and "dpa_connections 1" in metrics  # the metrics request's own


@pytest.mark.parametrize("options,text", [
    (dict(max_connections=0), "max_connections must be a positive integer"),
    (dict(read_timeout=0), "read_timeout must be > 0 seconds"),
    (dict(idle_timeout=-1.0), "idle_timeout must be > 0 seconds"),
])
def test_bad_guard_options(options, text):
    with pytest.raises(ValueError, match=text):
        ConnectionGuard(**options)


def test_bad_drain_timeout(demo_policy):
    with pytest.raises(ValueError, match="drain_timeout must be >= 0 seconds"):
        PolicyServer(demo_policy, drain_timeout=-1)


@pytest.mark.parametrize("flags", [["--drain-timeout", "-1"], ["--read-timeout", "0"], ["--idle-timeout", "nan"],
                                   ["--max-connections", "0"], ["--drain-timeout", "5", "--ray-replicas", "2"]])
def test_serve_flags_are_checked(flags, capsys):
    with pytest.raises(SystemExit):
        main(["serve", *flags])
    assert flags[0] in capsys.readouterr().err


def wait_for_queue(url, rows, timeout=60):
    deadline = time.monotonic() + timeout
    while True:
        status, _, health = request(url, "GET", "/health")
        if status == 200 and health["queued_rows"] >= rows:
            return
        assert time.monotonic() < deadline, f"never {rows} rows queued: {health}"
        time.sleep(0.02)


@pytest.mark.parametrize("steps,drain_timeout,all_answered", [(2, "60", True), (30, "0.1", False)])
def test_sigterm_exit_status_says_whether_all_were_answered(steps, drain_timeout, all_answered):
    """`dpa serve` with requests queued behind a running batch, then SIGTERM: with time to
    drain, every request gets 200 and the exit status is 0; with a drain timeout shorter than
    a batch, the running and queued requests get 503, stderr says how many were cut off, and
    the exit status is EXIT_CUT_OFF."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen([sys.executable, "-m", "diffusion_policy_accelerated", "serve", "--device", "cpu",
                                "--scheduler", "ddpm", "--steps", str(steps), "--max-batch", "1", "--instances", "1",
                                "--port", str(port), "--drain-timeout", drain_timeout],
                               stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        with PolicyClient(url, timeout=30) as client:
            client.wait_ready(timeout=300)
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            sent = [pool.submit(request, url, "POST", "/v1/act", protocol.encode_request(observation(i)), 120)
                    for i in range(3)]
            wait_for_queue(url, 2)  # one request runs, two wait
            process.send_signal(signal.SIGTERM)
            statuses = [future.result(120)[0] for future in sent]
        code = process.wait(timeout=120)
        log = process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
    if all_answered:
        assert (statuses, code) == ([200] * 3, 0), log
        assert "(for up to 60 s, --drain-timeout)" in log and "cut off" not in log
    else:
        assert (statuses, code) == ([503] * 3, EXIT_CUT_OFF), log
        assert "the drain timeout (0.1 s) cut off 3 queued or running requests (answered 503)" in log, log
