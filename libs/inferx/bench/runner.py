"""Run a benchmark: pick the trace and the load, replay it once per policy (in the
simulator or against a live stack), summarize and compare. I/O lives here and in
live.py; the policies and the simulator stay pure."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from inferx.bench.metrics import Comparison, Summary, compare, summarize
from inferx.errors import InvalidArgument
from inferx.scheduling.registry import accepted_names, canonical_name, make_policy, policy_info, policy_names
from inferx.sim.cluster import ClusterSim, sim_policy
from inferx.sim.profile import EngineProfile
from inferx.sim.records import ReplayResult
from inferx.sim.saturation import Saturation, find_saturation
from inferx.sim.trace import Trace, read_trace

DEFAULT_TRACE = Path(__file__).resolve().parents[3] / "benchmarks" / "default_trace.jsonl"

# progress(total) -> a context manager yielding advance(done_count)
ProgressFactory = Callable[[str, int], AbstractContextManager[Callable[[int], None]]]


@dataclass
class LoadChoice:
    rate_per_s: float
    how: str  # the sentence the report prints
    saturation: Saturation | None = None


def load_trace(path: str | None) -> Trace:
    if path is None:
        if not DEFAULT_TRACE.exists():
            raise InvalidArgument(
                f"no --trace given and the default trace {DEFAULT_TRACE} is missing "
                "(generate one with `inferx workload -o FILE`)"
            )
        return read_trace(DEFAULT_TRACE)
    return read_trace(path)


# The policy every other one is compared with (what a deployment without InferX does).
REFERENCE_POLICY = "round-robin"


def policy_options(pairs: list[str] | None, policies: list[str]) -> dict[str, object]:
    """`--option KEY=VALUE` pairs as typed values (YAML scalars: true, 0.5, 3). Each key
    must be accepted by at least one of the compared policies; policies that do not
    take it ignore it (so `--compare session-affinity chain-aware --option
    realtime_guard=false` ablates chain-aware only)."""
    options: dict[str, Any] = {}
    accepted: set[str] = set()
    for name in policies:
        accepted |= policy_info(name).options
    for pair in pairs or []:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise InvalidArgument(f"--option {pair!r}: expected KEY=VALUE")
        if key not in accepted:
            known = ", ".join(sorted(accepted)) or "none"
            raise InvalidArgument(f"--option {key}: no compared policy takes it (they take: {known})")
        try:
            options[key] = yaml.safe_load(raw)
        except yaml.YAMLError:
            raise InvalidArgument(f"--option {pair!r}: the value is not a scalar") from None
    for name in policies:  # a value of the wrong type is refused here, before any run
        try:
            make_policy(name, **options)
        except ValueError as exc:
            raise InvalidArgument(f"--option: {exc}") from None
    return options


def check_policies(names: list[str]) -> list[str]:
    """The registered (canonical) names of `names`: an alias such as `baseline` becomes
    `round-robin`, so results, comparisons and reports use one name per policy."""
    canonical = []
    for name in names:
        if name not in accepted_names():
            raise InvalidArgument(f"unknown policy {name!r}; choose from {', '.join(policy_names())}")
        canonical.append(canonical_name(name))
    if len(set(canonical)) < len(canonical):
        raise InvalidArgument(f"--compare names a policy twice: {' '.join(names)}")
    return canonical


def choose_load(
    trace: Trace,
    profile: EngineProfile,
    workers: int,
    rate: float | None,
    load: float | None,
    on_probe: Callable[[object], None] | None = None,
) -> LoadChoice:
    """An explicit --rate, else `load` x the reference policy's saturation rate in the
    simulator."""
    if rate is not None:
        return LoadChoice(rate, f"{rate:.3f} chains/s (--rate)")
    if load is None:
        base = trace.meta.config.rate_per_s
        return LoadChoice(base, f"{base:.3f} chains/s (the trace's own rate)")
    saturation = find_saturation(trace, profile, workers, policy=REFERENCE_POLICY, on_probe=on_probe)
    chosen = saturation.rate_per_s * load
    return LoadChoice(
        chosen,
        f"{chosen:.3f} chains/s = {load:.0%} of {REFERENCE_POLICY}'s saturation "
        f"({saturation.rate_per_s:.3f} chains/s, {workers} simulated workers)",
        saturation,
    )


def run_simulated(
    trace: Trace,
    policies: list[str],
    profile: EngineProfile,
    workers: int,
    progress: ProgressFactory,
    options: dict[str, Any] | None = None,
    pools: int = 1,
) -> list[ReplayResult]:
    runs = []
    for name in policies:
        started = time.perf_counter()
        with progress(f"simulating {name}", len(trace.chains)) as advance:
            policy = sim_policy(name, profile, options)
            run = ClusterSim(trace, policy, profile, workers, pools=pools).run(advance)
        run.wall_s = time.perf_counter() - started
        runs.append(run)
    return runs


def conclude(runs: list[ReplayResult]) -> tuple[list[Summary], Comparison | None]:
    summaries = [summarize(run) for run in runs]
    by_name = {s.policy: s for s in summaries}
    comparison = None
    if len(summaries) == 2 and REFERENCE_POLICY in by_name:
        other = next(s for s in summaries if s.policy != REFERENCE_POLICY)
        comparison = compare(by_name[REFERENCE_POLICY], other)
    return summaries, comparison
