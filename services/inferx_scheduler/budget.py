"""The scheduler's local KV budget (pure: no I/O, time passed in).

The memory-pool leases each scheduler a budget of KV tokens per worker; the scheduler
reserves a hop's (or a look-ahead's) KV from it here, with no call, and releases it
here when the hop ends (issue #14: Reserve and Release were ~1.8 ms of a hop's ~4.3 ms
and 0.69 ms of the memory-pool's CPU per hop). `budget_sync` talks to the memory-pool:
it declares the budget wanted per worker (`begin_sync`), reports what is reserved from
it, and applies what was granted (`apply_grants`), off the hop's critical path.

Sizing, per worker, from what the hops asked for over the last `window` syncs:
demand = the most reserved at once (plus what did not fit), spare = max(2 x the largest
request, demand / 2); the budget aims at demand + spare. It asks for more when it holds
less than that (the low-water mark; at the latest when the next hop of the largest
recent size would not fit, which wakes the sync at once), and returns what it holds
above twice that, so idle budget goes back within `window` syncs.

Safety: a budget may be used only while its lease is surely valid (`valid_until`, a
fraction of the lease counted from when the renewal was *sent*, so before the pool's own
expiry); it is lowered here before the pool is told (a return), raised only when the
pool's grant arrives. So the budget used here is never more than the pool counts for
this scheduler. What does not fit (or comes after the lease) is not reserved here: the
caller reserves it from the memory-pool directly, as every hop used to be.

Invariants: per worker, used == the sum of its live reservations, and used <= granted
after every reservation made here (a grant lowered under used only after the pool lost
the lease, which leaves no room until enough is released); nothing leaks: releasing
every reservation (or their leases ending) brings every worker back to 0 used.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

ReservationKind = Literal["hop", "lookahead"]
HOP: ReservationKind = "hop"
LOOKAHEAD: ReservationKind = "lookahead"

# The lease is used for this fraction of its length, counted from the renewal's send
# time: the rest is margin for a slow reply and clocks (the pool counts from receipt).
VALID_FRACTION = 0.8
WINDOW_SYNCS = 10  # how many sync periods the demand is remembered for


@dataclass(frozen=True)
class LocalReservation:
    reservation_id: str
    worker_id: str
    tokens: int
    kind: ReservationKind = HOP
    expires_at: float = math.inf  # hops: until released; look-aheads: their lease
    run_id: str = ""
    hop_id: str = ""


@dataclass(frozen=True)
class BudgetRow:
    """One worker's line of a budget declaration (see MemoryPool.SyncBudget)."""

    worker_id: str
    target_tokens: int
    reserved_tokens: int
    reservations: int
    lookahead_tokens: int
    lookahead_reservations: int


@dataclass
class _Worker:
    granted: int = 0
    used: int = 0
    engine_usage: float = 0.0
    peaks: deque[int] = field(default_factory=lambda: deque(maxlen=WINDOW_SYNCS))
    largests: deque[int] = field(default_factory=lambda: deque(maxlen=WINDOW_SYNCS))
    period_peak: int = 0  # most reserved at once since the last sync
    period_largest: int = 0  # largest request since the last sync
    missed: int = 0  # tokens asked for beyond the budget since the last sync

    def demand(self) -> tuple[int, int]:
        peak = max(max(self.peaks, default=0), self.period_peak, self.used + self.missed)
        largest = max(max(self.largests, default=0), self.period_largest)
        return peak, largest

    def want(self) -> int:
        peak, largest = self.demand()
        return peak + max(2 * largest, peak // 2)


class LocalBudget:
    def __init__(self, high_usage_ratio: float = 0.85) -> None:
        self.high_usage_ratio = high_usage_ratio
        self.valid_until = -math.inf  # monotonic; no budget may be used after it
        self._workers: dict[str, _Worker] = {}
        self._reservations: dict[str, LocalReservation] = {}
        self._ids = itertools.count(1)
        #: a reservation found the budget short (or running low): sync now, not at the
        #: next period. The sync clears it.
        self.grow_wanted = False

    # ----- the hop path ------------------------------------------------------------

    def reserve(
        self,
        worker_id: str,
        tokens: int,
        now: float,
        *,
        kind: ReservationKind = HOP,
        protected: bool = False,
        lease_s: float | None = None,
        replaces: str = "",
        run_id: str = "",
        hop_id: str = "",
    ) -> LocalReservation | None:
        """Reserve `tokens` on `worker_id` from the budget, or None when they do not
        fit (the caller asks the memory-pool instead). As the memory-pool's Reserve:
        `replaces` names a look-ahead reserved here for this hop, whose tokens count as
        free on the same worker and which goes when this one is granted; above the
        high-usage mark (engine-reported) only `protected` (realtime) work or a hop
        taking over its look-ahead's room is admitted."""
        if tokens <= 0:
            raise ValueError("tokens must be positive")
        if lease_s is not None and not (lease_s > 0 and math.isfinite(lease_s)):
            raise ValueError("lease_s must be positive and finite")
        self.expire(now)
        w = self._workers.setdefault(worker_id, _Worker())
        w.period_largest = max(w.period_largest, tokens)
        replaced = self._reservations.get(replaces) if replaces else None
        freed = replaced.tokens if replaced is not None and replaced.worker_id == worker_id else 0
        if not protected and not freed and w.engine_usage > self.high_usage_ratio:
            return None  # the memory-pool decides (it refuses all but realtime work)
        if now >= self.valid_until or w.used - freed + tokens > w.granted:
            w.missed += tokens
            self.grow_wanted = True
            return None
        if replaced is not None:
            self._remove(replaced)
        expires_at = now + lease_s if lease_s is not None else math.inf
        res = LocalReservation(
            f"local-{next(self._ids)}", worker_id, tokens, kind, expires_at, run_id, hop_id
        )
        self._reservations[res.reservation_id] = res
        w.used += tokens
        w.period_peak = max(w.period_peak, w.used)
        _, largest = w.demand()
        if w.granted - w.used < largest:  # the next hop of that size would not fit
            self.grow_wanted = True
        return res

    def release(self, reservation_id: str) -> bool:
        res = self._reservations.get(reservation_id)
        if res is None:
            return False
        self._remove(res)
        return True

    def expire(self, now: float) -> int:
        """End the look-ahead reservations whose lease ran out."""
        gone = [r for r in self._reservations.values() if r.expires_at <= now]
        for res in gone:
            self._remove(res)
        return len(gone)

    # ----- the sync ----------------------------------------------------------------

    def begin_sync(self, now: float) -> list[BudgetRow]:
        """The declaration to send now: per worker, the budget wanted and what is
        reserved from it. A budget lowered is lowered here at once (no reservation may
        use what is being returned); a raise waits for `apply_grants`."""
        self.expire(now)
        self.grow_wanted = False
        rows = []
        for worker_id, w in list(self._workers.items()):
            want = w.want()
            if w.granted < want:
                target = want  # below the low-water mark: ask ahead of need
            elif w.granted > 2 * want:
                target = want  # idle budget goes back
            else:
                target = w.granted
            target = max(target, w.used)
            w.granted = min(w.granted, target)
            w.peaks.append(max(w.period_peak, w.used))
            w.largests.append(w.period_largest)
            w.period_peak, w.period_largest, w.missed = w.used, 0, 0
            if target == 0 and w.used == 0 and not any(w.peaks) and not any(w.largests):
                del self._workers[worker_id]  # idle for the whole window: forgotten
                continue
            mine = [r for r in self._reservations.values() if r.worker_id == worker_id]
            ahead = [r for r in mine if r.kind == LOOKAHEAD]
            rows.append(
                BudgetRow(
                    worker_id,
                    target,
                    w.used,
                    len(mine),
                    sum(r.tokens for r in ahead),
                    len(ahead),
                )
            )
        return rows

    def apply_grants(
        self,
        grants: dict[str, int],
        sent_at: float,
        ttl_s: float,
        *,
        engine_usage: dict[str, float] | None = None,
        high_usage_ratio: float | None = None,
    ) -> None:
        """The pool's answer to the declaration sent at `sent_at`: the budget per
        worker now (a worker it does not list has none), valid for `ttl_s` from then."""
        for worker_id, w in self._workers.items():
            w.granted = max(0, grants.get(worker_id, 0))
            if engine_usage is not None:
                w.engine_usage = engine_usage.get(worker_id, 0.0)
        if high_usage_ratio is not None:
            self.high_usage_ratio = high_usage_ratio
        self.valid_until = sent_at + VALID_FRACTION * ttl_s

    def forget_grants(self) -> None:
        """The budget's grantor is gone (another memory-pool answers now): none is left
        to use until the next grant. Reservations stay until released."""
        for w in self._workers.values():
            w.granted = 0
        self.valid_until = -math.inf

    # ----- what it holds -------------------------------------------------------------

    def granted(self, worker_id: str) -> int:
        w = self._workers.get(worker_id)
        return w.granted if w is not None else 0

    def used(self, worker_id: str) -> int:
        w = self._workers.get(worker_id)
        return w.used if w is not None else 0

    def workers(self) -> list[str]:
        return list(self._workers)

    def reservations(self) -> list[LocalReservation]:
        return list(self._reservations.values())

    def get(self, reservation_id: str) -> LocalReservation | None:
        return self._reservations.get(reservation_id)

    def _remove(self, res: LocalReservation) -> None:
        del self._reservations[res.reservation_id]
        w = self._workers.get(res.worker_id)
        if w is None:  # forgotten while a reservation lived: cannot happen (used > 0 keeps it)
            return
        w.used -= res.tokens
