"""A client for `dpa serve` and its Ray Serve deployment. It needs numpy and safetensors only
(no torch), so it runs on the robot's computer.

    client = PolicyClient("http://gpu-box:8700")
    action = client.act({"obs": obs})          # [n_action_steps, action_dim] float32 numpy
    action = client.act({"obs": obs_batch})    # [n, n_action_steps, action_dim] for n robots
    action = client.act({"camera_0": frames, "robot_eef_pose": pose})   # an image policy:
                                               # frames uint8 [n_obs_steps, C, H, W]
    action = client.act(observation, jpeg_quality=90)   # the cameras sent as JPEG (needs torchvision)

Each call is one HTTP request on a kept-alive connection, with a timeout per attempt and a
deadline over all of them. Connection failures and 5xx answers (the server overloaded,
warming up, restarting, or a replica lost) are retried with exponential backoff until the
deadline: computing an action has no side effect, so a retried request is safe. 4xx answers
(a malformed request; 422: NaN or Inf in its inputs or in the actions computed for it, which a
robot must not execute) raise `RequestRejected` at once. One client per thread.
"""
import http.client
import json
import random
import time
import urllib.parse
from typing import Dict, Mapping, Optional, Tuple, Union

import numpy as np

from .protocol import CONTENT_TYPE, PolicySpec, decode_action, encode_request

RETRIED_STATUSES = (500, 502, 503, 504)


class RequestRejected(Exception):
    """The server refused the request (4xx: malformed, or 422 for NaN or Inf in its inputs or its
    actions); `status` and the server's message."""

    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


class ServerUnavailable(Exception):
    """No answer within the deadline (connection failures, timeouts or 5xx on every attempt)."""


class PolicyClient:
    """`timeout`: seconds per attempt (connect, send, wait for the answer); `deadline`:
    seconds over all attempts of one call (default 4 timeouts); `backoff`: the first retry's
    delay, doubled per retry (with jitter, so clients refused together do not return
    together)."""

    def __init__(self, url: str = "http://127.0.0.1:8700", *, timeout: float = 10.0,
                 deadline: Optional[float] = None, backoff: float = 0.02):
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme != "http" or not parsed.hostname:
            raise ValueError(f"url must be http://host:port, got {url!r}")
        self.host, self.port = parsed.hostname, parsed.port or 80
        self.prefix = parsed.path.rstrip("/")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        if not backoff > 0:
            raise ValueError(f"backoff must be > 0 seconds, got {backoff!r}")
        self.timeout = timeout
        self.deadline = deadline if deadline is not None else 4 * timeout
        self.backoff = backoff
        self._connection: Optional[http.client.HTTPConnection] = None
        self._spec: Optional[PolicySpec] = None
        self.last_timings: Dict[str, float] = {}
        self.retries = 0

    # ------------------------------------------------------------------ calls
    @property
    def spec(self) -> PolicySpec:
        """The served policy's inputs and action (GET /v1/spec, read once)."""
        if self._spec is None:
            self._spec = PolicySpec.from_json(json.loads(self._call("GET", "/v1/spec")[1]))
        return self._spec

    def act(self, observation: Mapping[str, np.ndarray], seed: Optional[int] = None,
            jpeg_quality: Union[None, int, Mapping[str, int]] = None) -> np.ndarray:
        """The action chunk for one observation (each input of the spec's shape), or the
        chunks [n, ...] for n observations ([n, *shape] each). Inputs are converted to the
        spec's dtype; `seed` fixes the noise. `jpeg_quality` (1-100) sends every camera input,
        or those it maps to a quality, as JPEG (torchvision's encode_jpeg; the server decodes
        them): fewer bytes, lossy. The server's timings land in `last_timings`."""
        return self.act_body(self.request_body(observation, seed, jpeg_quality))

    def act_body(self, body: bytes) -> np.ndarray:
        """The action chunk(s) for a request body made by `request_body` (to encode once
        and send again, or to encode off a timed path)."""
        if not isinstance(body, (bytes, bytearray)):
            raise TypeError(f"body must be the bytes request_body returns, got {type(body).__name__}")
        _, payload = self._call("POST", "/v1/act", body)
        action, self.last_timings = decode_action(payload)
        return action

    def request_body(self, observation: Mapping[str, np.ndarray], seed: Optional[int] = None,
                     jpeg_quality: Union[None, int, Mapping[str, int]] = None) -> bytes:
        """The bytes `act` sends for these arguments (checked as `act` says)."""
        spec = self.spec
        unknown = sorted(set(observation) - set(spec.inputs))
        if unknown:
            raise ValueError(f"observation has inputs {unknown} the policy does not take; it takes "
                             f"{ {k: list(v.shape) for k, v in spec.inputs.items()} }")
        for name, value in observation.items():
            if spec.inputs[name].dtype == "uint8" and np.asarray(value).dtype != np.uint8:
                raise ValueError(f"observation[{name!r}] is a camera input: send uint8 frames (0-255), got "
                                 f"{np.asarray(value).dtype} (float frames in [0, 1]: (frames * 255).round()"
                                 f".astype(np.uint8))")
        cameras = [name for name, s in spec.inputs.items() if s.dtype == "uint8" and len(s.shape) == 4]
        if isinstance(jpeg_quality, Mapping):
            wrong = sorted(set(jpeg_quality) - set(cameras))
            if wrong:
                raise ValueError(f"jpeg_quality names {wrong}, which are not camera inputs; those are {cameras}")
            qualities = dict(jpeg_quality)
        else:
            qualities = {} if jpeg_quality is None else {name: jpeg_quality for name in cameras if name in observation}
        jpeg = None
        if qualities:
            from .jpeg import encode_jpeg_frames

            jpeg = {name: encode_jpeg_frames(observation[name], quality, name) for name, quality in qualities.items()
                    if name in observation}
        return encode_request({k: np.asarray(v, dtype=spec.inputs[k].dtype) for k, v in observation.items()
                               if not jpeg or k not in jpeg}, seed, jpeg)

    def health(self) -> Tuple[int, dict]:
        """(status, body) of GET /health, without retrying: 200 when serving."""
        status, payload = self._call("GET", "/health", retry=False)
        return status, json.loads(payload)

    def wait_ready(self, timeout: float = 600.0) -> None:
        """Wait until the server answers /health with 200 (it captures its graphs first)."""
        end = time.monotonic() + timeout
        while True:
            try:
                if self.health()[0] == 200:
                    return
            except (OSError, http.client.HTTPException, ServerUnavailable, ValueError):
                pass
            if time.monotonic() > end:
                raise ServerUnavailable(f"{self.host}:{self.port} was not ready within {timeout} s")
            time.sleep(0.2)

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def __enter__(self) -> "PolicyClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ transport
    def _call(self, method: str, path: str, body: Optional[bytes] = None, retry: bool = True) -> Tuple[int, bytes]:
        """(status, body) of a 2xx answer; with retry=False, of any answer."""
        end = time.monotonic() + self.deadline
        delay = self.backoff
        while True:
            try:
                status, payload = self._once(method, path, body, min(self.timeout, max(end - time.monotonic(), 1e-3)))
                if 200 <= status < 300 or not retry:
                    return status, payload
                if status not in RETRIED_STATUSES:
                    raise RequestRejected(status, _message(payload))
                last = f"HTTP {status}: {_message(payload)}"
            except (OSError, http.client.HTTPException) as error:
                self.close()  # the connection's state is unknown: start a new one
                last = f"{type(error).__name__}: {error}"
                if not retry:
                    raise ServerUnavailable(f"{method} {path}: {last}") from error
            pause = delay * random.uniform(0.5, 1.5)
            if time.monotonic() + pause + 0.01 > end:  # no time left for another attempt
                raise ServerUnavailable(f"{method} {path} on {self.host}:{self.port}: no answer within "
                                        f"{self.deadline} s; last: {last}")
            self.retries += 1
            time.sleep(pause)
            delay *= 2

    def _once(self, method: str, path: str, body: Optional[bytes], timeout: float) -> Tuple[int, bytes]:
        if self._connection is None:
            self._connection = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        else:
            self._connection.timeout = timeout
            if self._connection.sock is not None:
                self._connection.sock.settimeout(timeout)
        headers = {"Content-Type": CONTENT_TYPE} if body is not None else {}
        self._connection.request(method, self.prefix + path, body=body, headers=headers)
        response = self._connection.getresponse()
        payload = response.read()
        if response.will_close:
            self.close()
        return response.status, payload


def _message(payload: bytes) -> str:
    try:
        return str(json.loads(payload)["error"])
    except (ValueError, KeyError, TypeError):
        return payload[:200].decode("utf-8", "replace")
