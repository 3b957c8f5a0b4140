"""`inferx sim --capacity` (and `inferx bench --simulate --capacity`): each policy's
capacity at SLO in the simulator, chain-aware against the strongest peer first."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from inferx.bench import runner
from inferx.bench.results import jsonable
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
from inferx.sim.trace import Trace, generate, workload

CANDIDATE = "chain-aware"


def strongest_peer(rates: dict[str, float]) -> str | None:
    """The compared policy other than chain-aware with the highest capacity (chains/s)."""
    peers = [name for name in rates if name != CANDIDATE]
    return max(peers, key=lambda name: rates[name]) if peers else None


def ratio(a: float, b: float) -> float | None:
    """a / b; None when b is 0 (a peer that meets the SLO at no rate tried)."""
    return a / b if b > 0 else None


def capacity_traces(args: argparse.Namespace, profile) -> list[Trace]:
    """The traces to search on: a named workload or the given trace, one per seed.
    Several seeds need a trace that can be regenerated (a workload, or a trace written
    by `inferx workload`); a trace from elsewhere is used as it is, once."""
    seeds = max(1, getattr(args, "seeds", 1) or 1)
    name = getattr(args, "workload", None)
    if name:
        if args.trace:
            raise InvalidArgument("give either --workload or --trace, not both")
        first = getattr(args, "seed", None) or 1
        configs = [workload(name, first + i) for i in range(seeds)]
        traces = [generate(config, profile) for config in configs]
    else:
        trace = runner.load_trace(args.trace)
        traces = [trace]
        if seeds > 1:
            if not trace.meta.generator.startswith("inferx.sim.trace"):
                raise InvalidArgument(
                    "--seeds needs a trace `inferx workload` wrote (it is regenerated with other "
                    "seeds) or --workload; for a trace from elsewhere, run once per trace file"
                )
            base = trace.meta.config
            traces += [
                generate(base.model_copy(update={"seed": base.seed + i}), profile) for i in range(1, seeds)
            ]
    if args.duration is not None:
        traces = [trace.head(args.duration) for trace in traces]  # seconds of the trace at its own rate
    if not all(trace.chains for trace in traces):
        raise InvalidArgument("a trace has no chains in the chosen --duration")
    return traces


def cmd_capacity(
    args: argparse.Namespace,
    policies: list[str],
    progress: runner.ProgressFactory,
    out: Console,
    err: Console,
    results_file=None,
) -> int:
    profile = load_profile(args.profile)
    if args.rate is not None and args.rate <= 0:
        raise InvalidArgument("--rate must be positive")
    traces = capacity_traces(args, profile)
    names = [canonical_name(name) for name in policies]
    options = runner.policy_options(getattr(args, "option", None), names)
    per_seed: dict[str, list[Capacity]] = {name: [] for name in names}
    started = time.perf_counter()
    context = {
        "trace": getattr(args, "workload", None) or args.trace or str(runner.DEFAULT_TRACE),
        "trace_seeds": [trace.meta.config.seed for trace in traces],
        "chains": [len(trace.chains) for trace in traces],
        "trace_rate_per_s": traces[0].meta.config.rate_per_s,
        "workers": args.workers,
        "programs": args.programs,
        "policy_options": options,
        "profile": profile.model_dump(),
        "criterion": {
            "realtime_slo_attainment": REALTIME_TARGET,
            "overall_slo_attainment": OVERALL_TARGET,
            "tolerance": TOLERANCE,
            "misses": "shed, failed and unfinished chains count as misses",
        },
    }
    for index, trace in enumerate(traces):
        start = args.rate if args.rate is not None else trace.meta.config.rate_per_s
        seed = trace.meta.config.seed
        for name in names:

            def bar(rate: float, name: str = name, seed: int = seed, chains: int = len(trace.chains)):
                return progress(f"{name} (seed {seed}) at {rate:.3f} chains/s", chains)

            def report(probe: CapacityProbe, name: str = name) -> None:
                # On stderr even with --json: the search takes minutes, stdout stays clean.
                a = probe.attainment
                realtime = f"{a.realtime:.1%}" if a.realtime is not None else "n/a"
                err.print(
                    f"  {name} at {probe.rate_per_s:.3f} chains/s: realtime {realtime}, all {a.overall:.1%} "
                    f"({'meets' if probe.meets else 'misses'} the SLO)",
                    style="dim",
                )

            evaluate = simulated_evaluator(
                trace, name, profile, args.workers, bar, options, programs=args.programs
            )
            per_seed[name].append(find_capacity(name, evaluate, start, on_probe=report))
            if results_file is not None:  # raw results as they come in, before any table
                results_file.save(
                    context=context, capacity={n: [_json(c) for c in cs] for n, cs in per_seed.items()}
                )
        err.print(f"seed {seed} done ({index + 1} of {len(traces)})", style="dim")
    context["wall_s"] = time.perf_counter() - started
    rates = {name: [c.rate_per_s for c in caps] for name, caps in per_seed.items()}
    medians = {name: statistics.median(values) for name, values in rates.items()}
    peer = strongest_peer(medians)
    versus = {
        name: ratio(medians[CANDIDATE], medians[name])
        for name in names
        if name != CANDIDATE and CANDIDATE in medians
    }
    if results_file is not None:
        results_file.save(
            context=context, capacity={n: [_json(c) for c in cs] for n, cs in per_seed.items()}, complete=True
        )
    plot = getattr(args, "plot", None)
    if plot:
        from inferx.bench.plot import plot_capacity

        seed = context["trace_seeds"][0]
        title = f"{context['trace']} (seed {seed}), {profile.name}, {args.workers} SIMULATED workers"
        plot_capacity({name: caps[0] for name, caps in per_seed.items()}, Path(plot), title)
        err.print(f"plot: {plot}", style="dim")
    if args.json:
        data = {
            "capacity": {
                name: {
                    "rate_per_s": medians[name],
                    "min_rate_per_s": min(rates[name]),
                    "max_rate_per_s": max(rates[name]),
                    "per_seed": [_json(c) for c in per_seed[name]],
                }
                for name in names
            },
            "strongest_peer": peer,
            f"{CANDIDATE}_vs_strongest_peer": versus.get(peer) if peer is not None else None,
            f"{CANDIDATE}_vs": versus,
            "context": context,
        }
        print(json.dumps(jsonable(data), indent=2))
        return 0
    seeds = context["trace_seeds"]
    out.print(
        f"[bold]capacity at SLO[/bold] (simulator, {profile.name}, {args.workers} SIMULATED workers): "
        f"the highest rate at which >= {REALTIME_TARGET:.0%} of realtime and >= {OVERALL_TARGET:.0%} "
        f"of all chains meet their SLO (shed/unfinished = miss), bisected to {TOLERANCE:.0%}; "
        f"{context['trace']}, seeds {', '.join(map(str, seeds))}, "
        f"{'/'.join(map(str, context['chains']))} chains; median over seeds [min-max]"
    )
    if CANDIDATE in medians and peer is not None:
        ours, theirs = medians[CANDIDATE], medians[peer]
        per = [
            ratio(a.rate_per_s, b.rate_per_s)
            for a, b in zip(per_seed[CANDIDATE], per_seed[peer], strict=True)
        ]
        spread = [r for r in per if r is not None]
        out.print(
            f"{CANDIDATE}: {ours:.3f} chains/s vs the strongest peer, {peer}: {theirs:.3f} chains/s"
            + (f" ([bold]x{ratio(ours, theirs):.2f}[/bold]" if theirs > 0 else "")
            + (
                f", per seed {min(spread):.2f}-{max(spread):.2f})"
                if theirs > 0 and spread
                else ")"
                if theirs > 0
                else ""
            )
        )
    table = Table(show_edge=False)
    columns = (
        "policy",
        "capacity (chains/s)",
        "min-max",
        f"{CANDIDATE} x",
        "realtime at cap.",
        "all at cap.",
    )
    for column in columns:
        if column == "policy":
            table.add_column(column, no_wrap=True, min_width=16)  # names must stay whole
        else:
            table.add_column(column, justify="right")
    for name in sorted(names, key=lambda n: -medians[n]):
        first = per_seed[name][0]
        at = first.at_capacity
        realtime = at.attainment.realtime if at is not None else None
        against = versus.get(name)
        table.add_row(
            name,
            f"{medians[name]:.3f}"
            + ("+" if any(c.failing_rate_per_s is None for c in per_seed[name]) else ""),
            f"{min(rates[name]):.3f}-{max(rates[name]):.3f}",
            f"{against:.2f}" if against is not None else "-",
            f"{realtime:.1%}" if realtime is not None else "-",
            f"{at.attainment.overall:.1%}" if at is not None else "-",
        )
    out.print(table)
    out.print(
        f"searched in {context['wall_s']:.0f} s of wall time (attainment columns: first seed)", style="dim"
    )
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
