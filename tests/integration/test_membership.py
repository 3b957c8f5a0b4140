"""Leases and discovery: a worker killed with -9 leaves scheduling within the TTL, a
SIGTERM'd worker leaves at once, a lost lease is re-granted and its keys re-put."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import pytest

from inferx import etcd
from inferx.client import InferxClient
from inferx.devstack import LocalStack
from inferx.errors import Unavailable
from inferx.etcd import LeaseKeeper, PrefixMirror, make_client
from tests.conftest import TEST_LEASE_TTL_S, running_sim_stack
from tests.polling import poll_until

pytestmark = pytest.mark.integration


async def worker_ids_in_etcd(stack: LocalStack) -> set[str]:
    async with make_client(stack.etcd_endpoint) as client:
        listing = await client.get_prefix(etcd.WORKERS.encode())
        return {json.loads(kv.value)["workerId"] for kv in listing}


async def scheduled_worker_ids(stack: LocalStack) -> set[str]:
    async with InferxClient(stack.router_address) as client:
        status = await client.status()
    return {w.worker_id for w in status.workers}


@pytest.fixture
def two_worker_stack(tmp_path: Path):
    with running_sim_stack(tmp_path) as stack:
        yield stack


async def test_kill_9_worker_leaves_etcd_and_scheduling_within_the_ttl(
    two_worker_stack: LocalStack,
) -> None:
    stack = two_worker_stack
    await poll_until(lambda: _has(worker_ids_in_etcd(stack), 2), timeout_s=10, what="two workers")
    before = await worker_ids_in_etcd(stack)
    victim = stack.workers[0]
    victim.signal(signal.SIGKILL)
    victim.wait(5)

    async def gone_everywhere() -> bool:
        return len(await worker_ids_in_etcd(stack)) == 1 and len(await scheduled_worker_ids(stack)) == 1

    # The claim is the deadline: gone within the lease TTL (+3 s for etcd to notice).
    await poll_until(gone_everywhere, timeout_s=TEST_LEASE_TTL_S + 3, interval_s=0.2, what="the worker to go")
    survivor = (await worker_ids_in_etcd(stack)).pop()
    assert survivor in before
    # Chains keep running, all on the survivor.
    async with InferxClient(stack.router_address) as client:
        for _ in range(3):
            events = [e async for e in client.run_chain("customer_service_agent", {"query": "refund"})]
            finished = events[-1].chain_finished
            assert finished.status == "ok", finished.error
            assert {h.worker_id for h in finished.hops if h.model} == {survivor}


async def test_sigterm_worker_deregisters_at_once(two_worker_stack: LocalStack) -> None:
    stack = two_worker_stack
    await poll_until(lambda: _has(worker_ids_in_etcd(stack), 2), timeout_s=10, what="two workers")
    victim = stack.workers[1]
    victim.signal(signal.SIGTERM)

    # The lease is revoked on SIGTERM, sooner than its TTL would expire: the deadline
    # is the claim.
    async def one_left() -> bool:
        return await _has(worker_ids_in_etcd(stack), 1)

    await poll_until(one_left, timeout_s=TEST_LEASE_TTL_S, interval_s=0.2, what="deregistration")
    assert victim.wait(20) == 0
    assert "stopped" in victim.log_tail()


async def _has(coro, count: int) -> bool:
    return len(await coro) == count


async def test_lease_lost_is_regranted_and_keys_reput(etcd_only: LocalStack) -> None:
    async with make_client(etcd_only.etcd_endpoint) as client:
        keeper = LeaseKeeper(client, ttl_s=2)
        await keeper.put("/inferx/v1/test/a", b"1")
        keeper.start()
        assert await keeper.wait_registered(5)
        first_lease = keeper.lease_id
        # Someone (or an etcd outage longer than the TTL) ends the lease.
        await client.revoke_lease(first_lease)
        assert await client.get(b"/inferx/v1/test/a") is None

        async def back() -> bool:
            # The keeper puts the key first, then records the new lease and counts
            # the re-grant: wait for all three, or this races with its bookkeeping.
            got = await client.get(b"/inferx/v1/test/a")
            return got is not None and got.value == b"1" and keeper.regrants >= 1

        await poll_until(back, timeout_s=5, what="the key to be re-put")
        assert keeper.lease_id != first_lease
        assert keeper.regrants == 1
        await keeper.close()
        assert await client.get(b"/inferx/v1/test/a") is None  # close revokes


async def test_etcd_outage_keeps_mirror_and_registration_comes_back(etcd_only: LocalStack) -> None:
    stack = etcd_only
    client = make_client(stack.etcd_endpoint)
    keeper = LeaseKeeper(client, ttl_s=2)
    await keeper.put("/inferx/v1/test/svc", b"x")
    keeper.start()
    assert await keeper.wait_registered(5)
    watcher_client = make_client(stack.etcd_endpoint)
    mirror = PrefixMirror(watcher_client, "/inferx/v1/test/")
    mirror.start()
    assert await mirror.wait_synced(5)
    assert mirror.items == {"/inferx/v1/test/svc": b"x"}

    assert stack.etcd is not None
    stack.etcd.stop()  # etcd down for longer than the lease TTL
    await asyncio.sleep(5)  # a duration, not a synchronisation: longer than the 2 s TTL
    assert mirror.items == {"/inferx/v1/test/svc": b"x"}  # last known state is kept
    stack.etcd = None
    restart_same_data(stack)

    async def registered() -> bool:
        try:
            got = await client.get(b"/inferx/v1/test/svc")
        except etcd.ETCD_DOWN_ERRORS:
            return False
        return got is not None

    await poll_until(registered, timeout_s=15, what="the registration to come back")
    await client.put(b"/inferx/v1/test/new", b"y")
    await poll_until(lambda: mirror.items.get("/inferx/v1/test/new") == b"y", timeout_s=10, what="the mirror")
    await keeper.close()
    await mirror.close()
    await client.close()
    await watcher_client.close()


def restart_same_data(stack: LocalStack) -> None:
    stack.fresh_etcd = False
    stack.start_etcd()


async def test_a_worker_that_lost_its_lease_is_waited_for_until_routed_again(
    two_worker_stack: LocalStack,
) -> None:
    """The harness's wait (`wait_workers_routed`, before every test on a shared stack):
    a worker starved past its lease TTL (here frozen) drops out of routing -- a hop for
    its pool then fails with "no live worker" -- and is waited for until it registers
    again and the router, its scheduler and the memory-pool all see it."""
    stack = two_worker_stack
    for worker in stack.workers:
        worker.signal(signal.SIGSTOP)
    try:
        # Gone from the router's view (their leases expired), though their processes live.
        async def both_dropped() -> list[str]:
            missing = await asyncio.to_thread(stack.workers_not_routed, stack.workers)
            dropped = [w for w in stack.workers if any(f"does not see {w.name} (" in p for p in missing)]
            return missing if len(dropped) == len(stack.workers) else []

        await poll_until(
            both_dropped,
            timeout_s=TEST_LEASE_TTL_S + 5,
            interval_s=0.2,
            what="the frozen workers to drop out of routing",
        )
        async with InferxClient(stack.router_address) as client:
            with pytest.raises(Unavailable, match="no live worker serves model"):
                async for _ in client.run_chain("customer_service_agent", {"query": "refund"}):
                    pass
    finally:
        for worker in stack.workers:
            worker.signal(signal.SIGCONT)
    waited = await asyncio.to_thread(stack.wait_workers, 30)
    assert waited > 0
    assert stack.workers_not_routed(stack.workers) == []
    async with InferxClient(stack.router_address) as client:
        events = [e async for e in client.run_chain("customer_service_agent", {"query": "refund"})]
    finished = events[-1].chain_finished
    assert finished.status == "ok", finished.error
