"""`inferx trace` and `inferx stats`: a run as a waterfall and a chain's per-node
percentiles, from the runs the router keeps -- no tracing backend needed.

Rendering is pure (protobuf in, rich Text lines out) and fits an 80-column terminal.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rich.console import Console
from rich.text import Text

from inferx.cli import argtypes, connect
from inferx.pricing import format_cost

if TYPE_CHECKING:  # imported by the commands that call the router (start-up time)
    from inferx.v1 import router_pb2

WIDTH = 80
NAME_W = 20
DURATION_W = 10
QUEUE_CH, RUN_CH = "░", "█"

out = Console(highlight=False, soft_wrap=True)


def fmt_ms(ms: float) -> str:
    return f"{ms:,.0f} ms" if ms >= 10 or ms == 0 else f"{ms:.1f} ms"


def _num(ms: float) -> str:
    """Milliseconds for a table column: sub-10 ms values keep a decimal."""
    return f"{ms:,.0f}" if ms >= 10 or ms == 0 else f"{ms:.1f}"


def _name(node_id: str, width: int = NAME_W) -> str:
    return node_id if len(node_id) <= width else node_id[: width - 1] + "…"


def wrap_parts(parts: Sequence[str], width: int, indent: str = "    ") -> list[str]:
    """Join `parts` with ' · ' into lines of at most `width` characters (a part too
    long for a line of its own is cut)."""
    lines: list[str] = []
    current = ""
    room = width - len(indent)
    for part in parts:
        part = part if len(part) <= room else part[: room - 1] + "…"
        candidate = f"{current} · {part}" if current else part
        if current and len(indent) + len(candidate) > width:
            lines.append(indent + current)
            candidate = part
        current = candidate
    if current:
        lines.append(indent + current)
    return lines


# ----- trace: the waterfall --------------------------------------------------------------


def bar(start_ms: float, end_ms: float, queue_ms: float, total_ms: float, width: int) -> str:
    """One node's bar: spaces until it starts, queue wait, then running time."""
    if total_ms <= 0:
        return " " * width
    scale = width / total_ms
    first = min(int(start_ms * scale), width - 1)
    last = min(max(math.ceil(end_ms * scale), first + 1), width)
    queued = min(int(round(queue_ms * scale)), last - first)
    return " " * first + QUEUE_CH * queued + RUN_CH * (last - first - queued) + " " * (width - last)


def node_details(hop: router_pb2.NodeFinished) -> list[str]:
    parts: list[str] = []
    if hop.model:
        parts.append(f"{hop.model} on {hop.worker_id}" if hop.worker_id else hop.model)
        parts.append(f"queue {fmt_ms(hop.queue_ms)} · run {fmt_ms(max(hop.latency_ms - hop.queue_ms, 0))}")
        u = hop.usage
        parts.append(
            f"tokens {u.prompt_tokens} in ({u.cached_prompt_tokens} cached) / {u.completion_tokens} out"
        )
        if hop.cost:
            parts.append(f"cost {format_cost(hop.cost)}")
    elif hop.tool:
        parts.append(f"tool {hop.tool}")
        if hop.status == "ok":
            parts.append("cache hit" if hop.cache_hit else "cache miss")
    if hop.child_run_ids:  # a sub-agent chain: its child runs are nested below
        count = len(hop.child_run_ids)
        parts.append(f"{count} child run{'' if count == 1 else 's'}")
    if hop.retries:
        parts.append(f"{hop.retries} retr{'y' if hop.retries == 1 else 'ies'}")
    if hop.degradation:
        reason = f" ({hop.degradation_reason})" if hop.degradation_reason else ""
        parts.append(f"degraded: {hop.degradation}{reason}")
    if hop.status not in ("ok",) and hop.error:
        parts.append(f"{hop.status}: {' '.join(hop.error.split())}")
    return parts


def arm_line(arm: router_pb2.ArmStats) -> Text:
    """One arm of an A/B test of the chain (inferx chain ab)."""
    share = arm.slo_met / arm.runs if arm.runs else 0.0
    return Text(
        f"arm {arm.arm} v{arm.version}: {arm.runs} runs, SLO met by {share:.1%}, "
        f"p50 {fmt_ms(arm.p50_ms)} · p99 {fmt_ms(arm.p99_ms)}, {arm.tokens:,} tokens, "
        f"cost {format_cost(arm.cost)}, {arm.errors} errors"
    )


def cost_summary(finished: router_pb2.ChainFinished) -> str:
    """`cost X` with the budget and verdict when the config has slo.max_cost."""
    text = f"cost {format_cost(finished.cost)}"
    if finished.max_cost:
        within = "within" if finished.cost <= finished.max_cost else "OVER"
        text += f" ({within} slo.max_cost {format_cost(finished.max_cost)})"
    return text


def _program_lines(trace: router_pb2.RunTrace) -> list[Text]:
    """The head of a dynamic program's record (calls of the OpenAI front or CallModel):
    no version, no SLO; `running` until it ends."""
    finished = trace.finished
    program = f"  program {trace.program_id}" if trace.program_id else ""
    lines = [Text.assemble((trace.chain, "bold"), f"{program}  run {finished.run_id}  {trace.tier}")]
    calls = f"{len(finished.hops)} call" + ("" if len(finished.hops) == 1 else "s")
    if finished.status == "running":
        lines.append(Text.assemble(("running", "yellow"), f": {calls} so far, {fmt_ms(finished.latency_ms)}"))
    else:
        style = "green" if finished.status == "ok" else "red"
        lines.append(Text.assemble((finished.status, style), f": {calls} in {fmt_ms(finished.latency_ms)}"))
    if trace.parent_program_id:
        lines.append(Text(f"started by program {trace.parent_program_id}", "dim"))
    return lines


def waterfall(trace: router_pb2.RunTrace, width: int = WIDTH, *, nested: bool = False) -> list[Text]:
    finished = trace.finished
    bar_w = width - 2 - NAME_W - 1 - DURATION_W
    timings = {t.node_id: t for t in trace.timings}
    total = max([finished.latency_ms, *(t.end_ms for t in trace.timings)])
    verdict = "met" if finished.slo_met else "missed"
    status_style = "green" if finished.status == "ok" else "red"
    if finished.chain_version == 0:  # versions start at 1: a dynamic program
        lines = _program_lines(trace)
    else:
        lines = [
            Text.assemble(
                (trace.chain, "bold"),
                f" v{finished.chain_version}  run {finished.run_id}  {trace.tier}"
                + (f"  A/B arm {finished.ab_arm}" if finished.ab_arm else ""),
            ),
            Text.assemble(
                (finished.status, status_style),
                f" in {fmt_ms(finished.latency_ms)}  (SLO {fmt_ms(finished.slo_ms)}: ",
                (verdict, "green" if finished.slo_met else "red"),
                ")" + (f"  retries {finished.retries_used}" if finished.retries_used else ""),
            ),
        ]
        if finished.cost or finished.max_cost:
            lines.append(Text(cost_summary(finished)))
    if trace.started_unix_ms:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(trace.started_unix_ms / 1000))
        lines.append(Text(f"started {when}" + (f"  trace {trace.trace_id}" if trace.trace_id else ""), "dim"))
    axis = " " * (2 + NAME_W + 1) + "0" + fmt_ms(total).rjust(bar_w - 1 + DURATION_W)
    lines.append(Text(axis, "dim"))
    for hop in finished.hops:
        timing = timings.get(hop.node_id)
        critical = timing is not None and timing.critical
        row = Text("* " if critical else "  ", "bold yellow")
        row.append(_name(hop.node_id).ljust(NAME_W) + " ", "bold" if critical else "")
        if hop.status == "skipped" and hop.latency_ms == 0:
            row.append(" " * bar_w)
            row.append("skipped".rjust(DURATION_W), "yellow")
        else:
            start, end = (timing.start_ms, timing.end_ms) if timing else (0.0, hop.latency_ms)
            style = "yellow" if critical else ("red" if hop.status != "ok" else "cyan")
            row.append(bar(start, end, hop.queue_ms, total, bar_w), style)
            row.append(fmt_ms(hop.latency_ms).rjust(DURATION_W), "red" if hop.status != "ok" else "")
        lines.append(row)
        for detail in wrap_parts(node_details(hop), width):
            lines.append(Text(detail, "dim"))
        lines += _child_lines(trace, hop, width)
    if not nested:
        lines.append(Text(f"{QUEUE_CH} queue wait  {RUN_CH} running  * critical path", "dim"))
    return lines


CHILD_INDENT = "    │ "


def _child_lines(trace: router_pb2.RunTrace, hop: router_pb2.NodeFinished, width: int) -> list[Text]:
    """The child runs of a `type: chain` node, each as its own waterfall, indented."""
    by_id = {child.finished.run_id: child for child in trace.children}
    lines: list[Text] = []
    for index, run_id in enumerate(hop.child_run_ids):
        child = by_id.get(run_id)
        item = f" [{index}]" if len(hop.child_run_ids) > 1 else ""
        if child is None:
            lines.append(Text(f"{CHILD_INDENT}child{item} run {run_id}: no longer kept", "dim"))
            continue
        lines.append(Text(f"{CHILD_INDENT}child{item}:", "dim"))
        for line in waterfall(child, max(width - len(CHILD_INDENT), 40), nested=True):
            lines.append(Text(CHILD_INDENT, "dim") + line)
    return lines


async def cmd_trace(args: argparse.Namespace) -> int:
    from google.protobuf import json_format

    from inferx.v1 import router_pb2

    async with connect.client(args) as client:
        trace = await client._unary(
            client._stub.GetRun, router_pb2.GetRunRequest(run_id=args.run_id or "", chain=args.chain or "")
        )
    if args.json:
        print(json.dumps(json_format.MessageToDict(trace, preserving_proto_field_name=True), indent=2))
        return 0
    for line in waterfall(trace):
        out.print(line)
    return 0


# ----- stats: percentiles per node ----------------------------------------------------------


def stats_lines(stats: router_pb2.ChainStats, width: int = WIDTH) -> list[Text]:
    share = stats.slo_met / stats.runs if stats.runs else 0.0
    lat = stats.latency
    # Dynamic programs declare no SLO (their latency includes the client's tool time).
    slo = f"SLO {fmt_ms(stats.slo_ms)} met by {share:.1%}" if stats.slo_ms else "no SLO"
    lines = [
        Text.assemble((stats.chain, "bold"), f": {stats.runs} recent runs, {stats.ok} ok, {slo}"),
        Text(
            f"chain  p50 {fmt_ms(lat.p50_ms)} · p90 {fmt_ms(lat.p90_ms)} · p99 {fmt_ms(lat.p99_ms)}"
            f" · max {fmt_ms(lat.max_ms)}"
        ),
        *(
            [
                Text(
                    f"cost   p50 {format_cost(stats.cost.p50)} · p99 {format_cost(stats.cost.p99)}"
                    f" · max {format_cost(stats.cost.max)} · total {format_cost(stats.cost.total)}"
                )
            ]
            if stats.cost.total
            else []
        ),
        *(arm_line(arm) for arm in stats.arms),
        Text(""),
        Text(f"  {'node':<{NAME_W}} {'n':>5} {'p50':>8} {'p90':>8} {'p99':>8} {'p99 share':>10}", "bold"),
    ]
    for node in stats.nodes:
        top = node.node_id == stats.top_node
        row = Text("▶ " if top else "  ", "bold red")
        lat = node.latency
        row.append(
            f"{_name(node.node_id):<{NAME_W}} {node.samples:>5} {_num(lat.p50_ms):>8}"
            f" {_num(lat.p90_ms):>8} {_num(lat.p99_ms):>8} {node.p99_share:>10.0%}",
            "bold red" if top else "",
        )
        lines.append(row)
        extra = []
        if node.queue.p99_ms:
            extra.append(f"queue p50 {fmt_ms(node.queue.p50_ms)} p99 {fmt_ms(node.queue.p99_ms)}")
        for count, what in (
            (node.errors, "failed"),
            (node.retries, "retries"),
            (node.degraded, "degraded"),
            (node.cache_hits, "cache hits"),
        ):
            if count:
                extra.append(f"{count} {what}")
        lines.extend(Text(line, "dim") for line in wrap_parts(extra, width))
    lines.append(Text(""))
    if stats.top_node:
        lines.append(Text(f"▶ {stats.top_node} contributes most to the P99 (times in ms)", "bold red"))
    lines.append(Text("p99 share: a node's latency above its median in the slowest 1% of runs,", "dim"))
    lines.append(Text("counted only while it was on the critical path.", "dim"))
    return lines


async def cmd_stats(args: argparse.Namespace) -> int:
    from google.protobuf import json_format

    from inferx.v1 import router_pb2

    async with connect.client(args) as client:
        stats = await client._unary(
            client._stub.GetChainStats, router_pb2.GetChainStatsRequest(chain=args.chain, last=args.last)
        )
    if args.json:
        print(json.dumps(json_format.MessageToDict(stats, preserving_proto_field_name=True), indent=2))
        return 0
    for line in stats_lines(stats):
        out.print(line)
    return 0


# ----- registration ----------------------------------------------------------------------------


def register(sub: argparse._SubParsersAction) -> None:
    common = argparse.ArgumentParser(add_help=False)
    connect.add_router_flags(common)  # --router, --token, --tls-ca
    common.add_argument("--json", action="store_true", help="machine-readable output")

    trace = sub.add_parser(
        "trace", parents=[common], help="a recent run as a waterfall: queue, run time, tokens, critical path"
    )
    trace.add_argument(
        "run_id",
        nargs="?",
        help="run id or a unique prefix, or a program id (default: the latest run)",
    )
    trace.add_argument("--chain", help="without RUN_ID: the latest run of this chain")
    trace.set_defaults(handler=cmd_trace)

    stats = sub.add_parser("stats", parents=[common], help="per-node P50/P90/P99 of a chain's recent runs")
    stats.add_argument("chain")
    stats.add_argument("--last", type=argtypes.count, default=0, metavar="N", help="only the newest N runs")
    stats.set_defaults(handler=cmd_stats)
