"""Render `inferx sim --capacity --json` outputs as the markdown tables of
docs/benchmarks.md: python benchmarks/capacity_markdown.py OUT.json [OUT.json ...]
(an `abl-` prefixed file is read as the chain-aware ablation of the same name)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

CANDIDATE = "chain-aware"


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def fmt(rates: dict) -> str:
    return f"{rates['rate_per_s']:.3f} ({rates['min_rate_per_s']:.3f}-{rates['max_rate_per_s']:.3f})"


def main(paths: list[str]) -> None:
    rows = []
    for raw in paths:
        path = Path(raw)
        if path.name.startswith("abl-"):
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
        ablation = path.with_name("abl-" + path.name)
        guard_off = load(ablation)["capacity"][CANDIDATE] if ablation.exists() else None
        context = data["context"]
        rows.append(
            (
                context["trace"],
                context["profile"]["name"].split(" ")[0],
                fmt(ours),
                f"{peer} {fmt(capacity[peer])}",
                f"**{ours['rate_per_s'] / capacity[peer]['rate_per_s']:.2f}x** "
                f"({min(per_seed):.2f}-{max(per_seed):.2f})",
                fmt(guard_off) if guard_off else "-",
                ", ".join(
                    f"{name} {capacity[name]['rate_per_s']:.3f}"
                    for name in sorted(capacity, key=lambda n: -capacity[n]["rate_per_s"])
                    if name not in (CANDIDATE, peer)
                ),
            )
        )
    columns = ("workload", "engine profile", "chain-aware", "strongest peer", "ratio (per seed)")
    columns += ("chain-aware, guard off", "other peers")
    print("| " + " | ".join(columns) + " |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
