"""Off-peak batch in the simulator (issue #44 item 4): a day-shaped arrival curve of
interactive chains (realtime chat, standard tool calls: quiet at night, two peaks) and
batch chains submitted during the working day with `schedule: off_peak` and a deadline
(8 hours). Two runs per seed, same trace, chain-aware scheduler:

* `now`: the batch chains run as they arrive (tier batch, the 8 h deadline);
* `off-peak`: their hops wait while the pool is busy (`inferx.scheduling.off_peak`,
  load above --threshold, optional --quiet-hours), never later than the deadline allows.

The day is compressed: --day-s virtual seconds stand for 24 hours (hours and the
8-hour deadline scale with it). Prints realtime and standard SLO attainment of the
chains arriving in the peak hours, over the whole day, and the share of off-peak chains
finished by their deadline (medians over --seeds).

    python benchmarks/off_peak.py --seeds 3 [--day-s 2400] [--peak-rate 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys

from inferx.scheduling.off_peak import OffPeakRule, parse_quiet_hours
from inferx.scheduling.registry import make_policy
from inferx.sim.cluster import ClusterSim
from inferx.sim.profile import load_profile
from inferx.sim.trace import Trace, TraceConfig, generate

# Relative arrival rate of interactive chains per hour of the day (peak = 1).
DAY_CURVE = [0.1, 0.08, 0.06, 0.06, 0.08, 0.12, 0.2, 0.4, 0.7, 0.9, 1.0, 1.0,
             0.8, 0.75, 0.95, 1.0, 1.0, 0.85, 0.6, 0.45, 0.35, 0.3, 0.2, 0.15]  # fmt: skip
PEAK_HOURS = [h for h, weight in enumerate(DAY_CURVE) if weight >= 0.95]
BATCH_HOURS = (9, 17)  # off-peak chains are submitted during the working day


def day_trace(seed: int, day_s: float, peak_rate: float, batch_per_hour: float, within_h: float) -> Trace:
    """Interactive chains thinned to the day curve, plus off-peak batch chains."""
    hour_s = day_s / 24
    rng = random.Random(seed)
    interactive = generate(
        TraceConfig(
            seed=seed,
            duration_s=day_s,
            rate_per_s=peak_rate,
            mix={"chat": 0.55, "bfcl": 0.45},
        )
    )
    kept = [c for c in interactive.chains if rng.random() < DAY_CURVE[int(c.arrival_s // hour_s) % 24]]
    batch_count = int(batch_per_hour * (BATCH_HOURS[1] - BATCH_HOURS[0]))
    batch = generate(
        TraceConfig(
            seed=seed + 1000,
            duration_s=batch_count / 1.0,
            rate_per_s=1.0,
            mix={"swe": 1.0},
            tiers={"swe": "batch"},
        )
    ).chains[:batch_count]
    start, end = BATCH_HOURS[0] * hour_s, BATCH_HOURS[1] * hour_s
    timed = [
        c.model_copy(
            update={
                "chain_id": f"b{i:04d}",
                "arrival_s": round(rng.uniform(start, end), 3),
                "slo_s": within_h * hour_s,
            }
        )
        for i, c in enumerate(batch)
    ]
    chains = sorted([*kept, *timed], key=lambda c: c.arrival_s)
    config = interactive.meta.config.model_copy(update={"duration_s": day_s})
    meta = interactive.meta.model_copy(update={"config": config, "chains": len(chains)})
    return Trace(meta=meta, chains=chains)


def run(args: argparse.Namespace, seed: int, gated: bool) -> dict[str, float]:
    profile = load_profile(args.profile)
    trace = day_trace(seed, args.day_s, args.peak_rate, args.batch_per_hour, args.within_h)
    off_peak = frozenset(c.chain_id for c in trace.chains if c.chain_id.startswith("b"))
    rule = OffPeakRule(
        load_threshold=args.threshold,
        quiet_hours=parse_quiet_hours(args.quiet_hours),
        recheck_s=args.recheck_s,
    )
    sim = ClusterSim(
        trace,
        make_policy(args.policy),
        profile,
        args.workers,
        horizon_factor=3.0,
        off_peak=off_peak if gated else frozenset(),
        off_peak_rule=rule if gated else None,
        day_s=args.day_s,
    )
    result = sim.run()
    hour_s = args.day_s / 24

    def share(chains: list) -> float:
        return sum(c.slo_met for c in chains) / len(chains) if chains else float("nan")

    at_peak = [c for c in result.chains if int(c.arrival_s // hour_s) % 24 in PEAK_HOURS]
    interactive = [c for c in result.chains if c.chain_id not in off_peak]
    batch = [c for c in result.chains if c.chain_id in off_peak]
    return {
        "realtime_peak": share([c for c in at_peak if c.tier == "realtime"]),
        "standard_peak": share([c for c in at_peak if c.tier == "standard" and c.chain_id not in off_peak]),
        "realtime_day": share([c for c in interactive if c.tier == "realtime"]),
        "standard_day": share([c for c in interactive if c.tier == "standard"]),
        "off_peak_by_deadline": share(batch),
        "off_peak_chains": float(len(batch)),
        "interactive_chains": float(len(interactive)),
        "off_peak_waits": float(sim.off_peak_waits),
    }


COLUMNS = [
    ("realtime_peak", "realtime at peak"),
    ("standard_peak", "standard at peak"),
    ("realtime_day", "realtime, day"),
    ("standard_day", "standard, day"),
    ("off_peak_by_deadline", "off-peak by deadline"),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--day-s", type=float, default=2400.0, help="virtual seconds standing for 24 hours")
    parser.add_argument("--peak-rate", type=float, default=3.0, help="interactive chains per s at the peak")
    parser.add_argument("--batch-per-hour", type=float, default=40.0, help="off-peak chains per hour, 9-17h")
    parser.add_argument("--within-h", type=float, default=8.0, help="the off-peak deadline, in hours")
    parser.add_argument("--threshold", type=float, default=0.6, help="pool load above which off-peak waits")
    parser.add_argument(
        "--quiet-hours", default="", help="e.g. 22-6: off-peak runs only then (or at its deadline)"
    )
    parser.add_argument("--recheck-s", type=float, default=2.0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--policy", default="chain-aware")
    parser.add_argument("--profile", default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        parse_quiet_hours(args.quiet_hours)
        OffPeakRule(load_threshold=args.threshold, recheck_s=args.recheck_s)
    except ValueError as exc:
        raise SystemExit(f"off_peak.py: {exc}") from None
    figures: dict[str, list[dict[str, float]]] = {"now": [], "off-peak": []}
    for seed in range(1, args.seeds + 1):
        for name, gated in (("now", False), ("off-peak", True)):
            figures[name].append(run(args, seed, gated))
            print(f"seed {seed} {name}: {figures[name][-1]}", file=sys.stderr)
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    print(f"| batch chains | {' | '.join(title for _, title in COLUMNS)} |")
    print("|---|" + "---|" * len(COLUMNS))
    for name, rows in figures.items():
        cells = [f"{statistics.median(row[key] for row in rows):.1%}" for key, _ in COLUMNS]
        print(f"| {name} | {' | '.join(cells)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
