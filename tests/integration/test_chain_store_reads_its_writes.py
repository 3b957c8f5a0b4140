"""A router's chain reads come from its watched mirror of etcd; a write through that
router (put, label, rollback) is seen by the next read through it even when the watch
is slow to deliver (found in CI: `get_chain` right after `rollback_chain` answered the
version before the rollback)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from inferx.devstack import LocalStack
from inferx.etcd import make_client
from inferx_router.chain_store import ChainStore

pytestmark = pytest.mark.integration

WATCH_DELAY_S = 0.3  # each watch event reaches the mirror this late

CHAIN = """
agent_chain:
  name: versioned
  slo: {end_to_end_latency_p99: 20s}
  inputs: [q]
  nodes:
    - {id: think, type: model_inference, model: qwen-7b, max_tokens: TOKENS, prompt: "{{ inputs.q }}"}
"""


class SlowWatch:
    """An aetcd watch whose events arrive `WATCH_DELAY_S` late."""

    def __init__(self, watch: Any) -> None:
        self._watch = watch

    async def __aiter__(self) -> AsyncIterator[Any]:
        async for event in self._watch:
            await asyncio.sleep(WATCH_DELAY_S)
            yield event

    async def cancel(self) -> None:
        await self._watch.cancel()


async def test_each_write_is_seen_by_the_next_read_despite_a_slow_watch(etcd_only: LocalStack) -> None:
    async with make_client(etcd_only.etcd_endpoint) as client:
        watch_prefix = client.watch_prefix

        async def slow_watch_prefix(*args: Any, **kw: Any) -> SlowWatch:
            return SlowWatch(await watch_prefix(*args, **kw))

        client.watch_prefix = slow_watch_prefix
        store = ChainStore(client)
        store.mirror.start()
        assert await store.mirror.wait_synced(5)
        try:
            for tokens in (4, 6):
                stored, activated = await store.put("default", CHAIN.replace("TOKENS", str(tokens)))
                assert activated and (await store.resolve("default", "versioned")).version == stored.version
            assert await store.rollback("default", "versioned") == (2, 1)
            assert (await store.resolve("default", "versioned")).version == 1
            assert store.pointer("default", "versioned", "active") == 1
            assert await store.label("default", "versioned", "prod", 2) == 0
            assert (await store.resolve("default", "versioned", label="prod")).version == 2
            assert await store.rollback("default", "versioned", 2) == (1, 2)
            assert (await store.resolve("default", "versioned")).version == 2
        finally:
            await store.mirror.close()
