"""The off-peak batch rule (inferx.scheduling.off_peak): wait while busy or outside quiet
hours, never past the latest start the deadline allows."""

from __future__ import annotations

import pytest

from inferx.scheduling.off_peak import (
    OffPeakRule,
    in_quiet_hours,
    latest_start_s,
    off_peak_decision,
    parse_quiet_hours,
)
from inferx.scheduling.registry import make_policy
from inferx.sim.cluster import ClusterSim
from inferx.sim.trace import Trace, TraceConfig, generate
from tests.conftest import load_benchmark_script


def decide(
    rule: OffPeakRule,
    *,
    now: float = 0.0,
    hour: float = 12.0,
    load: float | None = 0.9,
    deadline: float = 8 * 3600.0,
    remaining: float = 60.0,
):
    return off_peak_decision(
        rule, now_s=now, hour_of_day=hour, load=load, deadline_s=deadline, remaining_s=remaining
    )


def test_waits_while_the_pool_is_busy_and_goes_when_there_is_room() -> None:
    rule = OffPeakRule(load_threshold=0.6)
    busy = decide(rule, load=0.9)
    assert not busy.go and busy.reason == "pool load 90% above 60%"
    assert decide(rule, load=0.6).go
    assert decide(rule, load=0.2).reason == "room"
    assert decide(rule, load=None).go  # unknown load: nothing says it is busy


def test_quiet_hours_gate_even_an_idle_pool() -> None:
    rule = OffPeakRule(load_threshold=0.6, quiet_hours=((22, 6),))
    outside = decide(rule, hour=14, load=0.0)
    assert not outside.go and outside.reason == "outside quiet hours (22:00-06:00)"
    assert decide(rule, hour=23, load=0.1).go
    assert decide(rule, hour=3, load=0.1).go
    assert not decide(rule, hour=3, load=0.95).go  # quiet hours, but busy all the same


def test_never_later_than_the_deadline_allows() -> None:
    rule = OffPeakRule(load_threshold=0.1, quiet_hours=((1, 2),), margin=2.0, recheck_s=5.0)
    deadline, remaining = 1000.0, 100.0
    latest = latest_start_s(rule, deadline, remaining)
    assert latest == 1000 - 200 - 5
    assert not decide(rule, now=latest - 1, load=1.0, deadline=deadline, remaining=remaining).go
    at = decide(rule, now=latest, load=1.0, deadline=deadline, remaining=remaining)
    assert at.go and at.reason == "deadline near: runs now"
    assert decide(rule, now=deadline + 1, load=1.0, deadline=deadline, remaining=remaining).go


def test_quiet_hours_parse_and_wrap_midnight() -> None:
    assert parse_quiet_hours("") == ()
    assert parse_quiet_hours("22-6, 13-14.5") == ((22.0, 6.0), (13.0, 14.5))
    spans = parse_quiet_hours("22-6")
    assert in_quiet_hours(22, spans) and in_quiet_hours(0, spans) and in_quiet_hours(5.99, spans)
    assert not in_quiet_hours(6, spans) and not in_quiet_hours(12, spans)
    for bad in ("22", "a-b", "5-5", "3-25"):
        with pytest.raises(ValueError, match="quiet hours"):
            parse_quiet_hours(bad)


def test_bad_rules_are_refused() -> None:
    with pytest.raises(ValueError, match="load_threshold"):
        OffPeakRule(load_threshold=-1)
    with pytest.raises(ValueError, match="margin"):
        OffPeakRule(margin=0.5)
    with pytest.raises(ValueError, match="recheck_s"):
        OffPeakRule(recheck_s=0)
    with pytest.raises(ValueError, match="quiet_hours"):
        OffPeakRule(quiet_hours=((3, 3),))


def test_in_the_simulator_off_peak_chains_wait_for_room_and_meet_their_deadline() -> None:
    """Interactive chains for a minute, batch chains arriving amid them: gated, the batch
    hops wait until the pool has room, and every one still finishes by its deadline."""
    chat = generate(TraceConfig(seed=3, duration_s=60.0, rate_per_s=2.0, mix={"chat": 1.0}))
    batch = generate(
        TraceConfig(seed=4, duration_s=4.0, rate_per_s=1.0, mix={"swe": 1.0}, tiers={"swe": "batch"})
    )
    jobs = [
        c.model_copy(update={"chain_id": f"b{i}", "arrival_s": 10.0 + i, "slo_s": 3600.0})
        for i, c in enumerate(batch.chains[:3])
    ]
    trace = Trace(meta=chat.meta, chains=sorted([*chat.chains, *jobs], key=lambda c: c.arrival_s))
    rule = OffPeakRule(load_threshold=0.0, recheck_s=1.0)
    sim = ClusterSim(
        trace,
        make_policy("chain-aware"),
        workers=2,
        off_peak=frozenset({"b0", "b1", "b2"}),
        off_peak_rule=rule,
    )
    result = sim.run()
    assert sim.off_peak_waits > 0
    records = {c.chain_id: c for c in result.chains}
    assert all(records[f"b{i}"].slo_met for i in range(3))
    assert all(c.status == "ok" for c in result.chains)


def test_the_benchmark_refuses_bad_options() -> None:
    script = load_benchmark_script("off_peak")
    with pytest.raises(SystemExit, match="quiet hours"):
        script.main(["--quiet-hours", "25-3"])
    with pytest.raises(SystemExit, match="load_threshold"):
        script.main(["--threshold", "-1"])
