"""What chain-aware learns of an engine it was not told (`git show
afbf7ed:docs/benchmarks.md`, "The engine's figures, learned from finished hops"): one
simulated replay of a workload on a profile's engines, the policy started from
Llama-3-8B's figures and learning, then the figures it priced with at the end against
the profile's.

    python benchmarks/engine_fit.py [--profile FILE] [--workload mix|coding|research] \\
        [--rate R] [--seed N] [--workers 4] [--json]

SIMULATED engines (`inferx.sim`); deterministic for a given profile, workload, seed and rate.
"""

from __future__ import annotations

import argparse
import json
import sys

from inferx.errors import InferxError
from inferx.sim.capacity import attainment
from inferx.sim.cluster import ClusterSim, sim_policy
from inferx.sim.profile import load_profile
from inferx.sim.trace import WORKLOADS, generate, workload

# What a scheduler without --engine-profile starts from (ChainAwareConfig's defaults).
UNTOLD = {"prefill_tokens_per_s": 15_000.0, "kv_read_s_per_token": 0.08e-6, "learn_engine": True}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", help="engine calibration (YAML/JSON; default Llama-3-8B on an A100)")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="mix")
    parser.add_argument("--rate", type=float, default=None, help="chains/s (default: the workload's own)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.rate is not None and args.rate <= 0:
        parser.error("--rate must be positive")
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    try:
        profile = load_profile(args.profile)
        trace = generate(workload(args.workload, args.seed), profile)
    except InferxError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.rate is not None:
        trace = trace.at_rate(args.rate)
    policy = sim_policy("chain-aware", profile, dict(UNTOLD))
    run = ClusterSim(trace, policy, profile, args.workers).run()
    learned = (run.engine or {}).get("sim", {})
    result = {
        "profile": profile.name,
        "workload": args.workload,
        "seed": args.seed,
        "rate_per_s": args.rate,
        "true": profile.policy_options(),
        "learned": learned,
        "slo": attainment(run.chains).model_dump(),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    true = result["true"]
    print(f"{profile.name}, {args.workload} (seed {args.seed}), SIMULATED engines")
    for key, label, scale, form, unit in (
        ("prefill_tokens_per_s", "prefill", 1.0, ",.0f", "tokens/s"),
        ("kv_read_s_per_token", "decode cost", 1e6, ".3f", "ms per 1k tokens of KV"),
    ):
        got = format(learned[key] * scale, form) if key in learned else "not learned"
        print(f"  {label}: true {format(true[key] * scale, form)}, learned {got} {unit}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
