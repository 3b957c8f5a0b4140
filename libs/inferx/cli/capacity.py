"""`inferx sim --capacity` (and `inferx bench --simulate --capacity`): each policy's
capacity at SLO in the simulator, chain-aware against the strongest peer first."""

from __future__ import annotations

import argparse
import json
import time

from rich.console import Console
from rich.table import Table

from inferx.bench import runner
from inferx.errors import InvalidArgument
from inferx.scheduling.registry import canonical_name
from inferx.sim.capacity import (
    OVERALL_TARGET,
    REALTIME_TARGET,
    TOLERANCE,
    Capacity,
    CapacityProbe,
    find_capacity,
    simulated_evaluator,
)
from inferx.sim.profile import load_profile

CANDIDATE = "chain-aware"


def strongest_peer(results: dict[str, Capacity]) -> str | None:
    """The compared policy other than chain-aware with the highest capacity."""
    peers = [name for name in results if name != CANDIDATE]
    return max(peers, key=lambda name: results[name].rate_per_s) if peers else None


def ratio(a: float, b: float) -> float | None:
    """a / b; None when b is 0 (a peer that meets the SLO at no rate tried)."""
    return a / b if b > 0 else None


def cmd_capacity(
    args: argparse.Namespace,
    policies: list[str],
    progress: runner.ProgressFactory,
    out: Console,
    err: Console,
) -> int:
    profile = load_profile(args.profile)
    trace = runner.load_trace(args.trace)
    if args.duration is not None:
        trace = trace.head(args.duration)  # seconds of the trace at its own rate
    if not trace.chains:
        raise InvalidArgument("the trace has no chains in the chosen --duration")
    if args.rate is not None and args.rate <= 0:
        raise InvalidArgument("--rate must be positive")
    start = args.rate if args.rate is not None else trace.meta.config.rate_per_s
    names = [canonical_name(name) for name in policies]
    results: dict[str, Capacity] = {}
    started = time.perf_counter()
    for name in names:

        def bar(rate: float, name: str = name):
            return progress(f"{name} at {rate:.3f} chains/s", len(trace.chains))

        def report(probe: CapacityProbe, name: str = name) -> None:
            # On stderr even with --json: the search takes minutes, stdout stays clean.
            a = probe.attainment
            realtime = f"{a.realtime:.1%}" if a.realtime is not None else "n/a"
            err.print(
                f"  {name} at {probe.rate_per_s:.3f} chains/s: realtime {realtime}, all {a.overall:.1%} "
                f"({'meets' if probe.meets else 'misses'} the SLO)",
                style="dim",
            )

        evaluate = simulated_evaluator(trace, name, profile, args.workers, bar)
        results[name] = find_capacity(name, evaluate, start, on_probe=report)
    wall_s = time.perf_counter() - started
    peer = strongest_peer(results)
    context = {
        "trace": args.trace or str(runner.DEFAULT_TRACE),
        "trace_seed": trace.meta.config.seed,
        "chains": len(trace.chains),
        "trace_rate_per_s": trace.meta.config.rate_per_s,
        "workers": args.workers,
        "profile": profile.model_dump(),
        "criterion": {
            "realtime_slo_attainment": REALTIME_TARGET,
            "overall_slo_attainment": OVERALL_TARGET,
            "tolerance": TOLERANCE,
            "misses": "shed, failed and unfinished chains count as misses",
        },
        "wall_s": wall_s,
    }
    if args.json:
        data = {
            "capacity": {name: _json(result) for name, result in results.items()},
            "strongest_peer": peer,
            f"{CANDIDATE}_vs_strongest_peer": (
                ratio(results[CANDIDATE].rate_per_s, results[peer].rate_per_s)
                if CANDIDATE in results and peer is not None
                else None
            ),
            "context": context,
        }
        print(json.dumps(data, indent=2))
        return 0
    out.print(
        f"[bold]capacity at SLO[/bold] (simulator, {profile.name}, {args.workers} SIMULATED workers): "
        f"the highest rate at which >= {REALTIME_TARGET:.0%} of realtime and >= {OVERALL_TARGET:.0%} "
        f"of all chains meet their SLO (shed/unfinished = miss), bisected to {TOLERANCE:.0%}; "
        f"{len(trace.chains)} chains of {context['trace']} (seed {context['trace_seed']})"
    )
    if CANDIDATE in results and peer is not None:
        ours, theirs = results[CANDIDATE].rate_per_s, results[peer].rate_per_s
        out.print(
            f"{CANDIDATE}: {ours:.3f} chains/s vs the strongest peer, {peer}: {theirs:.3f} chains/s"
            + (f" ([bold]x{ratio(ours, theirs):.2f}[/bold])" if theirs > 0 else "")
        )
    table = Table(show_edge=False)
    columns = ("policy", "capacity (chains/s)", "x trace rate", "realtime at cap.", "all at cap.", "probes")
    for column in columns:
        if column == "policy":
            table.add_column(column, no_wrap=True, min_width=16)  # names must stay whole
        else:
            table.add_column(column, justify="right")
    for name in sorted(results, key=lambda n: -results[n].rate_per_s):
        result = results[name]
        at = result.at_capacity
        realtime = at.attainment.realtime if at is not None else None
        table.add_row(
            name,
            f"{result.rate_per_s:.3f}" + ("+" if result.failing_rate_per_s is None else ""),
            f"{result.rate_per_s / trace.meta.config.rate_per_s:.2f}",
            f"{realtime:.1%}" if realtime is not None else "-",
            f"{at.attainment.overall:.1%}" if at is not None else "-",
            str(len(result.probes)),
        )
    out.print(table)
    out.print(f"searched in {wall_s:.0f} s of wall time", style="dim")
    return 0


def _json(result: Capacity) -> dict:
    at = result.at_capacity
    return {
        "rate_per_s": result.rate_per_s,
        "failing_rate_per_s": result.failing_rate_per_s,
        "realtime_attainment": at.attainment.realtime if at is not None else None,
        "overall_attainment": at.attainment.overall if at is not None else None,
        "probes": [p.model_dump() for p in result.probes],
    }
