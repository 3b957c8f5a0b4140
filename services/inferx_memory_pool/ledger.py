"""The KV-capacity ledger (pure: no I/O, time passed in).

Capacity comes from what each worker's engine reported at registration
(vLLM: KV blocks x block size). A fraction `headroom_ratio` of every worker is kept
free for bursts; a reservation that would eat into it is refused. Reservations carry
an expiry (a lease) so a holder that dies without releasing cannot leak capacity for
ever; when the holder is named, its reservations can also be dropped as soon as it is
known to be dead (`drop_holder`).

Two kinds of reservation: a `hop` is about to run on the worker; a `lookahead` keeps
room for a chain's next hop before it is submitted. When that hop is reserved with
`replaces=<look-ahead id>`, the look-ahead is turned into the hop reservation
atomically: its tokens count as free for the request, so the hop cannot be refused
the room that was kept for it.

Invariants: reserved(worker) is never negative and never above usable(worker) (the
capacity check covers swaps too, as the replaced tokens leave as the new ones come
in); no reservation outlives its expiry once `expire(now)` ran (every call that takes
`now` runs it first); reservations never outlive their worker or a dead holder.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

ReservationKind = Literal["hop", "lookahead"]
HOP: ReservationKind = "hop"
LOOKAHEAD: ReservationKind = "lookahead"
KINDS: tuple[ReservationKind, ...] = (HOP, LOOKAHEAD)


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
    holder: str = ""  # registered service instance that holds it; "" = expires by time only
    kind: ReservationKind = HOP


@dataclass(frozen=True)
class WorkerLedger:
    worker_id: str
    pool: str
    capacity_tokens: int
    reserved_tokens: int
    usable_tokens: int
    reservations: int
    engine_usage_ratio: float = 0.0
    lookahead_tokens: int = 0  # part of reserved_tokens kept for next hops
    lookahead_reservations: int = 0


class KvLedger:
    def __init__(
        self,
        headroom_ratio: float = 0.2,
        reservation_ttl_s: float = 300.0,
        high_usage_ratio: float = 0.85,
        lookahead_ttl_s: float = 30.0,
    ) -> None:
        if not 0.0 <= headroom_ratio < 1.0:
            raise ValueError("headroom_ratio must be in [0, 1)")
        for name, ttl in (("reservation_ttl_s", reservation_ttl_s), ("lookahead_ttl_s", lookahead_ttl_s)):
            if not (ttl > 0 and math.isfinite(ttl)):
                raise ValueError(f"{name} must be positive and finite")
        self.headroom_ratio = headroom_ratio
        self.reservation_ttl_s = reservation_ttl_s  # default lease of a hop reservation
        self.lookahead_ttl_s = lookahead_ttl_s  # default lease of a look-ahead reservation
        self.high_usage_ratio = high_usage_ratio
        self._engine_usage: dict[str, float] = {}  # worker -> KV usage its engine reports
        self._capacity: dict[str, tuple[str, int]] = {}  # worker -> (pool, tokens)
        self._reservations: dict[str, Reservation] = {}
        self._ids = itertools.count(1)

    def set_workers(self, capacity: dict[str, tuple[str, int]]) -> None:
        """Replace the worker set; reservations on workers that left are dropped."""
        self._capacity = dict(capacity)
        self._drop(lambda r: r.worker_id not in self._capacity)
        self._engine_usage = {w: r for w, r in self._engine_usage.items() if w in self._capacity}

    def set_engine_usage(self, worker_id: str, ratio: float) -> None:
        if worker_id in self._capacity:
            self._engine_usage[worker_id] = ratio

    def usable(self, worker_id: str) -> int:
        _, capacity = self._capacity[worker_id]
        return int(capacity * (1.0 - self.headroom_ratio))

    def reserved(self, worker_id: str) -> int:
        return sum(r.tokens for r in self._reservations.values() if r.worker_id == worker_id)

    def get(self, reservation_id: str) -> Reservation | None:
        return self._reservations.get(reservation_id)

    def reservations(self) -> list[Reservation]:
        return list(self._reservations.values())

    def default_lease_s(self, kind: ReservationKind) -> float:
        return self.lookahead_ttl_s if kind == LOOKAHEAD else self.reservation_ttl_s

    def reserve(
        self,
        worker_id: str,
        tokens: int,
        now: float,
        run_id: str = "",
        hop_id: str = "",
        *,
        protected: bool = False,
        holder: str = "",
        lease_s: float | None = None,
        kind: ReservationKind = HOP,
        replaces: str = "",
    ) -> Reservation:
        """Grant `tokens` on `worker_id` for `lease_s` seconds (None: the kind's default).

        `replaces` names an earlier reservation (a look-ahead) this one takes over: on
        the same worker its tokens count as free for this request; on another worker
        they do not (the hop went elsewhere). Either way it is removed only when this
        reservation is granted; an unknown or expired id is ignored.
        """
        self.expire(now)
        if tokens <= 0:
            raise ValueError("tokens must be positive")
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if lease_s is None:
            lease_s = self.default_lease_s(kind)
        if not (lease_s > 0 and math.isfinite(lease_s)):
            raise ValueError("lease_s must be positive and finite")
        if worker_id not in self._capacity:
            raise UnknownWorker(f"unknown worker '{worker_id}'")
        replaced = self._reservations.get(replaces) if replaces else None
        freed = replaced.tokens if replaced is not None and replaced.worker_id == worker_id else 0
        engine_usage = self._engine_usage.get(worker_id, 0.0)
        # A hop taking over room kept for it on this worker is not refused for usage
        # that came after the room was kept: that is what the look-ahead was for.
        if not protected and not freed and engine_usage > self.high_usage_ratio:
            raise InsufficientCapacity(
                f"worker '{worker_id}' reports {engine_usage:.0%} KV usage, above the "
                f"{self.high_usage_ratio:.0%} mark: only realtime work is admitted now"
            )
        usable = self.usable(worker_id)
        reserved = self.reserved(worker_id) - freed
        if reserved + tokens > usable:
            raise InsufficientCapacity(
                f"worker '{worker_id}' has {usable - reserved} of {usable} usable KV tokens free "
                f"({self.headroom_ratio:.0%} headroom kept); {tokens} requested"
            )
        if replaced is not None:
            del self._reservations[replaced.reservation_id]
        res = Reservation(
            f"r{next(self._ids)}", worker_id, tokens, now + lease_s, run_id, hop_id, holder, kind
        )
        self._reservations[res.reservation_id] = res
        return res

    def release(self, reservation_id: str) -> bool:
        return self._reservations.pop(reservation_id, None) is not None

    def expire(self, now: float) -> int:
        return self._drop(lambda r: r.expires_at <= now)

    def drop_holder(self, holder: str) -> int:
        """Drop every reservation of `holder` (it died); returns how many."""
        if not holder:
            return 0
        return self._drop(lambda r: r.holder == holder)

    def snapshot(self, now: float | None = None) -> list[WorkerLedger]:
        """One row per worker; expires what is due first when `now` is given."""
        if now is not None:
            self.expire(now)
        rows = []
        for worker_id, (pool, capacity) in sorted(self._capacity.items()):
            mine = [r for r in self._reservations.values() if r.worker_id == worker_id]
            ahead = [r for r in mine if r.kind == LOOKAHEAD]
            rows.append(
                WorkerLedger(
                    worker_id,
                    pool,
                    capacity,
                    sum(r.tokens for r in mine),
                    self.usable(worker_id),
                    len(mine),
                    self._engine_usage.get(worker_id, 0.0),
                    sum(r.tokens for r in ahead),
                    len(ahead),
                )
            )
        return rows

    def _drop(self, doomed: Callable[[Reservation], bool]) -> int:
        gone = [rid for rid, r in self._reservations.items() if doomed(r)]
        for rid in gone:
            del self._reservations[rid]
        return len(gone)
