"""Human output of `inferx bench` / `inferx sim` (rich tables) and the JSON form."""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console
from rich.table import Table

from inferx.bench.metrics import Comparison, Stats, Summary

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


def fmt(value: float, kind: str) -> str:
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
        row = [label] + [fmt(v, kind) for v in values]
        if ratio and len(names) == 2:
            base, cand = values
            ok = base not in (0, None) and not (isinstance(base, float) and math.isinf(base))
            row.append(f"{cand / base:.2f}" if ok and kind not in ("int",) else "")
        table.add_row(*row)
    return table


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
    if comparison is not None:
        base = next((s for s in summaries if s.policy == comparison.baseline), None)
        if base is not None and math.isinf(base.overall.latency_p99_s):
            console.print(
                f"{comparison.baseline}'s P99 is a miss: more than 1% of its chains were shed or "
                "failed (they count as infinite latency), so the P99 ratio is 0",
                style="dim",
            )
        console.print(
            f"[bold]{comparison.candidate} vs {comparison.baseline}[/bold]: "
            f"P99 ratio {comparison.p99_ratio:.2f}, goodput ratio "
            f"{comparison.goodput_ratio:.2f}x, realtime SLO attainment "
            f"{comparison.realtime_attainment * 100:.1f}%"
        )
        for target, met in comparison.targets.items():
            mark = "[green]met[/green]" if met else "[red]not met[/red]"
            console.print(f"  target {target}: {mark}")


def to_json(
    summaries: list[Summary], comparison: Comparison | None, context: dict[str, Any]
) -> dict[str, Any]:
    def clean(value: Any) -> Any:
        # JSON has no inf/nan: misses and empty groups become null.
        if isinstance(value, float) and (math.isinf(value) or math.isnan(value)):
            return None
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, list):
            return [clean(v) for v in value]
        return value

    return clean(
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
    return table


def seed_table(summaries: list[Any]) -> Table:
    """The seed-agent scenario: one column per configuration, the on/off ratio."""
    table = Table(title="seed-agent chains", title_justify="left")
    table.add_column("metric")
    for s in summaries:
        table.add_column(s.config, justify="right")
    names = [s.config for s in summaries]
    both = "on" in names and "off" in names
    if both:
        table.add_column("on / off", justify="right")
    rows = (
        ("chains", "chains", "int"),
        ("completed", "completed", "int"),
        ("latency P50", "latency_p50_s", "s"),
        ("latency P90", "latency_p90_s", "s"),
        ("latency P99", "latency_p99_s", "s"),
        ("serving time P50", "serving_p50_s", "s"),
        ("serving time P99", "serving_p99_s", "s"),
        ("reusable-prefix hit rate", "reusable_hit_rate", "%"),
        ("prefix-cache hits (all prompt tokens)", "prefix_hit_rate", "%"),
        ("tool-cache hits", "tool_cache_hit_rate", "%"),
        ("worker switches per chain", "worker_switches", "f3"),
        ("wall time", "wall_s", "s"),
    )
    by = {s.config: s for s in summaries}
    for label, attr, kind in rows:
        row = [label] + [fmt(getattr(s, attr), kind) for s in summaries]
        if both:
            a, b = getattr(by["on"], attr), getattr(by["off"], attr)
            row.append(f"{a / b:.2f}" if kind == "s" and b and math.isfinite(b) else "")
        table.add_row(*row)
    return table
