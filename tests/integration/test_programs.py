"""Dynamic programs on a real stack (SIMULATED workers): an agent loop of calls through
the OpenAI front with the official `openai` SDK is ONE program in `GetRun` (`inferx
trace`), one hop per call, cached tokens growing; session headers and vLLM router's
`agentic_context` name programs; a program without an end mark ends after the router's
`--program-idle-s`; `Router.CallModel` streams text and usage, and its calls join the
HTTP calls of the same program; stats, metrics and spans cover programs."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from inferx import telemetry
from inferx.devstack import LocalStack, read_models_file
from inferx.errors import Internal
from inferx.v1 import common_pb2, router_pb2, router_pb2_grpc
from inferx_router.http_front import RUN_HEADER, WORKER_HEADER
from tests.conftest import EXAMPLES, make_stack, started
from tests.polling import poll_until

pytestmark = pytest.mark.integration

MODEL = "qwen-7b"
CALL_TRACK, NO_TOOLS = "Track parcel TRK-42 with the tool.", "Answer in words only."
CALL_TWO = "Track TRK-42 and look up order 7."
REACT = "Answer as Thought / Action / Observation."  # a ReAct agent: it stops before Observation
SCRIPT = [
    {
        "when": CALL_TWO,
        "reply": 'Both.\n<tool_call>\n{"name": "track", "arguments": {"id": "TRK-42"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "lookup", "arguments": {"order": 7}}\n</tool_call>',
    },
    {
        "when": CALL_TRACK,
        "reply": 'Checking.\n<tool_call>\n{"name": "track", "arguments": {"id": "TRK-42"}}\n</tool_call>',
    },
    {"when": NO_TOOLS, "reply": "It is on its way."},
    {"when": REACT, "reply": "Thought: find the parcel\nAction: track[TRK-42]\nObservation: (made up)"},
]
IDLE_S = 3.0
INFERX = str(Path(sys.executable).with_name("inferx"))


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalStack, Path]]:
    """etcd, every service, two sim workers; the router ends idle programs after IDLE_S
    and writes its spans to a file."""
    tmp = tmp_path_factory.mktemp("programs")
    spans = tmp / "spans.jsonl"
    script = tmp / "script.json"  # SIMULATED replies for two prompts only (tool-call tests)
    script.write_text(json.dumps(SCRIPT))

    def start(stack: LocalStack) -> None:
        stack.start_etcd()
        stack.start_service(
            "router",
            ["--program-idle-s", str(IDLE_S), "--trace-exporter", "file", "--trace-file", str(spans)],
        )
        stack.start_core()
        stack.load_models(read_models_file(EXAMPLES / "models.yaml"))
        for _ in range(2):
            stack.start_worker("tiny-llama", "sim", ["--sim-speed", "5", "--sim-script", str(script)])

    with started(make_stack(tmp), start, guard=True) as stack:
        yield stack, spans


@pytest.fixture(scope="module")
def stack(traced: tuple[LocalStack, Path]) -> LocalStack:
    return traced[0]


def sdk(stack: LocalStack, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.router_http_url, api_key="unused", max_retries=0, **kw)


async def get_run(stack: LocalStack, run_id: str) -> router_pb2.RunTrace:
    async with grpc.aio.insecure_channel(stack.router_address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        return await stub.GetRun(router_pb2.GetRunRequest(run_id=run_id), timeout=10)


async def chain_stats(stack: LocalStack, chain: str) -> router_pb2.ChainStats:
    async with grpc.aio.insecure_channel(stack.router_address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        return await stub.GetChainStats(router_pb2.GetChainStatsRequest(chain=chain), timeout=10)


def conversation(program: str) -> list:
    return [
        {"role": "system", "content": f"[{program}] You are a support agent. " + "Policy text. " * 60},
        {"role": "user", "content": "Where is order 7?"},
    ]


TOOL: Any = {
    "type": "function",
    "function": {"name": "track", "parameters": {"type": "object", "properties": {"id": {"type": "string"}}}},
}
LOOKUP: Any = {
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {"type": "object", "properties": {"order": {"type": "integer"}}},
    },
}


async def test_an_agent_loop_is_one_program_in_its_trace_with_cached_tokens_growing(
    stack: LocalStack,
) -> None:
    program = f"agent-{uuid.uuid4().hex[:8]}"
    client = sdk(
        stack,
        default_headers={
            "X-InferX-Program": program,
            "X-InferX-Program-Name": "support-bot",
            "X-InferX-Tier": "realtime",
        },
    )
    messages = conversation(program)
    runs, workers = set(), set()
    for step in range(4):
        last = step == 3
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=messages,
            tools=[TOOL],
            max_tokens=12,
            extra_headers={"X-InferX-Program-End": "true"} if last else None,
        )
        reply = raw.parse()
        runs.add(raw.headers[RUN_HEADER])
        workers.add(raw.headers[WORKER_HEADER])
        if step == 1:  # in the middle of the loop: the program is running, its calls so far kept
            running = await get_run(stack, program)
            assert running.finished.status == "running" and len(running.finished.hops) == 2
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "tool", "tool_call_id": f"call_{step}", "content": '{"status": "shipped"}' * 4},
        ]
    assert len(runs) == 1 and len(workers) == 1, (runs, workers)
    trace = await get_run(stack, program)
    finished = trace.finished
    assert finished.run_id == runs.pop() and trace.program_id == program
    assert trace.chain == "support-bot" and trace.tier == "realtime"
    assert finished.status == "ok" and finished.chain_version == 0
    assert [h.node_id for h in finished.hops] == ["call-0", "call-1", "call-2", "call-3"]
    cached = [h.usage.cached_prompt_tokens for h in finished.hops]
    assert cached[0] < cached[1] < cached[2] < cached[3], cached
    prompts = [h.usage.prompt_tokens for h in finished.hops]
    assert prompts == sorted(prompts) and all(h.usage.completion_tokens == 12 for h in finished.hops)
    assert {h.worker_id for h in finished.hops} == workers and all(h.queue_ms >= 0 for h in finished.hops)
    assert all(h.model == MODEL and h.status == "ok" and h.latency_ms > 0 for h in finished.hops)
    starts = [t.start_ms for t in trace.timings]
    assert starts == sorted(starts) and all(t.critical for t in trace.timings)
    assert finished.latency_ms >= trace.timings[-1].end_ms - 1
    # A prefix of the run id finds it too, and `inferx stats support-bot` covers it.
    assert (await get_run(stack, finished.run_id[:8])).program_id == program
    stats = await chain_stats(stack, "support-bot")
    assert stats.runs >= 1 and stats.slo_ms == 0
    assert [n.node_id for n in stats.nodes][:4] == ["call-0", "call-1", "call-2", "call-3"]


async def test_session_headers_and_agentic_context_name_programs(stack: LocalStack) -> None:
    session = f"sess-{uuid.uuid4().hex[:8]}"
    client = sdk(stack, default_headers={"X-Session-Id": session})
    for _ in range(2):
        client.chat.completions.create(model=MODEL, messages=conversation(session), max_tokens=4)
    assert len((await get_run(stack, session)).finished.hops) == 2

    task = f"task-{uuid.uuid4().hex[:8]}"
    context = {"task_id": task, "agent_id": "researcher", "parent_agent_id": "lead", "priority": 1}
    plain = sdk(stack)
    plain.chat.completions.create(
        model=MODEL,
        messages=conversation(task),
        max_tokens=4,
        extra_body={"vllm_xargs": {"agentic_context": context}},
    )
    plain.completions.create(
        model=MODEL,
        prompt="Summarise the findings",
        max_tokens=4,
        extra_body={"vllm_xargs": {"agentic_context": {**context, "expected_resume": False}}},
    )
    trace = await get_run(stack, f"{task}:researcher")
    assert trace.parent_program_id == f"{task}:lead"
    assert trace.finished.status == "ok" and len(trace.finished.hops) == 2  # expected_resume false: ended

    with pytest.raises(openai.BadRequestError) as caught:
        plain.chat.completions.create(
            model=MODEL,
            messages=conversation(task),
            extra_body={"agentic_context": {"program_id": "p", "colour": "red"}},
        )
    assert caught.value.status_code == 400 and caught.value.param == "agentic_context.colour"
    assert "unknown field" in caught.value.message


async def test_a_program_without_an_end_mark_ends_after_the_idle_time(stack: LocalStack) -> None:
    program = f"idle-{uuid.uuid4().hex[:8]}"
    client = sdk(stack, default_headers={"X-InferX-Program": program})
    for _ in range(2):
        client.completions.create(model=MODEL, prompt=f"{program} step", max_tokens=4)
    assert (await get_run(stack, program)).finished.status == "running"

    async def ended() -> router_pb2.RunTrace | None:
        trace = await get_run(stack, program)
        return trace if trace.finished.status != "running" else None

    trace = await poll_until(ended, timeout_s=IDLE_S + 10, interval_s=0.2, what="the idle program to end")
    assert trace is not None and trace.finished.status == "ok" and len(trace.finished.hops) == 2
    # The next call of the same id starts a new record of the program.
    client.completions.create(model=MODEL, prompt=f"{program} again", max_tokens=4)
    again = await get_run(stack, program)
    assert again.finished.run_id != trace.finished.run_id and again.finished.status == "running"
    metrics = await scrape(stack)
    assert metrics[("inferx_programs_ended_total", (("chain", "openai"), ("reason", "idle")))] >= 1


async def test_call_model_streams_text_and_usage_and_joins_the_http_calls_of_its_program(
    stack: LocalStack,
) -> None:
    program = f"mixed-{uuid.uuid4().hex[:8]}"
    messages = conversation(program)
    raw = sdk(stack, default_headers={"X-InferX-Program": program}).chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=8
    )
    messages.append({"role": "assistant", "content": raw.parse().choices[0].message.content})
    messages.append({"role": "user", "content": "And order 8?"})
    async with stack.client(timeout_s=30) as client:
        texts, finished = [], None
        async for event in client.call_model(
            MODEL, messages=messages, max_tokens=40, program_id=program, tier=common_pb2.TIER_REALTIME
        ):
            if event.WhichOneof("event") == "text":
                texts.append(event.text)
            else:
                finished = event.finished
        assert finished is not None and len(texts) >= 2  # pieces arrive as they are generated
        assert finished.run_id == raw.headers[RUN_HEADER] and finished.program_id == program
        assert finished.call_index == 1 and finished.worker_id == raw.headers[WORKER_HEADER]
        assert finished.finish_reason == "length" and finished.usage.completion_tokens == 40
        assert finished.usage.cached_prompt_tokens > 0 and finished.latency_ms > 0
        last = [
            e
            async for e in client.call_model(MODEL, "Bye", max_tokens=3, program_id=program, program_end=True)
        ]
        assert last[-1].finished.call_index == 2
    trace = await get_run(stack, program)
    assert trace.finished.status == "ok" and [h.node_id for h in trace.finished.hops] == [
        "call-0",
        "call-1",
        "call-2",
    ]
    assert trace.finished.hops[1].usage.completion_tokens == 40
    # A bad field is INVALID_ARGUMENT naming it; an unknown model NOT_FOUND.
    async with grpc.aio.insecure_channel(stack.router_address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        for request, code, words in (
            (router_pb2.ProgramCallRequest(model=MODEL, prompt="x", tier=9), "INVALID_ARGUMENT", "tier"),  # type: ignore[arg-type]
            (router_pb2.ProgramCallRequest(model="gpt-9", prompt="x"), "NOT_FOUND", "gpt-9"),
            (router_pb2.ProgramCallRequest(model=MODEL), "INVALID_ARGUMENT", "prompt"),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                [event async for event in stub.CallModel(request, timeout=10)]
            assert caught.value.code().name == code and words in (caught.value.details() or "")


async def test_program_calls_have_spans_with_the_program_id_and_metrics_with_bounded_labels(
    traced: tuple[LocalStack, Path],
) -> None:
    stack, path = traced
    program = f"spans-{uuid.uuid4().hex[:8]}"
    trace_id = uuid.uuid4().hex
    traceparent = f"00-{trace_id}-{uuid.uuid4().hex[:16]}-01"
    sdk(stack, default_headers={"X-InferX-Program": program}).chat.completions.create(
        model=MODEL,
        messages=conversation(program),
        max_tokens=4,
        extra_headers={"traceparent": traceparent, "X-InferX-Program-End": "true"},
    )
    record = await get_run(stack, program)

    def program_spans() -> list[dict]:
        return [
            s
            for s in telemetry.read_spans(str(path))
            if s["name"] == "program openai" and s["attributes"].get("inferx.program_id") == program
        ]

    spans = await poll_until(program_spans, timeout_s=10, what="the program call's span")
    span = spans[0]
    assert span["trace_id"] == trace_id  # the caller's trace, continued
    attributes = span["attributes"]
    assert attributes["inferx.run_id"] == record.finished.run_id
    assert attributes["gen_ai.usage.output_tokens"] == 4 and attributes["inferx.worker"]
    assert record.trace_id == trace_id
    children = {s["name"] for s in telemetry.read_spans(str(path)) if s["trace_id"] == trace_id}
    assert {"queue wait", "dispatch", "engine"} <= children
    metrics = await scrape(stack)
    calls = metrics[
        ("inferx_node_latency_seconds_count", (("chain", "openai"), ("node", "call"), ("status", "ok")))
    ]
    assert calls >= 1
    assert metrics[("inferx_programs_ended_total", (("chain", "openai"), ("reason", "end")))] >= 1
    assert not any("spans-" in json.dumps(labels) for _, labels in metrics)  # no program ids in labels


async def scrape(stack: LocalStack) -> dict[tuple[str, tuple], float]:
    """The router's /metrics (its address as registered in etcd: `inferx status`)."""
    async with stack.client() as client:
        status = await client.status()
    address = next(s.metrics_address for s in status.services if s.kind == "router")
    body = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(body)
        for sample in family.samples
    }


def test_the_same_program_id_from_two_fronts_at_once_is_one_program(stack: LocalStack) -> None:
    """Concurrent calls of one program (an agent's parallel tool results) are hops of it."""
    program = f"par-{uuid.uuid4().hex[:8]}"

    async def both() -> None:
        client = openai.AsyncOpenAI(
            base_url=stack.router_http_url,
            api_key="unused",
            max_retries=0,
            default_headers={"X-InferX-Program": program},
        )
        async with client:
            await asyncio.gather(
                *(
                    client.completions.create(model=MODEL, prompt=f"{program} {i}", max_tokens=3)
                    for i in range(3)
                )
            )
        trace = await get_run(stack, program)
        assert sorted(h.node_id for h in trace.finished.hops) == ["call-0", "call-1", "call-2"]

    asyncio.run(both())


def test_inferx_call_streams_a_call_and_inferx_trace_shows_its_program(stack: LocalStack) -> None:
    program = f"cli-{uuid.uuid4().hex[:8]}"
    router = ["--router", stack.router_address]
    called = subprocess.run(
        [INFERX, "call", MODEL, "Where is order 9?", "--program", program, "--max-tokens", "6", *router],
        capture_output=True,
        text=True,
        timeout=60,
    )
    called_at = time.monotonic()
    assert called.returncode == 0, called.stderr
    assert called.stdout.strip() and f"program {program} call 0" in called.stderr
    assert "tokens" in called.stderr and "/ 6 out" in called.stderr
    traced = subprocess.run([INFERX, "trace", program, *router], capture_output=True, text=True, timeout=60)
    assert traced.returncode == 0, traced.stderr
    assert f"openai  program {program}" in traced.stdout
    # Still open, unless the CLI took longer than the idle time to start (a loaded host):
    # then the router has ended it as idle, with its one call.
    if time.monotonic() - called_at < IDLE_S:
        assert "running: 1 call so far" in traced.stdout, traced.stdout
    else:
        assert "running: 1 call so far" in traced.stdout or "ok: 1 call" in traced.stdout, traced.stdout


# ----- tool calls over CallModel; tool_choice failures in the record; KV retention hints -----


def tool_messages(program: str, ask: str) -> list:
    return [
        {"role": "system", "content": f"[{program}] You track parcels."},
        {"role": "user", "content": ask},
    ]


async def test_call_model_reads_tool_calls_as_the_http_front_does(stack: LocalStack) -> None:
    program = f"tools-{uuid.uuid4().hex[:8]}"
    http = sdk(stack).chat.completions.create(
        model=MODEL, messages=tool_messages(program + "-http", CALL_TRACK), tools=[TOOL], max_tokens=64
    )
    assert http.choices[0].finish_reason == "tool_calls"
    async with stack.client(timeout_s=30) as client:
        events = [
            e
            async for e in client.call_model(
                MODEL,
                messages=tool_messages(program, CALL_TRACK),
                tools=[TOOL],
                max_tokens=64,
                program_id=program,
            )
        ]
    texts = "".join(e.text for e in events if e.WhichOneof("event") == "text")
    finished = events[-1].finished
    assert texts == "Checking." == http.choices[0].message.content  # the content only, no markup
    assert finished.finish_reason == "tool_calls"
    (call,) = finished.tool_calls
    (http_call,) = http.choices[0].message.tool_calls or []
    assert (call.name, json.loads(call.arguments_json)) == ("track", {"id": "TRK-42"})
    assert (http_call.function.name, json.loads(http_call.function.arguments)) == ("track", {"id": "TRK-42"})  # type: ignore[union-attr]
    assert call.id.startswith("call_")
    # The call streamed on its own as soon as it was read: after the content, before finished.
    assert event_kinds(events) == ["text", "tool_call", "finished"]
    assert [e.tool_call for e in events if e.WhichOneof("event") == "tool_call"] == [call]


async def test_a_react_agents_stop_sequence_ends_the_reply_before_it_on_both_fronts(
    stack: LocalStack,
) -> None:
    """OpenAI's `stop` reaches the engine: a ReAct agent's reply ends before the
    observation it must not invent (finish reason stop), whole, streamed and on CallModel."""
    messages: Any = [{"role": "user", "content": REACT}]
    expected = "Thought: find the parcel\nAction: track[TRK-42]"
    client = sdk(stack)
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=64, stop=["\nObservation:"]
    )
    assert whole.choices[0].message.content == expected and whole.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=64, stop="\nObservation:", stream=True, seed=1, top_p=0.9
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected
    unstopped = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=64)
    assert (unstopped.choices[0].message.content or "").endswith("Observation: (made up)")
    async with stack.client(timeout_s=30) as grpc_client:
        events = [
            e
            async for e in grpc_client.call_model(
                MODEL, messages=messages, max_tokens=64, stop=["\nObservation:"]
            )
        ]
    assert "".join(e.text for e in events if e.WhichOneof("event") == "text") == expected
    assert events[-1].finished.finish_reason == "stop"
    called = subprocess.run(
        [INFERX, "call", MODEL, REACT, "--stop", "\nObservation:", "--router", stack.router_address],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert called.returncode == 0, called.stderr
    assert called.stdout.strip() == expected and called.stderr.startswith("stop")


def event_kinds(events: list[router_pb2.ProgramCallEvent]) -> list[str]:
    """The kinds of a call's events, runs of text pieces as one."""
    kinds: list[str] = []
    for event in events:
        kind = str(event.WhichOneof("event"))
        if not (kind == "text" and kinds and kinds[-1] == "text"):
            kinds.append(kind)
    return kinds


async def test_call_model_streams_two_tool_calls_and_a_held_one_after_its_check(
    stack: LocalStack, tmp_path: Path
) -> None:
    program = f"two-{uuid.uuid4().hex[:8]}"
    async with stack.client(timeout_s=30) as client:
        both = [
            e
            async for e in client.call_model(
                MODEL, messages=tool_messages(program, CALL_TWO), tools=[TOOL, LOOKUP], max_tokens=128
            )
        ]
        # tool_choice named: the reply is held until it has passed its check, then sent.
        held = [
            e
            async for e in client.call_model(
                MODEL,
                messages=tool_messages(program, CALL_TRACK),
                tools=[TOOL, LOOKUP],
                tool_choice={"type": "function", "function": {"name": "track"}},
                max_tokens=64,
            )
        ]
    assert event_kinds(both) == ["text", "tool_call", "tool_call", "finished"]
    streamed = [e.tool_call for e in both if e.WhichOneof("event") == "tool_call"]
    assert [(c.index, c.name, json.loads(c.arguments_json)) for c in streamed] == [
        (0, "track", {"id": "TRK-42"}),
        (1, "lookup", {"order": 7}),
    ]
    assert list(both[-1].finished.tool_calls) == streamed
    assert event_kinds(held) == ["text", "tool_call", "finished"]
    assert held[-1].finished.finish_reason == "stop"  # a named call, as OpenAI says
    # From a shell: `inferx call --tools FILE` prints each call on a line of its own.
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([TOOL, LOOKUP]))
    command = [INFERX, "call", MODEL, CALL_TWO, "--tools", str(tools), "--max-tokens", "128"]
    called = subprocess.run(
        [*command, "--router", stack.router_address], capture_output=True, text=True, timeout=60
    )
    assert called.returncode == 0, called.stderr
    lines = [line for line in called.stdout.splitlines() if line.startswith("[tool call")]
    assert [line.split(" (call_")[0] for line in lines] == [
        '[tool call 0] track {"id": "TRK-42"}',
        '[tool call 1] lookup {"order": 7}',
    ]


async def test_a_reply_breaking_tool_choice_fails_both_fronts_and_is_recorded_as_an_error(
    stack: LocalStack,
) -> None:
    program = f"choice-{uuid.uuid4().hex[:8]}"
    client_http = sdk(stack, default_headers={"X-InferX-Program": program})
    with pytest.raises(openai.InternalServerError) as http_error:
        client_http.chat.completions.create(
            model=MODEL,
            messages=tool_messages(program, NO_TOOLS),
            tools=[TOOL],
            tool_choice="required",
            max_tokens=32,
        )
    assert http_error.value.code == "tool_choice_not_followed"
    async with stack.client(timeout_s=30) as client:
        with pytest.raises(Internal, match="tool_choice"):
            async for event in client.call_model(
                MODEL,
                messages=tool_messages(program, NO_TOOLS),
                tools=[TOOL],
                tool_choice={"type": "function", "function": {"name": "track"}},
                max_tokens=32,
                program_id=program,
            ):
                assert event.WhichOneof("event") != "text"  # nothing of a held reply is sent
    trace = await get_run(stack, program)
    assert [(h.status, h.error.split(":")[0]) for h in trace.finished.hops] == [
        ("error", "tool_choice_not_followed"),
        ("error", "tool_choice_not_followed"),
    ]
    assert trace.finished.hops[0].usage.completion_tokens > 0  # the model ran; its reply failed


async def scheduler_hints(stack: LocalStack) -> dict[str, float]:
    """inferx_scheduler_kv_retention_hints_total by outcome, over the stack's schedulers."""
    async with stack.client() as client:
        status = await client.status()
    counts: dict[str, float] = {}
    for service in status.services:
        if service.kind != "scheduler" or not service.metrics_address:
            continue
        body = urllib.request.urlopen(f"http://{service.metrics_address}/metrics", timeout=5).read().decode()
        for family in text_string_to_metric_families(body):
            for sample in family.samples:
                if sample.name == "inferx_scheduler_kv_retention_hints_total":
                    outcome = sample.labels["outcome"]
                    counts[outcome] = counts.get(outcome, 0.0) + sample.value
    return counts


async def test_a_clients_kv_retention_hint_reaches_the_scheduler_from_both_fronts(stack: LocalStack) -> None:
    before = await scheduler_hints(stack)
    program = f"keep-{uuid.uuid4().hex[:8]}"
    sdk(stack).chat.completions.create(
        model=MODEL,
        messages=conversation(program),
        max_tokens=4,
        extra_body={"agentic_context": {"program_id": program, "kv_retention_ttl": 0}},
    )
    async with stack.client(timeout_s=30) as client:
        async for _ in client.call_model(MODEL, "More?", max_tokens=4, program_id=program, kv_retention_s=30):
            pass
    # Past --max-hold-s (600 s by default): cut to it. From a shell, `inferx call`.
    router = ["--router", stack.router_address]
    command = [INFERX, "call", MODEL, "And?", "--program", program, "--max-tokens", "4", *router]
    called = subprocess.run(
        [*command, "--kv-retention-s", "3600"], capture_output=True, text=True, timeout=60
    )
    assert called.returncode == 0, called.stderr

    async def counted() -> dict[str, float] | None:
        now = await scheduler_hints(stack)
        grown = {k: now.get(k, 0.0) - before.get(k, 0.0) for k in ("released", "held", "capped")}
        return grown if all(v >= 1 for v in grown.values()) else None

    await poll_until(counted, timeout_s=10, what="the scheduler's count of the hints")
    with pytest.raises(grpc.aio.AioRpcError) as caught:  # a bad hint: INVALID_ARGUMENT naming it
        async with grpc.aio.insecure_channel(stack.router_address) as channel:
            request = router_pb2.ProgramCallRequest(
                model=MODEL, prompt="x", program_id=program, kv_retention_s=-1
            )
            [e async for e in router_pb2_grpc.RouterStub(channel).CallModel(request, timeout=10)]
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "kv_retention_s" in (
        caught.value.details() or ""
    )
