"""A/B tests of chain configs on live traffic, on sim workers: sticky arms, stats per arm,
promotion of the kept arm, the guard rail, bad input named."""

from __future__ import annotations

import pytest

from inferx import etcd
from inferx.ab import choose_arm
from inferx.client import InferxClient
from inferx.devstack import LocalStack, wait_serving
from inferx.errors import FailedPrecondition, InvalidArgument, NotFound
from inferx.etcd import make_client
from inferx.v1 import router_pb2
from tests.conftest import wait_workers_routed
from tests.integration.test_chain_runs import _cli
from tests.integration.test_chain_versions import config
from tests.integration.test_observability import metrics_addresses, scrape, total
from tests.polling import poll_until

pytestmark = pytest.mark.integration

TOKENS = {1: 4, 2: 6}  # what each version generates: the run says which version it ran


async def run(client: InferxClient, name: str, session: str = "", **kw) -> router_pb2.ChainFinished:
    events = [e async for e in client.run_chain(name, {"q": "x"}, session_id=session, **kw)]
    return events[-1].chain_finished


async def test_runs_split_sticky_per_session_then_the_kept_arm_is_promoted(sim_stack: LocalStack) -> None:
    async with InferxClient(sim_stack.router_address) as client:
        await client.put_chain(config("ab_chain", TOKENS[1]))
        await client.put_chain(config("ab_chain", TOKENS[2]))

        with pytest.raises(NotFound, match="no version 7"):
            await client.start_ab_test("ab_chain", 1, 7, 10)
        with pytest.raises(InvalidArgument, match="split: must be a percentage from 0 to 100"):
            await client.start_ab_test("ab_chain", 1, 2, 150)
        with pytest.raises(InvalidArgument, match="both arms are version 2"):
            await client.start_ab_test("ab_chain", 2, 2, 10)
        with pytest.raises(FailedPrecondition, match="no A/B test of chain 'ab_chain' is running"):
            await client.stop_ab_test("ab_chain", "a")
        with pytest.raises(NotFound, match="has had no A/B test"):
            await client.ab_status("ab_chain")

        test = await client.start_ab_test("ab_chain", 1, 2, 50, min_runs=1000)
        with pytest.raises(FailedPrecondition, match=r"is running \(v1 vs v2\)"):
            await client.start_ab_test("ab_chain", 1, 2, 20)
        # Stored next to the versions: every router (and a restarted one) reads it there.
        async with make_client(sim_stack.etcd_endpoint) as etcd_client:
            stored = await etcd_client.get(f"{etcd.CHAINS}default/ab_chain/ab".encode())
        assert stored is not None and b'"split_pct": 50.0' in stored.value

        arms = {"a": 0, "b": 0}
        for i in range(24):
            session = f"session-{i}"
            finished = await run(client, "ab_chain", session)
            want = choose_arm(session, 50, str(test.started_unix_ms))
            assert finished.ab_arm == want
            assert finished.chain_version == {"a": 1, "b": 2}[want]
            assert finished.hops[0].usage.completion_tokens == TOKENS[finished.chain_version]
            again = await run(client, "ab_chain", session)  # a session never flips
            assert (again.ab_arm, again.chain_version) == (finished.ab_arm, finished.chain_version)
            arms[want] += 2
        assert arms["a"] and arms["b"]
        pinned = await run(client, "ab_chain", "session-0", version=1)  # a pinned run is no arm's
        assert pinned.ab_arm == "" and pinned.chain_version == 1

        status = await client.ab_status("ab_chain")
        assert status.running and (status.test.a, status.test.b, status.test.split_pct) == (1, 2, 50)
        by_arm = {arm.arm: arm for arm in status.arms}
        assert (by_arm["a"].runs, by_arm["b"].runs) == (arms["a"], arms["b"])
        assert by_arm["b"].tokens > 0 and by_arm["a"].p99_ms >= by_arm["a"].p50_ms > 0
        assert status.note
        stats = await client._unary(
            client._stub.GetChainStats, router_pb2.GetChainStatsRequest(chain="ab_chain")
        )
        assert {(arm.arm, arm.version) for arm in stats.arms} == {("a", 1), ("b", 2)}

        with pytest.raises(InvalidArgument, match="keep: must be a or b"):
            await client.stop_ab_test("ab_chain", "c")
        await client.rollback_chain("ab_chain", 1)  # v1 active: keeping b moves it
        stopped = await client.stop_ab_test("ab_chain", "b")
        assert (stopped.kept, stopped.version, stopped.previous_active) == ("b", 2, 1)
        assert (await client.get_chain("ab_chain")).version == 2
        assert (await client.get_chain("ab_chain", label="ab-winner")).version == 2
        after = await client.ab_status("ab_chain")
        assert not after.running and "kept b (v2)" in after.last_result
        assert (await run(client, "ab_chain", "session-0")).ab_arm == ""


async def test_the_guard_stops_an_arm_that_fails(sim_stack: LocalStack) -> None:
    async with InferxClient(sim_stack.router_address) as client:
        await client.put_chain(config("ab_guarded", 4))
        broken = config("ab_guarded", 4).replace("end_to_end_latency_p99: 20s", "end_to_end_latency_p99: 1ms")
        await client.put_chain(broken, activate=False)  # v2: misses every deadline
        await client.start_ab_test("ab_guarded", 1, 2, 50, margin=0.2, min_runs=3)

        async def stopped() -> router_pb2.AbStatus | None:
            for i in range(4):
                await run(client, "ab_guarded", f"s-{stopped.calls}-{i}")  # type: ignore[attr-defined]
            stopped.calls += 1  # type: ignore[attr-defined]
            status = await client.ab_status("ab_guarded")
            return None if status.running else status

        stopped.calls = 0  # type: ignore[attr-defined]
        status = await poll_until(stopped, timeout_s=60, what="the guard to stop arm b")
        assert status is not None
        assert "guard stopped arm b" in status.last_result and "kept a (v1)" in status.last_result
        assert (await client.get_chain("ab_guarded")).version == 1
    samples: dict = {}
    for address in (await metrics_addresses(sim_stack))["router"]:
        samples.update(scrape(address))
    assert total(samples, "inferx_chain_ab_guard_stops_total", chain="ab_guarded", arm="b") == 1
    assert total(samples, "inferx_chain_ab_runs_total", chain="ab_guarded", arm="b", result="error") >= 3


def test_cli_start_status_stop_and_bad_input(sim_stack: LocalStack) -> None:
    import asyncio

    async def put() -> None:
        async with InferxClient(sim_stack.router_address) as client:
            await client.put_chain(config("ab_cli", 4))
            await client.put_chain(config("ab_cli", 6))

    asyncio.run(put())
    for args, needle in (
        (("--a", "v1", "--b", "v2", "--split", "150"), "--split"),
        (("--a", "one", "--b", "v2", "--split", "10"), "--a"),
        (("--a", "v1", "--b", "v2", "--split", "10", "--margin", "2"), "--margin"),
    ):
        bad = _cli(sim_stack, "chain", "ab", "start", "ab_cli", *args)
        assert bad.returncode == 2 and needle in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
    unknown = _cli(sim_stack, "chain", "ab", "start", "ab_cli", "--a", "v1", "--b", "v9", "--split", "10")
    assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stderr and "no version 9" in unknown.stderr
    started = _cli(sim_stack, "chain", "ab", "start", "ab_cli", "--a", "v1", "--b", "v2", "--split", "10")
    assert started.returncode == 0 and "10% of sessions to b" in started.stdout, started.stderr
    ran = _cli(sim_stack, "run", "ab_cli", "-i", "q=x", "--session", "s1")
    assert ran.returncode == 0 and "A/B arm " in ran.stdout, ran.stdout + ran.stderr
    traced = _cli(sim_stack, "trace", "--chain", "ab_cli")
    assert traced.returncode == 0 and "A/B arm " in traced.stdout, traced.stdout + traced.stderr
    status = _cli(sim_stack, "chain", "ab", "status", "ab_cli")
    assert status.returncode == 0 and "significance: too few runs to tell" in status.stdout, status.stderr
    stopped = _cli(sim_stack, "chain", "ab", "stop", "ab_cli", "--keep", "a")
    assert stopped.returncode == 0 and "kept a: v1 is active" in stopped.stdout, stopped.stderr
    stats = _cli(sim_stack, "stats", "ab_cli")
    assert stats.returncode == 0 and "arm " in stats.stdout, stats.stdout


def test_a_router_started_during_a_test_applies_it_alike(sim_stack: LocalStack) -> None:
    """The test lives in etcd: a router started (or restarted) while it runs reads it and
    gives every session the arm the first router gives it."""
    import asyncio

    async def begin() -> router_pb2.AbTest:
        async with InferxClient(sim_stack.router_address) as client:
            await client.put_chain(config("ab_routers", TOKENS[1]))
            await client.put_chain(config("ab_routers", TOKENS[2]))
            return await client.start_ab_test("ab_routers", 1, 2, 50, min_runs=1000)

    test = asyncio.run(begin())
    second = sim_stack.start_service("router", replica=1)
    try:
        wait_serving(second, 60)
        wait_workers_routed(sim_stack)

        async def both() -> None:
            async with (
                InferxClient(sim_stack.router_address) as first,
                InferxClient(second.address) as other,
            ):
                for i in range(8):
                    session = f"roaming-{i}"
                    here, there = (
                        await run(first, "ab_routers", session),
                        await run(other, "ab_routers", session),
                    )
                    want = choose_arm(session, 50, str(test.started_unix_ms))
                    assert here.ab_arm == there.ab_arm == want
                    assert here.chain_version == there.chain_version == {"a": 1, "b": 2}[want]
                await other.stop_ab_test("ab_routers", "a")  # any router may end it

        asyncio.run(both())
    finally:
        second.stop()
        del sim_stack.services["router-1"]
