"""`inferx sim --decision-cost`: the scheduler's decision cost per hop (wall time of the
queue + policy calls, not of the simulated engines) as workers and queued hops grow,
and the hops/s one scheduler partition decides (`inferx.sim.decision_cost`)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from rich.console import Console

from inferx.bench import runner
from inferx.errors import InvalidArgument
from inferx.sim import decision_cost
from inferx.sim.profile import load_profile


def cmd_decision_cost(args: argparse.Namespace, out: Console, err: Console, save) -> int:
    sizes = args.cost_workers
    depths = args.cost_depths
    if any(n < 1 for n in sizes) or any(d < 1 for d in depths):
        raise InvalidArgument("--cost-workers and --cost-depths must be positive")
    if any(n < args.pools for n in sizes):
        raise InvalidArgument(f"every --cost-workers size needs at least --pools ({args.pools}) workers")
    policy = args.policy or "chain-aware"
    runner.check_policies([policy])
    profile = load_profile(args.profile)
    trace = runner.load_trace(args.trace)
    duration = args.duration if args.duration is not None else 60.0
    rows: list[decision_cost.CostFigures] = []
    for workers in sizes:
        # The same trace, arriving in proportion to the cluster: every size as loaded.
        scaled = trace.at_rate(args.cost_rate_per_worker * workers).head(duration)
        if not args.json:
            err.print(f"replaying {len(scaled.chains)} chains on {workers} workers ...", style="dim")
        for indexed in (True, False) if args.cost_scan else (True,):
            row = decision_cost.replay(scaled, workers, args.pools, policy, profile, indexed)
            row.label += "" if indexed else " (scan)"
            rows.append(row)
            save(context=_context(args, policy, duration), rows=[asdict(r) for r in rows])
    for workers in sizes:
        for depth in depths:
            if not args.json:
                err.print(f"steady state: {workers} workers, {depth} queued hops ...", style="dim")
            for indexed in (True, False) if args.cost_scan else (True,):
                row = decision_cost.steady(
                    trace.chains, workers, depth, args.cost_cycles, policy, profile, indexed=indexed
                )
                row.label += "" if indexed else " (scan)"
                rows.append(row)
                save(context=_context(args, policy, duration), rows=[asdict(r) for r in rows])
    save(complete=True)
    if args.json:
        context = _context(args, policy, duration)
        print(json.dumps({"context": context, "rows": [asdict(r) for r in rows]}, indent=2))
        return 0
    # A Markdown table: what docs/benchmarks.md quotes, and readable in a terminal.
    out.print(f"decision cost per hop ({policy}; CPU time of the scheduler's calls only)\n")
    out.print("| run | workers | pools | hops | queued mean/max | p50 µs | p99 µs | mean µs | hops/s |")
    out.print("|---|--:|--:|--:|--:|--:|--:|--:|--:|")
    for r in rows:
        out.print(
            f"| {r.label} | {r.workers} | {r.pools} | {r.hops} | {r.mean_depth:.0f}/{r.max_depth} | "
            f"{r.p50_us:.0f} | {r.p99_us:.0f} | {r.mean_us:.0f} | {r.decisions_per_s:,.0f} |"
        )
    out.print()
    for r in rows:
        if r.extra:
            out.print(
                f"{r.label}: {r.extra['completed']:.0f}/{r.extra['chains']:.0f} chains completed, at most "
                f"{r.extra['max_chains_under_way']:.0f} under way at once; simulation "
                f"{r.extra['sim_wall_s']:.1f} s wall, of which decisions (CPU) "
                f"{r.extra['decision_wall_s']:.2f} s",
                style="dim",
            )
    return 0


def _context(args: argparse.Namespace, policy: str, duration: float) -> dict:
    return {
        "policy": policy,
        "trace": args.trace or str(runner.DEFAULT_TRACE),
        "workers": args.cost_workers,
        "depths": args.cost_depths,
        "pools": args.pools,
        "rate_per_worker": args.cost_rate_per_worker,
        "duration_s": duration,
        "cycles": args.cost_cycles,
        "scan_reference": args.cost_scan,
    }
