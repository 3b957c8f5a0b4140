"""The KV-capacity ledger (pure: no I/O, time passed in).

Capacity comes from what each worker's engine reported at registration
(vLLM: KV blocks x block size). A fraction `headroom_ratio` of every worker is kept
free for bursts; a reservation that would eat into it is refused. Reservations carry
an expiry so a holder that dies without releasing cannot leak capacity for ever.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass


class UnknownWorker(Exception):
    pass


class InsufficientCapacity(Exception):
    pass


@dataclass(frozen=True)
class Reservation:
    reservation_id: str
    worker_id: str
    tokens: int
    expires_at: float
    run_id: str = ""
    hop_id: str = ""


@dataclass(frozen=True)
class WorkerLedger:
    worker_id: str
    pool: str
    capacity_tokens: int
    reserved_tokens: int
    usable_tokens: int
    reservations: int
    engine_usage_ratio: float = 0.0


class KvLedger:
    def __init__(
        self, headroom_ratio: float = 0.2, reservation_ttl_s: float = 300.0, high_usage_ratio: float = 0.85
    ) -> None:
        if not 0.0 <= headroom_ratio < 1.0:
            raise ValueError("headroom_ratio must be in [0, 1)")
        self.headroom_ratio = headroom_ratio
        self.reservation_ttl_s = reservation_ttl_s
        self.high_usage_ratio = high_usage_ratio
        self._engine_usage: dict[str, float] = {}  # worker -> KV usage its engine reports
        self._capacity: dict[str, tuple[str, int]] = {}  # worker -> (pool, tokens)
        self._reservations: dict[str, Reservation] = {}
        self._ids = itertools.count(1)

    def set_workers(self, capacity: dict[str, tuple[str, int]]) -> None:
        """Replace the worker set; reservations on workers that left are dropped."""
        self._capacity = dict(capacity)
        for rid, res in list(self._reservations.items()):
            if res.worker_id not in self._capacity:
                del self._reservations[rid]
        self._engine_usage = {w: r for w, r in self._engine_usage.items() if w in self._capacity}

    def set_engine_usage(self, worker_id: str, ratio: float) -> None:
        if worker_id in self._capacity:
            self._engine_usage[worker_id] = ratio

    def usable(self, worker_id: str) -> int:
        _, capacity = self._capacity[worker_id]
        return int(capacity * (1.0 - self.headroom_ratio))

    def reserved(self, worker_id: str) -> int:
        return sum(r.tokens for r in self._reservations.values() if r.worker_id == worker_id)

    def reserve(
        self,
        worker_id: str,
        tokens: int,
        now: float,
        run_id: str = "",
        hop_id: str = "",
        *,
        protected: bool = False,
    ) -> Reservation:
        if tokens <= 0:
            raise ValueError("tokens must be positive")
        if worker_id not in self._capacity:
            raise UnknownWorker(f"unknown worker '{worker_id}'")
        self.expire(now)
        engine_usage = self._engine_usage.get(worker_id, 0.0)
        if not protected and engine_usage > self.high_usage_ratio:
            raise InsufficientCapacity(
                f"worker '{worker_id}' reports {engine_usage:.0%} KV usage, above the "
                f"{self.high_usage_ratio:.0%} mark: only realtime work is admitted now"
            )
        usable = self.usable(worker_id)
        reserved = self.reserved(worker_id)
        if reserved + tokens > usable:
            raise InsufficientCapacity(
                f"worker '{worker_id}' has {usable - reserved} of {usable} usable KV tokens free "
                f"({self.headroom_ratio:.0%} headroom kept); {tokens} requested"
            )
        res = Reservation(
            f"r{next(self._ids)}", worker_id, tokens, now + self.reservation_ttl_s, run_id, hop_id
        )
        self._reservations[res.reservation_id] = res
        return res

    def release(self, reservation_id: str) -> bool:
        return self._reservations.pop(reservation_id, None) is not None

    def expire(self, now: float) -> int:
        expired = [rid for rid, r in self._reservations.items() if r.expires_at <= now]
        for rid in expired:
            del self._reservations[rid]
        return len(expired)

    def snapshot(self) -> list[WorkerLedger]:
        rows = []
        for worker_id, (pool, capacity) in sorted(self._capacity.items()):
            mine = [r for r in self._reservations.values() if r.worker_id == worker_id]
            rows.append(
                WorkerLedger(
                    worker_id,
                    pool,
                    capacity,
                    sum(r.tokens for r in mine),
                    self.usable(worker_id),
                    len(mine),
                    self._engine_usage.get(worker_id, 0.0),
                )
            )
        return rows
