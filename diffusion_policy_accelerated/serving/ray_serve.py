"""Scale-out on Ray Serve: one replica per GPU, on one machine or a cluster, speaking the same
protocol as `dpa serve` (so `PolicyClient` talks to either).

    from ray import serve
    from diffusion_policy_accelerated.serving.policies import PolicySource
    from diffusion_policy_accelerated.serving.ray_serve import build_app

    serve.start(http_options={"host": "0.0.0.0", "port": 8700})
    serve.run(build_app(PolicySource("checkpoint", "policy.ckpt", dtype="bfloat16"), num_replicas=4))

or `dpa serve --ray-replicas 4 --checkpoint policy.ckpt`. Each replica loads the policy from
the `PolicySource` (so the checkpoint path must be readable on every node) and captures its
batch buckets' graphs before Ray routes traffic to it. Batching is Ray Serve's `@serve.batch`
(up to `max_batch` requests, waiting at most `max_wait_ms`); backpressure is Ray Serve's
(`max_queued_requests`: beyond it, 503). Ray Serve restarts a replica that dies; the client
retries requests that died with it.

Needs `pip install "ray[serve]"`.
"""
import asyncio
import concurrent.futures
import json
from typing import List, Tuple

import numpy as np
from ray import serve
from starlette.requests import Request
from starlette.responses import Response

from ..sampling.finite import NonFiniteError
from .policies import PolicySource, load_policy
from .jpeg import decode_jpeg_inputs
from .protocol import CONTENT_TYPE, ActRequest, RequestError, encode_action, parse_act_request, server_timing_header


def _json(status: int, payload: dict) -> Response:
    return Response(json.dumps(payload), status_code=status, media_type="application/json")


@serve.deployment
class PolicyDeployment:
    """One replica: a ServedPolicy, warmed up, behind Ray Serve's batching."""

    def __init__(self, source: PolicySource, max_batch: int, max_wait_ms: float):
        self.policy = load_policy(source, max_rows=max_batch)
        self.policy.warm_up()
        # One thread runs the policy (its graphs and buffers), so the replica's event loop
        # keeps taking requests while a batch runs.
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dpa-replica")
        self.act_batch.set_max_batch_size(max_batch)
        self.act_batch.set_batch_wait_timeout_s(max_wait_ms / 1e3)

    @serve.batch
    async def act_batch(self, requests: List[ActRequest]) -> List[Tuple[np.ndarray, dict]]:
        loop = asyncio.get_running_loop()
        actions, timings = await loop.run_in_executor(self.executor, self.policy.act, requests)
        return [(action, timings) for action in actions]

    async def __call__(self, request: Request) -> Response:
        path = request.url.path.rstrip("/")
        if request.method == "POST" and path.endswith("/v1/act"):
            try:
                # Refused before the body is read where the client declares its size.
                declared = request.headers.get("content-length", "0")
                if declared.isdigit() and int(declared) > self.policy.spec.max_request_bytes:
                    raise RequestError(413, f"the body has {declared} bytes, more than the "
                                            f"{self.policy.spec.max_request_bytes} that {self.policy.max_rows} "
                                            f"observations take{self.policy.spec.too_large_hint}")
                parsed = parse_act_request(await request.body(), self.policy.spec, self.policy.check_finite)
                if parsed.jpeg:
                    parsed = await asyncio.get_running_loop().run_in_executor(None, decode_jpeg_inputs, parsed,
                                                                               self.policy.spec)
            except RequestError as error:
                return _json(error.status, {"error": error.message})
            action, timings = await self.act_batch(parsed)
            if isinstance(action, NonFiniteError):  # NaN or Inf in this request's actions: not sent
                return _json(422, {"error": str(action)})
            return Response(encode_action(action, timings), media_type=CONTENT_TYPE,
                            headers={"Server-Timing": server_timing_header(timings)})
        if request.method == "GET" and path.endswith("/v1/spec"):
            return _json(200, self.policy.spec.to_json())
        if request.method == "GET" and path.endswith("/health"):
            return _json(200, {"status": "ok", "policy": self.policy.name})
        return _json(404, {"error": f"no route {request.method} {request.url.path}; the routes are POST /v1/act, "
                                    f"GET /v1/spec and GET /health"})


def build_app(source: PolicySource, *, num_replicas: int = 1, num_gpus: float = 1, max_batch: int = 64,
              max_wait_ms: float = 2.0, max_queued_requests: int = -1):
    """The Ray Serve application: `num_replicas` replicas of `source`, each with `num_gpus`
    GPUs (1: one replica per GPU; 0 for CPU replicas). Each replica takes up to
    2 * max_batch requests at once, so a batch fills while the previous one runs;
    `max_queued_requests` (-1: unbounded) caps what waits in front of them before Ray Serve
    answers 503."""
    if not isinstance(source, PolicySource):
        raise TypeError(f"source must be a PolicySource, got {type(source).__name__}")
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"num_replicas must be a positive integer, got {num_replicas!r}")
    return PolicyDeployment.options(
        num_replicas=num_replicas, max_ongoing_requests=2 * max_batch, max_queued_requests=max_queued_requests,
        ray_actor_options={"num_gpus": num_gpus, "num_cpus": 1 if num_gpus else 0.5},
    ).bind(source, max_batch, max_wait_ms)
