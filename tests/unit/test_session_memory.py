"""Session memory stays bounded (inferx_router.tools): a chain whose output holds its own
recall used to remember ever larger turns, each holding the ones before, until a run's
events passed what gRPC clients take (found by tests/integration/test_bad_input.py: a
74 MB ChainFinished)."""

from __future__ import annotations

import json

from inferx_router.tools import (
    MAX_RECALL_BYTES,
    MAX_TURN_OUTPUT_BYTES,
    ToolCall,
    ToolRouter,
    bounded_turn,
)


class FakeCache:
    def __init__(self) -> None:
        self.lists: dict[str, list[bytes]] = {}

    async def append(self, key: str, value: bytes, ttl_s: float) -> None:
        self.lists.setdefault(key, []).append(value)

    async def get_list(self, key: str) -> list[bytes]:
        return list(self.lists.get(key, []))


def tools() -> tuple[ToolRouter, FakeCache]:
    router = ToolRouter.__new__(ToolRouter)  # only the memory methods: no etcd, no services
    cache = FakeCache()
    router.cache = cache  # type: ignore[assignment]
    return router, cache


def recall(limit: int) -> ToolCall:
    return ToolCall("session_memory", {"limit": limit}, run_id="r", session_id="s1", timeout_s=1)


def test_a_small_turn_is_kept_as_it_is() -> None:
    turn = {"inputs": {"q": "hi"}, "output": "hello"}
    assert json.loads(bounded_turn(turn)) == turn


def test_a_large_output_is_cut_with_a_note() -> None:
    for text in ("é" * MAX_TURN_OUTPUT_BYTES, '"\\' * MAX_TURN_OUTPUT_BYTES):  # escapes take more room
        stored = bounded_turn({"inputs": {"q": "hi"}, "output": text})
        assert len(stored) < MAX_TURN_OUTPUT_BYTES + 100
        kept = json.loads(stored)["output"]
        assert kept.endswith(" bytes of this turn's output left out]") and text.startswith(
            kept.split("[...")[0]
        )


async def test_a_chain_that_outputs_its_own_recall_does_not_snowball() -> None:
    router, cache = tools()
    for i in range(18):  # each run's output is its recall of the last 5 turns, then remembered
        output = json.dumps(await router._session_memory(recall(5)))
        await router.remember("s1", {"inputs": {"i": str(i)}, "output": output + "x" * 40})
    stored = cache.lists[next(iter(cache.lists))]
    assert max(map(len, stored)) < MAX_TURN_OUTPUT_BYTES + 1024
    everything = await router._session_memory(recall(4_294_967_295))
    assert len(json.dumps(everything).encode()) < MAX_RECALL_BYTES + MAX_TURN_OUTPUT_BYTES + 1024
    assert everything[-1]["inputs"] == {"i": "17"}  # the newest kept first


async def test_a_recall_keeps_the_newest_turns_within_its_budget() -> None:
    router, cache = tools()
    for i in range(40):
        await router.remember("s1", {"inputs": {"i": str(i)}, "output": "y" * MAX_TURN_OUTPUT_BYTES})
    turns = await router._session_memory(recall(0))  # 0: every turn
    assert 1 <= len(turns) < 40
    assert [t["inputs"]["i"] for t in turns] == [str(i) for i in range(40 - len(turns), 40)]
