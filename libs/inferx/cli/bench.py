"""`inferx bench`, `inferx sim` and `inferx trace`: measure scheduling policies.

  inferx workload -o FILE         write a JSONL agent-chain workload
  inferx sim                      replay a trace in virtual time (SIMULATED engines)
  inferx bench --simulate         the same as `inferx sim`
  inferx bench --engine sim       replay the trace on a live local stack per policy
                                  (SIMULATED sim workers, time-compressed by --speed)
  inferx bench --overhead         what a hop through router + scheduler adds to a
                                  direct worker call (one SIMULATED sim worker)
  inferx bench --peer vllm-router InferX's OpenAI-compatible front against vllm-router,
                                  each in front of identical SIMULATED sim workers
  inferx bench --scenario seed-agent --engine vllm
                                  the seed-shaped agent chain on real vLLM workers,
                                  InferX on vs the reference: round-robin in front
                                  of stock vLLM, prefix caching on (see seed_run.py)
By default round-robin and chain-aware run on the default trace at 80% of
round-robin's saturation load (found in the simulator) and the ratios are printed.

Every benchmark writes its raw results to a JSON file (`--results`, default
.inferx/bench-results/) as they come in, before it renders anything.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from inferx.bench import results, runner
from inferx.errors import InferxError, InvalidArgument
from inferx.sim.profile import load_profile
from inferx.sim.trace import TraceConfig, generate, write_trace

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


class ChainRateColumn(ProgressColumn):
    """Chains (or other units) finished per wall-clock second, as rich measures the
    task's speed."""

    def __init__(self, unit: str = "chains") -> None:
        super().__init__()
        self.unit = unit

    def render(self, task: Task) -> Text:
        speed = "--" if task.speed is None else f"{task.speed:.2f}"
        return Text(f"{speed} {self.unit}/s", style="dim")


def _progress_factory(enabled: bool, unit: str = "chains") -> runner.ProgressFactory:
    @contextmanager
    def progress(label: str, total: int) -> Iterator[Callable[[int], None]]:
        if not enabled:
            yield lambda done: None
            return
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            ChainRateColumn(unit),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=err,
            transient=True,
        ) as bar:
            task = bar.add_task(label, total=total)
            yield lambda done: bar.update(task, completed=done)

    return progress


def _policies(args: argparse.Namespace) -> list[str]:
    """The registered names (`baseline` is accepted and becomes `round-robin`)."""
    names = args.compare if args.compare else [args.policy]
    return runner.check_policies(names)


class _Results:
    """This benchmark's results file (inferx.bench.results), rewritten as results come
    in. Opened once the arguments are checked, before the (possibly long) run."""

    def __init__(self, args: argparse.Namespace, kind: str) -> None:
        path = Path(args.results) if args.results else results.default_path(kind)
        self.file = results.ResultsFile(path)
        self.data: dict = {"kind": kind, "complete": False}
        err.print(f"raw results: {path} (written before any table)", style="dim")

    def save(self, **fields) -> None:
        self.data.update(fields)
        try:
            self.file.write(self.data)
        except InferxError as exc:
            # The run is over: show the figures anyway rather than lose them too.
            err.print(f"warning: {exc.message}; the figures below are not saved", style="yellow")


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
                f"  {runner.REFERENCE_POLICY} at {p.rate_per_s:.3f} chains/s: median slowdown "
                f"{p.early_slowdown:.2f} -> {p.late_slowdown:.2f} ({verdict})",
                style="dim",
            )

        if args.rate is None and args.load is not None:
            err.print(f"finding {runner.REFERENCE_POLICY}'s saturation load in the simulator ...")
    choice = runner.choose_load(trace, profile, args.workers, args.rate, args.load, on_probe)
    trace = trace.at_rate(choice.rate_per_s)
    if args.duration is not None:
        trace = trace.head(args.duration)
    max_chains = getattr(args, "max_chains", None)
    if max_chains is not None and 0 < max_chains < len(trace.chains):
        trace = trace.head(trace.chains[max_chains].arrival_s)
    if not trace.chains:
        raise InvalidArgument("the trace has no chains in the chosen --duration")
    return profile, trace, choice


def _context(args, choice, profile, trace, where: str) -> dict:
    return {
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


def _finish(
    args, runs, choice, profile, trace, where: str, saved: _Results, extra: dict | None = None
) -> int:
    context = {**_context(args, choice, profile, trace, where), **(extra or {})}
    errors = (extra or {}).get("errors", {})
    # Raw runs first (a bug in summarizing must not lose them), then the summaries;
    # both before anything is rendered.
    saved.save(context=context, runs=[results.replay_data(r, errors.get(r.policy)) for r in runs])
    summaries, comparison = runner.conclude(runs)
    saved.save(summaries=summaries, comparison=comparison, complete=True)
    if args.json:
        print(json.dumps(runner_json(summaries, comparison, context), indent=2))
    else:
        header = (
            f"[bold]{where}[/bold]: {len(trace.chains)} chains of "
            f"{context['trace']} (seed {context['trace_seed']}) at {choice.how}"
        )
        from inferx.bench.report import print_report

        print_report(out, summaries, comparison, header)
        if extra and "simulator" in extra:
            from inferx.bench.report import agreement_table

            out.print(agreement_table(summaries, extra["simulator"]))
        if extra and any(extra.get("errors", {}).values()):
            out.print(f"errors by status: {extra['errors']}", style="dim")
    return 0


def runner_json(summaries, comparison, context):
    from inferx.bench.report import to_json

    return to_json(summaries, comparison, context)


def _replays_one_trace(args: argparse.Namespace) -> None:
    """Outside a capacity search and --peer, a run replays one trace file: the flags that
    generate traces would otherwise be ignored without a word."""
    given = [
        flag
        for flag, is_given in (
            ("--workload", args.workload is not None),
            ("--seed", args.seed is not None),
            ("--seeds", args.seeds > 1),
        )
        if is_given
    ]
    if given:
        raise InvalidArgument(
            f"{', '.join(given)} choose the generated traces of a capacity search (--capacity) or "
            "of --peer; this run replays --trace FILE (default benchmarks/default_trace.jsonl): "
            "write one with `inferx workload -o FILE --seed N --mix ...`"
        )


def cmd_sim(args: argparse.Namespace) -> int:
    if getattr(args, "decision_cost", False):
        from inferx.cli.decision_cost import cmd_decision_cost

        return cmd_decision_cost(args, out, err, _Results(args, "decision-cost").save)
    policies = _policies(args)
    if getattr(args, "capacity", False):
        from inferx.cli.capacity import cmd_capacity

        saved = _Results(args, "capacity")
        return cmd_capacity(args, policies, _progress_factory(not args.json), out, err, saved)
    if getattr(args, "programs", False):
        raise InvalidArgument("--programs replays the capacity search as dynamic programs: add --capacity")
    _replays_one_trace(args)
    profile, trace, choice = _prepare(args)
    saved = _Results(args, "sim")
    options = runner.policy_options(args.option, policies)
    pools = getattr(args, "pools", 1)
    if not 1 <= pools <= args.workers:
        raise InvalidArgument(f"--pools must be between 1 and --workers ({args.workers})")
    runs = runner.run_simulated(
        trace, policies, profile, args.workers, _progress_factory(not args.json), options, pools=pools
    )
    where = f"simulator ({profile.name}, SIMULATED engines{f', {pools} pools' if pools > 1 else ''})"
    return _finish(args, runs, choice, profile, trace, where, saved)


async def cmd_live(args: argparse.Namespace) -> int:
    from inferx.bench.live import LiveOptions, run_live_sim, scheduler_flags

    if args.speed <= 0:
        raise InvalidArgument("--speed must be positive")
    policies = _policies(args)
    policy_options = runner.policy_options(args.option, policies)
    flags = scheduler_flags(policy_options)
    profile, trace, choice = _prepare(args)
    progress = _progress_factory(not args.json)
    options = LiveOptions(
        workers=args.workers,
        speed=args.speed,
        timeout_s=args.timeout,
        state_dir=Path(args.state_dir) if args.state_dir else None,
        scheduler_flags=flags,
    )
    note = (lambda s: None) if args.json else (lambda s: err.print(s, style="dim"))
    where = f"live stack, {args.workers} SIMULATED sim workers ({profile.name}), x{args.speed:g} time"
    saved = _Results(args, "live")
    done: list = []

    def keep(run, run_errors) -> None:
        # Each policy's chains as soon as its stack is done: the next one may crash.
        done.append(results.replay_data(run, run_errors))
        saved.save(context=_context(args, choice, profile, trace, where), runs=done)

    runs, errors = await run_live_sim(trace, policies, profile, options, progress, note, keep)
    # The simulator on the same chains, the policies given the same options: how far
    # live and virtual time agree.
    simulated = runner.run_simulated(trace, policies, profile, args.workers, progress, policy_options)
    sim_summaries, _ = runner.conclude(simulated)
    extra = {
        "speed": args.speed,
        "errors": errors,
        "simulator": [s.model_dump() for s in sim_summaries],
    }
    return _finish(args, runs, choice, profile, trace, where, saved, extra)


async def cmd_router(args: argparse.Namespace) -> int:
    """`inferx bench --router ADDR`: replay the trace against a running stack, once, with
    whatever policy its scheduler runs (restart it with the other --policy to compare)."""
    from inferx.bench.live import find_running_stack, run_against

    if args.compare_given and len(args.compare) > 1:
        raise InvalidArgument(
            "a running stack has one policy: drop --compare, run once per `inferx-scheduler --policy`"
        )
    speed = args.speed if args.speed_given else 1.0
    if speed <= 0:
        raise InvalidArgument("--speed must be positive")
    from inferx.cli import connect

    connection = connect.resolve(args)
    stack = await find_running_stack(connection.client(), args.model, connection.internal_transport())
    args.workers = stack.workers
    profile, trace, choice = _prepare(args)
    note = (lambda s: None) if args.json else (lambda s: err.print(s, style="dim"))
    note(f"replaying on model {stack.model!r} via the scheduler at {stack.scheduler} ({stack.policy})")
    saved = _Results(args, "router")
    run, errors = await run_against(
        stack, trace, profile, speed, args.timeout, _progress_factory(not args.json)
    )
    where = f"running stack at {args.router} ({stack.workers} workers of {stack.model!r}), x{speed:g} time"
    return _finish(
        args, [run], choice, profile, trace, where, saved, {"speed": speed, "errors": {stack.policy: errors}}
    )


async def cmd_bench(args: argparse.Namespace) -> int:
    if args.option and (args.peer or args.overhead or args.scenario or args.router):
        raise InvalidArgument(
            "--option sets the compared policies' options in the simulator (--simulate) or the live "
            "stack it starts (--engine sim); this benchmark starts no such policy"
        )
    if args.peer:
        from inferx.cli.peer import check_args as check_peer_args
        from inferx.cli.peer import cmd_peer

        check_peer_args(args)
        saved = _Results(args, "peer")
        progress = (_progress_factory(not args.json, "calls"), _progress_factory(not args.json, "chains"))
        return await cmd_peer(args, progress, out, err, saved)
    if not args.simulate:
        _replays_one_trace(args)
    if args.overhead:
        from inferx.cli.overhead import DEFAULT_SPEED, check_args, cmd_overhead

        if not args.speed_given:
            args.speed = DEFAULT_SPEED
        check_args(args)
        if args.policy:
            runner.check_policies([args.policy])
        saved = _Results(args, "overhead")
        return await cmd_overhead(args, _progress_factory(not args.json, "calls"), out, err, saved)
    if args.scenario == "seed-agent":
        return await cmd_seed_agent(args)
    if getattr(args, "programs", False) and not args.simulate:
        raise InvalidArgument("--programs is for the simulator's capacity search: add --simulate --capacity")
    if args.router:
        if args.simulate or args.engine:
            raise InvalidArgument("--router replays against a running stack: drop --simulate/--engine")
        return await cmd_router(args)
    if args.simulate:
        return cmd_sim(args)
    if args.capacity:
        raise InvalidArgument("--capacity searches in the simulator: add --simulate")
    if args.engine == "sim":
        return await cmd_live(args)
    if args.engine == "vllm":
        raise InvalidArgument(
            "the trace's contexts reach 32k tokens, beyond the local tiny model: replay it with "
            "--engine sim, or run the seed-shaped scenario on vLLM with --scenario seed-agent"
        )
    raise InvalidArgument("choose --simulate, --engine sim, or --scenario seed-agent --engine vllm")


async def cmd_seed_agent(args: argparse.Namespace) -> int:
    """`inferx bench --scenario seed-agent`: InferX on vs the reference (round-robin in
    front of stock vLLM, whose prefix caching is on by default)."""
    import tempfile

    from inferx.bench import seed_run

    engine = args.engine or "vllm"
    try:
        configs, renamed = seed_run.resolve_configs(args.compare or [seed_run.REFERENCE, seed_run.CANDIDATE])
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None
    for note_text in renamed:
        err.print(f"note: {note_text}", style="yellow")
    if args.rate is not None and args.rate <= 0:
        raise InvalidArgument("--rate must be positive")
    model_path = Path(args.model_path)
    if engine == "vllm" and not (model_path / "config.json").exists():
        raise InvalidArgument(f"{model_path}: no model here (run `make model`)")
    workers = args.workers if args.workers_given else 2
    options = seed_run.SeedOptions(
        engine=engine,
        workers=workers,
        chains=args.chains,
        rate_per_s=args.rate if args.rate is not None else 0.5,
        max_tokens=args.max_tokens,
        tool_median_s=args.tool_median_ms / 1000,
        model_path=str(model_path),
        sim_speed=args.speed,
        timeout_s=args.timeout,
    )
    knowledge = runner.DEFAULT_TRACE.parents[1] / "examples" / "knowledge_base.jsonl"
    note = (lambda s: None) if args.json else (lambda s: err.print(s, style="dim"))
    context = {
        "scenario": "seed-agent",
        "configs": {name: seed_run.CONFIGS[name] for name in configs},
        "options": options.__dict__,
    }
    saved = _Results(args, "seed-agent")
    done: list = []

    def keep(summary, outcomes) -> None:
        # Each configuration as soon as its stack is done: the next may take minutes.
        done.append({"summary": summary, "outcomes": outcomes})
        saved.save(context=context, runs=done)

    with tempfile.TemporaryDirectory(prefix="inferx-seed-") as tmp:
        root = Path(args.state_dir) if args.state_dir else Path(tmp)
        summaries = await seed_run.run_seed(
            options, configs, root, knowledge, _progress_factory(not args.json), note, keep
        )
    comparison = seed_run.compare_seed(summaries)
    saved.save(summaries=summaries, comparison=comparison, complete=True)
    if args.json:
        data = {**context, "summaries": summaries, "comparison": comparison}
        print(json.dumps(results.jsonable(data), indent=2))
        return 0
    from inferx.bench.report import print_seed_report

    header = (
        f"[bold]seed-agent[/bold] on {options.workers} {engine} workers: {options.chains} chains, "
        f"Poisson {options.rate_per_s:g}/s, max_tokens {options.max_tokens}, "
        f"tool latency lognormal median {args.tool_median_ms:g} ms"
    )
    print_seed_report(out, summaries, comparison, header)
    return 0


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
