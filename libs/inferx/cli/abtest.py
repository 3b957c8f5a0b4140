"""`inferx chain ab start|status|stop`: A/B tests of chain configs on live traffic
(docs/concepts.md#ab-tests)."""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from inferx.cli import argtypes
from inferx.pricing import format_cost

if TYPE_CHECKING:
    from inferx.client import InferxClient
    from inferx.v1 import router_pb2

out = Console(highlight=False, soft_wrap=True)

ClientFactory = Callable[[argparse.Namespace], "InferxClient"]
_client: ClientFactory


def version(text: str) -> int:
    """v3 or 3."""
    digits = text[1:] if text[:1] in ("v", "V") else text
    if not digits.isdigit() or int(digits) < 1:
        raise argparse.ArgumentTypeError(f"expected a version like v3 or 3, got {text!r}")
    return int(digits)


def percent(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a percentage from 0 to 100, got {text!r}") from None
    if not math.isfinite(value) or not 0 <= value <= 100:
        raise argparse.ArgumentTypeError(f"must be a percentage from 0 to 100, got {text!r}")
    return value


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text!r}") from None
    if not math.isfinite(value) or not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be a fraction in (0, 1], got {text!r}")
    return value


def _json(message) -> str:
    from google.protobuf import json_format

    return json.dumps(json_format.MessageToDict(message, preserving_proto_field_name=True))


def _describe(test: router_pb2.AbTest) -> str:
    return (
        f"A/B test of {test.chain}: a = v{test.a}, b = v{test.b}, {test.split_pct:g}% of sessions to b "
        f"(guard: stop an arm {test.margin:.0%} below the other after {test.min_runs} runs each)"
    )


async def cmd_start(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        test = await client.start_ab_test(
            args.name, args.a, args.b, args.split, margin=args.margin or 0.0, min_runs=args.min_runs
        )
    out.print(_json(test) if args.json else _describe(test), markup=False)
    return 0


def status_table(status: router_pb2.AbStatus) -> Table:
    table = Table("arm", "version", "runs", "SLO met", "p50", "p99", "tokens", "cost", "errors")
    for arm in status.arms:
        share = f"{arm.slo_met / arm.runs:.1%}" if arm.runs else "-"
        table.add_row(
            arm.arm,
            f"v{arm.version}",
            str(arm.runs),
            share,
            f"{arm.p50_ms:,.0f} ms",
            f"{arm.p99_ms:,.0f} ms",
            f"{arm.tokens:,}",
            format_cost(arm.cost),
            str(arm.errors),
        )
    return table


async def cmd_status(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        status = await client.ab_status(args.name)
    if args.json:
        print(_json(status))
        return 0
    test = status.test
    if status.running:
        since = time.strftime("%Y-%m-%d %H:%M", time.gmtime(test.started_unix_ms / 1000))
        out.print(f"{_describe(test)}, running since {since} UTC", markup=False)
    else:
        out.print(f"no A/B test of {test.chain} is running; the last one: {status.last_result}", markup=False)
    out.print(status_table(status))
    out.print(f"significance: {status.note}", markup=False)
    return 0


async def cmd_stop(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        stopped = await client.stop_ab_test(args.name, args.keep)
    if args.json:
        print(_json(stopped))
    else:
        out.print(
            f"{args.name}: kept {stopped.kept}: v{stopped.version} is active "
            f"(was v{stopped.previous_active}), labelled {stopped.label}",
            markup=False,
        )
    return 0


def register(
    chain_sub: argparse._SubParsersAction, common: argparse.ArgumentParser, client: ClientFactory
) -> None:
    global _client
    _client = client
    abp = chain_sub.add_parser("ab", help="A/B test two versions on live traffic")
    ab_sub = abp.add_subparsers(dest="ab_command", required=True, metavar="ACTION")
    start = ab_sub.add_parser("start", parents=[common], help="split new runs between two versions")
    start.add_argument("name")
    start.add_argument("--a", type=version, required=True, metavar="VERSION", help="arm a, e.g. v3")
    start.add_argument("--b", type=version, required=True, metavar="VERSION", help="arm b, e.g. v4")
    start.add_argument("--split", type=percent, required=True, metavar="PCT", help="percent of sessions to b")
    start.add_argument(
        "--margin",
        type=fraction,
        metavar="F",
        help="guard: stop an arm whose error rate or SLO attainment is this far below the "
        "other's (default 0.1)",
    )
    start.add_argument(
        "--min-runs",
        type=argtypes.count,
        default=0,
        metavar="N",
        help="guard: runs per arm first (default 30)",
    )
    start.set_defaults(handler=cmd_start)
    status = ab_sub.add_parser("status", parents=[common], help="per arm: runs, SLO, latency, tokens, cost")
    status.add_argument("name")
    status.set_defaults(handler=cmd_status)
    stop = ab_sub.add_parser("stop", parents=[common], help="end the test, promoting the kept arm")
    stop.add_argument("name")
    stop.add_argument("--keep", choices=["a", "b"], required=True)
    stop.set_defaults(handler=cmd_stop)
