"""Which workers may take hops right now: one circuit breaker per worker, fed by hop
failures and by active gRPC health checks, so a worker that stops answering leaves
scheduling within seconds instead of when its etcd lease finally expires."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inferx.discovery import ChannelPool
from inferx.pools import PoolDirectory
from inferx.resilience import BreakerBoard, BreakerState, CircuitBreaker

log = logging.getLogger("inferx.scheduler.health")

# A transport failure of a hop is strong evidence: one opens the breaker. Health
# checks can be slow under load, so it takes several failed ones in a row.
HOP_FAILURES_TO_OPEN = 1
HEALTH_FAILURES_TO_OPEN = 3
OPEN_S = 3.0
# A worker silent this many checks in a row (frozen, hung) has its running hops given
# up (`on_silent`) so they are re-dispatched now, not when the connection's keepalive
# notices (30 s + 10 s): a few more than take it out of scheduling, as a hop given up
# is work done again elsewhere.
HEALTH_FAILURES_TO_ABANDON = 5


class WorkerHealth:
    def __init__(
        self,
        directory: PoolDirectory,
        channels: ChannelPool,
        on_change: Callable[[], None],
        on_silent: Callable[[str, str], None] | None = None,
    ) -> None:
        """`on_change`: a worker was taken out; `on_silent(address, reason)`: a worker
        has been silent `HEALTH_FAILURES_TO_ABANDON` checks in a row (said once per
        silence)."""
        self._directory = directory
        self._channels = channels
        self._on_change = on_change
        self._on_silent = on_silent
        self.breakers = BreakerBoard(CircuitBreaker(failure_threshold=HOP_FAILURES_TO_OPEN, open_s=OPEN_S))
        self._health_failures: dict[str, int] = {}
        # Workers whose breakers health checks opened: health checks close them again.
        self._taken_out_by_health: set[str] = set()
        self._task: asyncio.Task[None] | None = None

    def usable(self, worker_id: str, now: float | None = None) -> bool:
        """Open breakers exclude a worker until OPEN_S passed; then one hop probes it."""
        breaker = self.breakers.breakers.get(worker_id)
        if breaker is None:
            return True
        return breaker.admits(now if now is not None else time.monotonic())

    def hop_failed(self, worker_id: str) -> None:
        breaker = self.breakers.get(worker_id)
        before = breaker.state
        breaker.force_open(time.monotonic())
        self._taken_out_by_health.discard(worker_id)  # a hop probes it now, not health checks
        if before != BreakerState.OPEN:
            log.warning("worker %s failed a hop: no new hops for %.0fs", worker_id, OPEN_S)

    def hop_succeeded(self, worker_id: str) -> None:
        breaker = self.breakers.breakers.get(worker_id)
        if breaker is not None:
            breaker.record(True, time.monotonic())

    def states(self) -> dict[str, str]:
        return {w: s.name.lower() for w, s in self.breakers.states().items()}

    def start(self, interval_s: float = 1.0) -> None:
        self._task = asyncio.create_task(self._probe_forever(interval_s), name="worker-health")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _probe_forever(self, interval_s: float) -> None:
        while True:
            started = time.monotonic()
            workers = self._directory.all_workers()
            # One round per interval: each probe gets most of it, all run at once.
            results = await asyncio.gather(*(self._probe(w.address, 0.8 * interval_s) for w in workers))
            # The directory as it is now, not as the round started: a worker that joined
            # during the probes may already have a breaker (a failed hop).
            self._forget_all_but({w.worker_id for w in self._directory.all_workers()})
            changed = False
            for worker, ok in zip(workers, results, strict=True):
                if ok:
                    self._health_failures.pop(worker.worker_id, None)
                    self._answers_again(worker.worker_id)
                    continue
                failures = self._health_failures.get(worker.worker_id, 0) + 1
                self._health_failures[worker.worker_id] = failures
                if failures >= HEALTH_FAILURES_TO_OPEN:
                    if self.usable(worker.worker_id):
                        log.warning(
                            "worker %s failed %d health checks: taking it out", worker.worker_id, failures
                        )
                        changed = True
                    # Still failing: the open period starts again, no probe goes to it.
                    self.breakers.get(worker.worker_id).force_open(time.monotonic())
                    self._taken_out_by_health.add(worker.worker_id)
                if failures == HEALTH_FAILURES_TO_ABANDON and self._on_silent is not None:
                    reason = f"worker {worker.worker_id} failed {failures} health checks in a row"
                    log.warning("%s: giving up the hops running on it (they are re-dispatched)", reason)
                    self._on_silent(worker.address, reason)
            if changed:
                self._on_change()
            await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - started)))

    def _answers_again(self, worker_id: str) -> None:
        """A worker that health checks took out (frozen, starved) and that answers them
        again once its open period has passed is closed by that answer, as a hop probe
        would close it: with no traffic for its pool no hop would come to probe it, and
        its breaker would read "open" (`inferx status`, `wait_workers`) for as long as the
        pool stays idle. A breaker a failed hop opened waits for a hop to probe it."""
        if worker_id not in self._taken_out_by_health:
            return
        breaker = self.breakers.breakers.get(worker_id)
        now = time.monotonic()
        if breaker is None:
            self._taken_out_by_health.discard(worker_id)
        elif breaker.admits(now):  # the open period has passed: half-open
            breaker.record(True, now)
            self._taken_out_by_health.discard(worker_id)

    def _forget_all_but(self, present: set[str]) -> None:
        """A worker that left the directory (deregistered, its lease expired) takes its
        breaker and failure count with it: `states()` (`inferx status`) would list it for
        as long as the scheduler runs, and under worker churn the board would only grow.
        A worker id is never reused (each process makes its own)."""
        for gone in [w for w in self.breakers.breakers if w not in present]:
            del self.breakers.breakers[gone]
        for gone in [w for w in self._health_failures if w not in present]:
            del self._health_failures[gone]
        self._taken_out_by_health &= present

    async def _probe(self, address: str, timeout_s: float) -> bool:
        stub = health_pb2_grpc.HealthStub(self._channels.get(address))
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING
