"""`inferx`: the command-line interface. Human output by default, `--json` for scripts.
Every failure is one line on stderr and a non-zero exit; never a traceback.

Start-up time matters (`inferx run` is called from scripts and agents): building the
parser imports nothing heavy, and each command imports what it needs (the gRPC client
and protobuf for calls, the benchmark and simulator code for `inferx bench`) when it
runs."""

from __future__ import annotations

import argparse
import getpass
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from inferx import DEFAULT_ROUTER
from inferx.cli import abtest, access, argtypes, bench_args, call, connect, observe, pools
from inferx.errors import InferxError
from inferx.pricing import format_cost

if TYPE_CHECKING:
    from inferx.client import InferxClient
    from inferx.v1 import router_pb2

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def _router_default() -> str:
    return os.environ.get("INFERX_ROUTER", DEFAULT_ROUTER)


def _client(args: argparse.Namespace) -> InferxClient:
    """The router of --router, with --token/--tls-ca or the local stack's (inferx.cli.connect)."""
    return connect.client(args)


def _msg_json(message) -> dict:
    from google.protobuf import json_format

    return json_format.MessageToDict(message, preserving_proto_field_name=True)


def _parse_inputs(pairs: list[str]) -> dict[str, str]:
    inputs: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise InferxError(f"--input {pair!r}: expected KEY=VALUE")
        inputs[key] = value
    return inputs


def _read_file(path: str) -> str:
    try:
        return Path(path).read_text()
    except FileNotFoundError:
        raise InferxError(f"{path}: no such file") from None
    except OSError as exc:
        raise InferxError(f"{path}: {exc.strerror}") from None


# ----- run ------------------------------------------------------------------------------


def _fmt_ms(ms: float) -> str:
    return f"{ms:,.0f} ms" if ms >= 10 else f"{ms:.1f} ms"


def _short(text: str, width: int = 60) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def _print_run(finished: router_pb2.ChainFinished, chain: str) -> None:
    """One block per node (fits an 80-column terminal), then the chain's verdict."""
    arm = f"  A/B arm {finished.ab_arm}" if finished.ab_arm else ""
    out.print(f"[bold]{chain}[/bold] v{finished.chain_version}  run {finished.run_id}{arm}")
    for hop in finished.hops:
        mark = "[green]ok[/green]" if hop.status == "ok" else f"[red]{hop.status}[/red]"
        what = f"model {hop.model}" if hop.model else f"tool {hop.tool or hop.node_type}"
        timing = f"{_fmt_ms(hop.latency_ms)}" if hop.status != "skipped" else "-"
        out.print(f"  {mark:>2} [bold]{hop.node_id}[/bold]  {what}  {timing}")
        details = []
        if hop.model:
            u = hop.usage
            details += [
                f"queue {_fmt_ms(hop.queue_ms)}",
                f"tokens {u.prompt_tokens} in ({u.cached_prompt_tokens} cached) / {u.completion_tokens} out",
                f"worker {hop.worker_id or '-'}",
            ]
            if hop.cost:
                details.append(f"cost {format_cost(hop.cost)}")
        elif hop.status == "ok":
            details.append("cache hit" if hop.cache_hit else "cache miss")
        if details:
            out.print("       " + "  ·  ".join(details), style="dim")
        text = hop.output if hop.status == "ok" else hop.error
        if text:
            out.print("       " + _short(text, 70), markup=False)
    verdict = "[green]met[/green]" if finished.slo_met else "[red]missed[/red]"
    status = "[green]ok[/green]" if finished.status == "ok" else f"[red]{finished.status}[/red]"
    out.print(
        f"chain {status} in {_fmt_ms(finished.latency_ms)}  (SLO {_fmt_ms(finished.slo_ms)}: {verdict})"
    )
    if finished.cost or finished.max_cost:
        out.print(observe.cost_summary(finished))
    if finished.error:
        err.print(f"error: {finished.error}", markup=False)


async def cmd_run(args: argparse.Namespace) -> int:
    if args.version and args.label:
        raise InferxError("give --version or --label, not both")
    async with _client(args) as client:
        finished = await client.chain_result(  # the hops are printed from its ChainFinished
            args.chain,
            _parse_inputs(args.input),
            version=args.version,
            label=args.label or "",
            session_id=args.session or "",
            schedule="off_peak" if args.off_peak else "",
            off_peak_within_ms=int(args.off_peak) if args.off_peak else 0,
        )
    if args.json:
        print(json.dumps(_msg_json(finished), indent=2))
    else:
        _print_run(finished, args.chain)
    return 0 if finished.status == "ok" else 1


# ----- chain ----------------------------------------------------------------------------


def cmd_chain_validate(args: argparse.Namespace) -> int:
    from inferx.chain.validate import load_chain_text

    validated = load_chain_text(_read_file(args.file), strict=args.strict, source=args.file)
    for warning in validated.warnings:
        err.print(f"warning: {warning}")
    config = validated.config
    if args.json:
        print(json.dumps({"name": config.name, "nodes": len(config.nodes), "warnings": validated.warnings}))
    else:
        out.print(f"{args.file}: valid chain '{config.name}' with {len(config.nodes)} nodes")
    return 0


def cmd_chain_schema(args: argparse.Namespace) -> int:
    from inferx.chain.schema import ChainConfig

    print(json.dumps(ChainConfig.json_schema(), indent=2))
    return 0


async def cmd_chain_put(args: argparse.Namespace) -> int:
    text = _read_file(args.file)
    async with _client(args) as client:
        reply = await client.put_chain(
            text,
            message=args.message or "",
            expect_version=args.expect_version,
            activate=not args.no_activate,
            author=getpass.getuser(),
        )
    if args.json:
        print(json.dumps(_msg_json(reply)))
    else:
        state = "active" if reply.active else "stored, not active"
        out.print(f"chain '{reply.name}' version {reply.version} ({state})")
    return 0


async def cmd_chain_get(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        reply = await client.get_chain(args.name, version=args.version, label=args.label or "")
    if args.json:
        print(json.dumps(_msg_json(reply), indent=2))
    else:
        tags = (["active"] if reply.active else []) + [f"label {label}" for label in reply.labels]
        suffix = f" ({', '.join(tags)})" if tags else ""
        out.print(f"# {reply.name} version {reply.version}{suffix}", style="dim", markup=False)
        print(reply.config_yaml, end="")
    return 0


async def cmd_chain_list(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        reply = await client.list_chains()
    if args.json:
        print(json.dumps(_msg_json(reply).get("chains", []), indent=2))
        return 0
    table = Table()
    for column in ("chain", "active", "latest", "nodes", "SLO"):
        table.add_column(column)
    for chain in reply.chains:
        table.add_row(
            chain.name,
            str(chain.active_version or "-"),
            str(chain.latest_version),
            str(chain.nodes),
            _fmt_ms(chain.slo_ms),
        )
    out.print(table if reply.chains else "no chains yet: `inferx chain put FILE`")
    return 0


async def cmd_chain_history(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        history = await client.chain_history(args.name)
    if args.json:
        print(json.dumps(_msg_json(history), indent=2))
        return 0
    table = Table(title=f"{history.name} (active: v{history.active_version})", title_justify="left")
    for column in ("version", "", "labels", "when (UTC)", "who", "message"):
        table.add_column(column)
    for v in history.versions:
        when = time.strftime("%Y-%m-%d %H:%M", time.gmtime(v.created_unix_ms / 1000))
        table.add_row(
            str(v.version),
            "active" if v.active else "",
            ", ".join(v.labels),
            when,
            v.author or "-",
            v.message or "",
        )
    out.print(table)
    return 0


async def cmd_chain_diff(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        diff = await client.diff_chain(args.name, args.v1, args.v2)
    if args.json:
        print(json.dumps({"diff": diff}))
    elif not diff:
        out.print(f"{args.name} v{args.v1} and v{args.v2} are identical")
    else:
        for line in diff.splitlines():
            style = "green" if line.startswith("+") else "red" if line.startswith("-") else None
            out.print(line, style=style, markup=False)
    return 0


async def cmd_chain_label(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        previous = await client.label_chain(args.name, args.label, args.version)
    if args.json:
        print(json.dumps({"name": args.name, "label": args.label, "version": args.version}))
    else:
        moved = f" (was v{previous})" if previous else ""
        out.print(f"label '{args.label}' of {args.name} -> v{args.version}{moved}")
    return 0


async def cmd_chain_rollback(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        reply = await client.rollback_chain(args.name, args.to)
    if args.json:
        print(json.dumps(_msg_json(reply)))
    else:
        out.print(f"{args.name}: active version v{reply.from_version} -> v{reply.to_version}")
    return 0


# ----- status ---------------------------------------------------------------------------


def _reserved_cell(row) -> str:
    if row is None:
        return "?"
    cell = f"{row.reserved_tokens:,}"
    if row.lookahead_tokens:
        cell += f" ({row.lookahead_tokens:,} look-ahead)"
    if row.leased_tokens:
        cell += f", {row.leased_tokens:,} budget leased"
    return cell


async def cmd_status(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        status = await client.status()
    if args.json:
        print(json.dumps(_msg_json(status), indent=2))
        return 0
    services = Table(title="services", title_justify="left")
    for column in ("kind", "instance", "address", "metrics"):
        services.add_column(column)
    for svc in sorted(status.services, key=lambda s: (s.kind, s.instance_id)):
        services.add_row(svc.kind, svc.instance_id, svc.address, f"http://{svc.metrics_address}/metrics")
    out.print(services)
    reserved = {row.worker_id: row for row in status.memory}
    workers = Table(title="workers", title_justify="left")
    for column in ("pool", "worker", "address", "engine", "KV tokens", "reserved", "KV used"):
        workers.add_column(column)
    for worker in sorted(status.workers, key=lambda w: (w.pool, w.worker_id)):
        row = reserved.get(worker.worker_id)
        workers.add_row(
            worker.pool,
            worker.worker_id,
            worker.address,
            worker.engine,
            f"{worker.kv_capacity_tokens:,}",
            _reserved_cell(row),
            f"{row.engine_kv_usage_ratio:.0%}" if row else "?",
        )
    out.print(workers)
    queues = Table(title=f"queues (policy {status.scheduler_policy or '?'})", title_justify="left")
    for column in ("pool", "queued", "running"):
        queues.add_column(column)
    for queue in status.queues:
        queues.add_row(queue.pool, str(queue.queued), str(queue.running))
    out.print(queues)
    if status.off_peak_waiting:  # off-peak hops held back, and why
        waits = Table(title="off-peak, waiting for room", title_justify="left")
        for column in ("run", "chain", "node", "model", "waiting", "why", "goes by"):
            waits.add_column(column)
        for wait in status.off_peak_waiting:
            goes_by = time.strftime("%H:%M:%S", time.localtime(wait.latest_start_unix_ms / 1000))
            waits.add_row(
                wait.run_id,
                wait.chain,
                wait.node_id,
                wait.model,
                f"{wait.waiting_s:.0f} s",
                wait.reason,
                goes_by,
            )
        out.print(waits)
    if status.tools:
        out.print("tools: " + ", ".join(status.tools))
    if status.circuit_breakers:
        out.print("circuit breakers:")
        for target, state in sorted(status.circuit_breakers.items()):
            colour = {"closed": "green", "half_open": "yellow"}.get(state, "red")
            out.print(f"  {target}: [{colour}]{state}[/{colour}]")
    for problem in status.problems:
        err.print(f"[yellow]problem:[/yellow] {problem}")
    return 0


async def cmd_cache_invalidate(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        reply = await client.invalidate_tool_cache(args.tool, args.arguments or "")
    if args.json:
        print(json.dumps(_msg_json(reply)))
    else:
        what = "that result" if args.arguments else "every result"
        out.print(
            f"dropped {what} of tool '{args.tool}': {reply.removed} entries "
            f"from {reply.replicas} cache replica(s) and this router's local tier"
        )
    return 0


async def cmd_cache_stats(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        stats = await client.tool_cache_stats()
    if args.json:
        print(json.dumps(_msg_json(stats), indent=2))
        return 0
    table = Table(title="tool cache", title_justify="left")
    for column in ("tier", "entries", "bytes", "hits", "misses", "hit rate", "evictions"):
        table.add_column(column)
    rows = [("L1 router", stats.local, "")] + [(f"L2 {r.address}", r.stats, r.error) for r in stats.replicas]
    for name, s, error in rows:
        if error:
            table.add_row(name, f"[red]{error}[/red]", "", "", "", "", "")
            continue
        looked = s.hits + s.misses
        rate = f"{s.hits / looked:.0%}" if looked else "-"
        table.add_row(
            name, str(s.entries), f"{s.bytes:,}", str(s.hits), str(s.misses), rate, str(s.evictions)
        )
    out.print(table)
    out.print(f"identical concurrent misses served by one call: {stats.single_flight_joins}")
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from inferx.devstack import run_foreground

    return run_foreground(
        engine=args.engine,
        workers=args.workers,
        http_port=args.http_port,
        insecure=args.insecure,
        replicas=args.replicas,
        embedded_scheduler=args.embedded_scheduler,
    )


# ----- parser ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    connect.add_router_flags(common)  # --router, --token, --tls-ca
    common.add_argument("--json", action="store_true", help="machine-readable output")

    parser = argparse.ArgumentParser(prog="inferx", description="InferX: schedule whole agent chains.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", parents=[common], help="run a chain and show every hop")
    run.add_argument("chain")
    run.add_argument("--input", "-i", action="append", default=[], metavar="KEY=VALUE")
    run.add_argument("--version", type=argtypes.count, default=0, help="config version (default: active)")
    run.add_argument("--label", help="config label, e.g. prod")
    run.add_argument("--session", help="session id: turns of one conversation share memory")
    run.add_argument(
        "--off-peak",
        type=argtypes.duration_ms,
        metavar="WITHIN",
        help="run off-peak: wait for room, finish within WITHIN (e.g. 8h; the command waits)",
    )
    run.set_defaults(handler=cmd_run)

    chain = sub.add_parser("chain", help="validate and manage chain configs")
    chain_sub = chain.add_subparsers(dest="chain_command", required=True, metavar="ACTION")
    validate = chain_sub.add_parser("validate", parents=[common], help="check a config file (offline)")
    validate.add_argument("file")
    validate.add_argument("--strict", action="store_true", help="treat warnings (SLO too tight) as errors")
    validate.set_defaults(handler=cmd_chain_validate)
    schema = chain_sub.add_parser("schema", parents=[common], help="print the config's JSON Schema")
    schema.set_defaults(handler=cmd_chain_schema)
    put = chain_sub.add_parser("put", parents=[common], help="store a new version")
    put.add_argument("file")
    put.add_argument("--message", "-m")
    put.add_argument(
        "--expect-version", type=argtypes.count, default=0, help="fail unless the latest version is N"
    )
    put.add_argument("--no-activate", action="store_true", help="store without making it active")
    put.set_defaults(handler=cmd_chain_put)
    get = chain_sub.add_parser("get", parents=[common], help="print a version (default: active)")
    get.add_argument("name")
    get.add_argument("--version", type=argtypes.count, default=0)
    get.add_argument("--label")
    get.set_defaults(handler=cmd_chain_get)
    lst = chain_sub.add_parser("list", parents=[common], help="list chains")
    lst.set_defaults(handler=cmd_chain_list)
    history = chain_sub.add_parser("history", parents=[common], help="every version of a chain")
    history.add_argument("name")
    history.set_defaults(handler=cmd_chain_history)
    diff = chain_sub.add_parser("diff", parents=[common], help="compare two versions")
    diff.add_argument("name")
    diff.add_argument("v1", type=argtypes.at_least_one)
    diff.add_argument("v2", type=argtypes.at_least_one)
    diff.set_defaults(handler=cmd_chain_diff)
    label = chain_sub.add_parser("label", parents=[common], help="point a label at a version")
    label.add_argument("name")
    label.add_argument("label")
    label.add_argument("version", type=argtypes.at_least_one)
    label.set_defaults(handler=cmd_chain_label)
    rollback = chain_sub.add_parser("rollback", parents=[common], help="move the active version back")
    rollback.add_argument("name")
    rollback.add_argument("--to", type=argtypes.count, default=0, help="version (default: the one before)")
    rollback.set_defaults(handler=cmd_chain_rollback)
    abtest.register(chain_sub, common, _client)

    cache = sub.add_parser("cache", help="the tool-result cache")
    cache_sub = cache.add_subparsers(dest="cache_command", required=True, metavar="ACTION")
    invalidate = cache_sub.add_parser("invalidate", parents=[common], help="drop a tool's cached results")
    invalidate.add_argument("tool")
    invalidate.add_argument("--arguments", metavar="JSON", help="only the result of these arguments")
    invalidate.set_defaults(handler=cmd_cache_invalidate)
    cache_stats = cache_sub.add_parser("stats", parents=[common], help="hits, misses, evictions per tier")
    cache_stats.set_defaults(handler=cmd_cache_stats)

    status = sub.add_parser("status", parents=[common], help="services, workers, queues, KV memory")
    status.set_defaults(handler=cmd_status)

    up = sub.add_parser("up", help="start etcd and every service locally (what `make run` does)")
    up.add_argument(
        "--engine",
        # Registered engines that need no outside server (see `inferx engines`), looked
        # up only when `up` is used: the registry imports every engine module.
        choices=_LazyChoices(_standalone_engines),
        metavar="ENGINE",  # a metavar: argparse would list (so load) the choices at once
        default="vllm",
        help="one of %(choices)s (default vllm; sim is a SIMULATED latency model)",
    )
    up.add_argument("--workers", type=argtypes.count, default=1, help="model-workers to start")
    up.add_argument(
        "--replicas",
        type=argtypes.at_least_one,
        default=1,
        help="instances of each of router, scheduler, memory-pool and cache (default 1); replica i "
        "listens on its kind's port + 100 x i (routers' HTTP fronts on --http-port + i), each "
        "registered in etcd; the schedulers elect one owner per model pool",
    )
    up.add_argument(
        "--embedded-scheduler",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="each router runs the scheduler in its own process (inferx-router --embedded-scheduler; the "
        "default): one gRPC crossing fewer per model hop, no scheduler process; --no-embedded-scheduler "
        "starts scheduler processes instead",
    )
    up.add_argument(
        "--http-port",
        type=argtypes.port,
        default=8000,
        help="port of the router's OpenAI-compatible HTTP front (default 8000; 0 = off)",
    )
    up.add_argument(
        "--insecure",
        action="store_true",
        help="plaintext everywhere and no tokens (development only; default: mutual TLS between "
        "services, TLS on the router, etcd with client certificates, an admin token)",
    )
    up.set_defaults(handler=cmd_up)
    engines = sub.add_parser("engines", help="the model-worker engines this install has")
    engines.set_defaults(handler=cmd_engines)
    policies = sub.add_parser("policies", help="the scheduling policies this install has")
    policies.set_defaults(handler=cmd_policies)
    observe.register(sub)
    call.register(sub)
    access.register(sub, common, _client)
    pools.register(sub, common, _client)
    bench_args.register(sub)
    return parser


class _LazyChoices:
    """argparse `choices` computed on first use (a value to check, a help to print)."""

    def __init__(self, load: Callable[[], list[str]]) -> None:
        self._load = load
        self._items: list[str] | None = None

    def _get(self) -> list[str]:
        if self._items is None:
            self._items = self._load()
        return self._items

    def __contains__(self, value: object) -> bool:
        return value in self._get()

    def __iter__(self) -> Iterator[str]:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())


def _standalone_engines() -> list[str]:
    from inferx_worker.engines.registry import engine_info, engine_names

    return [name for name in engine_names() if engine_info(name).standalone]


def cmd_engines(args: argparse.Namespace) -> int:
    from inferx_worker.engines.registry import engine_info, engine_names

    table = Table("engine", "what it is", "inferx up")
    for name in engine_names():
        info = engine_info(name)
        table.add_row(name, info.summary, "yes" if info.standalone else "no (needs its server)")
    out.print(table)
    return 0


def cmd_policies(args: argparse.Namespace) -> int:
    from inferx.scheduling.registry import policy_info, policy_names

    table = Table("policy", "aliases", "what it does", "imitates")
    for name in policy_names():
        info = policy_info(name)
        table.add_row(name, ", ".join(info.aliases), info.summary, info.imitates)
    out.print(table)
    return 0


# Signals that stop a command as Ctrl-C does: a supervisor's or `timeout`'s SIGTERM, and
# the SIGHUP of a terminal or ssh session that went away.
_STOPPING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _interrupt_on_terminate(signum: int, frame: object) -> None:  # noqa: ARG001
    # Once: a second SIGTERM (`timeout` passing its own on, a supervisor repeating
    # itself) must not break into the clean-up the first one started.
    for stopping in _STOPPING_SIGNALS:
        signal.signal(stopping, signal.SIG_IGN)
    os.kill(os.getpid(), signal.SIGINT)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    # SIGTERM (a supervisor, `timeout`, a CI job's end) or SIGHUP stops a command as
    # Ctrl-C does: its clean-up runs, so a benchmark's local stacks are not left running.
    previous = {stopping: signal.signal(stopping, _interrupt_on_terminate) for stopping in _STOPPING_SIGNALS}
    # They become a SIGINT, which a shell starts its background jobs with ignored (and
    # asyncio.run then leaves alone): give it Python's handler, or SIGTERM stops nothing.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        result = args.handler(args)
        if isinstance(result, Coroutine):
            import asyncio

            code = asyncio.run(result)
        else:
            code = result
    except InferxError as exc:
        name = exc.code.name if type(exc) is not InferxError else "error"
        err.print(f"inferx: {name}: {exc.message}" if name != "error" else f"inferx: error: {exc.message}")
        code = 1
    except KeyboardInterrupt:
        code = 130
    except BrokenPipeError:  # e.g. `inferx ... | head`
        sys.stderr.close()
        code = 0
    finally:
        for stopping, handler in previous.items():
            if signal.getsignal(stopping) is _interrupt_on_terminate:  # not stopped by it
                signal.signal(stopping, handler)
    sys.exit(code)


if __name__ == "__main__":
    main()
