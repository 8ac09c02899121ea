"""The server's counters, in Prometheus' text format (GET /metrics), without a dependency."""
import bisect
from typing import Dict, Sequence


class Counter:
    def __init__(self):
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class Gauge(Counter):
    def set(self, value: float) -> None:
        self.value = float(value)


class Histogram:
    def __init__(self, bounds: Sequence[float]):
        self.bounds = list(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: str = "") -> list:
        out, cumulative = [], 0
        for bound, count in zip(self.bounds + [float("inf")], self.counts):
            cumulative += count
            le = "+Inf" if bound == float("inf") else repr(bound)
            out.append(f'{name}_bucket{{{labels}{"," if labels else ""}le="{le}"}} {cumulative}')
        suffix = f"{{{labels}}}" if labels else ""
        return out + [f"{name}_sum{suffix} {self.sum}", f"{name}_count{suffix} {self.count}"]


LATENCY_BOUNDS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class Metrics:
    """Requests by HTTP status, request latency (arrival to response, seconds), batches and
    their rows and compute time, rows waiting, requests dropped because their client left,
    requests whose actions held NaN or Inf (answered 422, not sent); open connections, connections refused over the limit, requests that did not arrive in
    time (connections.py). Only the server's event loop touches them, so they need no lock."""

    def __init__(self):
        self.requests: Dict[int, Counter] = {}
        self.latency = Histogram(LATENCY_BOUNDS)
        self.batch_rows = Histogram((1, 2, 4, 8, 16, 32, 64, 128, 256))
        self.compute = Histogram(LATENCY_BOUNDS)
        self.rows = Counter()
        self.failed_batches = Counter()
        self.dropped = Counter()
        self.non_finite_actions = Counter()
        self.queue_rows = Gauge()
        self.connections = Gauge()
        self.refused_connections = Counter()
        self.timed_out_requests = Counter()

    def observe_request(self, status: int, seconds: float) -> None:
        self.requests.setdefault(status, Counter()).inc()
        self.latency.observe(seconds)

    def observe_batch(self, rows: int, seconds: float) -> None:
        self.batch_rows.observe(rows)
        self.compute.observe(seconds)
        self.rows.inc(rows)

    def render(self) -> str:
        lines = ["# TYPE dpa_requests_total counter"]
        lines += [f'dpa_requests_total{{code="{code}"}} {c.value:g}' for code, c in sorted(self.requests.items())]
        lines += ["# TYPE dpa_request_seconds histogram"] + self.latency.lines("dpa_request_seconds")
        lines += ["# TYPE dpa_batch_rows histogram"] + self.batch_rows.lines("dpa_batch_rows")
        lines += ["# TYPE dpa_batch_compute_seconds histogram"] + self.compute.lines("dpa_batch_compute_seconds")
        for name, metric, kind in (("dpa_rows_total", self.rows, "counter"),
                                   ("dpa_failed_batches_total", self.failed_batches, "counter"),
                                   ("dpa_dropped_requests_total", self.dropped, "counter"),
                                   ("dpa_non_finite_actions_total", self.non_finite_actions, "counter"),
                                   ("dpa_queue_rows", self.queue_rows, "gauge"),
                                   ("dpa_connections", self.connections, "gauge"),
                                   ("dpa_refused_connections_total", self.refused_connections, "counter"),
                                   ("dpa_timed_out_requests_total", self.timed_out_requests, "counter")):
            lines += [f"# TYPE {name} {kind}", f"{name} {metric.value:g}"]
        return "\n".join(lines) + "\n"
