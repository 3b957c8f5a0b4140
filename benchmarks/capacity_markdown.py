"""Render `inferx sim --capacity --json` outputs as the markdown tables of
docs/benchmarks.md: python benchmarks/capacity_markdown.py OUT.json [OUT.json ...]
(a file of the same name with a prefix of ABLATIONS is read as that chain-aware
ablation: `abl-` = realtime guard off, `fixed-` = the fixed 30 s KV hold)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

CANDIDATE = "chain-aware"
ABLATIONS = {"abl-": "chain-aware, guard off", "fixed-": "chain-aware, fixed 30 s hold"}


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def fmt(rates: dict) -> str:
    return f"{rates['rate_per_s']:.3f} ({rates['min_rate_per_s']:.3f}-{rates['max_rate_per_s']:.3f})"


def main(paths: list[str]) -> None:
    rows = []
    for raw in paths:
        path = Path(raw)
        if path.name.startswith(tuple(ABLATIONS)):
            continue
        data = load(path)
        capacity = data["capacity"]
        peer = data["strongest_peer"]
        ours = capacity[CANDIDATE]
        per_seed = [
            a["rate_per_s"] / b["rate_per_s"]
            for a, b in zip(ours["per_seed"], capacity[peer]["per_seed"], strict=True)
            if b["rate_per_s"] > 0
        ]
        ablated = []
        for prefix in ABLATIONS:
            ablation = path.with_name(prefix + path.name)
            measured = ablation.exists() and ablation.stat().st_size > 0  # empty: a run still going
            ablated.append(fmt(load(ablation)["capacity"][CANDIDATE]) if measured else "-")
        context = data["context"]
        rows.append(
            (
                context["trace"],
                context["profile"]["name"].split(" ")[0],
                fmt(ours),
                f"{peer} {fmt(capacity[peer])}",
                f"**{ours['rate_per_s'] / capacity[peer]['rate_per_s']:.2f}x** "
                f"({min(per_seed):.2f}-{max(per_seed):.2f})",
                *ablated,
                ", ".join(
                    f"{name} {capacity[name]['rate_per_s']:.3f}"
                    for name in sorted(capacity, key=lambda n: -capacity[n]["rate_per_s"])
                    if name not in (CANDIDATE, peer)
                ),
            )
        )
    columns = ("workload", "engine profile", "chain-aware", "strongest peer", "ratio (per seed)")
    columns += (*ABLATIONS.values(), "other peers")
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
