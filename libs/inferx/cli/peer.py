"""`inferx bench --peer vllm-router`: InferX's OpenAI-compatible front against
vllm-router in front of identical SIMULATED sim workers (issue #16). What it runs is
`inferx.bench.peer`; this module checks the flags, shows progress, saves the raw
results first and prints a table (or --json)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from inferx.errors import InvalidArgument

# Start rates (chains/s per worker) of the capacity ladder when --rate is not given:
# below the simulator's capacity of the peers' policies on these workloads.
START_RATE_PER_WORKER = {"mix": 0.25, "coding": 0.005, "research": 0.05}
DEFAULT_WORKERS = 2

_NOT_HERE = (
    ("simulate", "--simulate"),
    ("router", "--router"),
    ("scenario", "--scenario"),
    ("capacity", "--capacity"),
    ("overhead", "--overhead"),
    ("compare_given", "--compare"),
    ("policy", "--policy"),
)


def check_args(args: argparse.Namespace) -> None:
    for attr, flag in _NOT_HERE:
        if getattr(args, attr, None):
            raise InvalidArgument(
                f"--peer starts its own stacks (InferX chain-aware and vllm-router): drop {flag}"
            )
    if args.engine not in (None, "sim"):
        raise InvalidArgument("--peer runs SIMULATED sim workers: drop --engine vllm")
    if args.trace and args.workload:
        raise InvalidArgument("give --trace FILE or --workload NAME, not both")
    if args.trace and (args.seeds > 1 or args.seed is not None):
        raise InvalidArgument("--seeds and --seed choose generated traces: drop --trace, or them")
    if args.burst is not None:  # `inferx sim --capacity`'s name for the same burst
        if args.probe_chains is not None and args.probe_chains != args.burst:
            raise InvalidArgument("--burst and --probe-chains name the same burst: give one of them")
        args.probe_chains = args.burst
    if args.probe_chains is not None and args.window_s is not None:
        raise InvalidArgument(
            "--probe-chains replays a burst, --window-s a steady-state window: give one of them"
        )
    for name, value, low in (
        ("--probe-chains", 1 if args.probe_chains is None else args.probe_chains, 1),
        ("--max-probes", args.max_probes, 1),
        ("--count", args.count, 1),
        ("--warmup", args.warmup, 0),
    ):
        if value < low:
            raise InvalidArgument(f"{name} must be at least {low}")
    if not args.speed > 0 or math.isinf(args.speed):
        raise InvalidArgument("--speed must be a positive number")
    if args.rate is not None and args.rate <= 0:
        raise InvalidArgument("--rate must be positive")
    if not args.rate_step > 1:
        raise InvalidArgument("--rate-step must be above 1")
    if args.timeout <= 0:
        raise InvalidArgument("--timeout must be positive")


def _traces(args: argparse.Namespace, profile):
    from inferx.bench import runner
    from inferx.sim.trace import generate, workload

    if args.trace:
        traces = [runner.load_trace(args.trace)]
    else:
        name = args.workload or "mix"
        traces = [generate(workload(name, (args.seed or 1) + i), profile) for i in range(args.seeds)]
    for trace in traces:
        if args.probe_chains is not None and len(trace.chains) < args.probe_chains:
            raise InvalidArgument(
                f"the trace has {len(trace.chains)} chains, fewer than --probe-chains {args.probe_chains}"
            )
    return traces


def _start_rate(args: argparse.Namespace, workers: int, traces) -> float:
    if args.rate is not None:
        return args.rate
    if args.trace:
        return traces[0].meta.config.rate_per_s
    return START_RATE_PER_WORKER[args.workload or "mix"] * workers


def _ms(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:+.2f}" if value < 0 else f"{value:.2f}"


def _s(value: float | None) -> str:
    return "miss" if value is None else f"{value:.1f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _table(title: str, columns: list[str]) -> Table:
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for i, column in enumerate(columns):
        t.add_column(column, justify="left" if i == 0 else "right", no_wrap=i == 0)
    return t


def _short(front: str) -> str:
    """Table labels: "vllm-router consistent_hash" -> "vr consistent_hash"."""
    return front.replace("vllm-router ", "vr ")


def overhead_table(rows: list[dict[str, Any]]) -> Table:
    t = _table(
        "added latency per call (ms; sequential one-token chat calls, engine time ~0)",
        ["path", "calls", "p50", "p99", "added p50", "added p99", "errors"],
    )
    for row in rows:
        t.add_row(
            row["path"],
            str(row["calls"]),
            _ms(row["p50_ms"]),
            _ms(row["p99_ms"]),
            _ms(row["added_p50_ms"]),
            _ms(row["added_p99_ms"]),
            str(row["errors"]) if not row["errors"] else f"[red]{row['errors']}[/red]",
        )
    return t


def capacity_table(seed: dict[str, Any]) -> Table:
    t = _table(
        f"capacity at SLO, trace seed {seed['trace_seed']} (chains/s; >= 99% realtime and >= 95% of all "
        "chains within SLO; at capacity: P99 chain, TTFT in trace s)",
        ["front", "capacity", "1st miss", "P99", "TTFT p50", "TTFT p99", "realtime TTFT p99", "cached"],
    )
    for result in seed["fronts"]:
        at = next((p for p in result.probes if p.meets and p.rate_per_s == result.rate_per_s), None)
        capacity = (
            f"{'>= ' if result.at_least else ''}{result.rate_per_s:.3f}" if result.rate_per_s else "< lowest"
        )
        t.add_row(
            _short(result.front),
            capacity,
            "-" if result.failing_rate_per_s is None else f"{result.failing_rate_per_s:.3f}",
            _s(at.p99_latency_s) if at else "-",
            _s(at.ttft_p50_s) if at else "-",
            _s(at.ttft_p99_s) if at else "-",
            _s(at.realtime_ttft_p99_s) if at else "-",
            _pct(at.cached_ratio) if at else "-",
        )
    return t


def diagnostic_line(probe: Any) -> Text:
    """A diagnostic probe's result, as plain text: its front label ("inferx
    [inferx-end-marks]") would otherwise be read as a rich markup tag and vanish."""
    return Text(
        f"diagnostic {probe.front} at {probe.rate_per_s:.3f}/s: "
        f"{'meets' if probe.meets else 'misses'} the SLO ({_pct(probe.realtime)} realtime, "
        f"{_pct(probe.overall)} all, P99 {_s(probe.p99_latency_s)} s); not in the ratio",
        style="dim",
    )


def probes_lines(seed: dict[str, Any]) -> list[str]:
    """Every probe: rate, met (+) or missed (x), realtime and overall attainment, how
    many chains were counted, the front's own CPU per call and the box's load while it
    ran."""
    from inferx.bench.peer import probe_notes

    def extra(p) -> str:
        return "".join(f"; {note}" for note in probe_notes(p))

    lines = []
    for result in seed["fronts"]:
        probes = ", ".join(
            f"{p.rate_per_s:.3f}{'+' if p.meets else 'x'} ({_pct(p.realtime)} rt, {_pct(p.overall)} all "
            f"of {p.chains}{extra(p)})"
            for p in result.probes
        )
        lines.append(f"  {_short(result.front)}: {probes}")
    return lines


def same_rate_table(seed: dict[str, Any]) -> Table | None:
    """Every front probed at the best vllm-router mode's capacity rate, side by side."""
    rate = seed["comparison"]["best_peer_capacity_per_s"]
    if not rate:
        return None
    t = _table(
        f"at {rate:.3f} chains/s (the best {seed['comparison']['best_peer']} capacity), trace seconds",
        [
            "front",
            "SLO all",
            "realtime",
            "P50 chain",
            "P99 chain",
            "TTFT p50",
            "TTFT p99",
            "realtime TTFT p99",
            "cached",
            "errors",
        ],
    )
    for result in seed["fronts"]:
        probe = next((p for p in result.probes if math.isclose(p.rate_per_s, rate)), None)
        if probe is None:
            continue
        errors = str(sum(probe.errors.values()))  # by kind in the JSON
        t.add_row(
            _short(result.front),
            _pct(probe.overall),
            _pct(probe.realtime),
            _s(probe.p50_latency_s),
            _s(probe.p99_latency_s),
            _s(probe.ttft_p50_s),
            _s(probe.ttft_p99_s),
            _s(probe.realtime_ttft_p99_s),
            _pct(probe.cached_ratio),
            errors,
        )
    return t


def verdict_lines(comparison: dict[str, Any], summary: dict[str, Any]) -> list[str]:
    lines = []
    ratio = summary.get("capacity_ratio_median")
    if ratio is None:
        why = comparison.get("capacity_ratio_undefined_because") or "no seed gave one"
        lines.append(f"capacity ratio: undefined ({why})")
    else:
        bound = (
            " (a lower bound: InferX met the SLO at every rate it tried)"
            if comparison.get("inferx_capacity_is_lower_bound")
            else ""
        )
        from inferx.bench.peer import meets_ratio

        met = "met" if meets_ratio(ratio, comparison["capacity_target"]) else "not met"
        lines.append(
            f"capacity at SLO: InferX / best vllm-router mode ({comparison['best_peer']}) = "
            f"{ratio:.2f}x{bound}, median over the {summary.get('seeds_with_a_ratio', summary['seeds'])} "
            f"of {summary['seeds']} seed(s) that gave one; "
            f"target >= {comparison['capacity_target']}x: {met}"
        )
    gap = comparison.get("added_latency_gap_p50_ms")
    if gap is not None:
        met = "met" if gap <= comparison["added_latency_target_ms"] else "not met"
        lines.append(
            f"added latency per call, p50: InferX - {comparison['added_latency_peer']} = {gap:+.2f} ms; "
            f"target <= {comparison['added_latency_target_ms']} ms: {met}"
        )
    return lines


async def cmd_peer(args: argparse.Namespace, progress, out: Console, err: Console, saved) -> int:
    from inferx.bench.peer import (
        DEFAULT_MODES,
        LadderOptions,
        PeerOptions,
        check_modes,
        find_vllm_router,
        machine,
        program_scheduling_config,
        run_peer_bench,
    )
    from inferx.bench.results import jsonable
    from inferx.sim.profile import load_profile
    from inferx.sim.steady import steady_window

    if args.peer != "vllm-router":
        raise InvalidArgument(f"--peer {args.peer}: only vllm-router is supported")
    modes = check_modes(list(args.peer_modes or DEFAULT_MODES))
    binary = find_vllm_router()  # before anything starts: a clear error if it cannot run
    profile = load_profile(args.profile)
    workers = args.workers if args.workers_given else DEFAULT_WORKERS
    traces = _traces(args, profile)
    # Steady state unless a burst is asked for (--probe-chains): the window sized on the
    # first trace's SLOs (or --window-s), the same for every seed and front.
    burst = args.probe_chains is not None
    ladder = LadderOptions(
        start_rate=_start_rate(args, workers, traces),
        step=args.rate_step,
        max_probes=args.max_probes,
        window=None if burst else steady_window(traces[0], args.window_s),
        probe_chains=args.probe_chains if burst else 0,
        timeout_s=args.timeout,
    )
    options = PeerOptions(
        workers=workers,
        speed=args.speed,
        modes=modes,
        ladder=ladder,
        count=args.count,
        warmup=args.warmup,
        state_dir=Path(args.state_dir) if args.state_dir else None,
        diagnostics=args.inferx_diagnostics,
        embedded_scheduler=bool(args.embedded_scheduler),
    )
    # markup=False: a front label such as "inferx [inferx-end-marks]" is text, not a rich tag
    note = (lambda s: None) if args.json else (lambda s: err.print(s, style="dim", markup=False))
    context = {
        "machine": machine(),
        "peer": {"name": "vllm-router", "version": binary.version, "path": binary.path, "modes": modes},
        "program_scheduling_config": program_scheduling_config(profile, args.speed)
        if "program" in modes
        else None,
        "workers": workers,
        "inferx_embedded_scheduler": bool(args.embedded_scheduler),
        "speed": args.speed,
        "profile": profile.model_dump(),
        "trace": args.trace or f"--workload {args.workload or 'mix'}",
        "trace_seeds": [t.meta.config.seed for t in traces],
        "ladder": ladder.__dict__ | {"steady": ladder.steady, "probes": ladder.describe(args.speed)},
        "added_latency_calls": {"count": args.count, "warmup": args.warmup},
        "auth": "InferX's router started with --insecure when it has that flag: benchmarks run without auth",
    }
    saved.save(context=context)

    def keep(key: str, value: Any) -> None:
        saved.save(**{key: value})

    result = await run_peer_bench(traces, profile, options, binary, progress[0], progress[1], note, keep)
    saved.save(summary=result["summary"], complete=True)
    last = result["seeds"][-1]["comparison"]
    if args.json:
        print(json.dumps(jsonable({"kind": "peer", "context": context, **result}), indent=2))
        return 0
    out.print(
        f"[bold]InferX vs vllm-router {binary.version}[/bold] ({', '.join(modes)}): {workers} SIMULATED sim "
        f"workers each ({profile.name}), x{args.speed:g} time; {context['machine']}"
    )
    out.print(overhead_table(result["overhead"]))
    out.print(f"capacity probes: {context['ladder']['probes']}", style="dim")
    for seed in result["seeds"]:
        out.print(capacity_table(seed))
        out.print("probes (chains/s; + met the SLO, x missed):", style="dim")
        for line in probes_lines(seed):
            out.print(line, style="dim")
        same = same_rate_table(seed)
        if same is not None:
            out.print(same)
        for probe in seed.get("diagnostics", ()):
            out.print(diagnostic_line(probe))
    for line in verdict_lines(last, result["summary"]):
        out.print(line)
    return 0
