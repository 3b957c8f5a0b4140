"""Chain configs as versions in etcd: history, diff, labels, rollback, and a router
that applies a new active version to new runs without a restart."""

from __future__ import annotations

import asyncio
import time

import pytest

from inferx import etcd
from inferx.client import InferxClient
from inferx.devstack import LocalStack
from inferx.errors import FailedPrecondition, InvalidArgument, NotFound
from inferx.etcd import make_client
from tests.integration.test_chain_runs import _cli

pytestmark = pytest.mark.integration

TEMPLATE = """
agent_chain:
  name: NAME
  slo: {end_to_end_latency_p99: 20s}
  inputs: [q]
  nodes:
    - {id: think, type: model_inference, model: qwen-7b, timeout: 15s, max_tokens: TOKENS,
       prompt: "Think about {{ inputs.q }}"}
"""


def config(name: str, tokens: int) -> str:
    return TEMPLATE.replace("NAME", name).replace("TOKENS", str(tokens))


async def finish(client: InferxClient, name: str, **kw):
    events = [e async for e in client.run_chain(name, {"q": "x"}, **kw)]
    return events[-1].chain_finished


async def test_history_diff_label_rollback(sim_stack: LocalStack) -> None:
    async with InferxClient(sim_stack.router_address) as client:
        await client.put_chain(config("versioned", 4), message="first", author="alice")
        await client.put_chain(config("versioned", 6), message="more tokens", author="bob")

        history = await client.chain_history("versioned")
        assert [v.version for v in history.versions] == [2, 1]
        assert [v.message for v in history.versions] == ["more tokens", "first"]
        assert [v.author for v in history.versions] == ["bob", "alice"]
        assert history.active_version == 2 and history.versions[0].active

        diff = await client.diff_chain("versioned", 1, 2)
        assert "-    max_tokens: 4" in diff and "+    max_tokens: 6" in diff
        assert await client.diff_chain("versioned", 2, 2) == ""

        assert await client.label_chain("versioned", "prod", 1) == 0
        assert (await client.get_chain("versioned", label="prod")).version == 1
        labelled = await finish(client, "versioned", label="prod")
        assert labelled.chain_version == 1 and labelled.hops[0].usage.completion_tokens == 4
        latest = await finish(client, "versioned")
        assert latest.chain_version == 2 and latest.hops[0].usage.completion_tokens == 6

        rolled = await client.rollback_chain("versioned")
        assert (rolled.from_version, rolled.to_version) == (2, 1)
        assert (await client.get_chain("versioned")).version == 1
        with pytest.raises(FailedPrecondition, match="nothing to roll back"):
            await client.rollback_chain("versioned")
        await client.rollback_chain("versioned", 2)
        assert [v.version for v in (await client.chain_history("versioned")).versions] == [2, 1]

        with pytest.raises(NotFound, match="no version 7"):
            await client.label_chain("versioned", "canary", 7)
        with pytest.raises(InvalidArgument, match="label"):
            await client.label_chain("versioned", "bad label!", 1)
        with pytest.raises(NotFound, match="no label 'staging'"):
            await client.get_chain("versioned", label="staging")
        with pytest.raises(NotFound):
            await client.chain_history("never_stored")


async def test_new_active_version_reaches_new_runs_while_old_runs_finish_on_theirs(
    sim_stack: LocalStack,
) -> None:
    async with InferxClient(sim_stack.router_address) as client:
        await client.put_chain(config("hot", 300))  # a long hop: ~0.6 s at sim speed 5
        under_way = asyncio.Event()

        async def old_run():
            events = []
            async for event in client.run_chain("hot", {"q": "x"}):
                events.append(event)
                under_way.set()  # its first event: the run has taken its version (v1)
            return events[-1].chain_finished

        in_flight = asyncio.create_task(old_run())
        await asyncio.wait_for(under_way.wait(), 30)
        put_at = time.monotonic()
        await client.put_chain(config("hot", 3))
        # New runs see v2 within a second, without restarting the router: a run may
        # still get v1 only if it started less than a second after the put (measured
        # at its start, so the length of a v1 run does not count).
        while True:
            run_started = time.monotonic()
            run = await finish(client, "hot")
            if run.chain_version == 2:
                break
            assert run_started - put_at < 1.0, "a run started a second after the put still ran v1"
        assert run.hops[0].usage.completion_tokens == 3
        old = await in_flight
        assert old.chain_version == 1 and old.hops[0].usage.completion_tokens == 300


async def test_router_keeps_following_after_etcd_compaction(sim_stack: LocalStack) -> None:
    async with InferxClient(sim_stack.router_address) as client:
        await client.put_chain(config("compacted", 2))
        async with make_client(sim_stack.etcd_endpoint) as etcd_client:
            latest = await etcd_client.get(f"{etcd.CHAINS}default/compacted/latest".encode())
            await etcd_client.compact(latest.mod_revision, physical=True)
        await client.put_chain(config("compacted", 5))
        deadline = time.monotonic() + 2
        while True:  # as above: judged by when each run started
            run_started = time.monotonic()
            if (run := await finish(client, "compacted")).chain_version == 2:
                break
            assert run_started < deadline, "a run started 2 s after the put still ran v1"
        assert run.hops[0].usage.completion_tokens == 5


def test_cli_manages_versions(sim_stack: LocalStack, tmp_path) -> None:
    path = tmp_path / "cli.yaml"
    path.write_text(config("cli_chain", 2))
    assert _cli(sim_stack, "chain", "put", str(path), "-m", "one").returncode == 0
    path.write_text(config("cli_chain", 3))
    put = _cli(sim_stack, "chain", "put", str(path), "-m", "two")
    assert "version 2 (active)" in put.stdout
    stale = _cli(sim_stack, "chain", "put", str(path), "--expect-version", "1")
    assert stale.returncode == 1 and "FAILED_PRECONDITION" in stale.stderr
    diff = _cli(sim_stack, "chain", "diff", "cli_chain", "1", "2")
    assert "+    max_tokens: 3" in diff.stdout
    assert _cli(sim_stack, "chain", "label", "cli_chain", "prod", "1").returncode == 0
    history = _cli(sim_stack, "chain", "history", "cli_chain")
    assert "prod" in history.stdout and "two" in history.stdout
    rollback = _cli(sim_stack, "chain", "rollback", "cli_chain")
    assert "v2 -> v1" in rollback.stdout
    got = _cli(sim_stack, "chain", "get", "cli_chain", "--label", "prod")
    assert "max_tokens: 2" in got.stdout and "label prod" in got.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text(config("cli_chain", 2).replace("depends_on", "x").replace("prompt:", "promt:"))
    invalid = _cli(sim_stack, "chain", "validate", str(bad))
    assert invalid.returncode == 1 and "did you mean 'prompt'" in invalid.stderr
    assert "Traceback" not in invalid.stderr
