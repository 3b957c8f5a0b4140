"""Human output of `inferx bench` / `inferx sim` (rich tables) and the JSON form.

Rendering comes after the raw results are on disk (`inferx.bench.results`), so a bug
here costs a table, never the figures. Every row names a field of the summary it
renders (`ROWS` for `Stats`, `SEED_ROWS` for `SeedSummary`); the unit tests check them.
A value of None was not measured and shows as "-"; a row nobody measured is left out.
"""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console
from rich.table import Table

from inferx.bench.metrics import Comparison, Stats, Summary
from inferx.bench.results import jsonable

ROWS: tuple[tuple[str, str, str], ...] = (
    # (label, Stats field, format)
    ("chains", "chains", "int"),
    ("completed", "completed", "int"),
    ("shed", "shed", "int"),
    ("latency P50", "latency_p50_s", "s"),
    ("latency P90", "latency_p90_s", "s"),
    ("latency P99", "latency_p99_s", "s"),
    ("serving time P50", "serving_p50_s", "s"),
    ("serving time P99", "serving_p99_s", "s"),
    ("slowdown P50", "slowdown_p50", "x"),
    ("slowdown P99", "slowdown_p99", "x"),
    ("SLO attainment", "slo_attainment", "%"),
    ("goodput (chains/s)", "goodput_per_s", "f3"),
    ("hop TTFT P50", "ttft_p50_s", "s"),
    ("hop TTFT P99", "ttft_p99_s", "s"),
    ("prefix-cache hits", "prefix_hit_rate", "%"),
    ("preemptions", "preemptions", "int"),
)


def fmt(value: float | None, kind: str) -> str:
    if value is None:  # not measured
        return "-"
    if isinstance(value, float) and math.isnan(value):
        return "-"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if kind == "int":
        return f"{int(value):,}"
    if kind == "s":
        return f"{value:,.2f} s" if value < 100 else f"{value:,.0f} s"
    if kind == "x":
        return f"{value:.2f}x"
    if kind == "%":
        return f"{value * 100:.1f}%"
    return f"{value:.3f}"


def stats_table(title: str, columns: dict[str, Stats], ratio: bool) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("metric")
    names = list(columns)
    for name in names:
        table.add_column(name, justify="right")
    if ratio and len(names) == 2:
        table.add_column(f"{names[1]} / {names[0]}", justify="right")
    for label, attr, kind in ROWS:
        values = [getattr(columns[name], attr) for name in names]
        if all(v is None for v in values):
            continue  # measured by none of these runs (e.g. preemptions of a running stack)
        row = [label] + [fmt(v, kind) for v in values]
        if ratio and len(names) == 2:
            base, cand = values
            ok = (
                base is not None
                and cand is not None
                and kind != "int"
                and math.isfinite(base)
                and base != 0
                and not math.isnan(cand)
            )
            row.append(f"{cand / base:.2f}" if ok else "")
        table.add_row(*row)
    return table


def engine_line(pool: str, figures: dict[str, float]) -> str:
    """What the policy priced a pool's engine with (`ReplayResult.engine`)."""
    return (
        f"pool {pool}'s engine priced at {figures['prefill_tokens_per_s']:,.0f} prefill tokens/s, "
        f"{figures['kv_read_s_per_token'] * 1e6:.3f} ms of a decode step per 1k tokens of KV in flight"
    )


def print_report(
    console: Console, summaries: list[Summary], comparison: Comparison | None, header: str
) -> None:
    console.print(header)
    ratio = comparison is not None
    console.print(stats_table("all chains", {s.policy: s.overall for s in summaries}, ratio))
    tiers = [t for t in ("realtime", "standard", "batch") if t in summaries[0].tiers]
    for tier in tiers:
        columns = {s.policy: s.tiers[tier] for s in summaries if tier in s.tiers}
        console.print(stats_table(f"tier {tier}", columns, ratio))
    for s in summaries:
        console.print(
            f"{s.policy}: {s.source}, {s.workers} workers, {s.rate_per_s:.3f} chains/s over "
            f"{s.window_s:,.0f} s, last chain done at {s.makespan_s:,.0f} s "
            f"(wall {s.wall_s:.1f} s)",
            style="dim",
        )
        for pool, figures in (s.engine or {}).items():
            console.print(f"{s.policy}: {engine_line(pool, figures)}", style="dim")
    if comparison is not None:
        print_comparison(console, comparison)


def _ratio(value: float | None, suffix: str = "") -> str:
    if value is None:
        return "undefined"
    return "inf" if math.isinf(value) else f"{value:.2f}{suffix}"


def print_comparison(console: Console, comparison: Comparison) -> None:
    """The ratios and the issue's targets. An undefined ratio (a reference that shed
    chains has no P99) is said so, with the reason; it is never 0 and never "met"."""
    realtime = comparison.realtime_attainment
    console.print(
        f"[bold]{comparison.candidate} vs {comparison.baseline}[/bold]: "
        f"P99 ratio {_ratio(comparison.p99_ratio)}, goodput ratio "
        f"{_ratio(comparison.goodput_ratio, 'x')}, realtime SLO attainment "
        + ("undefined" if realtime is None else f"{realtime * 100:.1f}%")
    )
    for note in comparison.notes:
        console.print(f"  {note}", style="dim")
    marks = {True: "[green]met[/green]", False: "[red]not met[/red]", None: "[yellow]undefined[/yellow]"}
    for target, met in comparison.targets.items():
        console.print(f"  target {target}: {marks[met]}")


def to_json(
    summaries: list[Summary], comparison: Comparison | None, context: dict[str, Any]
) -> dict[str, Any]:
    """The `--json` form: context, summaries and the comparison (inf and nan as null)."""
    return jsonable(
        {
            **context,
            "summaries": [s.model_dump() for s in summaries],
            "comparison": comparison.model_dump() if comparison else None,
        }
    )


def agreement_table(live: list[Summary], simulated: list[dict[str, Any]]) -> Table:
    """Live run vs the simulator on the same chains, per policy."""
    table = Table(title="live vs simulator (same chains)", title_justify="left")
    table.add_column("metric")
    sims = {s["policy"]: s["overall"] for s in simulated}
    sim_engines = {s["policy"]: s.get("engine") or {} for s in simulated}
    for s in live:
        table.add_column(f"{s.policy} live", justify="right")
        table.add_column(f"{s.policy} sim", justify="right")
    for label, attr, kind in ROWS:
        if attr in ("chains", "completed", "shed"):
            continue
        row = [label]
        for s in live:
            row.append(fmt(getattr(s.overall, attr), kind))
            sim = sims.get(s.policy, {}).get(attr)
            row.append(fmt(sim, kind) if sim is not None else "-")
        table.add_row(*row)
    # What the policy learned of the engine, live (from the workers' reports) and simulated.
    pools = sorted(
        {pool for s in live for pool in (s.engine or {})} | {p for e in sim_engines.values() for p in e}
    )
    for pool in pools:
        for label, key, scale, form in ENGINE_ROWS:
            row = [f"{label} ({pool})" if len(pools) > 1 else label]
            for s in live:
                for figures in ((s.engine or {}).get(pool), sim_engines.get(s.policy, {}).get(pool)):
                    row.append(format(figures[key] * scale, form) if figures else "-")
            table.add_row(*row)
    return table


# The engine figures a learning policy priced with (ReplayResult.engine): label, key, scale, format.
ENGINE_ROWS = (
    ("engine: prefill tokens/s", "prefill_tokens_per_s", 1.0, ",.0f"),
    ("engine: decode ms per 1k KV tokens", "kv_read_s_per_token", 1e6, ".3f"),
)


SEED_ROWS: tuple[tuple[str, str, str], ...] = (
    # (label, SeedSummary field, format)
    ("chains", "chains", "int"),
    ("completed", "completed", "int"),
    ("latency P50", "latency_p50_s", "s"),
    ("latency P90", "latency_p90_s", "s"),
    ("latency P99", "latency_p99_s", "s"),
    ("reusable-prefix hit rate", "reusable_hit_rate", "%"),
    ("prefix-cache hits (all prompt tokens)", "prefix_hit_rate", "%"),
    ("tool-cache hits", "tool_cache_hit_rate", "%"),
    ("worker switches per chain", "worker_switches", "f3"),
    ("wall time", "wall_s", "s"),
)


def seed_table(summaries: list[Any], reference: str = "reference", candidate: str = "on") -> Table:
    """The seed-agent scenario: one column per configuration, and candidate / reference
    for the times when both ran (blank where the reference's time is not finite)."""
    table = Table(title="seed-agent chains", title_justify="left")
    table.add_column("metric")
    for s in summaries:
        table.add_column(s.config, justify="right")
    by = {s.config: s for s in summaries}
    both = reference in by and candidate in by
    if both:
        table.add_column(f"{candidate} / {reference}", justify="right")
    for label, attr, kind in SEED_ROWS:
        row = [label] + [fmt(getattr(s, attr), kind) for s in summaries]
        if both:
            a, b = getattr(by[candidate], attr), getattr(by[reference], attr)
            row.append(f"{a / b:.2f}" if kind == "s" and b and math.isfinite(b) else "")
        table.add_row(*row)
    return table


def print_seed_report(console: Console, summaries: list[Any], comparison: Any, header: str) -> None:
    """The seed-agent report: the table, the P99 ratio against the reference (or why
    there is none) and each configuration's errors."""
    console.print(header)
    console.print(seed_table(summaries))
    if comparison is not None:
        if comparison.p99_ratio is None:
            console.print(
                f"P99 ratio {comparison.candidate}/{comparison.reference} undefined: {comparison.note} "
                "(target <= 0.5: [yellow]undefined[/yellow])"
            )
        else:
            mark = "[green]met[/green]" if comparison.target_met else "[red]not met[/red]"
            console.print(
                f"P99 ratio {comparison.candidate}/{comparison.reference} "
                f"{_ratio(comparison.p99_ratio)} (target <= 0.5: {mark})"
            )
    for s in summaries:
        if s.errors:
            console.print(f"{s.config}: errors {s.errors}", style="dim")
