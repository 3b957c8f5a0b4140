"""`inferx sim --capacity` (and `inferx bench --simulate --capacity`): each policy's
capacity at SLO in the simulator, chain-aware against the strongest peer first."""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

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
    Throughput,
    engine_bound,
    find_capacity,
    saturated_throughput,
    simulated_evaluator,
)
from inferx.sim.profile import EngineProfile, load_profile
from inferx.sim.steady import SteadyWindow, steady_window
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
        first = getattr(args, "seed", None)
        traces = [trace]
        if seeds > 1 or first is not None:
            if not trace.meta.generator.startswith("inferx.sim.trace"):
                raise InvalidArgument(
                    "--seeds and --seed need a trace `inferx workload` wrote (it is regenerated "
                    "with other seeds) or --workload; for a trace from elsewhere, run once per "
                    "trace file"
                )
            base = trace.meta.config
            start = base.seed if first is None else first
            traces = [
                trace
                if start + i == base.seed
                else generate(base.model_copy(update={"seed": start + i}), profile)
                for i in range(seeds)
            ]
    if args.duration is not None:
        traces = [trace.head(args.duration) for trace in traces]  # seconds of the trace at its own rate
    if not all(trace.chains for trace in traces):
        raise InvalidArgument("a trace has no chains in the chosen --duration")
    return traces


@dataclass(frozen=True)
class SearchTask:
    """One capacity search (a policy on one seed's trace): what a job process needs."""

    policy: str
    seed_index: int
    trace: Trace
    profile: EngineProfile
    workers: int
    options: dict[str, Any]
    programs: bool
    window: SteadyWindow | None
    burst: int | None
    start_rate: float


def _search(task: SearchTask, report: Callable[[str], None], progress=None) -> Capacity:
    seed = task.trace.meta.config.seed

    def on_probe(probe: CapacityProbe) -> None:
        a = probe.attainment
        realtime = f"{a.realtime:.1%}" if a.realtime is not None else "n/a"
        bound = " (stopped early: already missed)" if a.stopped else ""
        report(
            f"  {task.policy} (seed {seed}) at {probe.rate_per_s:.4g} chains/s: {a.chains} chains measured"
            f"{f' of {a.simulated_chains} run' if a.simulated_chains else ''}, realtime {realtime}, "
            f"all {a.overall:.1%}{bound} ({'meets' if probe.meets else 'misses'} the SLO)"
        )

    bar = None
    if progress is not None:

        def bar(rate: float, chains: int):
            return progress(f"{task.policy} (seed {seed}) at {rate:.4g} chains/s", chains)

    evaluate = simulated_evaluator(
        task.trace,
        task.policy,
        task.profile,
        task.workers,
        bar,
        task.options,
        programs=task.programs,
        window=task.window,
        burst=task.burst,
    )
    return find_capacity(task.policy, evaluate, task.start_rate, on_probe=on_probe)


_REPORTS: Any = None  # a job process's queue of probe lines for the parent to print
_PROGRESS: Any = None  # the parent's progress bars, for jobs run in the parent
BOUND_OVERLOAD = 2.0  # --bound: offered this many times the highest capacity found
BOUND_POLICIES = 3  # --bound: run by this many policies, those with the highest capacities


def _job_init(reports: Any) -> None:
    global _REPORTS
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops the pool
    _REPORTS = reports


def _job(task: SearchTask | BoundTask) -> Capacity | Throughput:
    if isinstance(task, BoundTask):
        return _bound(task)
    return _search(task, _REPORTS.put)


@dataclass(frozen=True)
class BoundTask:
    """One policy's throughput with more offered than it serves (`--bound`)."""

    policy: str
    seed_index: int
    trace: Trace
    profile: EngineProfile
    workers: int
    options: dict[str, Any]
    programs: bool
    window: SteadyWindow
    offered_rate_per_s: float


def _bound(task: BoundTask) -> Throughput:
    return saturated_throughput(
        task.trace,
        task.policy,
        task.profile,
        task.workers,
        task.window,
        task.offered_rate_per_s,
        task.options,
        task.programs,
    )


def default_jobs() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


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
    burst = getattr(args, "burst", None)
    window_s = getattr(args, "window_s", None)
    if burst is not None and window_s is not None:
        raise InvalidArgument("--burst replays N chains, --window-s a steady-state window: give one of them")
    jobs = getattr(args, "jobs", None) or default_jobs()
    traces = capacity_traces(args, profile)
    windows = [None if burst is not None else steady_window(trace, window_s) for trace in traces]
    names = [canonical_name(name) for name in policies]
    options = runner.policy_options(getattr(args, "option", None), names)
    found: dict[str, list[Capacity | None]] = {name: [None] * len(traces) for name in names}
    started = time.perf_counter()
    first = windows[0]
    context = {
        "trace": getattr(args, "workload", None) or args.trace or str(runner.DEFAULT_TRACE),
        "trace_seeds": [trace.meta.config.seed for trace in traces],
        "chains": [len(trace.chains) for trace in traces],
        "trace_rate_per_s": traces[0].meta.config.rate_per_s,
        "workers": args.workers,
        "programs": args.programs,
        "policy_options": options,
        "profile": profile.model_dump(),
        "mode": "burst" if burst is not None else "steady",
        "burst_chains": burst,
        # Per seed: the arrival span of every probe (the chains measured per probe are in
        # each probe's attainment: `chains` measured of `simulated_chains` run).
        "window": [_window_json(w) for w in windows],
        "jobs": jobs,
        "criterion": {
            "realtime_slo_attainment": REALTIME_TARGET,
            "overall_slo_attainment": OVERALL_TARGET,
            "tolerance": TOLERANCE,
            "misses": "shed, failed and unfinished chains count as misses",
            "measured": "chains arriving in the window (warm-up and drain not counted)"
            if burst is None
            else "every chain of the burst",
        },
    }
    if burst is not None:
        err.print(
            f"[bold]burst scenario[/bold]: {burst} chains at each probed rate, all counted; this measures "
            "how a policy absorbs one burst, not a rate it can sustain",
        )
    elif first is not None:
        err.print(
            f"steady state: per probe {first.warmup_s:.0f} s warm-up + {first.window_s:.0f} s measured "
            f"({first.window_slos:.1f} median SLOs) + {first.drain_s:.0f} s drain of arrivals (seed "
            f"{traces[0].meta.config.seed}); {jobs} parallel job(s)",
            style="dim",
        )
        if not first.steady:
            err.print(
                f"[yellow]warning[/yellow]: the window is {first.window_slos:.1f} median chain SLOs, fewer "
                "than 20: not steady state by this benchmark's rule; do not quote it as a capacity"
            )
    tasks = [
        SearchTask(
            policy=name,
            seed_index=index,
            trace=trace,
            profile=profile,
            workers=args.workers,
            options=options,
            programs=args.programs,
            window=windows[index],
            burst=burst,
            start_rate=args.rate if args.rate is not None else trace.meta.config.rate_per_s,
        )
        for index, trace in enumerate(traces)
        for name in names
    ]

    def done(task: SearchTask, result: Capacity) -> None:
        found[task.policy][task.seed_index] = result
        if results_file is not None:  # raw results as they come in, before any table
            results_file.save(
                context=context,
                capacity={n: [_json(c) for c in cs if c is not None] for n, cs in found.items()},
            )
        finished = sum(c is not None for cs in found.values() for c in cs)
        err.print(
            f"{task.policy} (seed {task.trace.meta.config.seed}): {result.rate_per_s:.4g} chains/s "
            f"({finished} of {len(tasks)} searches done)",
            style="dim",
        )

    report = lambda line: err.print(line, style="dim")  # noqa: E731 -- stderr even with --json
    global _PROGRESS
    _PROGRESS = progress
    _run_jobs(tasks, jobs, done, report)
    per_seed: dict[str, list[Capacity]] = {n: [c for c in cs if c is not None] for n, cs in found.items()}
    bound = None
    if getattr(args, "bound", False):
        bound = _bounds(per_seed, traces, windows, profile, args, options, jobs, err, report)
        context["bound_method"] = (
            f"the {BOUND_POLICIES} policies of highest capacity on each seed offered {BOUND_OVERLOAD:g}x the "
            "highest capacity found over the same steady window; the share of the arrived work "
            "(each chain's serving time alone) that chains finishing in the measured window served "
            "(within SLO or not), times the offered rate: chains of the trace's mix per second, in its "
            "nominal rate units; the bound is the highest of them, or the best capacity where that is "
            "higher (throughput collapsing under overload); at_least: no run fell behind, so the "
            "workers can do more"
        )
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
            context=context,
            capacity={n: [_json(c) for c in cs] for n, cs in per_seed.items()},
            bound=bound,
            complete=True,
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
            "bound": bound,
            "context": context,
        }
        print(json.dumps(jsonable(data), indent=2))
        return 0
    seeds = context["trace_seeds"]
    if burst is not None:
        how = f"[bold]BURST[/bold] of {burst} chains per probe, all counted (not a sustained rate)"
    else:
        assert first is not None
        how = (
            f"steady state: {first.window_s:.0f} s of arrivals measured per probe "
            f"({first.window_slos:.0f} median SLOs; {first.warmup_s:.0f} s warm-up and "
            f"{first.drain_s:.0f} s drain not counted)"
        )
    out.print(
        f"[bold]capacity at SLO[/bold] (simulator, {profile.name}, {args.workers} SIMULATED workers): "
        f"the highest rate at which >= {REALTIME_TARGET:.0%} of realtime and >= {OVERALL_TARGET:.0%} "
        f"of all chains meet their SLO (shed/unfinished = miss), bisected to {TOLERANCE:.0%}; {how}; "
        f"{context['trace']}, seeds {', '.join(map(str, seeds))}, base traces of "
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
        "chains at cap.",
    ) + (("share of bound",) if bound is not None else ())
    for column in columns:
        if column == "policy":
            table.add_column(column, no_wrap=True, min_width=16)  # names must stay whole
        else:
            table.add_column(column, justify="right")
    for name in sorted(names, key=lambda n: -medians[n]):
        at = per_seed[name][0].at_capacity
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
            f"{at.attainment.chains:,}" if at is not None else "-",
            *([_share(bound["share_median"].get(name))] if bound is not None else []),
        )
    out.print(table)
    if bound is not None and bound["rate_per_s"] is not None:
        out.print(
            f"engine bound (every worker busy, best policy): {'>= ' if bound['at_least'] else ''}"
            f"{bound['rate_per_s']:.3f} chains/s, median over "
            f"seeds; 1.5x the strongest peer would be {1.5 * medians.get(peer or '', 0):.3f}"
        )
    out.print(
        f"searched in {context['wall_s']:.0f} s of wall time (attainment columns: first seed)", style="dim"
    )
    return 0


def _share(value: float | None) -> str:
    return f"{value:.0%}" if value is not None else "-"


def _window_json(window: SteadyWindow | None) -> dict | None:
    if window is None:
        return None
    return window.model_dump() | {"window_slos": window.window_slos, "steady": window.steady}


def _json(result: Capacity) -> dict:
    at = result.at_capacity
    return {
        "rate_per_s": result.rate_per_s,
        "failing_rate_per_s": result.failing_rate_per_s,
        "realtime_attainment": at.attainment.realtime if at is not None else None,
        "overall_attainment": at.attainment.overall if at is not None else None,
        "probes": [p.model_dump() for p in result.probes],
    }


def _run_jobs(
    tasks: list[Any],
    jobs: int,
    done: Callable[[Any, Any], None],
    report: Callable[[str], None],
) -> None:
    """`_job(task)` for every task in `jobs` processes (each is pure CPU in the
    simulator); their probe lines printed as they come. Ctrl-C or SIGTERM stops the jobs
    too (the pool is terminated on the way out; the jobs ignore SIGINT, the parent
    handles it)."""
    if jobs <= 1 or len(tasks) == 1:
        for task in tasks:
            done(task, _job_here(task, report))
        return
    context = get_context("spawn")  # no fork of a process that may hold threads
    reports = context.Queue()
    with context.Pool(min(jobs, len(tasks)), initializer=_job_init, initargs=(reports,)) as pool:
        pending = {index: pool.apply_async(_job, (task,)) for index, task in enumerate(tasks)}
        while pending:
            time.sleep(0.2)
            _drain(reports, report)
            for index in [i for i, result in pending.items() if result.ready()]:
                done(tasks[index], pending.pop(index).get())
        _drain(reports, report)


def _job_here(task: Any, report: Callable[[str], None]) -> Any:
    return _bound(task) if isinstance(task, BoundTask) else _search(task, report, _PROGRESS)


def _drain(reports: Any, report: Callable[[str], None]) -> None:
    while True:
        try:
            report(reports.get_nowait())
        except queue.Empty:
            return


def _bounds(
    per_seed: dict[str, list[Capacity]],
    traces: list[Trace],
    windows: list[SteadyWindow | None],
    profile: EngineProfile,
    args: argparse.Namespace,
    options: dict[str, Any],
    jobs: int,
    err: Console,
    report: Callable[[str], None],
) -> dict[str, Any]:
    """`--bound`: per seed, what the workers complete per second with every one busy
    (each policy offered more than any sustained), and each policy's capacity as a
    share of the highest of those."""
    tasks = []
    for index, (trace, window) in enumerate(zip(traces, windows, strict=True)):
        if window is None:
            raise InvalidArgument("--bound uses the steady-state window: it cannot go with --burst")
        by_capacity = sorted(per_seed, key=lambda n: -per_seed[n][index].rate_per_s)
        top = per_seed[by_capacity[0]][index].rate_per_s
        if top <= 0:
            continue
        # The policies that sustain the most are those that complete the most when every
        # worker is busy: the bound is taken over the best BOUND_POLICIES of them.
        for name in by_capacity[:BOUND_POLICIES]:
            tasks.append(
                BoundTask(
                    name,
                    index,
                    trace,
                    profile,
                    args.workers,
                    options,
                    args.programs,
                    window,
                    top * BOUND_OVERLOAD,
                )
            )
    err.print(
        f"bound: {len(tasks)} saturated runs ({BOUND_OVERLOAD:g}x the best capacity per seed)", style="dim"
    )
    found: dict[int, dict[str, Throughput]] = {}

    def done(task: BoundTask, result: Throughput) -> None:
        found.setdefault(task.seed_index, {})[task.policy] = result
        report(
            f"  {task.policy} (seed {task.trace.meta.config.seed}) offered {task.offered_rate_per_s:.4g} "
            f"chains/s: serves {result.completed_rate_per_s:.4g}/s of the mix "
            f"({result.completed_chains_rate_per_s:.4g} chains/s finished, each counted as one)"
            + ("" if result.saturated else " (kept up: the bound is higher)")
        )

    _run_jobs(tasks, jobs, done, report)
    seeds: list[dict[str, Any]] = []
    bounds: list[float] = []
    shares: dict[str, list[float]] = {name: [] for name in per_seed}
    for index in sorted(found):
        runs = found[index]
        bound, by = engine_bound(
            {n: r.completed_rate_per_s for n, r in runs.items()},
            {n: caps[index].rate_per_s for n, caps in per_seed.items()},
        )
        bounds.append(bound)
        for name, caps in per_seed.items():
            shares[name].append(caps[index].rate_per_s / bound)
        seeds.append(
            {
                "seed": traces[index].meta.config.seed,
                "bound_per_s": bound,
                "by": by,
                # No run fell behind its arrivals: the workers can do more (a lower bound).
                "at_least": not any(r.saturated for r in runs.values()),
                "throughput": {n: r.model_dump() for n, r in runs.items()},
                "share": {n: caps[index].rate_per_s / bound for n, caps in per_seed.items()},
            }
        )
    return {
        "rate_per_s": statistics.median(bounds) if bounds else None,
        "share_median": {name: statistics.median(v) if v else None for name, v in shares.items()},
        "at_least": any(seed["at_least"] for seed in seeds),
        "per_seed": seeds,
    }
