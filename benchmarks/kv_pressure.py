"""The KV-pressure scenario on real vLLM (issue #13's live target): chains whose tool
calls leave their context idle in a KV cache too small for all of them, so concurrent
chains evict each other during the gaps; `chain-aware` (priced retention) against
`session-affinity` on the same workers, in one run.

Each configuration gets a fresh stack (`inferx.bench.seed_run`): the same N vLLM CPU
workers on the tiny local model with a capped KV cache (`inferx-worker
--kv-cache-tokens`), the same router (tool cache off: every tool call is a real gap),
the same Poisson arrivals of the seed-shaped chain (8 model calls, a ~1.6k-token system
prompt growing to ~3k tokens, 7 `kb_search` calls with a lognormal delay); only the
scheduler differs: its policy, and the peer runs without KV reservations, as a sticky
router straight in front of vLLM does (`seed_run.CONFIGS`). Measured per configuration:

  * re-prefilled tokens: over steps 2-8, the tokens a step shares with the previous
    step's prompt that vLLM did *not* find in its prefix cache (its own
    cached-token count per request, from the trace's usage) -- what evictions (or a
    move to another worker) cost;
  * chain latency P50/P99 (nearest rank; a chain that did not finish is a miss).

Targets (issue #13): re-prefilled tokens <= 0.5x and chain P99 <= 0.7x the peer's.
The KV offload tier itself (`--kv-offload-gib`) needs a GPU; on the CPU build this
measures retention only.

    PYTHONPATH=libs:services .venv/bin/python benchmarks/kv_pressure.py     # ~4-6 min
    ... --engine sim                                             # a quick check of the harness
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import time
from pathlib import Path

from inferx.bench import results as bench_results
from inferx.bench import seed_run

ROOT = Path(__file__).resolve().parents[1]
PEER, CANDIDATE = "kv-session-affinity", "kv-chain-aware"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--engine", choices=("vllm", "sim"), default="vllm")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--chains", type=int, default=24, help="chains per configuration (24)")
    p.add_argument("--rate", type=float, default=0.4, help="chain arrivals per second (0.4)")
    p.add_argument(
        "--kv-cache-tokens", type=int, default=6144, help="each worker's KV cache, tokens (6144: ~2 contexts)"
    )
    p.add_argument("--tool-median-ms", type=float, default=1500.0, help="kb_search delay median (1500 ms)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--compare", nargs="+", default=[PEER, CANDIDATE], choices=sorted(seed_run.CONFIGS))
    p.add_argument("--model-path", default=str(ROOT / ".inferx/models/tiny-llama"))
    p.add_argument("--timeout", type=float, default=600.0, help="per configuration (s)")
    p.add_argument(
        "--results", help="raw results JSON (default .inferx/bench-results/<time>-kv-pressure.json)"
    )
    args = p.parse_args(argv)
    if args.engine == "vllm" and not (Path(args.model_path) / "config.json").exists():
        p.error(f"{args.model_path}: no model here (run `make model`)")
    for name in ("workers", "chains", "kv_cache_tokens"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.rate <= 0 or args.tool_median_ms < 0:
        p.error("--rate must be positive and --tool-median-ms not negative")
    return args


@contextlib.contextmanager
def progress(label: str, total: int):
    print(f"{label}: {total} chains ...", file=sys.stderr, flush=True)

    def advance(done: int) -> None:
        if done == total or done % 8 == 0:
            print(f"  {done}/{total}", file=sys.stderr, flush=True)

    yield advance


def ratio(a: float, b: float) -> float | None:
    return a / b if b and b != float("inf") and a != float("inf") else None


def engine_cell(engine: dict[str, dict[str, float]] | None) -> str:
    """What the scheduler priced the workers with at the end (learned from finished hops
    unless told a profile): the prefill rate is what a re-prefill costs, so what a held
    context is worth."""
    if not engine:
        return "not exported"
    return "; ".join(
        f"{f['prefill_tokens_per_s']:,.0f} tok/s, {f['kv_read_s_per_token'] * 1e6:.3f} ms/1k KV"
        for f in engine.values()
    )


def table(summaries: list[seed_run.SeedSummary]) -> str:
    by = {s.config: s for s in summaries}
    names = list(by)
    rows = [
        ("chains completed", lambda s: f"{s.completed}/{s.chains}"),
        ("re-prefilled tokens (steps 2-8)", lambda s: f"{s.reprefilled_tokens:,} of {s.reusable_tokens:,}"),
        ("reusable-prefix hit rate", lambda s: f"{s.reusable_hit_rate:.1%}"),
        ("chain latency P50", lambda s: f"{s.latency_p50_s:.2f} s"),
        ("chain latency P99", lambda s: f"{s.latency_p99_s:.2f} s"),
        ("worker switches per chain", lambda s: f"{s.worker_switches:.2f}"),
        ("engine priced at (prefill; decode per KV)", lambda s: engine_cell(s.engine)),
        ("wall", lambda s: f"{s.wall_s:.0f} s"),
    ]
    lines = ["| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    lines += ["| " + label + " | " + " | ".join(cell(by[n]) for n in names) + " |" for label, cell in rows]
    if PEER in by:
        peer = by[PEER]
        for n in names:
            if n == PEER:
                continue
            s = by[n]
            rp = ratio(s.reprefilled_tokens, peer.reprefilled_tokens)
            p99 = ratio(s.latency_p99_s, peer.latency_p99_s)
            lines.append(
                f"\n{n} / {PEER}: re-prefilled tokens "
                + (f"{rp:.2f}x (target <= 0.5x)" if rp is not None else "undefined")
                + ", chain P99 "
                + (f"{p99:.2f}x (target <= 0.7x)" if p99 is not None else "undefined")
            )
    return "\n".join(lines)


async def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    options = seed_run.SeedOptions(
        engine=args.engine,
        workers=args.workers,
        chains=args.chains,
        rate_per_s=args.rate,
        max_tokens=args.max_tokens,
        tool_median_s=args.tool_median_ms / 1000,
        model_path=args.model_path,
        timeout_s=args.timeout,
        kv_cache_tokens=args.kv_cache_tokens,
    )
    path = Path(args.results) if args.results else bench_results.default_path("kv-pressure")
    saved = bench_results.ResultsFile(path)
    context = {
        "scenario": "kv-pressure",
        "command": " ".join(sys.argv),
        "configs": {name: seed_run.CONFIGS[name] for name in args.compare},
        "options": options.__dict__,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    runs: list[dict] = []
    print(f"raw results: {path}", file=sys.stderr)

    def keep(summary: seed_run.SeedSummary, outcomes: list[seed_run.RunOutcome]) -> None:
        runs.append({"summary": summary, "outcomes": outcomes})
        saved.write({**context, "runs": runs, "complete": False})

    knowledge = ROOT / "examples" / "knowledge_base.jsonl"
    with tempfile.TemporaryDirectory(prefix="inferx-kvp-") as tmp:
        summaries = await seed_run.run_seed(
            options, args.compare, Path(tmp), knowledge, progress, lambda s: print(s, file=sys.stderr), keep
        )
    saved.write({**context, "runs": runs, "summaries": summaries, "complete": True})
    print(
        f"KV pressure: {options.workers} {options.engine} workers, "
        f"KV cache {options.kv_cache_tokens} tokens each, "
        f"{options.chains} chains at {options.rate_per_s:g}/s, kb_search median {args.tool_median_ms:g} ms\n"
    )
    print(table(summaries))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
