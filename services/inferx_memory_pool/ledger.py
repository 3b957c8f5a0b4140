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

Budgets (issue #14): a scheduler (a holder) leases a budget of KV tokens per worker
(`sync_budget`) and reserves its hops from it locally, so a hop costs the pool no call.
A budget counts against the worker's capacity whether used or not, exactly like a
reservation: reservations and every holder's budgets together never exceed usable(worker).
Each call declares the holder's whole budget (idempotent): a budget is lowered to what is
asked at once, raised by as much as the worker has free, and a worker left out is
returned. Budgets are leased: renewed by every call for `ttl_s`, dropped when not
renewed by then, when their worker leaves, or when their holder dies (`drop_holder`).
What a holder reports having reserved from its budget is what `snapshot` shows as
reserved (it is part of the budget, never counted twice).

Invariants: committed(worker) = reserved(worker) + leased(worker) is never negative and
never above usable(worker) (the capacity check covers swaps too, as the replaced tokens
leave as the new ones come in; a budget only grows into free room); no reservation or
budget outlives its expiry once `expire(now)` ran (every call that takes `now` runs it
first); reservations and budgets never outlive their worker or a dead holder.
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
class BudgetWant:
    """One worker's row of a holder's budget declaration: the budget wanted, and what
    the holder has reserved from it locally (shown, not counted again)."""

    worker_id: str
    target_tokens: int
    reserved_tokens: int = 0
    reservations: int = 0
    lookahead_tokens: int = 0
    lookahead_reservations: int = 0


@dataclass
class BudgetLease:
    holder: str
    worker_id: str
    granted: int
    expires_at: float
    reported: BudgetWant


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
    leased_tokens: int = 0  # budgets of schedulers on this worker (used or not)
    budget_holders: int = 0


class KvLedger:
    def __init__(
        self,
        headroom_ratio: float = 0.2,
        reservation_ttl_s: float = 300.0,
        high_usage_ratio: float = 0.85,
        lookahead_ttl_s: float = 30.0,
        budget_ttl_s: float = 10.0,
    ) -> None:
        if not 0.0 <= headroom_ratio < 1.0:
            raise ValueError("headroom_ratio must be in [0, 1)")
        for name, ttl in (
            ("reservation_ttl_s", reservation_ttl_s),
            ("lookahead_ttl_s", lookahead_ttl_s),
            ("budget_ttl_s", budget_ttl_s),
        ):
            if not (ttl > 0 and math.isfinite(ttl)):
                raise ValueError(f"{name} must be positive and finite")
        self.headroom_ratio = headroom_ratio
        self.reservation_ttl_s = reservation_ttl_s  # default lease of a hop reservation
        self.lookahead_ttl_s = lookahead_ttl_s  # default lease of a look-ahead reservation
        self.budget_ttl_s = budget_ttl_s  # default and longest lease of a budget
        self.high_usage_ratio = high_usage_ratio
        self._budgets: dict[tuple[str, str], BudgetLease] = {}  # (holder, worker) -> lease
        self._budget_seq: dict[str, int] = {}  # holder -> seq of the last declaration applied
        self._engine_usage: dict[str, float] = {}  # worker -> KV usage its engine reports
        self._capacity: dict[str, tuple[str, int]] = {}  # worker -> (pool, tokens)
        self._reservations: dict[str, Reservation] = {}
        self._ids = itertools.count(1)

    def fresh(self) -> KvLedger:
        """A ledger with these settings, workers and engine usage, and nothing reserved
        or leased: what a memory-pool starts from when it takes the ledger over (the
        budgets come back with the schedulers' next syncs)."""
        ledger = KvLedger(
            self.headroom_ratio,
            self.reservation_ttl_s,
            self.high_usage_ratio,
            lookahead_ttl_s=self.lookahead_ttl_s,
            budget_ttl_s=self.budget_ttl_s,
        )
        ledger.set_workers(self._capacity)
        for worker_id, ratio in self._engine_usage.items():
            ledger.set_engine_usage(worker_id, ratio)
        return ledger

    def set_workers(self, capacity: dict[str, tuple[str, int]]) -> None:
        """Replace the worker set; reservations on workers that left are dropped."""
        self._capacity = dict(capacity)
        self._drop(lambda r: r.worker_id not in self._capacity)
        self._drop_budgets(lambda b: b.worker_id not in self._capacity)
        self._engine_usage = {w: r for w, r in self._engine_usage.items() if w in self._capacity}

    def set_engine_usage(self, worker_id: str, ratio: float) -> None:
        if worker_id in self._capacity:
            self._engine_usage[worker_id] = ratio

    def usable(self, worker_id: str) -> int:
        _, capacity = self._capacity[worker_id]
        return int(capacity * (1.0 - self.headroom_ratio))

    def engine_usage(self, worker_id: str) -> float:
        return self._engine_usage.get(worker_id, 0.0)

    def reserved(self, worker_id: str) -> int:
        """Tokens of the reservations made here (Reserve), budgets not included."""
        return sum(r.tokens for r in self._reservations.values() if r.worker_id == worker_id)

    def leased(self, worker_id: str) -> int:
        """Tokens of the budgets holders lease on the worker (used or not)."""
        return sum(b.granted for b in self._budgets.values() if b.worker_id == worker_id)

    def committed(self, worker_id: str) -> int:
        """What is taken from the worker's usable KV: reservations and budgets."""
        return self.reserved(worker_id) + self.leased(worker_id)

    def budgets(self) -> list[BudgetLease]:
        return list(self._budgets.values())

    def budget_of(self, holder: str, worker_id: str) -> int:
        lease = self._budgets.get((holder, worker_id))
        return lease.granted if lease is not None else 0

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
        reserved = self.committed(worker_id) - freed
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

    def sync_budget(
        self,
        holder: str,
        wants: list[BudgetWant],
        now: float,
        *,
        ttl_s: float | None = None,
        seq: int = 0,
    ) -> dict[str, int]:
        """Apply `holder`'s whole budget declaration; returns its budget per worker now.

        Per worker listed: a budget above what is asked is lowered to it; one below is
        raised by at most what the worker has free (usable minus reservations and every
        budget, this one included), so committed(worker) never exceeds usable(worker).
        The holder's budgets on workers not listed are returned. Every budget of the
        holder is renewed for `ttl_s` (None: the default; never longer). A declaration
        whose `seq` (> 0) is not above the last applied one changes nothing.
        """
        self.expire(now)
        if not holder:
            raise ValueError("a budget needs a holder")
        if ttl_s is None:
            ttl_s = self.budget_ttl_s
        if not (ttl_s > 0 and math.isfinite(ttl_s)):
            raise ValueError("ttl_s must be positive and finite")
        ttl_s = min(ttl_s, self.budget_ttl_s)
        if seq and seq <= self._budget_seq.get(holder, 0):
            return self._grants_of(holder)  # a late or repeated declaration
        if seq:
            self._budget_seq[holder] = seq
        listed: dict[str, BudgetWant] = {}
        for want in wants:
            if want.target_tokens < 0:
                raise ValueError("target_tokens must not be negative")
            if want.worker_id in self._capacity:
                listed[want.worker_id] = want  # the last row of a worker wins
        self._drop_budgets(lambda b: b.holder == holder and b.worker_id not in listed)
        for worker_id, want in listed.items():
            lease = self._budgets.get((holder, worker_id))
            current = lease.granted if lease is not None else 0
            granted = want.target_tokens
            if granted > current:
                free = max(0, self.usable(worker_id) - self.committed(worker_id))
                granted = current + min(granted - current, free)
            if granted == 0 and want.reserved_tokens == 0:
                self._budgets.pop((holder, worker_id), None)
                continue
            self._budgets[(holder, worker_id)] = BudgetLease(holder, worker_id, granted, now + ttl_s, want)
        return self._grants_of(holder)

    def _grants_of(self, holder: str) -> dict[str, int]:
        return {b.worker_id: b.granted for b in self._budgets.values() if b.holder == holder}

    def expire(self, now: float) -> int:
        self._drop_budgets(lambda b: b.expires_at <= now)
        return self._drop(lambda r: r.expires_at <= now)

    def drop_holder(self, holder: str) -> int:
        """Drop every reservation and budget of `holder` (it died); returns how many
        reservations (budgets are not counted)."""
        if not holder:
            return 0
        self._drop_budgets(lambda b: b.holder == holder)
        self._budget_seq.pop(holder, None)
        return self._drop(lambda r: r.holder == holder)

    def snapshot(self, now: float | None = None) -> list[WorkerLedger]:
        """One row per worker; expires what is due first when `now` is given."""
        if now is not None:
            self.expire(now)
        rows = []
        for worker_id, (pool, capacity) in sorted(self._capacity.items()):
            mine = [r for r in self._reservations.values() if r.worker_id == worker_id]
            ahead = [r for r in mine if r.kind == LOOKAHEAD]
            budgets = [b for b in self._budgets.values() if b.worker_id == worker_id]
            local = [b.reported for b in budgets]
            rows.append(
                WorkerLedger(
                    worker_id,
                    pool,
                    capacity,
                    sum(r.tokens for r in mine) + sum(w.reserved_tokens for w in local),
                    self.usable(worker_id),
                    len(mine) + sum(w.reservations for w in local),
                    self._engine_usage.get(worker_id, 0.0),
                    sum(r.tokens for r in ahead) + sum(w.lookahead_tokens for w in local),
                    len(ahead) + sum(w.lookahead_reservations for w in local),
                    sum(b.granted for b in budgets),
                    len(budgets),
                )
            )
        return rows

    def _drop_budgets(self, doomed: Callable[[BudgetLease], bool]) -> int:
        gone = [key for key, b in self._budgets.items() if doomed(b)]
        for key in gone:
            del self._budgets[key]
        return len(gone)

    def _drop(self, doomed: Callable[[Reservation], bool]) -> int:
        gone = [rid for rid, r in self._reservations.items() if doomed(r)]
        for rid in gone:
            del self._reservations[rid]
        return len(gone)
