"""Finished run records shared between routers (inferx_router.shared_runs): the record's
wire form and its bounds, merging a router's own records with the shared ones, tenant
scoping, and a store whose etcd is down never failing anything."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from types import SimpleNamespace

import aetcd
import pytest
from google.protobuf import json_format

from inferx import etcd
from inferx.errors import InvalidArgument, NotFound
from inferx.v1 import router_pb2
from inferx_router import metrics, shared_runs
from inferx_router.records import RUNNING, RunRecord, RunStore
from inferx_router.shared_runs import SharedRuns, decode, encode, encode_bounded, find_in, merge, of_chain

DEPS = {"a": (), "b": ("a",)}


def record(run_id: str, ended_ms: int, *, tenant: str = "acme", chain: str = "demo", **kw) -> RunRecord:
    latency = kw.pop("latency_ms", 100.0)
    hops = [
        router_pb2.NodeFinished(node_id="a", status="ok", latency_ms=40, output="x" * 200, model="m"),
        router_pb2.NodeFinished(node_id="b", status="ok", latency_ms=60, output="answer"),
    ]
    finished = router_pb2.ChainFinished(
        run_id=run_id,
        status=kw.pop("status", "ok"),
        latency_ms=latency,
        slo_ms=1000,
        hops=hops,
        output="answer",
    )
    return RunRecord(chain, "standard", int(ended_ms - latency), "trace", DEPS, finished, tenant=tenant, **kw)


# ----- the wire form ------------------------------------------------------------------------


def test_a_record_round_trips_with_its_version() -> None:
    original = record(
        "0123456789abcdef", 5000, program_id="p1", parent_program_id="p0", starts_ms={"a": 0.0, "b": 40.5}
    )
    value = encode(original)
    assert json.loads(value)["v"] == shared_runs.FORMAT_VERSION
    assert decode(value) == original


def test_a_record_of_another_format_version_or_not_a_record_is_refused() -> None:
    document = json.loads(encode(record("r1", 1000)))
    document["v"] = shared_runs.FORMAT_VERSION + 1
    for value in (json.dumps(document).encode(), b"[]", b"not json", b'{"v": 1}'):
        with pytest.raises(ValueError):
            decode(value)


def test_a_record_written_by_a_router_of_format_1_is_still_read() -> None:
    # During a rolling upgrade the routers of the last release write format 1: `finished`
    # as protobuf JSON, not as the message's bytes.
    original = record("0123456789abcdef", 5000, program_id="p1", starts_ms={"a": 0.0})
    document = json.loads(encode(original))
    document["v"] = 1
    document["finished"] = json_format.MessageToDict(original.finished, preserving_proto_field_name=True)
    assert decode(json.dumps(document).encode()) == original


def test_a_record_whose_message_bytes_are_damaged_is_refused_by_name() -> None:
    document = json.loads(encode(record("r1", 1000)))
    for damaged in ("not base64!", base64.b64encode(b"\xff\xff\xff").decode()):
        document["finished"] = damaged
        with pytest.raises(ValueError, match="not a run record"):
            decode(json.dumps(document).encode())


def test_a_record_over_the_bound_loses_its_outputs_then_is_not_shared() -> None:
    big = record("r1", 1000)
    whole = len(encode(big))
    bare = encode_bounded(big, max_bytes=whole - 1)
    assert bare is not None and len(bare) < whole
    kept = decode(bare)
    assert kept.finished.output == "" and all(h.output == "" for h in kept.finished.hops)
    assert [h.latency_ms for h in kept.finished.hops] == [40, 60]
    assert big.finished.hops[0].output == "x" * 200  # the router's own copy is untouched
    assert encode_bounded(big, max_bytes=100) is None


# ----- merging and finding ---------------------------------------------------------------


def test_merge_keeps_one_record_per_run_the_routers_own_and_orders_by_end() -> None:
    shared = [record("r3", 3000), record("r1", 1000), record("r2", 2000, status="error")]
    local = [record("r2", 2000), record("r4", 4000)]
    merged = merge(local, shared)
    assert [r.finished.run_id for r in merged] == ["r1", "r2", "r3", "r4"]
    assert merged[1].finished.status == "ok"  # the local copy won


def test_find_in_is_scoped_to_the_tenant() -> None:
    records = [record("aaaa1111", 1000), record("bbbb2222", 2000, tenant="other")]
    assert find_in(records, "aaaa1111", "", "acme").finished.run_id == "aaaa1111"
    assert find_in(records, "aaaa", "", "acme").finished.run_id == "aaaa1111"
    with pytest.raises(NotFound):
        find_in(records, "bbbb2222", "", "acme")
    assert find_in(records, "", "", "acme").finished.run_id == "aaaa1111"  # the tenant's latest
    assert find_in(records, "", "", "other").finished.run_id == "bbbb2222"


def test_find_in_takes_a_program_id_and_says_when_a_prefix_is_ambiguous() -> None:
    records = [record("aaaa1111", 1000, program_id="agent-7"), record("aaaa2222", 2000, program_id="agent-7")]
    assert find_in(records, "agent-7", "", "acme").finished.run_id == "aaaa2222"  # its latest record
    with pytest.raises(InvalidArgument):
        find_in(records, "aaaa", "", "acme")


def test_of_chain_leaves_out_other_chains_tenants_and_running_programs() -> None:
    records = [
        record("r1", 1000),
        record("r2", 2000, chain="other"),
        record("r3", 3000, tenant="other"),
        record("r4", 4000, status=RUNNING),
        record("r5", 5000),
        record("r6", 6000),
    ]
    assert [r.finished.run_id for r in of_chain(records, "demo", 0, "acme")] == ["r1", "r5", "r6"]
    assert [r.finished.run_id for r in of_chain(records, "demo", 2, "acme")] == ["r5", "r6"]


# ----- the store, with etcd faked --------------------------------------------------------


class FakeEtcd:
    """etcd's KV as the store uses it: leases, puts and deletes in transactions (refused,
    as etcd refuses them, when they name a key twice or exceed --max-txn-ops)."""

    transactions = aetcd.client.Transactions()

    def __init__(self) -> None:
        self.kv: dict[str, tuple[bytes, int]] = {}
        self.leases: list[int] = []
        self.down = False
        self.txns: list[int] = []  # operations per transaction
        self.gate: asyncio.Event | None = None  # set: transactions wait for it

    def _check(self) -> None:
        if self.down:
            raise ConnectionError("etcd is down")

    async def lease(self, ttl: int) -> SimpleNamespace:
        self._check()
        self.leases.append(ttl)
        return SimpleNamespace(id=len(self.leases))

    async def put(self, key: bytes, value: bytes, lease: int | None = None) -> None:
        self._check()
        self.kv[key.decode()] = (value, len(self.kv))

    async def delete(self, key: bytes) -> None:
        self._check()
        self.kv.pop(key.decode(), None)

    async def transaction(self, compare, success, failure) -> tuple[bool, list]:
        if self.gate is not None:
            await self.gate.wait()
        self._check()
        keys = [op.key for op in success]
        if len(keys) != len(set(keys)):
            raise aetcd.exceptions.ClientError("etcdserver: duplicate key given in txn request")
        if len(success) > 128:
            raise aetcd.exceptions.ClientError("etcdserver: too many operations in txn request")
        self.txns.append(len(success))
        for op in success:
            if isinstance(op, aetcd.transactions.Put):
                self.kv[op.key.decode()] = (op.value, self._order())
            else:
                self.kv.pop(op.key.decode(), None)
        return True, []

    def _order(self) -> int:
        self.puts = getattr(self, "puts", 0) + 1
        return self.puts


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeEtcd:
    client = FakeEtcd()

    async def newest(_client, prefix: str, limit: int) -> list[tuple[str, bytes]]:
        client._check()
        found = sorted(
            ((k, v) for k, v in client.kv.items() if k.startswith(prefix)), key=lambda kv: -kv[1][1]
        )
        return [(k, v) for k, (v, _) in found[:limit]]

    monkeypatch.setattr(etcd, "get_prefix_newest", newest)
    return client


def counted(op: str, result: str) -> float:
    return metrics.SHARED_RUN_RECORDS.labels(op, result)._value.get()


async def test_records_are_put_under_their_tenant_and_bounded_per_router(fake: FakeEtcd) -> None:
    store = SharedRuns(fake, retention_s=60, per_router=2)
    for i in range(3):
        assert await store.put(record(f"run{i}", 1000 * i))
    assert sorted(fake.kv) == [etcd.run_key("acme", "run1"), etcd.run_key("acme", "run2")]
    assert fake.leases == [60]  # one lease for records put within a tenth of the retention


async def test_get_run_and_stats_merge_the_shared_records_of_the_tenant_only(fake: FakeEtcd) -> None:
    store = SharedRuns(fake, retention_s=60)
    for r in (
        record("elsewhere1", 1000),
        record("elsewhere2", 3000),
        record("theirs01", 2000, tenant="other"),
    ):
        await store.put(r)
    local = RunStore()
    local.add(record("mine0001", 2000))
    found = await shared_runs.find_run(local, store, "elsewhere1", "", "acme")
    assert found.finished.run_id == "elsewhere1"
    with pytest.raises(InvalidArgument):  # a prefix of two shared runs
        await shared_runs.find_run(local, store, "else", "", "acme")
    assert (
        await shared_runs.find_run(local, store, "elsewhere2", "", "acme")
    ).finished.run_id == "elsewhere2"
    with pytest.raises(NotFound):
        await shared_runs.find_run(local, store, "theirs01", "", "acme")
    assert (await shared_runs.find_run(local, store, "", "", "acme")).finished.run_id == "elsewhere2"
    runs = await shared_runs.chain_runs(local, store, "demo", 0, "acme")
    assert [r.finished.run_id for r in runs] == ["elsewhere1", "mine0001", "elsewhere2"]


async def test_etcd_down_fails_nothing_counts_and_logs_once(
    fake: FakeEtcd, caplog: pytest.LogCaptureFixture
) -> None:
    store = SharedRuns(fake, retention_s=60)
    fake.down = True
    failed_before = counted("put", "failed")
    with caplog.at_level(logging.WARNING, logger="inferx.router.shared_runs"):
        assert not await store.put(record("r1000000", 1000))
        assert not await store.put(record("r2", 2000))
    assert counted("put", "failed") == failed_before + 2
    assert len([m for m in caplog.messages if "cannot share" in m]) == 1
    local = RunStore()
    local.add(record("mine0001", 1000))
    assert (await shared_runs.find_run(local, store, "mine0001", "", "acme")).finished.run_id == "mine0001"
    with pytest.raises(NotFound):
        await shared_runs.find_run(local, store, "r1000000", "", "acme")
    assert len(await shared_runs.chain_runs(local, store, "demo", 0, "acme")) == 1
    fake.down = False
    assert await store.put(record("r3", 3000))


async def test_a_router_that_shares_nothing_answers_from_its_own_records(fake: FakeEtcd) -> None:
    store = SharedRuns(fake, retention_s=0)
    store.publish(record("r1", 1000))
    assert not store.enabled and fake.kv == {}
    local = RunStore()
    local.add(record("mine0001", 1000))
    assert (await shared_runs.find_run(local, None, "mine", "", "acme")).finished.run_id == "mine0001"


async def test_published_records_are_put_by_the_writer_and_flushed_on_close(fake: FakeEtcd) -> None:
    store = SharedRuns(fake, retention_s=60)
    store.start()
    store.publish(record("run00001", 1000))
    store.publish(record("run00002", 2000, tenant="other"))
    await store.close()
    assert sorted(fake.kv) == [etcd.run_key("acme", "run00001"), etcd.run_key("other", "run00002")]


async def test_records_published_while_a_write_is_in_flight_go_in_one_transaction(fake: FakeEtcd) -> None:
    store = SharedRuns(fake, retention_s=60)
    fake.gate = asyncio.Event()
    store.start()
    store.publish(record("first001", 1000))
    await asyncio.sleep(0)  # the writer takes it and waits on etcd
    for i in range(20):
        store.publish(record(f"run{i:05d}", 2000 + i))
    fake.gate.set()
    await store.close()
    assert fake.txns == [1, 20]  # a batch of one when idle, then everything that queued
    assert len(fake.kv) == 21 and all(fake.kv[etcd.run_key("acme", f"run{i:05d}")] for i in range(20))


async def test_a_batch_keeps_etcds_bounds_and_the_per_router_bound(
    fake: FakeEtcd, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shared_runs, "BATCH_BYTES", 3 * len(encode(record("run00000", 0))))
    store = SharedRuns(fake, retention_s=60, per_router=4)
    assert await store.put_many([record(f"run{i:05d}", 1000 * i) for i in range(3)]) == 3
    # 7 more: split by bytes (3 per transaction); the oldest past 4 deleted in the same
    # transaction, and the new ones already past it never put (etcd refuses a key twice).
    assert await store.put_many([record(f"run{i:05d}", 1000 * i) for i in range(3, 10)]) == 7
    assert sorted(fake.kv) == [etcd.run_key("acme", f"run{i:05d}") for i in range(6, 10)]
    assert fake.txns[0] == 3 and all(n <= 6 for n in fake.txns)
    monkeypatch.setattr(shared_runs, "BATCH_BYTES", 1 << 20)
    many = SharedRuns(fake, retention_s=60, per_router=1000)
    assert await many.put_many([record(f"big{i:05d}", i) for i in range(120)]) == 120
    assert fake.txns[-3:] == [50, 50, 20]  # BATCH_RECORDS: within etcd's 128 operations


async def test_a_failed_batch_counts_every_record_and_keeps_the_bound_state(fake: FakeEtcd) -> None:
    store = SharedRuns(fake, retention_s=60, per_router=2)
    failed_before = counted("put", "failed")
    fake.down = True
    assert await store.put_many([record("r0000001", 1), record("r0000002", 2)]) == 0
    assert counted("put", "failed") == failed_before + 2
    fake.down = False
    assert await store.put_many([record(f"r{i:07d}", i) for i in range(3, 6)]) == 3
    assert sorted(fake.kv) == [etcd.run_key("acme", "r0000004"), etcd.run_key("acme", "r0000005")]


async def test_a_busy_router_writes_at_most_one_transaction_per_interval_and_a_stop_flushes_at_once(
    fake: FakeEtcd, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(shared_runs, "BATCH_INTERVAL_S", 10.0)
    store = SharedRuns(fake, retention_s=60)
    store.start()
    store.publish(record("idle0001", 1000))
    for _ in range(200):  # idle: written at once, not after the interval
        if fake.kv:
            break
        await asyncio.sleep(0.01)
    assert list(fake.kv) == [etcd.run_key("acme", "idle0001")]
    store.publish(record("busy0001", 2000))
    store.publish(record("busy0002", 3000))
    await asyncio.sleep(0.2)
    assert len(fake.kv) == 1  # within the interval of the last write: they wait for more
    started = asyncio.get_running_loop().time()
    with caplog.at_level(logging.WARNING, logger="inferx.router.shared_runs"):
        await store.close()
    assert asyncio.get_running_loop().time() - started < 1.0  # the stop did not wait 10 s
    assert not [m for m in caplog.messages if "not shared" in m]
    assert len(fake.kv) == 3 and fake.txns == [1, 2]


async def test_records_finishing_faster_than_the_interval_share_transactions(
    fake: FakeEtcd, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shared_runs, "BATCH_INTERVAL_S", 0.05)
    store = SharedRuns(fake, retention_s=60)
    store.start()
    for i in range(40):  # one every 5 ms for 0.2 s: 40 puts before, ~5 transactions now
        store.publish(record(f"fast{i:04d}", i))
        await asyncio.sleep(0.005)
    await store.close()
    assert len(fake.kv) == 40 and sum(fake.txns) == 40
    assert len(fake.txns) <= 10, fake.txns


async def test_a_full_batch_does_not_wait_for_the_interval(
    fake: FakeEtcd, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The interval bounds transactions per second, never records per second: with a
    backlog of full batches each goes as soon as the previous one is written."""
    monkeypatch.setattr(shared_runs, "BATCH_INTERVAL_S", 10.0)
    store = SharedRuns(fake, retention_s=60, per_router=1000)
    fake.gate = asyncio.Event()
    store.start()
    store.publish(record("first001", 0))
    await asyncio.sleep(0)  # written alone (idle), held by etcd
    for i in range(2 * shared_runs.BATCH_RECORDS):
        store.publish(record(f"run{i:05d}", i))
    fake.gate.set()
    for _ in range(200):
        if len(fake.kv) == 1 + 2 * shared_runs.BATCH_RECORDS:
            break
        await asyncio.sleep(0.01)
    assert fake.txns == [1, shared_runs.BATCH_RECORDS, shared_runs.BATCH_RECORDS]  # within 2 s, not 20
    await store.close()
