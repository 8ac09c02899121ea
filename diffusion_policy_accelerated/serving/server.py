"""`dpa serve`: one process, one device, many robots, over HTTP (see protocol.py).

aiohttp serves the protocol; a `Batcher` turns concurrent requests into one sampler call per
batch. The server starts listening at once (GET /health answers 503 "warming up", so an
orchestrator can tell starting from dead) while every batch bucket's CUDA graph is captured,
then serves. SIGINT/SIGTERM stop it gracefully: new requests get 503, queued and running
ones are answered for up to `drain_timeout` seconds (what is left then gets 503), then it
exits. connections.py limits the connections and times out requests that arrive too slowly.
"""
import asyncio
import json
import signal
import sys
import threading
import time
from typing import Callable, Optional, Sequence, Union

from aiohttp import web

if sys.version_info >= (3, 11):
    from asyncio import timeout as _timeout
else:  # aiohttp's dependency there
    from async_timeout import timeout as _timeout

from ..sampling.finite import NonFiniteError
from .jpeg import decode_jpeg_inputs
from .batcher import DRAIN_TIMEOUT_S, Batcher, ClientGone, Overloaded
from .connections import IDLE_TIMEOUT_S, MAX_CONNECTIONS, READ_TIMEOUT_S, ConnectionGuard
from .metrics import Metrics
from .policies import ServedPolicy
from .protocol import CONTENT_TYPE, RequestError, encode_action, parse_act_request, server_timing_header

RETRY_AFTER_S = "1"


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _json(status: int, payload: dict, **headers) -> web.Response:
    return web.Response(status=status, text=json.dumps(payload), content_type="application/json",
                        headers=headers or None)


def _error(status: int, message: str) -> web.Response:
    return _json(status, {"error": message}, **({"Retry-After": RETRY_AFTER_S} if status == 503 else {}))


def _connected(request: web.Request) -> bool:
    transport = request.transport
    return transport is not None and not transport.is_closing()


class PolicyServer:
    """Serves `policy` on host:port (port 0: any free port; see `port` after `start`).

    `policy`: a ServedPolicy, or several instances of one whose batches may run side by side
    (batcher.py says when that pays). `max_wait_ms`: how long a request may wait for others
    to share its batch when an instance is idle; `max_queue_rows`: how many observation rows
    may wait (default 4 batches) before requests are refused with 503; `drain_timeout`: how
    long `stop` answers queued and running requests before it answers the rest 503;
    `max_connections`, `read_timeout`, `idle_timeout`: see connections.py."""

    def __init__(self, policy: Union[ServedPolicy, Sequence[ServedPolicy]], *, host: str = "127.0.0.1",
                 port: int = 8700, max_wait_ms: float = 2.0, max_queue_rows: Optional[int] = None,
                 drain_timeout: float = DRAIN_TIMEOUT_S, max_connections: int = MAX_CONNECTIONS,
                 read_timeout: float = READ_TIMEOUT_S, idle_timeout: float = IDLE_TIMEOUT_S,
                 log: Callable[[str], None] = _log):
        if not drain_timeout >= 0:
            raise ValueError(f"drain_timeout must be >= 0 seconds, got {drain_timeout!r}")
        self.host, self.port = host, port
        self.drain_timeout = drain_timeout
        self.log = log
        self.metrics = Metrics()
        self.guard = ConnectionGuard(max_connections=max_connections, read_timeout=read_timeout,
                                     idle_timeout=idle_timeout, metrics=self.metrics)
        self.batcher = Batcher(policy, max_wait_s=max_wait_ms / 1e3, max_queue_rows=max_queue_rows,
                               metrics=self.metrics)
        self.policy = self.batcher.policy
        self.stopping = False
        self.warm_up: Optional[asyncio.Task] = None
        self._runner: Optional[web.AppRunner] = None
        self._listener: Optional[asyncio.AbstractServer] = None
        self._watch: Optional[asyncio.Task] = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _app(self) -> web.Application:
        # request.read() stops at this size (the handler then answers 413).
        app = web.Application(client_max_size=self.policy.spec.max_request_bytes, middlewares=[self.guard.middleware()])
        app.add_routes([web.post("/v1/act", self._act), web.get("/v1/spec", self._spec),
                        web.get("/health", self._health), web.get("/metrics", self._metrics)])
        return app

    async def start(self) -> None:
        """Listen, and start warming up (`wait_ready` waits for it)."""
        self._runner = web.AppRunner(self._app(), access_log=None, handle_signals=False)
        await self._runner.setup()
        # What web.TCPSite does, with aiohttp's protocol under the connection guard.
        self._listener = await asyncio.get_running_loop().create_server(
            self.guard.protocol_factory(self._runner.server), self.host, self.port, backlog=128)
        self.port = self._listener.sockets[0].getsockname()[1]
        self._watch = asyncio.create_task(self.guard.watch())
        self.log(f"dpa serve: {self.policy.name} on {self.policy.device}, listening on {self.url}; "
                 f"warming up batches {self.policy.buckets}" + (" (one CUDA graph each)" if self.policy.device.type == "cuda" else "")
                 + (f" of {len(self.batcher.instances)} instances..." if len(self.batcher.instances) > 1 else "..."))
        self.warm_up = asyncio.create_task(self.batcher.start(self.log))

    async def wait_ready(self) -> None:
        await self.warm_up
        self.log(f"dpa serve: ready on {self.url} (POST /v1/act, GET /v1/spec /health /metrics)")

    async def stop(self, drain_timeout: Optional[float] = None) -> None:
        """Refuse new requests, answer the queued and running ones for up to `drain_timeout`
        seconds (default: the server's), the rest 503 (`batcher.cut_off` counts them), close."""
        self.stopping = True
        if self.warm_up is not None and not self.warm_up.done():
            self.warm_up.cancel()
        await self.batcher.stop(self.drain_timeout if drain_timeout is None else drain_timeout)
        if self._watch is not None:
            self._watch.cancel()
        if self._listener is not None:
            self._listener.close()
        if self._runner is not None:
            await self._runner.cleanup()
        await self.guard.close_all()

    # ------------------------------------------------------------------ handlers
    async def _act(self, request: web.Request) -> web.Response:
        start = time.perf_counter()
        response = await self._answer(request, start)
        self.metrics.observe_request(response.status, time.perf_counter() - start)
        return response

    async def _answer(self, request: web.Request, start: float) -> web.Response:
        try:
            body = await self._read_body(request)
            if body is None:
                self.metrics.timed_out_requests.inc()
                response = _error(408, f"the request's body did not arrive within {self.guard.read_timeout:g} s of "
                                       f"its first byte (dpa serve --read-timeout)")
                response.force_close()
                await response.prepare(request)
                await response.write_eof()
                # Closed now: aiohttp would otherwise wait for the rest of the body (its lingering time).
                request.protocol.force_close()
                return response
            parsed = parse_act_request(body, self.policy.spec, self.policy.check_finite)
            if parsed.jpeg:  # decoded in a thread, off the event loop
                parsed = await asyncio.to_thread(decode_jpeg_inputs, parsed, self.policy.spec)
            result = await self.batcher.submit(parsed, lambda: _connected(request))
        except RequestError as error:
            return _error(error.status, error.message)
        # NaN or Inf in this request's actions (ServedPolicy's guard): not sent, named.
        except NonFiniteError as error:
            return _error(422, str(error))
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"the body is larger than the {self.policy.spec.max_request_bytes} bytes that "
                               f"{self.policy.max_rows} observations take{self.policy.spec.too_large_hint}")
        except Overloaded as error:
            return _error(503, str(error))
        except (ClientGone, ConnectionError):
            return _error(499, "the client disconnected")
        # Whatever else failed is the server's fault, reported to the client; the server goes on.
        except Exception as error:  # noqa: BLE001
            self.log(f"dpa serve: a batch failed: {type(error).__name__}: {error}")
            return _error(500, f"{type(error).__name__}: {error}")
        timings = {**result.timings, "server_ms": 1e3 * (time.perf_counter() - start)}
        return web.Response(body=encode_action(result.action, timings), content_type=CONTENT_TYPE,
                            headers={"Server-Timing": server_timing_header(timings)})

    async def _read_body(self, request: web.Request) -> Optional[bytes]:
        """The request's body, or None where it does not arrive by the request's deadline. Read
        in this task (a timeout scope, not wait_for's task of its own), so that a body that has
        arrived is read at once, even where its client hangs up right after sending it."""
        deadline = self.guard.read_deadline(request)
        if deadline is None:
            return await request.read()
        try:
            async with _timeout(max(0.0, deadline - asyncio.get_running_loop().time())):
                return await request.read()
        except asyncio.TimeoutError:
            return None

    async def _spec(self, request: web.Request) -> web.Response:
        return _json(200, self.policy.spec.to_json())

    async def _health(self, request: web.Request) -> web.Response:
        if self.stopping or not self.batcher.ready:
            return _json(503, {"status": "stopping" if self.stopping else "warming up"}, **{"Retry-After": RETRY_AFTER_S})
        return _json(200, {"status": "ok", "policy": self.policy.name, "queued_rows": self.batcher.queued_rows})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.metrics.render(), content_type="text/plain", charset="utf-8",
                            headers={"X-Content-Type-Options": "nosniff"})


async def serve(server: PolicyServer) -> None:
    """Run `server` until SIGINT or SIGTERM, then stop it gracefully."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    waiter = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({server.warm_up, waiter}, return_when=asyncio.FIRST_COMPLETED)
    if server.warm_up in done:
        await server.wait_ready()  # raises if warming up failed
        await waiter
    server.log(f"dpa serve: stopping: answering queued requests (for up to {server.drain_timeout:g} s, "
               f"--drain-timeout)...")
    await server.stop()
    server.log("dpa serve: stopped" + ("" if server.batcher.drained else
                                       f": the drain timeout cut off {server.batcher.cut_off} requests (answered 503)"))


class ServerThread:
    """A PolicyServer on a background thread's event loop, for tests, notebooks and programs
    that embed a server: `with ServerThread(policy, port=0) as server: ... server.url`."""

    def __init__(self, policy: ServedPolicy, **options):
        self.server = PolicyServer(policy, **options)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="dpa-serve-loop", daemon=True)

    @property
    def url(self) -> str:
        return self.server.url

    def call(self, coroutine, timeout: Optional[float] = None):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        try:
            self.call(self.server.start())
            self.call(self.server.wait_ready())
        except BaseException:
            self.close()
            raise
        return self

    def close(self, drain_timeout: Optional[float] = None) -> None:
        if self.thread.is_alive():
            try:
                self.call(self.server.stop(drain_timeout))
            finally:
                self.loop.call_soon_threadsafe(self.loop.stop)
                self.thread.join()
        self.loop.close()

    def __exit__(self, *exc) -> None:
        self.close()
