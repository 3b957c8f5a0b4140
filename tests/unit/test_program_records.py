"""Dynamic programs as run records (a fake clock): one hop per call, the end mark, the
idle timeout, rollover and eviction, traces by program id, tenants; and the one
program-call path (`ProgramCalls`) the HTTP front and Router.CallModel share, with a
fake executor."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import pytest

from inferx.auth.limits import TenantQuotas
from inferx.auth.model import Principal, Role
from inferx.errors import InvalidArgument, NotFound, Unavailable
from inferx.limits import RequestLimits
from inferx.openai_compat import schema
from inferx.openai_compat.errors import InvalidField, ModelNotFound, ToolChoiceNotFollowed
from inferx.openai_compat.identity import ProgramIdentity
from inferx.openai_compat.render import render_chat
from inferx.openai_compat.toolcalls import Content, ToolCall
from inferx.pools import PoolDirectory
from inferx.scheduling.views import Tier
from inferx.tokens import estimate_tokens
from inferx.v1 import common_pb2, router_pb2
from inferx_router import programs
from inferx_router.access import AccessControl
from inferx_router.executors import hop_request
from inferx_router.hops import HopDone, ModelHop
from inferx_router.program_calls import (
    CallDone,
    ProgramCalls,
    call_event,
    finished_event,
    request_body,
    request_identity,
)
from inferx_router.programs import Program, ProgramBook
from inferx_router.records import RUNNING, RunStore, chain_stats, run_trace_message


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def book_with(clock: Clock, store: RunStore | None = None, **kw) -> tuple[ProgramBook, list[Program]]:
    ended: list[Program] = []
    ids = iter(f"run{n:04d}" for n in range(10_000))
    book = ProgramBook(
        store if store is not None else RunStore(),
        clock=clock,
        wall=lambda: 1_700_000_000.0,
        on_end=ended.append,
        new_run_id=lambda: next(ids),
        **kw,
    )
    return book, ended


def result(
    prompt: int = 100, cached: int = 0, status: str = "ok", worker: str = "w-0"
) -> router_pb2.NodeFinished:
    node = router_pb2.NodeFinished(
        status=status, model="m", worker_id=worker, queue_ms=1.5, output="x" * 500, reasoning="r" * 500
    )
    node.usage.prompt_tokens, node.usage.cached_prompt_tokens, node.usage.completion_tokens = (
        prompt,
        cached,
        8,
    )
    if status != "ok":
        node.error = "boom"
    return node


def one_call(
    book: ProgramBook, clock: Clock, identity: ProgramIdentity, seconds: float, **kw
) -> programs.Ticket:
    ticket = book.begin(identity, tenant=kw.pop("tenant", "acme"))
    clock.now += seconds
    book.finish(ticket, result(**kw))
    return ticket


# ----- records ---------------------------------------------------------------------------------


def test_each_call_is_a_hop_of_one_record_with_its_real_start_and_the_program_ends_with_its_end_mark() -> (
    None
):
    clock = Clock()
    store = RunStore()
    book, ended = book_with(clock, store)
    agent = ProgramIdentity("ticket-7", Tier.REALTIME, parent_program_id="root")
    one_call(book, clock, agent, 0.2, prompt=100, cached=0)
    clock.now += 1.0  # the client runs a tool
    one_call(book, clock, agent, 0.1, prompt=150, cached=100)
    record = store.find("ticket-7", tenant="acme")
    assert record.finished.status == RUNNING and record.chain == "openai" and record.tier == "realtime"
    assert [h.node_id for h in record.finished.hops] == ["call-0", "call-1"]
    assert record.finished.latency_ms == pytest.approx(1300)  # first call's start to the last answer
    clock.now += 0.5
    one_call(book, clock, ProgramIdentity("ticket-7", program_end=True), 0.1, prompt=200, cached=150)
    assert [p.ended for p in ended] == ["end"] and len(book) == 0
    finished = record.finished
    assert finished.status == "ok" and finished.slo_met and finished.slo_ms == 0
    assert [h.usage.cached_prompt_tokens for h in finished.hops] == [0, 100, 150]
    assert {h.node_type for h in finished.hops} == {"model_inference"}
    assert len(finished.hops[0].output) == 200  # outputs shortened, as for chain runs
    assert len(finished.hops[0].reasoning) == 200  # a reasoning model's thinking too
    trace = run_trace_message(record)
    assert trace.program_id == "ticket-7" and trace.parent_program_id == "root"
    starts = [(t.node_id, round(t.start_ms), round(t.end_ms), t.critical) for t in trace.timings]
    assert starts == [("call-0", 0, 200, True), ("call-1", 1200, 1300, True), ("call-2", 1800, 1900, True)]
    assert list(trace.timings[1].depends_on) == ["call-0"]


def test_an_idle_program_ends_at_the_sweep_after_its_idle_time_and_a_busy_one_does_not() -> None:
    clock = Clock()
    book, ended = book_with(clock, idle_s=300)
    one_call(book, clock, ProgramIdentity("idle"), 0.1)
    busy = book.begin(ProgramIdentity("busy"), tenant="acme")  # a call in flight: never idle
    clock.now += 299
    assert book.sweep() == [] and len(book) == 2
    clock.now += 2
    assert [p.program_id for p in book.sweep()] == ["idle"]
    assert [(p.program_id, p.ended, p.finished.status) for p in ended] == [("idle", "idle", "ok")]
    clock.now += 1000
    assert book.sweep() == []
    book.finish(busy, result())
    clock.now += 300
    assert [p.program_id for p in book.sweep()] == ["busy"]


def test_a_call_after_the_end_starts_a_new_record_of_the_same_program() -> None:
    clock = Clock()
    store = RunStore()
    book, _ = book_with(clock, store, idle_s=10)
    first = one_call(book, clock, ProgramIdentity("p", program_end=True), 0.1)
    second = one_call(book, clock, ProgramIdentity("p"), 0.1)
    assert first.program.run_id != second.program.run_id
    assert first.program.chain_key == second.program.chain_key == "acme/p"  # the scheduler's key
    assert store.find("p", tenant="acme").finished.run_id == second.program.run_id  # the latest
    assert second.hop_index == 0


def test_failed_calls_are_hops_too_and_make_the_program_fail() -> None:
    clock = Clock()
    book, ended = book_with(clock)
    one_call(book, clock, ProgramIdentity("p"), 0.1)
    one_call(book, clock, ProgramIdentity("p", program_end=True), 0.1, status="timeout")
    assert ended[0].finished.status == "deadline_exceeded" and not ended[0].finished.slo_met
    assert ended[0].finished.error == "call-1: boom"


def test_a_call_without_identity_is_a_finished_one_hop_record() -> None:
    clock = Clock()
    store = RunStore()
    book, ended = book_with(clock, store)
    ticket = one_call(book, clock, ProgramIdentity(), 0.05)
    assert ticket.last and ended[0].ended == "end" and len(book) == 0
    record = store.find(ticket.program.run_id, tenant="acme")
    assert record.program_id == "" and [h.node_id for h in record.finished.hops] == ["call-0"]


def test_a_full_record_rolls_over_and_the_hop_index_keeps_counting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(programs, "MAX_CALLS_PER_RECORD", 3)
    clock = Clock()
    book, ended = book_with(clock)
    tickets = [one_call(book, clock, ProgramIdentity("long"), 0.01) for _ in range(5)]
    assert [t.hop_index for t in tickets] == [0, 1, 2, 3, 4]
    assert [t.node_id for t in tickets] == ["call-0", "call-1", "call-2", "call-0", "call-1"]
    assert [p.ended for p in ended] == ["full"] and len(ended[0].finished.hops) == 3


def test_a_full_record_with_a_call_in_flight_ends_when_that_call_finishes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(programs, "MAX_CALLS_PER_RECORD", 2)
    clock = Clock()
    book, ended = book_with(clock)
    one_call(book, clock, ProgramIdentity("long"), 0.01)
    slow = book.begin(ProgramIdentity("long"), tenant="acme")
    next_record = book.begin(ProgramIdentity("long"), tenant="acme")
    assert next_record.program is not slow.program and ended == []
    book.finish(slow, result())
    assert [(p.ended, len(p.finished.hops)) for p in ended] == [("full", 2)]


def test_past_capacity_the_least_recently_active_idle_program_is_evicted() -> None:
    clock = Clock()
    book, ended = book_with(clock, capacity=2)
    one_call(book, clock, ProgramIdentity("a"), 0.1)
    one_call(book, clock, ProgramIdentity("b"), 0.1)
    one_call(book, clock, ProgramIdentity("a"), 0.1)
    one_call(book, clock, ProgramIdentity("c"), 0.1)
    assert [(p.program_id, p.ended) for p in ended] == [("b", "evicted")]
    assert book.get("acme", "a") is not None and book.get("acme", "b") is None


def test_programs_are_their_tenants_and_two_tenants_may_use_one_id() -> None:
    clock = Clock()
    store = RunStore()
    book, _ = book_with(clock, store)
    mine = one_call(book, clock, ProgramIdentity("shared"), 0.1, tenant="acme")
    theirs = one_call(book, clock, ProgramIdentity("shared"), 0.1, tenant="globex")
    assert mine.program is not theirs.program and mine.program.chain_key == "acme/shared"
    assert store.find("shared", tenant="acme").finished.run_id == mine.program.run_id
    with pytest.raises(NotFound):
        store.find("only-mine", tenant="globex")
    one_call(book, clock, ProgramIdentity("only-mine"), 0.1, tenant="acme")
    with pytest.raises(NotFound):
        store.find("only-mine", tenant="globex")
    with pytest.raises(NotFound):
        store.find(mine.program.run_id, tenant="globex")


def test_a_program_is_found_by_a_prefix_of_its_id_and_an_ambiguous_prefix_is_refused() -> None:
    clock = Clock()
    store = RunStore()
    book, _ = book_with(clock, store)
    one_call(book, clock, ProgramIdentity("session-one:lead"), 0.1)
    one_call(book, clock, ProgramIdentity("session-two:lead"), 0.1)
    assert store.find("session-one", tenant="acme").program_id == "session-one:lead"
    with pytest.raises(InvalidArgument):
        store.find("session-", tenant="acme")


def test_stats_of_a_program_name_cover_its_ended_programs_only() -> None:
    clock = Clock()
    store = RunStore()
    book, _ = book_with(clock, store)
    named = ProgramIdentity("a", name="support-bot")
    one_call(book, clock, named, 0.1)
    assert store.of_chain("support-bot", tenant="acme") == []  # still running
    one_call(book, clock, ProgramIdentity("a", name="support-bot", program_end=True), 0.2)
    one_call(book, clock, ProgramIdentity("b", name="support-bot", program_end=True), 0.3)
    kept = store.of_chain("support-bot", tenant="acme")
    stats = chain_stats("support-bot", kept)
    assert stats.runs == 2 and stats.ok == 2
    assert [(n.node_id, n.samples) for n in stats.nodes] == [("call-0", 2), ("call-1", 1)]


# ----- the shared call path ---------------------------------------------------------------------

WHO = Principal(tenant="acme", role=Role.RUN, token_id="t1", name="agent")


class FakeExecutor:
    def __init__(self, pieces: tuple[str, ...] = ("Hel", "lo"), fail: Exception | None = None) -> None:
        self.pieces = pieces
        self.fail = fail
        self.hops: list[ModelHop] = []
        self.gate: asyncio.Event | None = None

    async def run_hop(
        self,
        hop: ModelHop,
        timeout_s: float,
        on_dispatched: Callable[[str], None],
        on_text: Callable[[str], None] | None = None,
    ) -> HopDone:
        self.hops.append(hop)
        on_dispatched("w-1")
        if self.fail is not None:
            raise self.fail
        for piece in self.pieces:
            if on_text is not None:
                on_text(piece)
            await asyncio.sleep(0)
        if self.gate is not None:
            await self.gate.wait()
        cached = 10 * (len(self.hops) - 1)
        return HopDone(
            text="".join(self.pieces),
            worker_id="w-1",
            queue_ms=0.5,
            prompt_tokens=50,
            completion_tokens=2,
            cached_prompt_tokens=cached,
            finish_reason="length",
        )


def calls_with(executor: FakeExecutor, store: RunStore, quotas: TenantQuotas | None = None) -> ProgramCalls:
    directory = PoolDirectory()
    directory.model_to_pool = {"m": "pool"}
    return ProgramCalls(
        directory,
        executor,
        access=AccessControl(None),
        quotas=quotas or TenantQuotas(),
        default_timeout_s=30,
        book=ProgramBook(store),
    )


def chat(**fields) -> schema.ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return schema.validate_body(schema.ChatCompletionRequest, body)


async def test_calls_of_a_program_are_recorded_with_their_usage_and_worker() -> None:
    store = RunStore()
    executor = FakeExecutor()
    calls = calls_with(executor, store)
    identity = ProgramIdentity("loop-1")
    for _ in range(2):
        done = await calls.call(WHO, identity, calls.prepare(chat(max_tokens=2)))
    assert done.done.text == "Hello" and done.call_index == 1 and done.program_id == "loop-1"
    record = store.find("loop-1", tenant="acme")
    assert record.finished.run_id == done.run_id
    assert [(h.status, h.worker_id, h.usage.cached_prompt_tokens) for h in record.finished.hops] == [
        ("ok", "w-1", 0),
        ("ok", "w-1", 10),
    ]
    assert executor.hops[0].run_id == "acme/loop-1" and executor.hops[0].max_tokens == 2


async def test_the_stream_sends_text_then_the_result() -> None:
    calls = calls_with(FakeExecutor(), RunStore())
    items = [item async for item in calls.stream(WHO, ProgramIdentity(), calls.prepare(chat()))]
    assert items[:2] == [Content("Hel"), Content("lo")] and isinstance(items[-1], CallDone)


async def test_a_failed_call_is_raised_and_recorded() -> None:
    store = RunStore()
    calls = calls_with(FakeExecutor(fail=Unavailable("no worker")), store)
    with pytest.raises(Unavailable):
        await calls.call(WHO, ProgramIdentity("p"), calls.prepare(chat()))
    hop = store.find("p", tenant="acme").finished.hops[0]
    assert (hop.status, hop.error) == ("error", "no worker")


# ----- tool calls: one reading for the HTTP front and CallModel -------------------------------

TOOLS = [{"type": "function", "function": {"name": "track", "parameters": {"type": "object"}}}]
CALL_TEXT = ("Let me check.", '\n<tool_call>\n{"name": "track", "arguments": {"id": "T"}}\n</tool_call>')


async def test_a_streamed_call_gives_content_and_whole_tool_calls_not_the_markup() -> None:
    calls = calls_with(FakeExecutor(CALL_TEXT), RunStore())
    body = chat(tools=TOOLS)
    items = [
        item
        async for item in calls.stream(
            WHO, ProgramIdentity("p"), calls.prepare(body), reader=calls.reader(body)
        )
    ]
    assert items[0] == Content("Let me check.")
    assert not any(isinstance(i, Content) and "<tool_call>" in i.text for i in items)
    (call,) = [i for i in items if isinstance(i, ToolCall)]
    assert (call.name, json.loads(call.arguments)) == ("track", {"id": "T"})
    done = items[-1]
    assert isinstance(done, CallDone) and done.reply.calls == [call]
    finished = finished_event(done).finished
    assert finished.finish_reason == "tool_calls"
    assert [(c.id, c.index, c.name, json.loads(c.arguments_json)) for c in finished.tool_calls] == [
        (call.id, 0, "track", {"id": "T"})
    ]


async def test_a_call_without_tools_keeps_the_markup_as_content_and_no_tool_calls() -> None:
    calls = calls_with(FakeExecutor(CALL_TEXT), RunStore())
    body = chat()
    done = await calls.call(WHO, ProgramIdentity(), calls.prepare(body), reader=calls.reader(body))
    finished = finished_event(done).finished
    assert done.reply.content == "".join(CALL_TEXT) and not finished.tool_calls
    assert finished.finish_reason == "length"


@pytest.mark.parametrize("streamed", [False, True])
async def test_a_reply_that_breaks_tool_choice_fails_the_call_and_is_recorded_as_an_error(
    streamed: bool,
) -> None:
    store = RunStore()
    calls = calls_with(FakeExecutor(("No tool ", "for you.")), store)
    body = chat(tools=TOOLS, tool_choice="required")
    call, reader = calls.prepare(body), calls.reader(body)
    with pytest.raises(ToolChoiceNotFollowed):
        if streamed:
            items = [item async for item in calls.stream(WHO, ProgramIdentity("p"), call, reader=reader)]
            assert items == []  # never reached; nothing of the reply was given either
        else:
            await calls.call(WHO, ProgramIdentity("p"), call, reader=reader)
    hop = store.find("p", tenant="acme").finished.hops[0]
    assert hop.status == "error" and hop.error.startswith("tool_choice_not_followed: ")
    assert hop.output == "No tool for you." and hop.usage.completion_tokens == 2  # the model did run


async def test_the_tokens_of_a_reply_that_broke_tool_choice_count_against_its_tenant() -> None:
    class Counting(TenantQuotas):
        def __init__(self) -> None:
            super().__init__()
            self.tokens = 0

        def finished(self, tenant, limits, tokens, cost=0.0) -> None:
            self.tokens += tokens
            super().finished(tenant, limits, tokens, cost)

    quotas = Counting()
    calls = calls_with(FakeExecutor(("No tool.",)), RunStore(), quotas)
    body = chat(tools=TOOLS, tool_choice="required")
    with pytest.raises(ToolChoiceNotFollowed):
        await calls.call(WHO, ProgramIdentity(), calls.prepare(body), reader=calls.reader(body))
    assert quotas.tokens == 52  # 50 prompt + 2 completion: the engine ran
    with pytest.raises(Unavailable):
        failing = calls_with(FakeExecutor(fail=Unavailable("no worker")), RunStore(), quotas)
        await failing.call(WHO, ProgramIdentity(), failing.prepare(chat()))
    assert quotas.tokens == 52  # a hop that never ran used none


async def test_nothing_of_a_held_reply_is_streamed_before_it_fails() -> None:
    calls = calls_with(FakeExecutor(("No tool ", "for you.")), RunStore())
    body = chat(tools=TOOLS, tool_choice="required")
    seen = []
    with pytest.raises(ToolChoiceNotFollowed):
        async for item in calls.stream(
            WHO, ProgramIdentity(), calls.prepare(body), reader=calls.reader(body)
        ):
            seen.append(item)
    assert seen == []


# ----- CallModel's events: text, each tool call as soon as it is read whole, finished -------

TWO_TOOLS = [*TOOLS, {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
TWO_CALLS = (
    "Checking both.",
    '\n<tool_call>\n{"name": "track", "arguments": {"id": "T"}}\n</tool_call>',
    '\n<tool_call>\n{"name": "lookup", "arguments": {"order": 7}}\n</tool_call>',
)


def kinds(events: list[router_pb2.ProgramCallEvent]) -> list[str]:
    return [str(event.WhichOneof("event")) for event in events]


async def test_call_model_sends_each_tool_call_as_soon_as_it_is_read_then_finished_lists_them() -> None:
    executor = FakeExecutor(TWO_CALLS)
    executor.gate = asyncio.Event()  # the model "runs on" after its calls until this is set
    calls = calls_with(executor, RunStore())
    body = chat(tools=TWO_TOOLS)
    events: list[router_pb2.ProgramCallEvent] = []
    calls_before_the_end = 0
    stream = calls.stream(WHO, ProgramIdentity("p"), calls.prepare(body), reader=calls.reader(body))
    async for item in stream:
        if (event := call_event(item)) is not None:
            events.append(event)
        if kinds(events).count("tool_call") == 2 and not executor.gate.is_set():
            calls_before_the_end = 2  # both arrived while the hop was still running
            executor.gate.set()
    assert calls_before_the_end == 2
    assert kinds(events) == ["text", "tool_call", "tool_call", "finished"]
    assert events[0].text == "Checking both."
    streamed = [event.tool_call for event in events[1:3]]
    assert [(c.index, c.name, json.loads(c.arguments_json)) for c in streamed] == [
        (0, "track", {"id": "T"}),
        (1, "lookup", {"order": 7}),
    ]
    finished = events[-1].finished
    assert list(finished.tool_calls) == streamed  # the same calls (ids too), again, in finished
    assert finished.finish_reason == "tool_calls"


async def test_a_held_reply_sends_its_tool_call_only_after_it_has_passed_its_tool_choice() -> None:
    executor = FakeExecutor(CALL_TEXT)
    executor.gate = asyncio.Event()
    calls = calls_with(executor, RunStore())
    body = chat(tools=TWO_TOOLS, tool_choice={"type": "function", "function": {"name": "track"}})
    stream = calls.stream(WHO, ProgramIdentity("p"), calls.prepare(body), reader=calls.reader(body))
    first = asyncio.ensure_future(anext(stream))
    for _ in range(10):  # the whole reply, call included, has been read by now
        await asyncio.sleep(0)
    assert len(executor.hops) == 1 and not first.done()  # held: nothing sent yet
    executor.gate.set()
    events = [call_event(await first)] + [call_event(item) async for item in stream]
    assert kinds([e for e in events if e is not None]) == ["text", "tool_call", "finished"]


@pytest.mark.parametrize(
    "reply",
    [
        ("No tool ", "for you."),  # no call at all
        CALL_TEXT,  # a call, but to another function than the one named
    ],
)
async def test_no_tool_call_of_a_reply_that_breaks_a_named_tool_choice_is_ever_sent(reply) -> None:
    calls = calls_with(FakeExecutor(reply), RunStore())
    body = chat(tools=TWO_TOOLS, tool_choice={"type": "function", "function": {"name": "lookup"}})
    sent = []
    with pytest.raises(ToolChoiceNotFollowed):
        async for item in calls.stream(
            WHO, ProgramIdentity(), calls.prepare(body), reader=calls.reader(body)
        ):
            sent.append(call_event(item))
    assert sent == []


def test_empty_content_is_no_event() -> None:
    assert call_event(Content("")) is None
    assert call_event(Content("x")) == router_pb2.ProgramCallEvent(text="x")


async def test_the_clients_kv_retention_hint_goes_with_the_hop() -> None:
    executor = FakeExecutor()
    calls = calls_with(executor, RunStore())
    await calls.call(WHO, ProgramIdentity("p", kv_retention_s=30.0), calls.prepare(chat()))
    await calls.call(WHO, ProgramIdentity("p", kv_retention_s=0.0), calls.prepare(chat()))
    await calls.call(WHO, ProgramIdentity("p"), calls.prepare(chat()))
    assert [hop.kv_retention_s for hop in executor.hops] == [30.0, 0.0, None]
    sent = [hop_request(hop).context for hop in executor.hops]
    assert [c.kv_retention_s if c.HasField("kv_retention_s") else None for c in sent] == [30.0, 0.0, None]


def test_call_model_takes_a_kv_retention_hint_checked_like_the_headers() -> None:
    given = router_pb2.ProgramCallRequest(model="m", prompt="p", program_id="p", kv_retention_s=12.5)
    assert request_identity(given, None).kv_retention_s == 12.5
    zero = router_pb2.ProgramCallRequest(model="m", prompt="p", program_id="p", kv_retention_s=0)
    assert request_identity(zero, None).kv_retention_s == 0.0  # set: let go at once
    assert request_identity(router_pb2.ProgramCallRequest(model="m", prompt="p"), None).kv_retention_s is None
    for bad in (-1.0, float("inf"), float("nan")):
        request = router_pb2.ProgramCallRequest(model="m", prompt="p", program_id="p", kv_retention_s=bad)
        with pytest.raises(InvalidField) as caught:
            request_identity(request, None)
        assert caught.value.param == "kv_retention_s"


async def test_closing_the_stream_early_cancels_the_call_and_records_it() -> None:
    store = RunStore()
    executor = FakeExecutor()
    executor.gate = asyncio.Event()  # never set: the call hangs after its text
    calls = calls_with(executor, store)
    stream = calls.stream(WHO, ProgramIdentity("p"), calls.prepare(chat()))
    assert await anext(stream) == Content("Hel")
    await stream.aclose()
    for _ in range(5):
        await asyncio.sleep(0)
    assert store.find("p", tenant="acme").finished.hops[0].status == "cancelled"


def test_call_model_is_held_to_the_routers_output_token_limit() -> None:
    calls = ProgramCalls(
        PoolDirectory(model_to_pool={"m": "pool"}),
        FakeExecutor(),
        access=AccessControl(None),
        quotas=TenantQuotas(),
        default_timeout_s=30,
        book=ProgramBook(RunStore()),
        request_limits=RequestLimits(max_output_tokens=8),
    )
    with pytest.raises(InvalidField) as caught:
        calls.prepare(request_body(router_pb2.ProgramCallRequest(model="m", prompt="p", max_tokens=9)))
    assert caught.value.param == "max_tokens" and "--max-output-tokens" in caught.value.message


def test_unknown_models_and_empty_prompts_are_refused_before_any_hop() -> None:
    calls = calls_with(FakeExecutor(), RunStore())
    with pytest.raises(ModelNotFound):
        calls.prepare(chat(model="gpt-9"))
    empty = schema.validate_body(schema.CompletionRequest, {"model": "m", "prompt": ""})
    with pytest.raises(InvalidField):
        calls.prepare(empty)


# ----- CallModel's request --------------------------------------------------------------------


def test_a_call_model_request_is_the_openai_body_it_stands_for() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    request = router_pb2.ProgramCallRequest(
        model="m",
        messages=[
            router_pb2.ProgramMessage(role="user", content="hi"),
            router_pb2.ProgramMessage(role="assistant", tool_calls_json=json.dumps([call])),
            router_pb2.ProgramMessage(role="tool", content="{}", tool_call_id="c1"),
        ],
        tools_json='[{"type": "function", "function": {"name": "f"}}]',
        tool_choice_json="auto",
        max_tokens=7,
        temperature=0.2,
    )
    body = request_body(request)
    assert isinstance(body, schema.ChatCompletionRequest)
    assert body.output_tokens() == 7 and body.temperature == 0.2 and body.tool_choice == "auto"
    assert body.messages[1].tool_calls == [call]
    assert body.messages[2].tool_call_id == "c1" and body.tools is not None
    text = request_body(router_pb2.ProgramCallRequest(model="m", prompt="Once"))
    assert isinstance(text, schema.CompletionRequest) and text.temperature is None


@pytest.mark.parametrize(
    ("request_", "param"),
    [
        (router_pb2.ProgramCallRequest(model="m", prompt="p", messages=[{"role": "user"}]), "prompt"),
        (router_pb2.ProgramCallRequest(model="m", prompt="p", tools_json="[]"), "tools_json"),
        (router_pb2.ProgramCallRequest(model="m", messages=[{"role": "robot"}]), "messages[0].role"),
        (router_pb2.ProgramCallRequest(model="m", messages=[{"role": "user"}], tools_json="{"), "tools_json"),
        (
            router_pb2.ProgramCallRequest(
                model="m", messages=[{"role": "user"}], tools_json="[" * 100_000 + "]" * 100_000
            ),
            "tools_json",
        ),
        (
            router_pb2.ProgramCallRequest(
                model="m", messages=[{"role": "assistant", "tool_calls_json": "{}"}]
            ),
            "messages[0].tool_calls_json",
        ),
        (router_pb2.ProgramCallRequest(prompt="p"), "model"),
    ],
)
def test_a_bad_call_model_request_names_its_field(
    request_: router_pb2.ProgramCallRequest, param: str
) -> None:
    with pytest.raises(InvalidField) as caught:
        request_body(request_)
    assert caught.value.param == param


def test_call_model_takes_the_grpc_deadline_when_it_gives_none() -> None:
    request = router_pb2.ProgramCallRequest(
        model="m", prompt="p", program_id="p", tier=common_pb2.TIER_REALTIME
    )
    assert request_identity(request, 2.5).deadline_ms == 2500
    assert request_identity(request, None).deadline_ms is None
    request.deadline_ms = 900
    identity = request_identity(request, 2.5)
    assert identity.deadline_ms == 900 and identity.tier == Tier.REALTIME and identity.program_id == "p"


def test_the_cli_registers_inferx_call() -> None:
    from inferx.cli import call
    from inferx.cli.main import build_parser

    args = build_parser().parse_args(["call", "m", "hi", "--program", "p", "--end", "--tier", "realtime"])
    assert args.handler is call.cmd_call and (args.model, args.prompt) == ("m", "hi")
    assert args.program == "p" and args.end and args.tier == "realtime" and args.max_tokens == 0


def test_inferx_call_offers_tools_from_a_file_and_refuses_a_bad_one(tmp_path) -> None:
    from inferx.cli import call
    from inferx.errors import InferxError

    good = tmp_path / "tools.json"
    good.write_text(json.dumps(TOOLS))
    assert call.read_tools(str(good)) == TOOLS
    assert call.tool_choice("required") == "required" and call.tool_choice(None) is None
    assert call.tool_choice("track") == {"type": "function", "function": {"name": "track"}}
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "object.json").write_text('{"type": "function"}')
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    for name, problem in [
        ("missing.json", "no such file"),
        ("bad.json", "not JSON"),
        ("deep.json", "nested too deeply"),
        ("object.json", "array"),
    ]:
        with pytest.raises(InferxError, match=problem):
            call.read_tools(str(tmp_path / name))


async def test_inferx_call_prints_each_tool_call_as_it_arrives(
    tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from inferx.cli import call, connect
    from inferx.cli.main import build_parser
    from inferx.errors import InferxError

    sent: dict = {}
    tool = router_pb2.ProgramToolCall(id="call_1", name="track", arguments_json='{"id": "T"}', index=0)
    events = [
        router_pb2.ProgramCallEvent(text="Checking."),
        router_pb2.ProgramCallEvent(tool_call=tool),
        router_pb2.ProgramCallEvent(finished=router_pb2.ProgramCallFinished(finish_reason="tool_calls")),
    ]

    class Client:
        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc) -> None:
            return None

        async def call_model(self, model, prompt, **kw):
            sent.update(kw, prompt=prompt)
            for event in events:
                yield event

    monkeypatch.setattr(connect, "client", lambda args: Client())
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS))
    args = build_parser().parse_args(
        ["call", "m", "Track T", "--tools", str(tools), "--tool-choice", "track"]
    )
    assert await call.cmd_call(args) == 0
    assert capsys.readouterr().out == 'Checking.\n[tool call 0] track {"id": "T"} (call_1)\n\n'
    assert sent["prompt"] == "" and sent["messages"] == [{"role": "user", "content": "Track T"}]
    assert sent["tools"] == TOOLS and sent["tool_choice"] == {
        "type": "function",
        "function": {"name": "track"},
    }
    with pytest.raises(InferxError, match="--tool-choice: only with --tools"):
        await call.cmd_call(build_parser().parse_args(["call", "m", "hi", "--tool-choice", "required"]))


def test_a_chat_calls_tool_choice_travels_in_its_chat_for_the_worker() -> None:
    calls = calls_with(FakeExecutor(), RunStore())
    chat_with = json.loads(calls.prepare(chat(tools=TOOLS, tool_choice="required")).chat_json)
    assert chat_with["tools"] == TOOLS and chat_with["tool_choice"] == "required"
    assert "tool_choice" not in json.loads(calls.prepare(chat(tools=TOOLS)).chat_json)


SYSTEM = "You are a support agent for the order desk. Answer in one short paragraph and cite the order id."
LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}


async def test_a_chat_names_its_tool_specs_and_system_messages_as_the_shared_prefix() -> None:
    """Two programs with the same instructions name one prefix, whatever their
    conversations; other instructions another; none without any (or on a bare prompt)."""
    executor = FakeExecutor()
    calls = calls_with(executor, RunStore())

    def agent(system: str, user: str, **fields) -> schema.ChatCompletionRequest:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        return chat(messages=messages, tools=[LOOKUP], **fields)

    for program, body in [
        ("p1", agent(SYSTEM, "Where is order 17?")),
        ("p2", agent(SYSTEM, "Cancel order 99, please.")),
        ("p3", agent(SYSTEM.upper(), "Where is order 17?")),
        ("p4", chat()),  # no instructions: nothing shared
    ]:
        await calls.call(WHO, ProgramIdentity(program), calls.prepare(body))
    completion = schema.validate_body(schema.CompletionRequest, {"model": "m", "prompt": SYSTEM * 3})
    await calls.call(WHO, ProgramIdentity("p5"), calls.prepare(completion))
    first, same, other, bare, raw = ((hop.prefix_id, hop.prefix_tokens) for hop in executor.hops)
    head = render_chat([schema.ChatMessage(role="system", content=SYSTEM)], [LOOKUP]).removesuffix(
        "<|assistant|>\n"
    )
    assert first == same == (first[0], estimate_tokens(head)) and first[0]
    assert executor.hops[0].prompt.startswith(head) and executor.hops[1].prompt.startswith(head)
    assert other[0] and other[0] != first[0]
    assert bare == raw == ("", 0)
    sent = hop_request(executor.hops[0]).context
    assert (sent.prefix_id, sent.prefix_tokens) == first
