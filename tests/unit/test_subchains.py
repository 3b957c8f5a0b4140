"""Sub-agent chains (`type: chain` nodes): validation on their own and against stored
chains (missing child, cycles), for_each lists, and ChainRun running children with the
parent's deadline, tier, budget and scheduling key (a fake executor)."""

from __future__ import annotations

import asyncio
import json
import random
from typing import cast

import pytest
import yaml

from inferx.chain.schema import ChainConfig, ChainConfigError
from inferx.chain.subchains import MAX_ITEMS, child_inputs, fan_out_items, reference_problems
from inferx.chain.validate import load_chain_text
from inferx.errors import InvalidArgument, NotFound
from inferx_router.chain_store import StoredVersion
from inferx_router.records import RECENT
from inferx_router.runner import ChainRun
from inferx_router.tools import ToolRouter
from tests.unit.test_chain_walker import FakeExecutor, FakeTools


def config_text(name: str, *nodes: dict, inputs: list[str] | None = None, slo: str = "60s") -> str:
    chain: dict = {"name": name, "slo": {"end_to_end_latency_p99": slo}, "nodes": list(nodes)}
    if inputs:
        chain["inputs"] = inputs
    return yaml.safe_dump({"agent_chain": chain})


def load(name: str, *nodes: dict, **kw) -> ChainConfig:
    return load_chain_text(config_text(name, *nodes, **kw)).config


def model(node_id: str, prompt: str = "", **keys) -> dict:
    return {
        "id": node_id,
        "type": "model_inference",
        "model": "m",
        **({"prompt": prompt} if prompt else {}),
        **keys,
    }


def sub(node_id: str, child: str, **keys) -> dict:
    return {"id": node_id, "type": "chain", "chain": child, **keys}


# ----- validation on its own ------------------------------------------------------------------


def problems_of(*nodes: dict, inputs: list[str] | None = None) -> str:
    with pytest.raises(ChainConfigError) as caught:
        load_chain_text(config_text("p", *nodes, inputs=inputs))
    return str(caught.value)


def test_a_chain_node_needs_a_chain_and_one_of_version_or_label() -> None:
    assert "node 'k': chain: a chain node needs a 'chain'" in problems_of({"id": "k", "type": "chain"})
    text = problems_of(sub("k", "child", version=2, label="prod"))
    assert "node 'k': version, label: give one of them, not both" in text
    assert "node 'k': version" in problems_of(sub("k", "child", version=0))
    assert "node 'k': chain" in problems_of(sub("k", "bad name!"))


def test_bad_for_each_is_named() -> None:
    assert "node 'k': for_each: must not be empty" in problems_of(sub("k", "c", for_each="  "))
    assert "node 'k': for_each: a literal for_each list holds strings only" in problems_of(
        sub("k", "c", for_each=[1, 2])
    )
    assert "node 'k': for_each: bad template expression" in problems_of(sub("k", "c", for_each="{{ item }}"))
    assert "references unknown node 'plan'" in problems_of(sub("k", "c", for_each="{{ nodes.plan.output }}"))
    assert "node 'k': max_concurrency: only used with for_each" in problems_of(
        sub("k", "c", max_concurrency=2)
    )
    assert "node 'k': item_input: only used with for_each" in problems_of(sub("k", "c", item_input="x"))
    assert "node 'k': max_concurrency" in problems_of(sub("k", "c", for_each="[]", max_concurrency=0))
    clash = problems_of(sub("k", "c", for_each="[]", inputs={"item": "x"}))
    assert "node 'k': inputs.item: set by for_each" in clash
    assert "node 'k': item_input" in problems_of(sub("k", "c", for_each="[]", item_input="not valid"))


def test_child_input_templates_are_checked_like_prompts() -> None:
    text = problems_of(sub("k", "c", inputs={"topic": "{{ inputs.qq }}"}), inputs=["q"])
    assert "node 'k': inputs.topic: unknown input 'qq'" in text
    text = problems_of(model("a"), sub("k", "c", inputs={"t": "{{ nodes.a.output }}"}))
    assert "node 'k': inputs.t: references node 'a', which is not upstream" in text


def test_a_valid_chain_node_round_trips() -> None:
    config = load(
        "p",
        model("plan", "list for {{ inputs.q }}"),
        sub(
            "each",
            "child",
            label="prod",
            depends_on=["plan"],
            for_each="{{ nodes.plan.output }}",
            inputs={"ctx": "{{ inputs.q }}"},
            item_input="topic",
            max_concurrency=2,
        ),
        sub("lit", "child", version=3, for_each=["a", "b"]),
        inputs=["q"],
    )
    again = ChainConfig.model_validate(config.to_document()["agent_chain"])
    assert again == config
    assert again.node("lit").for_each == '["a", "b"]'


# ----- against the stored chains --------------------------------------------------------------


def resolver(stored: dict[tuple[str, int | str], ChainConfig]):
    """Fake ChainStore.resolve: (name, version) or (name, label) or (name, 'active')."""

    async def resolve(name: str, version: int, label: str) -> ChainConfig:
        key = (name, version or label or "active")
        if key not in stored:
            raise NotFound(f"no {key}")
        return stored[key]

    return resolve


async def test_a_missing_child_chain_version_or_label_names_the_node() -> None:
    child = load("child", model("a"))
    resolve = resolver({("child", "active"): child, ("child", 1): child})
    parent = load(
        "p",
        sub("k", "nope"),
        sub("v", "child", version=9),
        sub("l", "child", label="prod"),
        sub("ok", "child"),
        sub("ok1", "child", version=1),
    )
    problems = await reference_problems(parent, resolve)
    assert problems == [
        "node 'k': chain: 'nope' cannot be run: no ('nope', 'active')",
        "node 'v': chain: 'child' v9 cannot be run: no ('child', 9)",
        "node 'l': chain: 'child' label 'prod' cannot be run: no ('child', 'prod')",
    ]


async def test_cycles_between_chains_are_refused() -> None:
    # a -> b -> c -> a (a is the chain being put), and a chain naming itself
    b = load("b", sub("to_c", "c"))
    c = load("c", sub("to_a", "a", label="prod"))
    resolve = resolver({("b", "active"): b, ("c", "active"): c, ("a", "prod"): load("a", model("x"))})
    problems = await reference_problems(load("a", sub("to_b", "b")), resolve)
    assert problems == ["node 'to_b': chain: cycle a -> b -> c -> a"]
    assert await reference_problems(load("a", sub("me", "a")), resolve) == ["node 'me': chain: cycle a -> a"]
    # b -> c -> a is no cycle when putting d
    assert await reference_problems(load("d", sub("to_b", "b")), resolve) == []


def test_fan_out_items() -> None:
    assert fan_out_items('["a", "b c", 3, {"k": 1}]') == ["a", "b c", "3", '{"k": 1}']
    assert fan_out_items(" one\n\n two \n") == ["one", "two"]
    assert fan_out_items("[not json") == ["[not json"]
    assert fan_out_items("") == []
    with pytest.raises(InvalidArgument, match="gave a JSON dict, not a list"):
        fan_out_items('{"a": 1}')
    with pytest.raises(InvalidArgument, match=f"more than {MAX_ITEMS}"):
        fan_out_items(json.dumps([str(i) for i in range(MAX_ITEMS + 1)]))


def test_child_inputs_are_checked() -> None:
    child = load("child", model("a", "{{ inputs.topic }}"), inputs=["topic"])
    assert child_inputs(child, {"topic": "x"}) == {"topic": "x"}
    with pytest.raises(InvalidArgument, match="input 'item': chain 'child' takes topic"):
        child_inputs(child, {"topic": "x", "item": "y"})
    with pytest.raises(InvalidArgument, match="input 'topic': required by chain 'child'"):
        child_inputs(child, {})


# ----- ChainRun with children --------------------------------------------------------------------


def stored(config: ChainConfig, version: int = 1) -> StoredVersion:
    from inferx.chain.plan import ChainPlan

    return StoredVersion("default", config.name, version, config, "t", "", 0, ChainPlan.build(config))


def store_of(*configs: ChainConfig):
    versions = {config.name: stored(config) for config in configs}

    async def resolve(tenant: str, name: str, version: int, label: str) -> StoredVersion:
        if name not in versions:
            raise NotFound(f"unknown chain '{name}'")
        return versions[name]

    return resolve


def parent_run(parent: ChainConfig, executor: FakeExecutor, resolve, **kw) -> ChainRun:
    return ChainRun(
        stored(parent),
        {"q": "hi"},
        session_id="",
        tier=1,
        executor=executor,
        tools=cast(ToolRouter, FakeTools()),
        rng=random.Random(0),
        resolve_chain=resolve,
        **kw,
    )


async def test_children_share_the_parents_deadline_tier_and_scheduling_key() -> None:
    child = load(
        "child", model("a", "about {{ inputs.topic }} ({{ inputs.item }})"), inputs=["topic", "item"]
    )
    single = load("single", model("b", "{{ inputs.topic }}"), inputs=["topic"])
    parent = load(
        "p",
        model("plan", "{{ inputs.q }}"),
        sub(
            "each",
            "child",
            depends_on=["plan"],
            for_each='["x", "y", "z"]',
            max_concurrency=2,
            inputs={"topic": "{{ nodes.plan.output }}"},
        ),
        sub("one", "single", inputs={"topic": "{{ inputs.q }}"}),
        model("sum", "{{ nodes.each.output }} {{ nodes.one.output }}", depends_on=["each", "one"]),
        inputs=["q"],
        slo="20s",
    )
    executor = FakeExecutor()
    executor.script["each[0]/a"] = [0.05]
    executor.script["each[1]/a"] = [0.05]
    run = parent_run(parent, executor, store_of(child, single))
    finished = await asyncio.wait_for(run.run(), 10)
    assert finished.status == "ok", finished.error
    each = next(hop for hop in finished.hops if hop.node_id == "each")
    assert json.loads(each.output) == ["each[0]/a@m", "each[1]/a@m", "each[2]/a@m"]
    assert len(each.child_run_ids) == 3
    hops = {hop.hop_id: hop for hop in executor.hops}
    assert set(hops) == {"plan", "each[0]/a", "each[1]/a", "each[2]/a", "one/b", "sum"}
    assert hops["each[1]/a"].prompt == "about plan@m (y)"
    # one scheduling key, one deadline, the parent's tier, for every hop of the tree
    assert {hop.run_id for hop in executor.hops} == {run.run_id}
    assert {hop.deadline_unix_ms for hop in executor.hops} == {run._deadline_unix_ms}
    assert {int(hop.tier) for hop in executor.hops} == {1}
    # hop_index counts the model hops of the whole tree finished before each
    assert (hops["plan"].hop_index, hops["sum"].hop_index) == (0, 5)
    assert {hop.remaining_hops for hop in executor.hops} == {None}
    # at most 2 children at once: the third starts after one of the first two is done
    log = executor.log
    assert log.index(("enter", "each[2]/a")) > min(
        log.index(("exit", "each[0]/a")), log.index(("exit", "each[1]/a"))
    )
    # the children's records name their parent; their SLO is what was left of the parent's
    record = RECENT.find(each.child_run_ids[0])
    assert (record.parent_run_id, record.parent_node_id, record.chain) == (run.run_id, "each", "child")
    assert 0 < record.finished.slo_ms <= 20_000
    assert "sum@m" in finished.output


async def test_a_child_past_the_parents_deadline_is_cut_there() -> None:
    child = load("slow", model("a", timeout="30s"), slo="60s")
    parent = load("p", sub("k", "slow", timeout="30s"), slo="300ms")
    executor = FakeExecutor()
    executor.script["k/a"] = [2.0]
    finished = await asyncio.wait_for(parent_run(parent, executor, store_of(child)).run(), 5)
    assert finished.status == "deadline_exceeded"
    assert finished.latency_ms < 1500
    assert executor.timeouts[0] <= 0.31  # the child's hop was given the parent's deadline


async def test_missing_child_and_failing_child_fail_the_node_clearly() -> None:
    failing = load("failing", model("a"))
    parent = load("p", sub("gone", "nope"), sub("bad", "failing"))
    executor = FakeExecutor()
    executor.script["bad/a"] = [InvalidArgument("no such model")]
    finished = await asyncio.wait_for(parent_run(parent, executor, store_of(failing)).run(), 5)
    errors = {hop.node_id: hop.error for hop in finished.hops}
    assert errors["gone"] == "chain 'nope': unknown chain 'nope'"
    assert errors["bad"].startswith("child run ") and "of 'failing': error: a: no such model" in errors["bad"]


async def test_a_cycle_made_after_put_is_stopped_at_run_time() -> None:
    loop_a = load("a", sub("to_b", "b"))
    loop_b = load("b", sub("to_a", "a"))
    finished = await asyncio.wait_for(parent_run(loop_a, FakeExecutor(), store_of(loop_a, loop_b)).run(), 5)
    assert finished.status == "error"
    assert "cycle a -> b -> a" in finished.error


async def test_bad_for_each_output_fails_the_node() -> None:
    child = load("child", model("a", "{{ inputs.item }}"), inputs=["item"])
    parent = load(
        "p", model("plan"), sub("k", "child", depends_on=["plan"], for_each="{{ nodes.plan.output }}")
    )
    executor = FakeExecutor()
    from inferx_router.hops import HopDone

    executor.script["plan"] = [HopDone(text='{"not": "a list"}', worker_id="w")]
    finished = await asyncio.wait_for(parent_run(parent, executor, store_of(child)).run(), 5)
    assert "k: for_each: gave a JSON dict, not a list" in finished.error
