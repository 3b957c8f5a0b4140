"""The pure parts of partitions by model pool (issue 15): who owns what, what an
instance campaigns for, and how the router treats a hop refused or cut by a scheduler."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import grpc
import pytest

from inferx import etcd
from inferx.discovery import ServiceLocator
from inferx.errors import OWNER_KEY, SERVICE_STATUS_KEY, NoOwner, NotOwner, from_rpc_error
from inferx.partitions import Owner, OwnerTable, PartitionElector, eligible, parse_owners, pools_to_campaign
from inferx.pools import PoolDirectory
from inferx.v1 import scheduler_pb2
from inferx_router.load import PoolLoad, merge_loads
from inferx_router.scheduler_target import MAX_REDIRECTS, Failure, HopAttempts, SchedulerTargets, classify
from tests.unit.test_errors_and_settings import FakeRpcError
from tests.unit.test_service_locator import registration

PREFIX = etcd.partitions_prefix("scheduler")


def test_partition_keys_follow_the_layout() -> None:
    assert etcd.partition_key("scheduler", "qwen-7b") == "/inferx/v1/partitions/scheduler/qwen-7b"
    assert etcd.partition_key("scheduler", "qwen-7b").startswith(PREFIX)


def test_owner_round_trips_and_bad_values_are_skipped() -> None:
    owner = Owner("scheduler-a", "10.0.0.1:50052", lease=0x1234)
    items = {
        PREFIX + "qwen-7b": owner.encode(),
        PREFIX + "broken": b"{not json",
        PREFIX + "missing": b'{"address": "x"}',
        PREFIX + "a/b": owner.encode(),  # a pool name holds no '/'
    }
    assert parse_owners(PREFIX, items) == {"qwen-7b": owner}
    assert Owner.decode(owner.encode()) == owner


def test_an_instance_campaigns_only_for_unowned_pools_it_may_serve() -> None:
    owners = {"a": Owner("s1", "x:1", 1)}
    # default: every pool seen in etcd
    assert pools_to_campaign(None, {"a", "b", "c"}, owners) == ["b", "c"]
    # --pools: those only, seen or not (a pool whose workers come later is taken at once)
    assert pools_to_campaign(frozenset({"a", "d"}), {"a", "b"}, owners) == ["d"]
    assert pools_to_campaign(None, set(), {}) == []
    assert eligible("b", None) and eligible("b", frozenset({"b"})) and not eligible("b", frozenset({"a"}))


def test_an_owner_answer_travels_in_a_trailer() -> None:
    redirected = from_rpc_error(
        FakeRpcError(grpc.StatusCode.FAILED_PRECONDITION, "not mine", ((OWNER_KEY, "10.0.0.2:50052"),))
    )
    assert isinstance(redirected, NotOwner) and redirected.owner_address == "10.0.0.2:50052"
    waiting = from_rpc_error(FakeRpcError(grpc.StatusCode.UNAVAILABLE, "electing", ((OWNER_KEY, ""),)))
    assert isinstance(waiting, NoOwner) and waiting.owner_address == ""
    plain = from_rpc_error(FakeRpcError(grpc.StatusCode.FAILED_PRECONDITION, "version conflict"))
    assert not isinstance(plain, NotOwner) and plain.owner_address is None


@pytest.mark.parametrize(
    ("code", "trailers", "failure"),
    [
        (grpc.StatusCode.FAILED_PRECONDITION, {OWNER_KEY: "h:1", SERVICE_STATUS_KEY: "1"}, Failure.NOT_OWNER),
        (grpc.StatusCode.UNAVAILABLE, {OWNER_KEY: "", SERVICE_STATUS_KEY: "1"}, Failure.NO_OWNER),
        # the connection broke: no status from the scheduler's code
        (grpc.StatusCode.UNAVAILABLE, {}, Failure.OWNER_LOST),
        # the scheduler itself said UNAVAILABLE (no worker of the pool): not a lost owner
        (grpc.StatusCode.UNAVAILABLE, {SERVICE_STATUS_KEY: "1"}, Failure.OTHER),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, {SERVICE_STATUS_KEY: "1"}, Failure.OTHER),
        (grpc.StatusCode.INTERNAL, {}, Failure.OTHER),
    ],
)
def test_failures_are_told_apart(code, trailers, failure) -> None:
    assert classify(code, trailers) == failure


def test_a_refused_certificate_is_not_a_lost_owner() -> None:
    refused = (
        "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:5: Ssl handshake failed: "
        "SSL_ERROR_SSL: error:1000007d:SSL routines:OPENSSL_internal:CERTIFICATE_VERIFY_FAILED: "
        "Hostname Verification Check failed."
    )
    assert classify(grpc.StatusCode.UNAVAILABLE, {}, refused) == Failure.OTHER
    gone = "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:5: Connection refused"
    assert classify(grpc.StatusCode.UNAVAILABLE, {}, gone) == Failure.OWNER_LOST


def test_a_hop_cut_by_its_schedulers_death_is_resubmitted_exactly_once() -> None:
    attempts = HopAttempts()
    assert attempts.again(Failure.OWNER_LOST, streamed=False)
    assert not attempts.again(Failure.OWNER_LOST, streamed=False)


def test_a_hop_whose_text_was_streamed_is_not_resubmitted() -> None:
    assert not HopAttempts().again(Failure.OWNER_LOST, streamed=True)


def test_redirects_are_bounded_and_other_failures_are_not_retried_here() -> None:
    attempts = HopAttempts()
    for _ in range(MAX_REDIRECTS):
        assert attempts.again(Failure.NOT_OWNER, streamed=False)
    assert not attempts.again(Failure.NO_OWNER, streamed=False)
    assert not HopAttempts().again(Failure.OTHER, streamed=False)


def test_pool_load_is_summed_over_the_schedulers() -> None:
    owner = scheduler_pb2.SchedulerStatus()
    pool = owner.pools.add(pool="p", queued=3, running=2)
    pool.workers.add().worker.max_concurrency = 4
    pool.workers.add().worker.max_concurrency = 4
    other = scheduler_pb2.SchedulerStatus()  # a non-owner left over hops still running
    other.pools.add(pool="p", queued=0, running=1)
    assert merge_loads([owner, other]) == {"p": PoolLoad(running=3, queued=3, capacity=8)}


def owners_table(owners: dict[str, Owner]) -> OwnerTable:
    table = OwnerTable(client=None, kind="scheduler")  # fed by hand, never started
    table._update({PREFIX + pool: owner.encode() for pool, owner in owners.items()})
    return table


def targets(table: OwnerTable, *schedulers: str) -> SchedulerTargets:
    services = ServiceLocator(client=None)
    services._update({f"/s/{a}": registration("scheduler", a) for a in schedulers})
    directory = PoolDirectory(model_to_pool={"qwen-7b": "tiny"})
    return SchedulerTargets(services, table, directory, failover_wait_s=0.3)


async def test_a_hop_goes_to_its_pools_owner_or_any_scheduler_while_none() -> None:
    table = owners_table({"tiny": Owner("s1", "s1:1", 7)})
    assert await targets(table, "s1:1", "s2:1").first("qwen-7b", 1.0) == "s1:1"
    nobody = targets(owners_table({}), "s2:1")
    assert await nobody.first("qwen-7b", 1.0) == "s2:1"  # it campaigns, or says why it cannot


async def test_after_a_lost_owner_the_hop_waits_for_the_next_one() -> None:
    table = owners_table({"tiny": Owner("s1", "s1:1", 7)})
    where = targets(table, "s1:1", "s2:1")
    asyncio.get_running_loop().call_later(
        0.05, table._update, {PREFIX + "tiny": Owner("s2", "s2:1", 8).encode()}
    )
    assert await where.after("qwen-7b", Failure.OWNER_LOST, "s1:1", "", 5.0) == "s2:1"
    # the owner did not change within the failover wait (a dropped connection, not a
    # death): the hop goes back to it, once
    assert await where.after("qwen-7b", Failure.OWNER_LOST, "s2:1", "", 5.0) == "s2:1"


async def test_a_refusal_naming_the_owner_is_followed() -> None:
    where = targets(owners_table({}), "s1:1", "s2:1")
    assert await where.after("qwen-7b", Failure.NOT_OWNER, "s1:1", "s2:1", 1.0) == "s2:1"


class FakeLeaseClient:
    """Answers lease renewals as etcd would: alive (TTL left), gone (TTL -1) or down."""

    def __init__(self, answer: str, delay_s: float = 0.0) -> None:
        self.answer = answer
        self.delay_s = delay_s
        self.renewals = 0

    async def refresh_lease(self, lease: int):
        self.renewals += 1
        await asyncio.sleep(self.delay_s)
        if self.answer == "down":
            raise ConnectionError("etcd is not reachable")
        return SimpleNamespace(ID=lease, TTL=2 if self.answer == "alive" else -1)


def owner_under_lease(client: FakeLeaseClient, *, renewed_s_ago: float) -> PartitionElector:
    """An elector whose table names it owner of pool "p" under lease 7, last renewed
    `renewed_s_ago` (TTL 2 s); nothing started."""
    elector = PartitionElector(client, "memory-pool", instance_id="me", address="me:1", ttl_s=2)
    elector._lease = 7
    elector._renewed_at = time.monotonic() - renewed_s_ago
    elector.table.owners = {"p": Owner("me", "me:1", 7)}
    return elector


async def test_an_owner_renewed_within_its_ttl_serves_without_asking_etcd() -> None:
    client = FakeLeaseClient("gone")
    elector = owner_under_lease(client, renewed_s_ago=0.5)
    assert await elector.confirm("p")
    assert client.renewals == 0


async def test_a_stalled_owner_whose_lease_ran_out_refuses_before_its_watch_catches_up() -> None:
    """The split brain this guards against: a ledger owner stalled past its TTL wakes
    with a call queued; its table still names it (the watch event is queued too), so
    `owns` says yes -- but etcd, asked, says the lease is gone: refuse."""
    client = FakeLeaseClient("gone")
    elector = owner_under_lease(client, renewed_s_ago=2.5)
    assert elector.owns("p")
    assert not await elector.confirm("p")
    assert client.renewals == 1
    assert not elector.owns("p") and elector._lease is None


async def test_a_stalled_owner_whose_lease_lives_serves_and_counts_the_renewal() -> None:
    client = FakeLeaseClient("alive")
    elector = owner_under_lease(client, renewed_s_ago=2.5)
    calls = await asyncio.gather(*(elector.confirm("p") for _ in range(5)))
    assert all(calls)
    assert client.renewals == 1  # the waiting calls share one renewal
    assert await elector.confirm("p") and client.renewals == 1  # renewed: not asked again


async def test_with_etcd_unreachable_an_owner_serves_on_and_asks_again_only_later() -> None:
    client = FakeLeaseClient("down")
    elector = owner_under_lease(client, renewed_s_ago=2.5)
    assert await elector.confirm("p")  # nobody can be elected in its place either
    assert await elector.confirm("p")
    assert client.renewals == 1  # not one failed round trip per call
    elector._confirm_failed_at -= elector._interval
    assert await elector.confirm("p") and client.renewals == 2


async def test_an_etcd_that_hangs_delays_a_call_by_a_third_of_the_ttl_at_most() -> None:
    client = FakeLeaseClient("alive", delay_s=30)
    elector = owner_under_lease(client, renewed_s_ago=2.5)
    started_at = time.monotonic()
    assert await elector.confirm("p")
    assert time.monotonic() - started_at < 5
    assert elector._confirm_failed_at > started_at
