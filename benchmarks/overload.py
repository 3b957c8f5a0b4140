"""At a fixed arrival rate (e.g. the strongest peer's capacity at SLO, or twice it):
realtime and overall SLO attainment, what is shed, preemptions and P99 chain latency,
per policy, over several trace seeds, in the simulator.

    python benchmarks/overload.py --workload research --rate 0.534 --seeds 3 \\
        --compare prefix-aware chain-aware chain-aware:overload_control=true [--profile F]

A `policy:key=value,key=value` entry runs the policy with those options (an ablation).
Prints a markdown table (medians over the seeds, (min-max) in brackets); --json for
the raw figures; --tokens adds where prompt tokens came from (prefilled, found in the
GPU prefix cache, loaded back from a KV offload tier).

Steady state (issue #42): the trace's chains arrive at --rate for the same window as
`inferx sim --capacity` uses (warm-up and drain not counted; --window-s to change it),
and every figure is over the chains arriving in the measured window. The run stops one
longest SLO after the last arrival: a measured chain unfinished by then is a miss.
"Finished per s" is the measured chains that finished, per second of the window; "work
served" is the engine bound's measure (`inferx sim --capacity --bound`): the serving time
alone of the chains finishing within the window over that of the chains arriving in it.
Under ~95% (none shed), the engines fell behind the arrivals: no SLO holds at that rate.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys

import yaml

from inferx.scheduling.registry import make_policy
from inferx.sim.capacity import attainment, finished_in_window, throughput_of
from inferx.sim.cluster import ClusterSim
from inferx.sim.profile import load_profile
from inferx.sim.steady import steady_trace, steady_window
from inferx.sim.trace import generate, workload


def parse_entry(entry: str) -> tuple[str, dict[str, object]]:
    name, _, raw = entry.partition(":")
    options: dict[str, object] = {}
    for pair in filter(None, raw.split(",")):
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"overload.py: {entry!r}: options are key=value, comma-separated")
        options[key] = yaml.safe_load(value)
    return name, options


def run(name: str, options: dict[str, object], args: argparse.Namespace, seed: int) -> dict[str, float]:
    profile = load_profile(args.profile)
    base = generate(workload(args.workload, seed), profile)
    window = steady_window(base, args.window_s)
    trace, measured = steady_trace(base, args.rate, window)
    try:
        policy = make_policy(name, **options)
    except (KeyError, ValueError) as exc:
        raise SystemExit(f"overload.py: {name}: {exc}") from None
    end = window.span_s + window.drain_s
    result = ClusterSim(trace, policy, profile, args.workers, measured=measured, until_s=end).run()
    chains = [c for c in result.chains if c.chain_id in measured]
    score = attainment(chains)
    prompt = sum(c.prompt_tokens for c in chains) or 1
    cached = sum(c.cached_tokens for c in chains)
    loaded = sum(c.loaded_tokens for c in chains)
    finished = [c for c in chains if c.latency_s is not None]
    served = throughput_of(name, args.rate, chains, finished_in_window(result.chains, window), window)
    return {
        "prefilled": (prompt - cached - loaded) / prompt,
        "gpu_cached": cached / prompt,
        "host_loaded": loaded / prompt,
        "realtime": score.realtime if score.realtime is not None else math.nan,
        "overall": score.overall,
        "shed": sum(c.status == "shed" for c in chains) / len(chains),
        "preemptions": float(result.preemptions or 0),
        "completed": len(finished) / len(chains),
        "finished_per_s": len(finished) / window.window_s,
        # the serving time of chains finishing in the window (any arrival) over that of
        # the chains arriving in it: ~100% when the engines keep up
        "work_served": served.completed_rate_per_s / args.rate,
        "measured_chains": float(len(chains)),
        # inf when more than 1% did not finish (shed ones included)
        "p99_latency_s": score.p99_latency_s if score.p99_latency_s is not None else math.nan,
    }


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", required=True, choices=["mix", "coding", "research"])
    parser.add_argument("--rate", type=float, required=True, help="chain arrivals per second")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1, help="the first trace seed")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--profile", default=None)
    parser.add_argument("--compare", nargs="+", required=True, metavar="POLICY[:k=v,...]")
    parser.add_argument(
        "--window-s", type=float, default=None, help="measured window (default: as --capacity)"
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--tokens", action="store_true", help="add prompt tokens prefilled / cached / loaded")
    args = parser.parse_args(argv)
    if args.rate <= 0 or args.seeds < 1 or args.workers < 1:
        raise SystemExit("overload.py: --rate, --seeds and --workers must be positive")
    figures: dict[str, list[dict[str, float]]] = {}
    for entry in args.compare:
        name, options = parse_entry(entry)
        figures[entry] = []
        for seed in range(args.seed, args.seed + args.seeds):
            figures[entry].append(run(name, options, args, seed))
            print(f"{entry} seed {seed}: {figures[entry][-1]}", file=sys.stderr)
    if args.json:
        print(json.dumps({"args": vars(args), "figures": figures}, indent=2))
        return

    def throughput(rows: list[dict[str, float]]) -> str:
        values = [row["finished_per_s"] for row in rows]
        return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"

    def cell(rows: list[dict[str, float]], key: str, percent: bool = True) -> str:
        values = [row[key] for row in rows]
        scale, unit = (100.0, "%") if percent else (1.0, "")
        mid, lo, hi = statistics.median(values) * scale, min(values) * scale, max(values) * scale
        return f"{mid:.1f}{unit} ({lo:.1f}-{hi:.1f})" if percent else f"{mid:.0f} ({lo:.0f}-{hi:.0f})"

    print(f"\n{args.workload} at {args.rate:g} chains/s, {args.workers} workers, seeds {args.seed}..")
    extra = " prompt tokens prefilled | from the GPU cache | loaded from host |" if args.tokens else ""
    head = (
        "| policy | realtime within SLO | all within SLO | shed | preemptions | P99 chain latency (s) "
        "| finished | finished per s (window) | work served |"
    )
    print(head + extra)
    print("|---|---|---|---|---|---|---|---|---|" + ("---|---|---|" if args.tokens else ""))
    for entry, rows in figures.items():
        tokens = (
            f" {cell(rows, 'prefilled')} | {cell(rows, 'gpu_cached')} | {cell(rows, 'host_loaded')} |"
            if args.tokens
            else ""
        )
        print(
            f"| {entry} | {cell(rows, 'realtime')} | {cell(rows, 'overall')} | {cell(rows, 'shed')} "
            f"| {cell(rows, 'preemptions', percent=False)} | {cell(rows, 'p99_latency_s', percent=False)} "
            f"| {cell(rows, 'completed')} | {throughput(rows)} | {cell(rows, 'work_served')} |" + tokens
        )


if __name__ == "__main__":
    main(sys.argv[1:])
