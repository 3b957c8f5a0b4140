"""The simulator's time-driven passes (ticks): like the live dispatcher's one wake-up
timer, one tick is pending at a time -- set when the queue asks to be woken earlier
than the pending one or none is pending -- and a tick it replaced is dropped, not acted
on. Checked from outside, against a model of that timer, on a seeded replay where hops
wait on time (realtime guard, affinity patience, holds)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from inferx.scheduling.policy import Policy
from inferx.scheduling.queue import DispatchQueue, QueuedHop, WorkerSlots
from inferx.scheduling.registry import make_policy
from inferx.scheduling.views import HopView
from inferx.sim.cluster import TICK_S, ClusterSim
from inferx.sim.profile import EngineProfile
from inferx.sim.trace import TraceConfig, generate

TIERS = {"chat": {"realtime": 0.6, "batch": 0.4}, "bfcl": "standard", "swe": {"batch": 0.5, "standard": 0.5}}


class CallLog(DispatchQueue):
    """Records each `assign` call: its time, whether an event (a hop admitted or
    finished) came before it since the last call -- if not, a tick caused it -- and
    the wake-up it reported."""

    def __init__(self, policy: Policy) -> None:
        super().__init__(max_queued_per_pool=1 << 30, policy=policy)
        self.calls: list[tuple[float, bool, float | None]] = []
        self._event = False

    def submit(
        self, pool: str, run_id: str, hop_id: str, now: float, view: HopView | None = None
    ) -> QueuedHop:
        queued = super().submit(pool, run_id, hop_id, now, view)
        self._event = True  # only once admitted: a refused hop is followed by no pass
        return queued

    def finished(self, hop: QueuedHop, now: float | None = None, **outcome: Any) -> None:
        super().finished(hop, now, **outcome)
        self._event = True

    def assign(
        self, workers_by_pool: Mapping[str, Sequence[WorkerSlots]], now: float | None = None
    ) -> list[QueuedHop]:
        assigned = super().assign(workers_by_pool, now)
        self.calls.append((self._now, not self._event, self.next_wake))
        self._event = False
        return assigned


def replay(
    workers: int = 4, pools: int = 2, duration_s: float = 6, rate: float = 20.0
) -> tuple[ClusterSim, CallLog]:
    trace = generate(TraceConfig(seed=11, duration_s=duration_s, rate_per_s=rate, tiers=TIERS))
    queues: list[CallLog] = []

    def factory(policy: Policy) -> DispatchQueue:
        queues.append(CallLog(policy))
        return queues[-1]

    # A small engine so that hops queue and wait on the realtime guard and on holds
    # (placed by room alone, as when this scenario was set: other tiers placed apart
    # from realtime wait on the guard less, and fewer pending ticks move earlier).
    profile = EngineProfile(kv_capacity_tokens=120_000, max_num_seqs=16)
    policy = make_policy("chain-aware", realtime_apart=0.0)
    sim = ClusterSim(trace, policy, profile, workers, pools=pools, queue_factory=factory)
    sim.run()
    return sim, queues[0]


def test_only_the_latest_requested_tick_runs_a_pass_and_none_is_missed() -> None:
    sim, log = replay()
    pending: float | None = None  # the one wake-up timer, as the live dispatcher keeps it
    ticks = 0
    for now, by_tick, wake in log.calls:
        if by_tick:
            # A pass nobody asked for (a replaced tick acted on) fails here.
            assert pending is not None and now == pending, (now, pending)
            ticks += 1
            pending = None  # the timer fired
        else:
            # A requested wake-up that passed without a pass (a tick lost) fails here.
            assert pending is None or now <= pending, (now, pending)
        if wake is not None:
            target = max(wake, now + TICK_S)
            if pending is None or pending <= now or target < pending:
                pending = target
    assert ticks == sim.ticks_run > 100, "the replay must have hops waiting on time"
    assert sim.ticks_dropped >= 5, "the replay must move the pending tick earlier, or nothing is dropped"


def test_ticks_are_bounded_by_time_not_by_the_waits_requested() -> None:
    # Consecutive ticks that run are at least TICK_S apart; passes follow the events.
    sim, log = replay(workers=8, pools=2, duration_s=4, rate=60.0)
    makespan = log.calls[-1][0]
    assert sim.ticks_run <= makespan / TICK_S + 1
    events = sum(1 for _, by_tick, _ in log.calls if not by_tick)
    assert len(log.calls) == events + sim.ticks_run
