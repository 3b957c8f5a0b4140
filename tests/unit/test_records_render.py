"""`inferx trace` / `inferx stats` rendering: 80 columns, bars where the nodes ran,
the critical path marked, retries and degradations shown, the P99 node highlighted."""

from __future__ import annotations

from inferx.cli import observe
from inferx.cli.main import build_parser
from inferx.v1 import common_pb2, router_pb2
from inferx_router import records
from inferx_router.records import RunRecord

DEPS = {
    "classify_the_customer_intent_now": (),
    "lookup": (),
    "answer": ("classify_the_customer_intent_now", "lookup"),
}


def sample_trace() -> router_pb2.RunTrace:
    hops = [
        router_pb2.NodeFinished(
            node_id="classify_the_customer_intent_now",  # longer than the name column
            node_type="model_inference",
            status="ok",
            latency_ms=120,
            queue_ms=40,
            model="qwen-7b",
            worker_id="worker-a",
            usage=common_pb2.TokenUsage(prompt_tokens=45, completion_tokens=8, cached_prompt_tokens=32),
        ),
        router_pb2.NodeFinished(
            node_id="lookup",
            node_type="tool_call",
            status="ok",
            latency_ms=15,
            tool="vector_search",
            cache_hit=True,
            retries=2,
            degradation="stale_cache",
            degradation_reason="timeout",
        ),
        router_pb2.NodeFinished(
            node_id="answer",
            node_type="model_inference",
            status="error",
            latency_ms=280,
            model="qwen-72b",
            error="worker w: engine failed with a very long message " + "x" * 120,
        ),
    ]
    finished = router_pb2.ChainFinished(
        run_id="3f2a9c1d0e4b5a67",
        status="error",
        latency_ms=400,
        slo_ms=5000,
        slo_met=False,
        hops=hops,
        chain_version=3,
        retries_used=2,
    )
    record = RunRecord("support", "realtime", 1_700_000_000_000, "ab" * 16, DEPS, finished)
    return records.run_trace_message(record)


def test_waterfall_fits_80_columns_and_draws_each_node_where_it_ran() -> None:
    lines = [line.plain for line in observe.waterfall(sample_trace())]
    assert all(len(line) <= 80 for line in lines), max(lines, key=len)
    text = "\n".join(lines)
    rows = {
        line.split()[1] if line.startswith("*") else line.split()[0]: line for line in lines if "█" in line
    }
    intent = next(line for key, line in rows.items() if key.startswith("classify_the_custom"))
    answer, lookup = rows["answer"], rows["lookup"]
    bar_start = 2 + observe.NAME_W + 1
    # The answer starts where the (slower) intent node ends, and both are critical.
    assert intent.startswith("* ") and answer.startswith("* ") and lookup.startswith("  ")
    assert intent.index("█") < answer.index("█")
    assert answer.rstrip().endswith("280 ms") and intent[bar_start] == observe.QUEUE_CH
    assert answer.index("█") >= intent.rindex("█")
    assert "classify_the_custom…" in text
    assert "tokens 45 in (32 cached) / 8 out" in text
    assert "queue 40 ms · run 80 ms" in text
    assert "2 retries" in text and "degraded: stale_cache (timeout)" in text
    assert "cache hit" in text
    assert "error: worker w: engine failed" in text
    assert "missed" in text and "retries 2" in text and "trace " + "ab" * 16 in text


def test_waterfall_marks_skipped_nodes_without_a_bar() -> None:
    trace = sample_trace()
    trace.finished.hops[2].status = "skipped"
    trace.finished.hops[2].latency_ms = 0
    row = next(
        line.plain for line in observe.waterfall(trace) if line.plain.lstrip("* ").startswith("answer")
    )
    assert row.rstrip().endswith("skipped") and "█" not in row


def test_bar_scales_and_never_vanishes() -> None:
    assert observe.bar(0, 50, 0, 100, 10) == "█████     "
    assert observe.bar(50, 100, 25, 100, 10) == "     ░░███"
    assert observe.bar(0, 0.01, 0, 1000, 10) == "█         "  # a 10 µs node still shows
    assert observe.bar(0, 10, 0, 0, 4) == "    "


def test_stats_highlights_the_p99_node_within_80_columns() -> None:
    kept = []
    for i in range(20):
        trace = sample_trace()
        finished = trace.finished
        finished.run_id = f"run{i:04d}"
        finished.hops[2].status = "ok"
        finished.hops[0].latency_ms = 100 if i < 19 else 900  # one slow intent run
        finished.latency_ms = finished.hops[0].latency_ms + finished.hops[2].latency_ms
        kept.append(RunRecord("support", "realtime", 0, "", DEPS, finished))
    stats = records.chain_stats_message(records.chain_stats("support", kept))
    lines = [line.plain for line in observe.stats_lines(stats)]
    assert all(len(line) <= 80 for line in lines), max(lines, key=len)
    rows = [line for line in lines if line[2:].startswith(("classify", "lookup", "answer")) and "%" in line]
    assert [row[:2] for row in rows] == ["▶ ", "  ", "  "]
    assert rows[0].split()[1:] == ["classify_the_custom…", "20", "100", "100", "748", "100%"]
    assert "▶ classify_the_customer_intent_now contributes most to the P99 (times in ms)" in lines
    assert "    40 retries · 20 degraded · 20 cache hits" in lines  # all on `lookup`


def test_wrap_parts_breaks_between_parts() -> None:
    assert observe.wrap_parts(["a" * 30, "b" * 30, "c" * 30], 70) == [
        "    " + "a" * 30 + " · " + "b" * 30,
        "    " + "c" * 30,
    ]


def test_cli_registers_trace_and_stats() -> None:
    args = build_parser().parse_args(["trace", "3f2a", "--router", "h:1"])
    assert args.handler is observe.cmd_trace and args.run_id == "3f2a" and args.router == "h:1"
    args = build_parser().parse_args(["trace", "--chain", "support", "--json"])
    assert args.run_id is None and args.chain == "support" and args.json
    args = build_parser().parse_args(["stats", "support", "--last", "50"])
    assert args.handler is observe.cmd_stats and args.last == 50


def program_trace(status: str = "running") -> router_pb2.RunTrace:
    """A dynamic program of two calls with a tool gap between them."""
    hops = [
        router_pb2.NodeFinished(
            node_id=f"call-{i}",
            node_type="model_inference",
            status="ok",
            latency_ms=200,
            queue_ms=5,
            model="qwen-7b",
            worker_id="worker-0",
            usage=common_pb2.TokenUsage(prompt_tokens=300 + 100 * i, cached_prompt_tokens=280 * i),
        )
        for i in range(2)
    ]
    finished = router_pb2.ChainFinished(run_id="9c1d0e4b5a673f2a", status=status, latency_ms=1400, hops=hops)
    record = RunRecord(
        "openai",
        "realtime",
        1_700_000_000_000,
        "",
        {"call-0": (), "call-1": ("call-0",)},
        finished,
        program_id="ticket-4711",
        parent_program_id="ticket-4700",
        starts_ms={"call-0": 0.0, "call-1": 1200.0},
    )
    return records.run_trace_message(record)


def test_a_program_trace_shows_its_calls_where_they_ran_and_no_slo() -> None:
    lines = [line.plain for line in observe.waterfall(program_trace())]
    assert all(len(line) <= 80 for line in lines), max(lines, key=len)
    assert lines[0] == "openai  program ticket-4711  run 9c1d0e4b5a673f2a  realtime"
    assert lines[1] == "running: 2 calls so far, 1,400 ms"
    assert "started by program ticket-4700" in lines
    rows = [line for line in lines if "█" in line]
    bar_start = 2 + observe.NAME_W + 1
    assert rows[0].index("█") - bar_start < 2 and rows[1].index("█") - bar_start > 30  # the tool gap shows
    assert "tokens 400 in (280 cached) / 0 out" in "\n".join(lines) and "SLO" not in "\n".join(lines)
    ended = [line.plain for line in observe.waterfall(program_trace("ok"))]
    assert ended[1] == "ok: 2 calls in 1,400 ms"


def test_stats_of_programs_say_they_have_no_slo() -> None:
    record = RunRecord("openai", "standard", 0, "", {}, program_trace("ok").finished, program_id="p")
    stats = records.chain_stats_message(records.chain_stats("openai", [record]))
    assert observe.stats_lines(stats)[0].plain == "openai: 1 recent runs, 1 ok, no SLO"
