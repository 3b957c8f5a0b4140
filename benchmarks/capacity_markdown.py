"""Render `inferx sim --capacity --json` outputs as the headline table of
docs/benchmarks.md:

    python benchmarks/capacity_markdown.py OUT.json [OUT.json ...]
    python benchmarks/capacity_markdown.py --top-peers 2 OUT.json   # names, for `make bench`

Files of the same workload and engine profile are merged by trace seed (e.g. one run of
every policy on seed 1 and one of the strongest on seeds 2-3): a policy's capacity is
the median over the seeds it was measured on, and the table says how many. The
strongest peer is the peer with the highest median among those measured on every seed
chain-aware was. With `--bound` results, the engine bound (median over seeds) and each
policy's capacity as a share of it are shown too. Burst results (`--burst`) are refused:
they are not sustained capacities.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

CANDIDATE = "chain-aware"


def top_peers(count: int, paths: list[str]) -> list[str]:
    """The `count` peers of highest median capacity in these results: `make bench`
    measures every policy on the first seed, then only these and chain-aware on the rest
    (a peer well behind on one seed does not become the strongest on the median)."""
    by_name: dict[str, list[float]] = defaultdict(list)
    for raw in paths:
        for name, runs in _per_seed(raw, json.loads(Path(raw).read_text())).items():
            by_name[name].extend(run["rate_per_s"] for run in runs)
    peers = [name for name in by_name if name != CANDIDATE]
    return sorted(peers, key=lambda n: -statistics.median(by_name[n]))[:count]


def main(paths: list[str]) -> None:
    if paths[:1] == ["--top-peers"]:
        if len(paths) < 3 or not paths[1].isdigit():
            raise SystemExit("usage: capacity_markdown.py --top-peers N OUT.json [OUT.json ...]")
        print(" ".join(top_peers(int(paths[1]), paths[2:])))
        return
    groups: dict[tuple[str, str], dict] = {}
    for raw in paths:
        data = json.loads(Path(raw).read_text())
        context = data["context"]
        if context.get("mode") != "steady":
            raise SystemExit(f"{raw}: not a steady-state capacity search (mode {context.get('mode')!r})")
        key = (context["trace"], context["profile"]["name"].split(" ")[0])
        group = groups.setdefault(
            key, {"rates": defaultdict(dict), "bounds": {}, "windows": set(), "workers": context["workers"]}
        )
        seeds = context["trace_seeds"]
        for name, runs in _per_seed(raw, data).items():
            for seed, run in zip(seeds, runs, strict=True):
                group["rates"][name][seed] = run["rate_per_s"]
        for window in context["window"]:
            group["windows"].add(round(window["window_s"]))
        for seed_bound in (data.get("bound") or {}).get("per_seed", []):
            if "at_least" not in seed_bound:
                continue  # measured before bounds were in nominal units (offered 1.3x): not comparable
            group["bounds"][seed_bound["seed"]] = (seed_bound["bound_per_s"], seed_bound["at_least"])
    columns = (
        "workload",
        "engine profile",
        "window (s)",
        "chain-aware",
        "strongest peer",
        "ratio (per seed)",
        "engine bound",
        "share of bound: chain-aware / peer",
        "other peers",
    )
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for (trace, profile), group in groups.items():
        rates = group["rates"]
        ours = rates[CANDIDATE]
        seeds = sorted(ours)
        peers = [n for n in rates if n != CANDIDATE and set(seeds) <= set(rates[n])]
        median = {n: statistics.median(rates[n].values()) for n in rates}
        peer = max(peers, key=lambda n: median[n])
        per_seed = [ours[s] / rates[peer][s] for s in seeds if rates[peer][s] > 0]
        bounds = [group["bounds"][s] for s in seeds if s in group["bounds"]]
        bound = statistics.median(b for b, _ in bounds) if bounds else None
        at_least = ">= " if any(flag for _, flag in bounds) else ""

        others = ", ".join(
            f"{name} {median[name]:.3g}"
            + (f" ({len(rates[name])} seed)" if len(rates[name]) < len(seeds) else "")
            for name in sorted(rates, key=lambda n: -median[n])
            if name not in (CANDIDATE, peer)
        )
        print(
            "| "
            + " | ".join(
                (
                    trace,
                    profile,
                    "/".join(str(w) for w in sorted(group["windows"])),
                    _cell(rates[CANDIDATE], median[CANDIDATE]),
                    f"{peer} {_cell(rates[peer], median[peer])}",
                    f"**{median[CANDIDATE] / median[peer]:.2f}x** ({min(per_seed):.2f}-{max(per_seed):.2f}), "
                    f"seeds {','.join(map(str, seeds))}",
                    f"{at_least}{bound:.3g} ({len(bounds)} seeds)" if bound is not None else "-",
                    f"{median[CANDIDATE] / bound:.0%} / {median[peer] / bound:.0%}" if bound else "-",
                    others,
                )
            )
            + " |"
        )


def _per_seed(path: str, data: dict) -> dict[str, list[dict]]:
    """Each policy's searches in seed order, from `--json`'s output (`per_seed`) or a
    `--results` file (a list per policy; refused while the run had not finished)."""
    if data.get("complete") is False:
        raise SystemExit(f"{path}: an unfinished run (complete: false)")
    return {
        name: result if isinstance(result, list) else result["per_seed"]
        for name, result in data["capacity"].items()
    }


def _cell(by_seed: dict[int, float], median: float) -> str:
    values = list(by_seed.values())
    spread = f" ({min(values):.3g}-{max(values):.3g})" if len(values) > 1 else ""
    return f"{median:.3g}{spread}"


if __name__ == "__main__":
    main(sys.argv[1:])
