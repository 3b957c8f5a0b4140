"""Leader election per model pool on a real etcd (issue 15): one owner per pool at a
time; a clean resign hands the pools over at once; a lease that ends (an owner cut off
from etcd) loses its pools, and the instance campaigns again under a new lease; --pools
limits what an instance takes."""

from __future__ import annotations

import pytest

from inferx import etcd
from inferx.devstack import LocalStack
from inferx.etcd import make_client
from inferx.partitions import PartitionElector
from tests.polling import poll_until

pytestmark = pytest.mark.integration


def elector(stack: LocalStack, name: str, wanted: frozenset[str] | None = None) -> PartitionElector:
    return PartitionElector(
        make_client(stack.etcd_endpoint),
        "scheduler",
        instance_id=name,
        address=f"{name}:1",
        ttl_s=2,
        wanted=wanted,
    )


async def test_one_owner_per_pool_and_a_resign_hands_over_at_once(etcd_only: LocalStack) -> None:
    a, b = elector(etcd_only, "a"), elector(etcd_only, "b")
    a.set_seen({"p", "q"})
    a.start()
    await poll_until(lambda: a.owned() == ["p", "q"], timeout_s=10, what="a to own both pools")
    b.set_seen({"p", "q"})
    b.start()
    await poll_until(lambda: set(b.table.owners) == {"p", "q"}, timeout_s=10, what="b to see the owners")
    assert b.owned() == [] and not await b.campaign("p")  # taken: b's transaction fails
    await a.resign()
    assert a.owned() == []
    await poll_until(lambda: b.owned() == ["p", "q"], timeout_s=5, what="b to take both pools")
    async with make_client(etcd_only.etcd_endpoint) as client:
        found = await client.get(etcd.partition_key("scheduler", "p").encode())
        assert found is not None and b'"b"' in found.value
    await a.close()
    await b.close()


async def test_a_lost_lease_loses_the_pools_and_they_are_taken_again(etcd_only: LocalStack) -> None:
    a = elector(etcd_only, "a")
    a.set_seen({"p"})
    a.start()
    await poll_until(lambda: a.owns("p"), timeout_s=10, what="a to own p")
    lease = a._lease
    assert lease is not None
    async with make_client(etcd_only.etcd_endpoint) as client:
        await client.revoke_lease(lease)  # as etcd does when a's renewals stop reaching it
    # at once (the watch shows the key gone), and taken back under a new lease
    await poll_until(lambda: a._lease != lease and a.owns("p"), timeout_s=10, what="a to own p again")
    await a.close()


async def test_pools_flag_limits_what_an_instance_takes(etcd_only: LocalStack) -> None:
    only_q = elector(etcd_only, "only-q", wanted=frozenset({"q"}))
    only_q.set_seen({"p", "q"})
    only_q.start()
    await poll_until(lambda: only_q.owned() == ["q"], timeout_s=10, what="only-q to own q")
    assert not await only_q.campaign("p")
    assert only_q.table.owner("p") is None
    await only_q.close()
