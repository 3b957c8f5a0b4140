"""ChainRun (the router's chain walker) driven by a fake model executor and tool router."""

from __future__ import annotations

import asyncio
import random
import time
from collections import defaultdict
from typing import cast

import pytest
import yaml

from inferx.chain.plan import TIMEOUTS, LearnedLatency
from inferx.chain.validate import load_chain_text
from inferx.errors import InvalidArgument, Unavailable
from inferx.scheduling.views import Tier
from inferx.tokens import estimate_tokens
from inferx_router import runner
from inferx_router.chain_store import StoredVersion
from inferx_router.hops import HopDone, ModelHop, NextHop
from inferx_router.runner import ChainRun
from inferx_router.servicer import _gather_following
from inferx_router.tools import ResolvedTool, ToolCall, ToolResult, ToolRouter


class FakeExecutor:
    """Records every hop; per hop id, `script` gives the outcome of each attempt in turn
    (HopDone, an exception to raise, a float to sleep first, or (seconds, outcome));
    the default answer is "<id>@<model>"."""

    def __init__(self) -> None:
        self.hops: list[ModelHop] = []
        self.timeouts: list[float] = []
        self.script: dict[str, list] = defaultdict(list)
        self.gates: dict[str, asyncio.Event] = {}
        self.entered: dict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self.log: list[tuple[str, str]] = []

    async def run_hop(self, hop, timeout_s, on_dispatched) -> HopDone:
        self.hops.append(hop)
        self.timeouts.append(timeout_s)
        self.log.append(("enter", hop.hop_id))
        self.entered[hop.hop_id].set()
        on_dispatched("w-1")
        if hop.hop_id in self.gates:
            await self.gates[hop.hop_id].wait()
        outcome = self.script[hop.hop_id].pop(0) if self.script[hop.hop_id] else None
        if isinstance(outcome, tuple):  # (seconds, outcome): slow, then the outcome
            await asyncio.sleep(outcome[0])
            outcome = outcome[1]
        if isinstance(outcome, float):
            await asyncio.sleep(outcome)
        if isinstance(outcome, BaseException):
            raise outcome
        self.log.append(("exit", hop.hop_id))
        if isinstance(outcome, HopDone):
            return outcome
        return HopDone(text=f"{hop.hop_id}@{hop.model}", worker_id="w-1")


class FakeTools:
    """The ToolRouter methods ChainRun uses; `results[tool]` is a value or an exception."""

    def __init__(self, results: dict | None = None) -> None:
        self.results = results or {}
        self.calls: list[ToolCall] = []
        self.remembered: list[tuple[str, dict]] = []

    def resolve(self, tool: str) -> ResolvedTool:
        return ResolvedTool(tool, "1", f"tool:{tool}", True, self._never_invoked)

    async def _never_invoked(self, call: ToolCall) -> None:
        raise AssertionError("ChainRun calls tools through call(), not ResolvedTool.invoke")

    async def call(self, call, *, cacheable, cache_ttl_s) -> ToolResult:
        self.calls.append(call)
        value = self.results.get(call.tool, "tool-out")
        if isinstance(value, BaseException):
            raise value
        return ToolResult(value)

    async def stale_result(self, tool, arguments, *, tenant="default"):
        return False, None

    async def remember(self, session_id, turn, *, tenant="default") -> None:
        self.remembered.append((session_id, turn))


class FakeLoad:
    def __init__(self, hot: set[str]) -> None:
        self.hot = hot

    def overloaded(self, model: str) -> bool:
        return model in self.hot


def m(node_id: str, model: str, **keys) -> dict:
    return {"id": node_id, "type": "model_inference", "model": model, **keys}


def tool(node_id: str, name: str, **keys) -> dict:
    return {"id": node_id, "type": "tool_call", "tool": name, **keys}


def chain(*nodes: dict, slo: str = "60s", tier: str = "standard", budget: int = 3) -> StoredVersion:
    """A stored version (v7) of a chain config written as YAML and loaded as the router does."""
    document = {"name": "c", "tier": tier, "retry_budget": budget, "slo": {"end_to_end_latency_p99": slo}}
    validated = load_chain_text(yaml.safe_dump({"agent_chain": {**document, "nodes": list(nodes)}}))
    return StoredVersion("default", "c", 7, validated.config, "tester", "", 0, validated.plan)


def make_run(stored, executor, tools=None, **kwargs) -> ChainRun:
    kwargs.setdefault("session_id", "")
    kwargs.setdefault("tier", 0)
    return ChainRun(
        stored,
        {"q": "hi"},
        executor=executor,
        tools=cast(ToolRouter, tools or FakeTools()),
        rng=random.Random(0),
        **kwargs,
    )


async def finish(run: ChainRun):
    return await asyncio.wait_for(run.run(), timeout=10)


def hop_of(finished, node_id: str):
    return next(hop for hop in finished.hops if hop.node_id == node_id)


def drain(run: ChainRun) -> list:
    events = []
    while not run.events.empty():
        events.append(run.events.get_nowait())
    return events


LINEAR = (
    m("a", "m1", timeout="1s", max_tokens=10, temperature=0.5, stop=["\nObservation:"]),
    tool("t", "search", depends_on=["a"], timeout="2s", arguments={"query": "{{ nodes.a.output }}"}),
    m(
        "b",
        "m2",
        depends_on=["t"],
        timeout="3s",
        priority="high",
        max_tokens=20,
        max_context_tokens=500,
        context_overflow="truncate",
        prompt="Q={{ inputs.q }} T={{ nodes.t.output }}",
    ),
    m("c", "m3", depends_on=["b"], timeout="4s"),
)
PARALLEL = (m("x", "mx", timeout="1s"), m("y", "my", timeout="1s"), m("z", "mz", depends_on=["x", "y"]))


async def test_independent_nodes_run_concurrently_and_join_waits_for_both() -> None:
    """x and y are both in flight before either finishes; z starts after both, with their outputs."""
    executor = FakeExecutor()
    executor.gates = {"x": executor.entered["y"], "y": executor.entered["x"]}  # each waits for the other
    finished = await finish(make_run(chain(*PARALLEL), executor))
    assert finished.status == "ok"
    assert set(executor.log[:2]) == {("enter", "x"), ("enter", "y")}
    assert set(executor.log[2:4]) == {("exit", "x"), ("exit", "y")}
    assert executor.log[4:] == [("enter", "z"), ("exit", "z")]
    assert executor.hops[2].prompt == "q: hi\n[x] x@mx\n[y] y@my\nTask (z):"


async def test_model_hop_fields() -> None:
    """hop_index/remaining_hops count model hops, next_hops pass through tools, tier, deadline, path."""
    stored = chain(*LINEAR, tier="batch")
    executor, tools = FakeExecutor(), FakeTools({"search": "found"})
    before = time.time()
    run = make_run(stored, executor, tools, session_id="s1")
    after = time.time()
    assert (await finish(run)).status == "ok"
    a, b, c = executor.hops
    assert [h.hop_id for h in executor.hops] == ["a", "b", "c"]
    assert [h.hop_index for h in executor.hops] == [0, 1, 2]
    assert [h.remaining_hops for h in executor.hops] == [2, 1, 0]
    assert [h.remaining_critical_path_ms for h in executor.hops] == [10_000.0, 7_000.0, 4_000.0]
    assert a.remaining_critical_path_ms == stored.plan.remaining_path_ms("a", TIMEOUTS)
    assert a.next_hops == (NextHop("b", "m2", estimate_tokens(a.prompt) + 10, 20),)
    assert b.next_hops == (NextHop("c", "m3", estimate_tokens(b.prompt) + 20, 64),)
    assert c.next_hops == ()
    assert [h.tier for h in executor.hops] == [Tier.BATCH] * 3
    assert [h.priority for h in executor.hops] == [2, 0, 2]
    assert (a.prompt, b.prompt) == ("q: hi\nTask (a):", "Q=hi T=found")
    assert (a.max_tokens, a.temperature, a.max_context_tokens, a.truncate_context) == (10, 0.5, 0, False)
    assert (b.max_tokens, b.max_context_tokens, b.truncate_context) == (20, 500, True)
    assert (a.stop, b.stop) == (("\nObservation:",), ())
    identity = {(h.run_id, h.session_id, h.chain_name, h.chain_version) for h in executor.hops}
    assert identity == {(run.run_id, "s1", "c", 7)}
    assert {h.deadline_unix_ms for h in executor.hops} == {a.deadline_unix_ms}
    assert int(before * 1000 + 60_000) <= a.deadline_unix_ms <= int(after * 1000 + 60_000)
    assert 0.9 < executor.timeouts[0] <= 1.0
    assert 2.9 < executor.timeouts[1] <= 3.0
    (call,) = tools.calls
    assert (call.tool, call.arguments) == ("search", {"query": "a@m1"})
    assert call.idempotency_key == f"{run.run_id}:t"


async def test_explicit_tier_overrides_the_config() -> None:
    """A run's tier argument wins over the config's tier."""
    executor = FakeExecutor()
    await finish(make_run(chain(*LINEAR, tier="batch"), executor, tier=int(Tier.REALTIME)))
    assert [h.tier for h in executor.hops] == [Tier.REALTIME] * 3


async def test_hop_result_fills_node_finished() -> None:
    """Text, usage, queue time and worker of the HopDone land in NodeFinished."""
    executor = FakeExecutor()
    executor.script["x"] = [
        HopDone("hello", "w-7", queue_ms=12.5, prompt_tokens=11, completion_tokens=3, cached_prompt_tokens=4)
    ]
    x = hop_of(await finish(make_run(chain(*PARALLEL), executor)), "x")
    assert (x.status, x.output, x.worker_id, x.queue_ms, x.model) == ("ok", "hello", "w-7", 12.5, "mx")
    assert (x.usage.prompt_tokens, x.usage.completion_tokens, x.usage.cached_prompt_tokens) == (11, 3, 4)


@pytest.fixture
def backoffs(monkeypatch) -> list[int]:
    """Backoff made instant; the attempts it was asked about are recorded."""
    attempts: list[int] = []

    def no_wait(attempt: int, *, rng=None) -> float:
        attempts.append(attempt)
        return 0.0

    monkeypatch.setattr(runner, "backoff_s", no_wait)
    return attempts


async def test_retries_stop_when_the_run_budget_is_spent(backoffs) -> None:
    """retries: 5 with retry_budget 2: three attempts in all, then the node fails."""
    executor = FakeExecutor()
    executor.script["a"] = [Unavailable("pool down")] * 6
    finished = await finish(make_run(chain(m("a", "m1", retries=5), budget=2), executor))
    assert [h.hop_id for h in executor.hops] == ["a", "a", "a"]
    assert backoffs == [1, 2]
    a = hop_of(finished, "a")
    assert (a.status, a.retries, a.error) == ("error", 2, "pool down")
    assert (finished.status, finished.retries_used) == ("error", 2)


async def test_retry_succeeds_within_budget_and_budget_is_shared(backoffs) -> None:
    """Two failing nodes share one budget of 3; a node succeeding on retry is ok."""
    executor = FakeExecutor()
    executor.script["x"] = [Unavailable("x down")] * 3
    executor.script["y"] = [TimeoutError(), HopDone("y fine", "w-2")]
    stored = chain(m("x", "mx", retries=2), m("y", "my", retries=2), budget=3)
    finished = await finish(make_run(stored, executor))
    x, y = hop_of(finished, "x"), hop_of(finished, "y")
    assert (y.status, y.output, y.retries) == ("ok", "y fine", 1)
    assert (x.status, x.retries) == ("error", 2)
    assert (len(executor.hops), finished.retries_used) == (5, 3)


async def test_invalid_argument_is_not_retried(backoffs) -> None:
    """InvalidArgument fails the node at once, spending no retry."""
    executor = FakeExecutor()
    executor.script["a"] = [InvalidArgument("prompt too long")]
    finished = await finish(make_run(chain(m("a", "m1", retries=3)), executor))
    assert (len(executor.hops), backoffs) == (1, [])
    assert (hop_of(finished, "a").error, finished.retries_used) == ("prompt too long", 0)
    assert finished.status == "error"


async def test_a_retry_is_told_only_the_node_time_left(backoffs) -> None:
    """After a 0.5 s failed attempt of a 1 s node, the retry's timeout_s is at most 0.5 s."""
    executor = FakeExecutor()
    executor.script["a"] = [(0.5, Unavailable("slow failure"))]
    finished = await finish(make_run(chain(m("a", "m1", timeout="1s", retries=1)), executor))
    assert finished.status == "ok"
    assert executor.timeouts[0] == pytest.approx(1.0, abs=0.05)
    assert executor.timeouts[1] <= 0.5


async def test_fallback_model_after_failure() -> None:
    """A failed hop is retried on fallback_model and recorded as that degradation."""
    executor = FakeExecutor()
    executor.script["a"] = [TimeoutError()]
    finished = await finish(make_run(chain(m("a", "big", fallback_model="small")), executor))
    assert [h.model for h in executor.hops] == ["big", "small"]
    a = hop_of(finished, "a")
    assert (a.status, a.model, a.output) == ("ok", "small", "a@small")
    assert (a.degradation, a.degradation_reason, finished.status) == ("fallback_model", "timeout", "ok")


async def test_overload_uses_fallback_at_once_and_skips_non_critical() -> None:
    """Under load: the fallback model is used first, a non-critical node is not run at all."""
    executor = FakeExecutor()
    stored = chain(m("a", "big", fallback_model="small"), m("n", "big", critical=False))
    finished = await finish(make_run(stored, executor, load=FakeLoad({"big"})))
    assert [(h.hop_id, h.model) for h in executor.hops] == [("a", "small")]
    a, n = hop_of(finished, "a"), hop_of(finished, "n")
    assert (a.degradation, a.degradation_reason) == ("fallback_model", "overload")
    assert (n.status, n.degradation, n.degradation_reason) == ("skipped", "skipped", "overload")


async def test_non_critical_failure_is_skipped_and_downstream_runs() -> None:
    """A failed critical: false node is skipped; its dependent runs with an empty output."""
    executor = FakeExecutor()
    executor.script["a"] = [Unavailable("down")]
    stored = chain(m("a", "m1", critical=False), m("b", "m2", depends_on=["a"]))
    finished = await finish(make_run(stored, executor))
    a = hop_of(finished, "a")
    assert (a.status, a.degradation, a.degradation_reason, a.output) == ("skipped", "skipped", "error", "")
    assert executor.hops[1].prompt == "q: hi\n[a] \nTask (b):"
    assert (hop_of(finished, "b").status, finished.status, finished.output) == ("ok", "ok", "b@m2")


async def test_failed_critical_node_blocks_dependents() -> None:
    """Dependents of a failed critical node are skipped as blocked and the chain errors."""
    executor = FakeExecutor()
    executor.script["a"] = [Unavailable("down")]
    stored = chain(m("a", "m1"), m("b", "m2", depends_on=["a"]), tool("c", "search", depends_on=["b"]))
    run = make_run(stored, executor)
    finished = await finish(run)
    assert [h.hop_id for h in executor.hops] == ["a"]
    statuses = [(h.node_id, h.status, h.degradation) for h in finished.hops]
    assert statuses == [("a", "error", ""), ("b", "skipped", ""), ("c", "skipped", "")]
    assert finished.status == "error"
    assert finished.error == "a: down; b: upstream a did not finish; c: upstream b did not finish"
    kinds = [e.WhichOneof("event") for e in drain(run)[:-1]]
    assert kinds == ["node_started", "node_finished", "node_finished", "node_finished", "chain_finished"]


async def test_slow_executor_exceeds_the_chain_deadline() -> None:
    """A hop slower than the chain's SLO budget ends the run as deadline_exceeded."""
    executor = FakeExecutor()
    executor.script["a"] = [5.0]  # the hop sleeps 5 s; the chain has 150 ms
    stored = chain(m("a", "m1", timeout="10s"), m("b", "m2", depends_on=["a"]), slo="150ms")
    started = time.monotonic()
    finished = await finish(make_run(stored, executor))
    assert time.monotonic() - started < 2.0
    assert executor.timeouts[0] <= 0.15
    a = hop_of(finished, "a")
    assert (a.status, a.error) == ("deadline_exceeded", "the chain's end-to-end budget is spent")
    assert hop_of(finished, "b").status == "skipped"
    assert (finished.status, finished.slo_met) == ("deadline_exceeded", False)


async def test_learned_latency_lowers_the_next_runs_critical_path() -> None:
    """Fast finished nodes are learned: run 2's remaining path is the observed sum, not timeouts."""
    latency = LearnedLatency(min_samples=1)
    stored = chain(*LINEAR)
    first, second = FakeExecutor(), FakeExecutor()
    done = await finish(make_run(stored, first, latency=latency))
    await finish(make_run(stored, second, latency=latency))
    assert first.hops[0].remaining_critical_path_ms == 10_000.0
    observed = {hop.node_id: hop.latency_ms for hop in done.hops}
    expected = observed["a"] + (observed["t"] + (observed["b"] + (observed["c"] + 0.0)))
    assert second.hops[0].remaining_critical_path_ms == pytest.approx(expected)
    assert second.hops[0].remaining_critical_path_ms < first.hops[0].remaining_critical_path_ms


async def test_events_stream_in_order_and_end_with_none() -> None:
    """node_started/node_finished per node in order, then chain_finished, then None."""
    run = make_run(chain(m("a", "m1"), tool("b", "kv", depends_on=["a"])), FakeExecutor())
    finished = await finish(run)
    events = drain(run)
    assert events[-1] is None
    steps = [(e.WhichOneof("event"), getattr(e, e.WhichOneof("event")).node_id) for e in events[:-2]]
    assert steps == [
        ("node_started", "a"),
        ("node_finished", "a"),
        ("node_started", "b"),
        ("node_finished", "b"),
    ]
    assert events[-2].WhichOneof("event") == "chain_finished"
    assert events[-2].chain_finished == finished
    assert {e.run_id for e in events[:-1]} == {run.run_id}
    assert [e.at_ms for e in events[:-1]] == sorted(e.at_ms for e in events[:-1])


async def test_final_only_sends_chain_finished_alone() -> None:
    """node_events=False (RunChainRequest.final_only): no node events, even for a skipped
    node; chain_finished still holds every hop, as the full stream's does."""
    executor = FakeExecutor()
    executor.script["a"] = [Unavailable("down")]
    stored = chain(m("a", "m1"), tool("b", "kv", depends_on=["a"]), m("c", "m2"))
    run = make_run(stored, executor, node_events=False)
    finished = await finish(run)
    events = drain(run)
    assert events[-1] is None
    assert [e.WhichOneof("event") for e in events[:-1]] == ["chain_finished"]
    assert events[0].chain_finished == finished
    assert [(h.node_id, h.status) for h in finished.hops] == [("a", "error"), ("b", "skipped"), ("c", "ok")]


async def batched_messages(stored) -> list:
    """The messages RunChain sends for one run with batch_events: its stream loop, with
    the servicer's `_gather_following`, over a real ChainRun's event queue; each hop takes
    5 ms, as a real one takes a round trip."""
    executor = FakeExecutor()
    for node_id in stored.config.node_ids:
        executor.script[node_id] = [0.005]
    run = make_run(stored, executor)
    task = asyncio.create_task(run.run())
    messages = []
    while (event := await run.events.get()) is not None:
        messages.append(event)
        if await _gather_following(run.events, event):
            break
    await task
    return messages


def labels(events) -> list[tuple[str, str]]:
    kinds = [e.WhichOneof("event") for e in events]
    return [(kind, getattr(getattr(e, kind), "node_id", "")) for e, kind in zip(events, kinds, strict=True)]


def flat(messages) -> list[tuple[str, str]]:
    assert all(not e.following for message in messages for e in message.following)  # one level
    return labels([e for message in messages for e in (message, *message.following)])


async def test_batched_events_are_every_event_in_order_in_fewer_messages() -> None:
    """batch_events: a node's finish, its successor's start and the chain's end travel
    together; flattened, the stream is the unbatched one (same events, same order)."""
    stored = chain(m("a", "m1"), m("b", "m2", depends_on=["a"]), m("c", "m3", depends_on=["b"]))
    run = make_run(stored, FakeExecutor())
    await finish(run)
    expected = labels(drain(run)[:-1])
    messages = await batched_messages(stored)
    assert flat(messages) == expected
    # started a | finished a, started b | finished b, started c | finished c, chain_finished
    assert [len(message.following) for message in messages] == [0, 1, 1, 1]
    # A join: both parents' finishes come before the child's start, whatever the grouping.
    order = flat(await batched_messages(chain(*PARALLEL)))
    assert order[-1] == ("chain_finished", "")
    assert order.index(("node_started", "z")) > max(order.index(("node_finished", n)) for n in "xy")


async def test_sink_outputs_are_joined_and_the_turn_remembered() -> None:
    """The output is every sink's text in file order; an ok run with a session is remembered."""
    tools = FakeTools({"kv": {"k": 1}})
    stored = chain(m("s", "ms"), tool("y", "kv", depends_on=["s"]), m("w", "mw", depends_on=["s"]))
    finished = await finish(make_run(stored, FakeExecutor(), tools, session_id="s9"))
    assert finished.output == '{"k": 1}\nw@mw'
    assert tools.remembered == [("s9", {"inputs": {"q": "hi"}, "output": '{"k": 1}\nw@mw'})]


async def test_a_reasoning_models_thinking_stays_out_of_later_prompts() -> None:
    """With its pool's reasoning parser, a node's output is the answer: the next node's
    template sees it alone, and the thinking is kept apart on the node (`reasoning`)."""
    executor = FakeExecutor()
    executor.script["a"] = [HopDone(text="weigh the options</think>Pick B.", worker_id="w-1")]
    nodes = (m("a", "m1"), m("b", "m2", depends_on=["a"], prompt="Do {{ nodes.a.output }}"))
    parsers = {"m1": "deepseek_r1", "m2": ""}
    finished = await finish(make_run(chain(*nodes), executor, reasoning_parser=parsers.__getitem__))
    assert finished.status == "ok"
    assert executor.hops[1].prompt == "Do Pick B."
    a = hop_of(finished, "a")
    assert (a.output, a.reasoning) == ("Pick B.", "weigh the options")
    plain = FakeExecutor()
    plain.script["a"] = [HopDone(text="weigh the options</think>Pick B.", worker_id="w-1")]
    assert (await finish(make_run(chain(*nodes), plain))).status == "ok"
    assert plain.hops[1].prompt == "Do weigh the options</think>Pick B."  # no parser: the text as written


async def test_an_unknown_reasoning_parser_fails_the_node_before_its_hop_runs() -> None:
    from inferx.errors import FailedPrecondition

    def broken(model: str) -> str:
        raise FailedPrecondition("the model mapping at /inferx/v1/models/m1: unknown reasoning parser 'r1'")

    executor = FakeExecutor()
    finished = await finish(make_run(chain(m("a", "m1")), executor, reasoning_parser=broken))
    assert finished.status != "ok" and executor.hops == []
    assert "unknown reasoning parser 'r1'" in hop_of(finished, "a").error


async def test_a_template_names_its_static_head_as_the_shared_prefix() -> None:
    """Every run renders a template's text before its first expression the same: the
    hop names it (equal text, equal id across nodes and chains); a head shorter than a
    KV block, or a node without a template, names none."""
    system = "You are a research assistant. Cite every source you use and keep each answer short. "
    stored = chain(
        m("a", "m1", prompt=system + "{{ inputs.q }}"),
        m("b", "m1", depends_on=["a"], prompt=system + "{{ nodes.a.output }} Improve it."),
        m("c", "m1", depends_on=["b"], prompt="Q={{ inputs.q }}"),
        m("d", "m1", depends_on=["c"]),
    )
    executor = FakeExecutor()
    assert (await finish(make_run(stored, executor))).status == "ok"
    a, b, c, d = executor.hops
    assert a.prefix_id == b.prefix_id != "" and a.prefix_tokens == b.prefix_tokens == estimate_tokens(system)
    assert (c.prefix_id, c.prefix_tokens) == (d.prefix_id, d.prefix_tokens) == ("", 0)
    assert runner.template_prefix(system + "{{ inputs.other }}") == (a.prefix_id, a.prefix_tokens)
