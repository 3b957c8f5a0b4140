"""`inferx bench --overhead`: what a hop through the router and the scheduler adds to
a direct worker call (issue #14). Starts its own local stack with one SIMULATED sim
worker at a very high --sim-speed (engine time ~0), measures the four paths in one
run, prints a table (or --json), and saves the raw samples first."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import tempfile
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from inferx.errors import InvalidArgument

DEFAULT_SPEED = 10_000.0

# Flags of the other `inferx bench` modes that --overhead does not take (its stack is
# its own: one sim worker, no trace).
_OTHER_MODES = (
    ("simulate", "--simulate"),
    ("router", "--router"),
    ("scenario", "--scenario"),
    ("capacity", "--capacity"),
    ("trace", "--trace"),
    ("compare_given", "--compare"),
    ("workers_given", "--workers"),
)


def check_args(args: argparse.Namespace) -> None:
    """Clear errors for flags that make no sense here or values out of range."""
    for attr, flag in _OTHER_MODES:
        if getattr(args, attr, None):
            raise InvalidArgument(f"--overhead starts its own stack with one sim worker: drop {flag}")
    if args.engine not in (None, "sim"):
        raise InvalidArgument("--overhead runs a SIMULATED sim worker (engine time ~0): drop --engine vllm")
    if args.hops < 2:
        raise InvalidArgument("--hops must be at least 2 (the 1-hop chain is always measured)")
    if args.count < 1:
        raise InvalidArgument("--count must be at least 1")
    if args.warmup < 0:
        raise InvalidArgument("--warmup must be 0 or more")
    if args.concurrency < 1:
        raise InvalidArgument("--concurrency must be at least 1")
    if args.load_calls < args.concurrency:
        raise InvalidArgument("--load-calls must be at least --concurrency (every caller makes a call)")
    if not args.speed > 0 or math.isinf(args.speed):
        raise InvalidArgument("--speed must be a positive number")
    if args.timeout <= 0:
        raise InvalidArgument("--timeout must be positive")
    if not args.outside_duration > 0 or math.isinf(args.outside_duration):
        raise InvalidArgument("--outside-duration must be a positive number of seconds")


def _ms(value: float) -> str:
    if math.isnan(value):
        return "-"
    return f"{value:+.2f}" if value < 0 else f"{value:.2f}"


def _rate(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:,.0f}"


COLUMNS = ("path", "hops", "p50", "p99", "p50/hop", "added p50", "added p99", "calls/s", "hops/s", "err")


def table(summary) -> Table:
    """One row per path; latencies in ms; "added" is per hop, minus the direct call."""
    t = Table(
        title="latency (ms) and throughput; added = per hop minus direct",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
    )
    for column in COLUMNS:
        t.add_column(column, justify="left" if column == "path" else "right", no_wrap=column == "path")
    for s in summary.paths:
        t.add_row(
            f"{s.client} {s.name}" if s.client else s.name,
            str(s.hops),
            _ms(s.p50_ms),
            _ms(s.p99_ms),
            _ms(s.per_hop_p50_ms),
            _ms(s.added_per_hop_p50_ms),
            _ms(s.added_per_hop_p99_ms),
            _rate(s.calls_per_s),
            _rate(s.hops_per_s),
            str(s.errors) if not s.errors else f"[red]{s.errors}[/red]",
        )
    return t


async def cmd_overhead(args: argparse.Namespace, progress, out: Console, err: Console, saved) -> int:
    import asyncio

    from inferx.bench.overhead import summarize
    from inferx.bench.overhead_run import OverheadOptions, measure, measure_outside, start_overhead_stack
    from inferx.bench.results import jsonable

    # The stack `inferx up` starts unless told otherwise: the router runs the scheduler.
    embedded = args.embedded_scheduler is not False
    options = OverheadOptions(
        hops=args.hops,
        count=args.count,
        warmup=args.warmup,
        concurrency=args.concurrency,
        load_calls=args.load_calls,
        speed=args.speed,
        policy=args.policy,
        embedded_scheduler=embedded,
        insecure=args.insecure,
        outside=args.outside,
        outside_duration_s=args.outside_duration,
    )
    note = (lambda s: None) if args.json else (lambda s: err.print(s, style="dim"))
    context = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "options": {k: v for k, v in options.__dict__.items() if k != "python"},
        "engine": "sim (SIMULATED), one worker",
    }
    paths: list = []
    with tempfile.TemporaryDirectory(prefix="inferx-overhead-") as tmp:
        state = Path(args.state_dir) if args.state_dir else Path(tmp)
        state.mkdir(parents=True, exist_ok=True)
        services = "router with its scheduler" if embedded else "router, scheduler"
        services += " (plaintext)" if args.insecure else ""
        note(f"starting etcd, {services}, memory-pool, cache, one sim worker (x{args.speed:g}) ...")
        stack = await asyncio.to_thread(start_overhead_stack, state, options)
        try:

            def keep(samples) -> None:
                paths.append(samples)
                saved.save(context=context, paths=paths)

            async def both() -> None:
                await measure(stack, options, progress, keep)
                if options.outside:
                    note(
                        "a plain outside client (inferx.bench.outside, its own process): direct, "
                        f"1-hop, {options.hops}-hop batched, x{options.concurrency} for "
                        f"{options.outside_duration_s:g} s each ..."
                    )
                    for samples in await measure_outside(stack, options):
                        keep(samples)

            await asyncio.wait_for(both(), args.timeout)
        except TimeoutError:
            raise InvalidArgument(
                f"the measurement did not finish within --timeout {args.timeout:g} s; "
                "lower --count/--load-calls or raise --timeout"
            ) from None
        finally:
            await asyncio.to_thread(stack.stop)
    summary = summarize(paths)
    saved.save(summary=summary, complete=True)
    if args.json:
        print(json.dumps(jsonable({"kind": "overhead", "context": context, "summary": summary}), indent=2))
    else:
        header = (
            f"[bold]hop overhead[/bold]: {options.count} sequential calls per path "
            f"(after {options.warmup} warm-up), closed loop x{options.concurrency} over "
            f"{options.load_calls} calls; one sim worker x{options.speed:g}; {context['machine']}"
        )
        out.print(header)
        out.print(table(summary))
        out.print(
            f"one more hop in a chain (p50, ({options.hops}-hop - 1-hop) / {options.hops - 1}): "
            f"{_ms(summary.marginal_hop_p50_ms)} ms; fixed cost of a run (1-hop - one hop): "
            f"{_ms(summary.fixed_chain_p50_ms)} ms",
            style="dim",
        )
    if summary.errors:
        first = next((p.first_error for p in paths if p.first_error), "")
        err.print(f"inferx: error: {summary.errors} calls failed (first: {first})")
        return 1
    return 0
