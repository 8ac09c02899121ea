"""The connection limit and the timeouts of `dpa serve`, beneath aiohttp, which has neither a
limit on connections nor a deadline for a request that arrives slowly.

- At most `max_connections` connections are open at once. One more is answered 503 with
  Retry-After as soon as it connects, then closed: its client retries later (PolicyClient
  does), and a flood of connections cannot use up the process's file descriptors.
- A request must arrive whole (request line, headers and body) within `read_timeout`
  seconds of its first byte, or it is answered 408 and its connection closed: a client that
  sends part of a request and stalls holds a connection for that long at most.
- A connection on which no request arrives or runs for `idle_timeout` seconds is closed
  (a client reconnects on its next call; PolicyClient does).

Requests are expected one at a time per connection, as HTTP clients send them: the bytes of
a pipelined request that arrive while the one before it runs are under the idle timeout only.
"""
import asyncio
import json
from typing import Callable, Dict, Optional, Set

from .metrics import Metrics

# The defaults. A request is at most a few MB (max_rows observations), which a network a
# robot uses carries in well under READ_TIMEOUT_S. IDLE_TIMEOUT_S is longer than a robot's
# pause between requests within an episode. MAX_CONNECTIONS is 4x the 64 concurrent clients
# of the load test (scripts/load_test.py), a quarter of a usual 1024-descriptor limit.
MAX_CONNECTIONS = 256
READ_TIMEOUT_S = 10.0
IDLE_TIMEOUT_S = 60.0
# When a connection over the limit is closed after its 503 (see _Refused).
REFUSED_LINGER_S = 1.0


def raw_response(status: int, reason: str, message: str, headers: str = "") -> bytes:
    """An HTTP response with the server's JSON error body, for a connection aiohttp is not
    answering; it closes the connection."""
    body = json.dumps({"error": message}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n{headers}Connection: close\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


class ConnectionGuard:
    """Enforces the limit and the timeouts (module doc) on the connections its
    `protocol_factory` makes; its `middleware()` tells it when requests start and end, and
    `watch()` (a task while the server runs) closes the connections that time out. (aiohttp
    is imported where the middleware is made, so that `dpa serve --help` reads the defaults
    here without it.)"""

    def __init__(self, *, max_connections: int = MAX_CONNECTIONS, read_timeout: float = READ_TIMEOUT_S,
                 idle_timeout: float = IDLE_TIMEOUT_S, metrics: Optional[Metrics] = None):
        if isinstance(max_connections, bool) or not isinstance(max_connections, int) or max_connections < 1:
            raise ValueError(f"max_connections must be a positive integer, got {max_connections!r}")
        for name, value in (("read_timeout", read_timeout), ("idle_timeout", idle_timeout)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value!r}")
        self.max_connections, self.read_timeout, self.idle_timeout = max_connections, read_timeout, idle_timeout
        self.metrics = metrics or Metrics()
        self._connections: Set["_Connection"] = set()
        self._by_transport: Dict[asyncio.BaseTransport, "_Connection"] = {}

    def protocol_factory(self, make_protocol: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """For loop.create_server: aiohttp's protocol (`make_protocol()`) under the guard, or
        a refusal where the limit is reached. Counted here, not when the connection is made:
        an accept loop makes several protocols before any is told its connection."""
        def factory() -> asyncio.Protocol:
            if len(self._connections) >= self.max_connections:
                self.metrics.refused_connections.inc()
                return _Refused(self.max_connections)
            connection = _Connection(self, make_protocol())
            self._connections.add(connection)
            self.metrics.connections.set(len(self._connections))
            return connection
        return factory

    def read_deadline(self, request) -> Optional[float]:
        """When the whole of `request` must have arrived (event-loop time), for its handler
        reading the body; None where its connection is gone."""
        connection = self._by_transport.get(request.transport)
        return None if connection is None else connection.read_deadline

    def middleware(self):
        """The aiohttp middleware that tells the guard when each request's handler runs."""
        from aiohttp import web

        @web.middleware
        async def track(request: web.Request, handler):
            connection = self._by_transport.get(request.transport)
            if connection is None:  # its connection is gone already
                return await handler(request)
            loop = asyncio.get_running_loop()
            connection.read_deadline = (connection.request_since or loop.time()) + self.read_timeout
            connection.request_since = None
            connection.handlers += 1
            try:
                return await handler(request)
            finally:
                connection.handlers -= 1
                connection.active_at = loop.time()
        return track

    async def watch(self) -> None:
        """Close the connections whose request is late (with a 408) or that are idle, checking
        a few times per timeout."""
        loop = asyncio.get_running_loop()
        period = min(1.0, max(0.02, min(self.read_timeout, self.idle_timeout) / 4))
        while True:
            await asyncio.sleep(period)
            now = loop.time()
            for connection in list(self._connections):
                transport = connection.transport
                if transport is None or transport.is_closing() or connection.handlers:
                    continue
                if connection.request_since is not None and now - connection.request_since > self.read_timeout:
                    self.metrics.timed_out_requests.inc()
                    transport.write(raw_response(408, "Request Timeout", f"the request did not arrive within "
                                                 f"{self.read_timeout:g} s (dpa serve --read-timeout)"))
                    transport.close()  # after the buffered 408 is sent
                elif connection.request_since is None and now - connection.active_at > self.idle_timeout:
                    transport.close()

    async def close_all(self, timeout: float = 1.0) -> None:
        """Close every connection, and wait up to `timeout` seconds for them to be gone (their
        protocols told), so that a loop stopped next leaves no handler behind."""
        for connection in list(self._connections):
            if connection.transport is not None:
                connection.transport.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while any(c.transport is not None for c in self._connections) and loop.time() < deadline:
            await asyncio.sleep(0.01)

    def _made(self, connection: "_Connection") -> None:
        self._by_transport[connection.transport] = connection

    def _lost(self, connection: "_Connection") -> None:
        self._connections.discard(connection)
        self._by_transport.pop(connection.transport, None)
        self.metrics.connections.set(len(self._connections))


class _Connection(asyncio.Protocol):
    """aiohttp's protocol for one connection, and what the guard knows of the connection:
    when the request now arriving began (None: none is) and the deadline of the one handled
    last, how many handlers run for it, and when it was last active."""

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol):
        self.guard, self.inner = guard, inner
        self.transport: Optional[asyncio.Transport] = None
        self.request_since: Optional[float] = None
        self.read_deadline: Optional[float] = None
        self.handlers = 0
        self.active_at = asyncio.get_running_loop().time()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.guard._made(self)
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        now = asyncio.get_running_loop().time()
        self.active_at = now
        if self.request_since is None and not self.handlers:
            self.request_since = now
        self.inner.data_received(data)

    def eof_received(self) -> Optional[bool]:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc: Optional[BaseException]) -> None:
        self.guard._lost(self)
        self.inner.connection_lost(exc)


class _Refused(asyncio.Protocol):
    """A connection over the limit: answered 503 at once. Closing it at once could reset it
    while its request still arrives, and a reset may discard the answer before the client
    reads it; so the server stops sending, discards what comes, and closes when the client
    does or after REFUSED_LINGER_S."""

    def __init__(self, limit: int):
        self.limit = limit

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(raw_response(503, "Service Unavailable", f"too many connections (dpa serve "
                                     f"--max-connections {self.limit}); retry later", "Retry-After: 1\r\n"))
        try:
            transport.write_eof()
        except OSError:  # the client is gone already
            transport.close()
            return
        asyncio.get_running_loop().call_later(REFUSED_LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        pass

    def eof_received(self) -> bool:
        return False  # close
