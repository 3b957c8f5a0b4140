"""`inferx bench`, `inferx sim` and `inferx trace`: measure scheduling policies.

  inferx workload -o FILE         write a JSONL agent-chain workload
  inferx sim                      replay a trace in virtual time (SIMULATED engines)
  inferx bench --simulate         the same as `inferx sim`
  (live replay with --engine sim|vllm / --router is not implemented yet)
By default both policies run on the default trace at 80% of the baseline's
saturation load (found in the simulator) and the ratios are printed.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from inferx.bench import runner
from inferx.errors import InferxError, InvalidArgument
from inferx.sim.profile import load_profile
from inferx.sim.trace import TraceConfig, generate, write_trace

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def _progress_factory(enabled: bool) -> runner.ProgressFactory:
    @contextmanager
    def progress(label: str, total: int) -> Iterator[Callable[[int], None]]:
        if not enabled:
            yield lambda done: None
            return
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=err,
            transient=True,
        ) as bar:
            task = bar.add_task(label, total=total)
            yield lambda done: bar.update(task, completed=done)

    return progress


def _policies(args: argparse.Namespace) -> list[str]:
    names = args.compare if args.compare else [args.policy]
    runner.check_policies(names)
    return names


def _prepare(args: argparse.Namespace):
    profile = load_profile(args.profile)
    trace = runner.load_trace(args.trace)
    if args.rate is not None and args.rate <= 0:
        raise InvalidArgument("--rate must be positive")
    quiet = args.json
    on_probe = None
    if not quiet:

        def on_probe(p) -> None:
            verdict = "sustainable" if p.sustainable else "overloaded"
            err.print(
                f"  baseline at {p.rate_per_s:.3f} chains/s: median slowdown "
                f"{p.early_slowdown:.2f} -> {p.late_slowdown:.2f} ({verdict})",
                style="dim",
            )

        if args.rate is None and args.load is not None:
            err.print("finding the baseline's saturation load in the simulator ...")
    choice = runner.choose_load(trace, profile, args.workers, args.rate, args.load, on_probe)
    trace = trace.at_rate(choice.rate_per_s)
    if args.duration is not None:
        trace = trace.head(args.duration)
    if not trace.chains:
        raise InvalidArgument("the trace has no chains in the chosen --duration")
    return profile, trace, choice


def _finish(args, runs, choice, profile, trace, where: str) -> int:
    summaries, comparison = runner.conclude(runs)
    context = {
        "where": where,
        "trace": args.trace or str(runner.DEFAULT_TRACE),
        "trace_seed": trace.meta.config.seed,
        "chains": len(trace.chains),
        "rate_per_s": choice.rate_per_s,
        "load": choice.how,
        "saturation_per_s": choice.saturation.rate_per_s if choice.saturation else None,
        "workers": args.workers,
        "profile": profile.model_dump(),
    }
    if args.json:
        print(json.dumps(runner_json(summaries, comparison, context), indent=2))
    else:
        header = (
            f"[bold]{where}[/bold]: {len(trace.chains)} chains of "
            f"{context['trace']} (seed {context['trace_seed']}) at {choice.how}"
        )
        from inferx.bench.report import print_report

        print_report(out, summaries, comparison, header)
    return 0


def runner_json(summaries, comparison, context):
    from inferx.bench.report import to_json

    return to_json(summaries, comparison, context)


def cmd_sim(args: argparse.Namespace) -> int:
    policies = _policies(args)
    profile, trace, choice = _prepare(args)
    runs = runner.run_simulated(trace, policies, profile, args.workers, _progress_factory(not args.json))
    where = f"simulator ({profile.name}, SIMULATED engines)"
    return _finish(args, runs, choice, profile, trace, where)


async def cmd_bench(args: argparse.Namespace) -> int:
    if args.simulate:
        return cmd_sim(args)
    # The live replay (a LocalStack per policy with `sim` or vLLM workers, hops sent
    # closed-loop to the scheduler) is not built yet; say so instead of pretending.
    raise InferxError(
        "live replay (--engine/--router) is not implemented yet; "
        "use `inferx sim` or `inferx bench --simulate` (virtual time, SIMULATED engines)"
    )


def cmd_trace(args: argparse.Namespace) -> int:
    mix: dict[str, float] = {}
    for part in args.mix.split(","):
        kind, sep, weight = part.partition("=")
        try:
            mix[kind.strip()] = float(weight)
        except ValueError:
            raise InvalidArgument(f"--mix {args.mix!r}: expected KIND=WEIGHT,...") from None
        if not sep:
            raise InvalidArgument(f"--mix {args.mix!r}: expected KIND=WEIGHT,...")
    config = TraceConfig(
        seed=args.seed,
        duration_s=args.duration,
        rate_per_s=args.rate,
        burstiness=args.burstiness,
        mix=mix,
    )
    trace = generate(config, load_profile(args.profile))
    write_trace(trace, args.out)
    kinds = {k: sum(1 for c in trace.chains if c.kind == k) for k in mix}
    out.print(f"wrote {len(trace.chains)} chains to {args.out} ({kinds}, seed {args.seed})")
    return 0


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", help="JSONL trace (default: benchmarks/default_trace.jsonl)")
    parser.add_argument(
        "--compare",
        nargs="+",
        metavar="POLICY",
        default=None,
        help="policies to run on the same trace (default: baseline chain-aware)",
    )
    parser.add_argument("--policy", help="run one policy instead of comparing")
    parser.add_argument("--workers", type=int, default=4, help="model workers (default 4)")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--rate", type=float, help="chain arrivals per second (virtual time)")
    load.add_argument(
        "--load",
        type=float,
        default=0.8,
        help="fraction of the baseline's saturation rate (default 0.8)",
    )
    parser.add_argument("--duration", type=float, help="only chains arriving in the first S s")
    parser.add_argument("--profile", help="engine calibration file (YAML/JSON)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def _defaults(args: argparse.Namespace) -> None:
    if args.policy:
        args.compare = None
    elif not args.compare:
        args.compare = ["baseline", "chain-aware"]


def register(sub: argparse._SubParsersAction) -> None:
    sim = sub.add_parser("sim", help="replay a trace through the policies in virtual time")
    _common(sim)
    sim.set_defaults(handler=lambda a: (_defaults(a), cmd_sim(a))[1], simulate=True)

    bench = sub.add_parser("bench", help="benchmark the scheduling policies on a trace")
    _common(bench)
    bench.add_argument("--simulate", action="store_true", help="same as `inferx sim`")
    bench.add_argument(
        "--engine",
        choices=("sim", "vllm"),
        help="live: start a local stack with this engine per policy (not implemented yet)",
    )
    bench.add_argument("--router", help="use a running stack (its scheduler's policy)")
    bench.add_argument(
        "--speed",
        type=float,
        default=4.0,
        help="live sim: engines and the trace run this many times faster than real time",
    )
    bench.add_argument("--timeout", type=float, default=900.0, help="live: give up after S wall seconds")
    bench.set_defaults(handler=lambda a: (_defaults(a), cmd_bench(a))[1])

    trace = sub.add_parser("workload", help="generate a JSONL agent-chain workload trace")
    trace.add_argument("-o", "--out", required=True, help="output file")
    trace.add_argument("--seed", type=int, default=4)
    trace.add_argument("--duration", type=float, default=900.0, help="arrival window (s)")
    trace.add_argument("--rate", type=float, default=1.0, help="chains per second")
    trace.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    trace.add_argument("--mix", default="chat=0.45,bfcl=0.4,swe=0.15", help="KIND=WEIGHT,...")
    trace.add_argument("--profile", help="engine calibration used to set SLOs")
    trace.set_defaults(handler=cmd_trace)
