"""Dynamic batching for `dpa serve`: concurrent requests become one sampler call.

Requests wait in a bounded queue (counted in observation rows). A worker per policy
instance runs them, as many as fit in `max_rows` per sampler call, in a thread of its own, so
that the event loop keeps receiving and validating the next requests while the device works.

Several instances of one policy (each with its own CUDA graphs, buffers and stream) let a
batch start while another one runs: a request that just missed a batch then waits for no
one's batch but its own. With one instance it waits for the running batch to end first, so
the slowest of many closed-loop clients pays about two batches.

When an instance is free and requests wait, its next batch starts once it is full, or once no
request has come for `max_wait_s`, or once it has waited `IDLE_WAITS * max_wait_s`.
The end of a batch counts as an arrival: its clients are about to send their next requests
(a robot asks for its next chunk when it gets one), so the worker waits for them rather than
starting at once with the few that came during the run. Starting at once splits
closed-loop clients into groups that take turns, each request then waiting for another
group's batch before its own. A lone request pays `max_wait_s` once.

Every submitted request gets exactly one outcome: its actions, the batch's exception, its own
`NonFiniteError` where its actions hold NaN or Inf (ServedPolicy's guard), or `ClientGone` if
its client disconnected before its batch started (its rows are then not computed). A full queue raises `Overloaded` at submission, and so does a stopping batcher;
`stop()` answers everything already queued first.
"""
import asyncio
import collections
import concurrent.futures
from dataclasses import dataclass
from typing import Callable, Deque, Dict, List, Optional, Sequence, Union

import numpy as np

from ..sampling.finite import NonFiniteError
from .metrics import Metrics
from .policies import ServedPolicy
from .protocol import ActRequest


# How many max_wait_s an idle device waits at most for a batch to fill.
IDLE_WAITS = 5
# How long stop() answers what is queued by default: Kubernetes' default grace period between
# SIGTERM and SIGKILL.
DRAIN_TIMEOUT_S = 30.0


class Overloaded(Exception):
    """The queue is full, or the server is warming up or stopping: retry later (HTTP 503)."""


class ClientGone(Exception):
    """The client disconnected before its batch ran."""


@dataclass
class Result:
    action: np.ndarray
    timings: Dict[str, float]


@dataclass
class _Pending:
    request: ActRequest
    future: asyncio.Future
    arrival: float
    is_connected: Callable[[], bool]


class Batcher:
    """Batches requests for `policy`: one ServedPolicy, or a sequence of instances of one
    policy (the same spec; see the module doc), each run by a worker of its own."""

    def __init__(self, policy: Union[ServedPolicy, Sequence[ServedPolicy]], *, max_wait_s: float = 0.002,
                 max_queue_rows: Optional[int] = None, metrics: Optional[Metrics] = None):
        if max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
        self.instances = check_instances(policy)
        policy = self.instances[0]
        self.policy = policy
        self.max_rows = policy.max_rows
        self.max_wait_s = max_wait_s
        self.max_queue_rows = max_queue_rows if max_queue_rows is not None else 4 * self.max_rows
        if self.max_queue_rows < self.max_rows:
            raise ValueError(f"max_queue_rows ({self.max_queue_rows}) must hold at least one full batch "
                             f"({self.max_rows} rows)")
        self.metrics = metrics or Metrics()
        self.ready = False
        self.accepting = True
        # False when stop() gave up on a batch that is still running (see stop()); cut_off
        # counts the requests it then answered with Overloaded.
        self.drained = True
        self.cut_off = 0
        self._pending: Deque[_Pending] = collections.deque()
        self._pending_rows = 0
        self._wakeup: Optional[asyncio.Event] = None
        # Event-loop times of the latest arrival and of the end of the latest batch.
        self._last_arrival = self._last_batch_end = float("-inf")
        self._workers: List[asyncio.Task] = []
        # One thread per instance: an instance (its CUDA graphs and buffers) is used by one
        # thread only.
        self._executors = [concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"dpa-serve-{i}")
                           for i in range(len(self.instances))]

    async def start(self, log=None) -> None:
        """Warm up (capture every batch bucket's graph) in each instance's thread, one
        instance after the other, then serve."""
        loop = asyncio.get_running_loop()
        self._wakeup = asyncio.Event()
        for i, (instance, executor) in enumerate(zip(self.instances, self._executors)):
            if log is None:
                await loop.run_in_executor(executor, instance.warm_up)
            else:
                if len(self.instances) > 1:
                    log(f"dpa serve: instance {i + 1} of {len(self.instances)}")
                await loop.run_in_executor(executor, instance.warm_up, log)
        for instance, executor in zip(self.instances, self._executors):
            worker = asyncio.create_task(self._work(instance, executor))
            worker.add_done_callback(self._worker_ended)
            self._workers.append(worker)
        self.ready = True

    def _worker_ended(self, worker: asyncio.Task) -> None:
        """A worker that died of a bug must not leave requests waiting forever: fail them
        and refuse new ones (/health turns 503)."""
        if worker.cancelled() or worker.exception() is None:
            return
        self.ready = False
        _fail(self._pending, worker.exception())
        self._pending.clear()
        self._pending_rows = 0

    @property
    def queued_rows(self) -> int:
        return self._pending_rows

    async def submit(self, request: ActRequest, is_connected: Callable[[], bool] = lambda: True) -> Result:
        if not self.ready or not self.accepting:
            raise Overloaded("the server is " + ("warming up" if self.accepting else "shutting down"))
        if self._pending_rows + request.rows > self.max_queue_rows:
            raise Overloaded(f"the queue is full ({self._pending_rows} of {self.max_queue_rows} rows waiting)")
        loop = asyncio.get_running_loop()
        pending = _Pending(request, loop.create_future(), loop.time(), is_connected)
        self._pending.append(pending)
        self._pending_rows += request.rows
        self._last_arrival = pending.arrival
        self.metrics.queue_rows.set(self._pending_rows)
        self._wakeup.set()
        # A handler cancelled while waiting cancels its future; the worker then skips it.
        return await pending.future

    async def stop(self, timeout: float = DRAIN_TIMEOUT_S) -> None:
        """Refuse new requests, answer every queued one, then stop the worker; after
        `timeout` seconds, answer what is left with Overloaded (503) instead."""
        self.accepting = False
        if self._workers:
            self._wakeup.set()
            try:
                # A worker that died has failed its requests already (_worker_ended).
                await asyncio.wait_for(asyncio.shield(asyncio.gather(*self._workers, return_exceptions=True)), timeout)
            except asyncio.TimeoutError:
                self.drained = False
                for worker in self._workers:
                    worker.cancel()
                # A cancelled worker answers its running batch's requests (_run) at once.
                await asyncio.gather(*self._workers, return_exceptions=True)
                self.cut_off += _fail(self._pending, Overloaded("the server stopped before this request ran"))
                self._pending.clear()
        # Not waiting for a batch stuck on the device, or for a warm-up: the threads are left
        # to the process's exit (`dpa serve` exits at once when not drained).
        for executor in self._executors:
            executor.shutdown(wait=bool(self._workers) and self.drained)

    async def _work(self, instance: ServedPolicy, executor: concurrent.futures.Executor) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self._pending:
                if not self.accepting:
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
            # Wait for a full batch, while requests keep coming (see the module doc). Another
            # idle worker may take them meanwhile: then this one waits again.
            idle_until = max(loop.time(), self._pending[0].arrival) + IDLE_WAITS * self.max_wait_s
            while self._pending_rows < self.max_rows and self.accepting:
                quiet_until = max(self._last_arrival, self._last_batch_end) + self.max_wait_s
                remaining = min(quiet_until, idle_until) - loop.time()
                if remaining <= 0:
                    break
                self._wakeup.clear()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), remaining)
                except asyncio.TimeoutError:
                    break
            batch, rows = [], 0
            while self._pending and rows + self._pending[0].request.rows <= self.max_rows:
                pending = self._pending.popleft()
                self._pending_rows -= pending.request.rows
                if pending.future.cancelled() or not pending.is_connected():
                    self.metrics.dropped.inc()
                    if not pending.future.done():
                        pending.future.set_exception(ClientGone())
                        pending.future.exception()  # retrieved: nobody may be waiting
                    continue
                batch.append(pending)
                rows += pending.request.rows
            self.metrics.queue_rows.set(self._pending_rows)
            if batch:
                await self._run(loop, instance, executor, batch)
                self._last_batch_end = loop.time()

    async def _run(self, loop, instance: ServedPolicy, executor: concurrent.futures.Executor, batch) -> None:
        started = loop.time()
        try:
            actions, timings = await loop.run_in_executor(executor, instance.act, [p.request for p in batch])
        # A batch still running when stop() gives up answers its requests with 503.
        except asyncio.CancelledError:
            self.cut_off += _fail(batch, Overloaded("the server stopped before this request's batch finished"))
            raise
        # A failing batch fails its own requests (a 500 each); the server keeps serving.
        except Exception as error:  # noqa: BLE001
            self.metrics.failed_batches.inc()
            _fail(batch, error)
            return
        if len(actions) != len(batch):
            self.metrics.failed_batches.inc()
            _fail(batch, RuntimeError(f"the policy returned {len(actions)} results for {len(batch)} requests"))
            return
        self.metrics.observe_batch(timings["batch_rows"], timings["compute_ms"] / 1e3)
        for pending, action in zip(batch, actions):
            if pending.future.done():
                continue
            if isinstance(action, NonFiniteError):  # this request's alone; the others get theirs
                self.metrics.non_finite_actions.inc()
                pending.future.set_exception(action)
            else:
                pending.future.set_result(Result(action, {"queue_ms": 1e3 * (started - pending.arrival), **timings}))


def check_instances(policy: Union[ServedPolicy, Sequence[ServedPolicy]]) -> List[ServedPolicy]:
    """`policy` as a list of instances, checked: at least one, all serving the same spec, none
    listed twice. That they share no model or sampler is the caller's to ensure (ServedPolicy)."""
    instances = [policy] if isinstance(policy, ServedPolicy) else list(policy)
    if not instances or not all(isinstance(p, ServedPolicy) for p in instances):
        raise TypeError(f"policy must be a ServedPolicy or a non-empty sequence of them, got {policy!r}")
    if len({id(p) for p in instances}) != len(instances):
        raise ValueError("policy: the same instance is listed twice (each needs graphs and buffers of its own)")
    for other in instances[1:]:
        if other.spec != instances[0].spec:
            raise ValueError(f"policy: the instances serve different specs ({instances[0].spec} and {other.spec})")
    return instances


def _fail(pendings, error: BaseException) -> int:
    """Fails the requests not answered yet with `error`; returns how many."""
    failed = 0
    for pending in pendings:
        if not pending.future.done():
            pending.future.set_exception(error)
            failed += 1
    return failed
