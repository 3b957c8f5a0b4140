"""Finished run records shared by every router, in etcd: any router answers any run's
trace (`GetRun`) and any chain's stats (`GetChainStats`), and a client that reconnects
to another router -- or whose router died -- still finds its runs.

Why etcd (and not the cache service): etcd is already every service's replicated store
(a record survives the loss of an etcd member and of the router that ran it), leases give
the retention bound for free (a record is gone when its lease ends, whoever wrote it),
and a tenant's records can be listed by key prefix, newest first and bounded. The cache
service keeps each key on one replica (consistent hashing, no copies) and cannot list.
What etcd asks in return is respected: one put per finished run (never per hop), records
already shortened (outputs cut to 200 characters, `records.shorten`) and capped at
`MAX_RECORD_BYTES` (hop outputs dropped first, then the record is not shared), and a
count bound per router (`per_router`: its oldest shared record is deleted past it).

Layout: `/inferx/v1/runs/<tenant>/<run id>` = the record as JSON (`encode`), with a
format version `v`; the ChainFinished message as protobuf JSON (json_format), so
`etcdctl get` shows it. Each record is put under a lease of `retention_s` that is
never refreshed; a router grants a new one every `retention_s / 10` (at least 1 s), so
a record lives between 0.9x and 1x the retention, and a router holds about ten leases.

Writing is off the run's path and batched: `publish` queues the record (bounded,
`QUEUE_SIZE`; past it a record is dropped and counted), and one writer task puts
everything that queued while its previous write was in flight in one etcd transaction
(at most `BATCH_RECORDS` records and `BATCH_BYTES` bytes, with the deletes of this
router's records past `per_router`), and, short of a full batch, at most one
transaction per `BATCH_INTERVAL_S` (25 ms): still one record per finished run, but one
etcd call per batch instead of one per run, so under load the router spends its CPU on
runs, not on etcd calls (issue #14's profile: the per-run put was ~8% of the router's
CPU). An idle router writes a record at once; a busy one shares it at most 25 ms later
than before. A clean stop (`close`) waits for everything queued to be written.

etcd unreachable: the put fails, is counted (`inferx_shared_run_records_total`) and
logged once until a put succeeds again; the run itself is never failed by it. A read
that fails is counted too and answers with this router's own records only.

Pure parts (`encode`, `decode`, `merge`, `find_in`, `of_chain`) are tested alone.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import itertools
import json
import logging
import math
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import replace

import aetcd
import grpc
from google.protobuf import json_format
from google.protobuf.message import DecodeError

from inferx import etcd
from inferx.errors import InvalidArgument, NotFound
from inferx.v1 import router_pb2
from inferx_router import metrics
from inferx_router.records import RUNNING, RunRecord, RunStore

log = logging.getLogger("inferx.router.shared_runs")

# 2: `finished` is the ChainFinished message's bytes, base64. Format 1 had it as protobuf
# JSON: ~56 us to encode a 4-hop record against 9, CPU the batch writer takes from the
# same core that serves every run. Format 1 is still read, so routers of either version
# share records during a rolling upgrade.
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
MAX_RECORD_BYTES = 512 * 1024  # etcd refuses requests over 1.5 MiB by default; stay well below
DEFAULT_RETENTION_S = 3600
DEFAULT_PER_ROUTER = 10_000
LIST_LIMIT = 2000  # records read from etcd per listing (the tenant's newest)
QUEUE_SIZE = 1000  # records waiting for their put; more are dropped (counted)
# One transaction's bounds: etcd refuses more than --max-txn-ops (default 128) operations
# (a batch is its puts plus as many deletes at most) and requests over 1.5 MiB.
BATCH_RECORDS = 50
BATCH_BYTES = 1024 * 1024
# At most one transaction per interval: an idle router writes a record at once, a busy
# one gathers what finishes within the interval (a record waits at most this long), so
# the etcd calls per second stay bounded however many runs finish.
BATCH_INTERVAL_S = 0.025
PREFIX_MATCHES = 16  # records read for a run id prefix

FAILURES = (*etcd.ETCD_DOWN_ERRORS, grpc.RpcError)


# ----- pure: the record on the wire, and merging ------------------------------------------


def encode(record: RunRecord, *, keep_outputs: bool = True) -> bytes:
    finished = record.finished
    if not keep_outputs:
        finished = router_pb2.ChainFinished()
        finished.CopyFrom(record.finished)
        finished.output = ""
        for hop in finished.hops:
            hop.output = ""
    document = {
        "v": FORMAT_VERSION,
        "chain": record.chain,
        "tier": record.tier,
        "tenant": record.tenant,
        "started_unix_ms": record.started_unix_ms,
        "trace_id": record.trace_id,
        "program_id": record.program_id,
        "parent_program_id": record.parent_program_id,
        "depends_on": {node: list(deps) for node, deps in record.depends_on.items()},
        "starts_ms": dict(record.starts_ms),
        "first_hop_index": record.first_hop_index,
        "continues_run_id": record.continues_run_id,
        "parent_run_id": record.parent_run_id,
        "parent_node_id": record.parent_node_id,
        "finished": base64.b64encode(finished.SerializeToString()).decode("ascii"),
    }
    return json.dumps(document, separators=(",", ":"), ensure_ascii=False).encode()


def encode_bounded(record: RunRecord, max_bytes: int = MAX_RECORD_BYTES) -> bytes | None:
    """The record within `max_bytes`: whole, else without its outputs, else None."""
    value = encode(record)
    if len(value) <= max_bytes:
        return value
    value = encode(record, keep_outputs=False)
    return value if len(value) <= max_bytes else None


def decode(value: bytes) -> RunRecord:
    """A record from `encode`'s bytes; ValueError for anything else (a newer format too)."""
    try:
        document = json.loads(value)
        if not isinstance(document, dict):
            raise ValueError("not an object")
        version = document.get("v")
        if version not in READABLE_VERSIONS:
            raise ValueError(f"format version {version!r}, this router reads {READABLE_VERSIONS}")
        finished = router_pb2.ChainFinished()
        if version == 1:
            json_format.ParseDict(document["finished"], finished)
        else:
            finished.ParseFromString(base64.b64decode(document["finished"], validate=True))
        return RunRecord(
            chain=str(document["chain"]),
            tier=str(document["tier"]),
            started_unix_ms=int(document["started_unix_ms"]),
            trace_id=str(document.get("trace_id", "")),
            depends_on={str(n): tuple(str(d) for d in deps) for n, deps in document["depends_on"].items()},
            finished=finished,
            tenant=str(document["tenant"]),
            program_id=str(document.get("program_id", "")),
            parent_program_id=str(document.get("parent_program_id", "")),
            starts_ms={str(n): float(ms) for n, ms in document.get("starts_ms", {}).items()},
            first_hop_index=int(document.get("first_hop_index", 0)),
            continues_run_id=str(document.get("continues_run_id", "")),
            parent_run_id=str(document.get("parent_run_id", "")),
            parent_node_id=str(document.get("parent_node_id", "")),
        )
    except (KeyError, TypeError, AttributeError, json_format.ParseError, binascii.Error, DecodeError) as exc:
        raise ValueError(f"not a run record: {exc}") from None  # binascii.Error is a ValueError too


def ended_unix_ms(record: RunRecord) -> float:
    return record.started_unix_ms + record.finished.latency_ms


def merge(local: Iterable[RunRecord], shared: Iterable[RunRecord]) -> list[RunRecord]:
    """One record per run id (this router's own copy wins: it may be newer, e.g. a program
    still running), oldest end first."""
    by_id: dict[str, RunRecord] = {}
    for record in shared:
        by_id[record.finished.run_id] = record
    for record in local:
        by_id[record.finished.run_id] = record
    return sorted(by_id.values(), key=ended_unix_ms)


MAX_JOINED = 64  # records of one program joined into one trace at most


def join_program(records: Iterable[RunRecord], found: RunRecord) -> RunRecord:
    """`found` (a dynamic program's record) joined with the records of the same program
    it continues and that continue it (`RunRecord.continues_run_id`: the program moved
    between routers), as one record: every call, named by its hop index in the program
    (`call-<n>`), its start on the first record's clock; running while any part is.
    `found` itself when it is linked to none of `records`."""
    if not found.program_id:
        return found
    same = [r for r in records if r.program_id == found.program_id and r.tenant == found.tenant]
    by_id = {r.finished.run_id: r for r in same}
    after = {r.continues_run_id: r for r in same if r.continues_run_id}
    parts = [found]
    while parts[0].continues_run_id in by_id and len(parts) < MAX_JOINED:
        earlier = by_id[parts[0].continues_run_id]
        if earlier in parts:
            break
        parts.insert(0, earlier)
    while parts[-1].finished.run_id in after and len(parts) < MAX_JOINED:
        later = after[parts[-1].finished.run_id]
        if later in parts:
            break
        parts.append(later)
    if len(parts) == 1:
        return found
    first = parts[0]
    finished = router_pb2.ChainFinished()
    finished.CopyFrom(parts[-1].finished)
    del finished.hops[:]
    depends_on: dict[str, tuple[str, ...]] = {}
    starts_ms: dict[str, float] = {}
    last_node = ""
    latency_ms = 0.0
    for part in parts:
        offset_ms = part.started_unix_ms - first.started_unix_ms
        names = {}
        for hop in part.finished.hops:
            local = _call_number(hop.node_id)
            names[hop.node_id] = hop.node_id if local is None else f"call-{part.first_hop_index + local}"
        part_last = ""
        for hop in sorted(part.finished.hops, key=lambda h: part.starts_ms.get(h.node_id, 0.0)):
            kept = finished.hops.add()
            kept.CopyFrom(hop)
            kept.node_id = names[hop.node_id]
            start = offset_ms + part.starts_ms.get(hop.node_id, 0.0)
            starts_ms[kept.node_id] = start
            deps = tuple(names.get(d, d) for d in part.depends_on.get(hop.node_id, ()))
            # A part's first call followed the previous part's last (on another router).
            depends_on[kept.node_id] = deps or ((last_node,) if last_node else ())
            latency_ms = max(latency_ms, start + hop.latency_ms)
            part_last = kept.node_id
        last_node = part_last or last_node
    statuses = {part.finished.status for part in parts}
    for status in (RUNNING, "error", "deadline_exceeded"):
        if status in statuses:
            finished.status = status
            break
    finished.latency_ms = latency_ms
    finished.slo_met = finished.status == "ok"
    finished.error = "; ".join(part.finished.error for part in parts if part.finished.error)
    return replace(
        first,
        finished=finished,
        depends_on=depends_on,
        starts_ms=starts_ms,
        trace_id=parts[-1].trace_id or first.trace_id,
        continues_run_id="",
    )


def _call_number(node_id: str) -> int | None:
    prefix, _, number = node_id.partition("-")
    return int(number) if prefix == "call" and number.isdigit() else None


def find_in(records: Sequence[RunRecord], run_id: str, chain: str, tenant: str) -> RunRecord:
    """`RunStore.find`'s answer (full id, unique prefix, program id, latest of a chain)
    over `records`, the tenant's only; NotFound says no router keeps it."""
    store = RunStore(capacity=len(records))
    for record in records:
        store.add(record)
    try:
        return store.find(run_id, chain, tenant=tenant)
    except NotFound:
        if not run_id:
            where = f" of chain '{chain}'" if chain else ""
            raise NotFound(f"no recent run{where} is kept by any router") from None
        raise NotFound(
            f"run '{run_id}' is not kept by any router (finished runs are shared for "
            "--run-retention-s, and each router keeps its last --recent-runs in memory)"
        ) from None


def of_chain(records: Sequence[RunRecord], chain: str, last: int, tenant: str) -> list[RunRecord]:
    """The tenant's ended runs of `chain` in `records` (merged, oldest first); the newest `last`."""
    runs = [r for r in records if r.chain == chain and r.tenant == tenant and r.finished.status != RUNNING]
    return runs[-last:] if last > 0 else runs


# ----- the store ----------------------------------------------------------------------------


class SharedRuns:
    """This router's writer and reader of the shared records (see the module's doc).

    `publish` is synchronous and never fails (it queues); a task puts the records."""

    def __init__(
        self,
        client: aetcd.Client,
        *,
        retention_s: int = DEFAULT_RETENTION_S,
        per_router: int = DEFAULT_PER_ROUTER,
        list_limit: int = LIST_LIMIT,
        max_record_bytes: int = MAX_RECORD_BYTES,
    ) -> None:
        self._client = client
        self.retention_s = retention_s
        self.per_router = per_router
        self.list_limit = list_limit
        self.max_record_bytes = max_record_bytes
        self._queue: asyncio.Queue[RunRecord] = asyncio.Queue(QUEUE_SIZE)
        self._mine: deque[str] = deque()  # keys this router put, oldest first
        self._lease: int | None = None
        self._lease_at = 0.0
        self._task: asyncio.Task[None] | None = None
        self._put_failing = False
        self._read_failing = False
        self._closing = asyncio.Event()

    @property
    def enabled(self) -> bool:
        return self.retention_s > 0 and self.per_router > 0

    @property
    def lease_every_s(self) -> float:
        return max(self.retention_s / 10, 1.0)

    # ----- writing ------------------------------------------------------------------------

    def publish(self, record: RunRecord) -> None:
        if not self.enabled:
            return
        try:
            self._queue.put_nowait(record)
        except asyncio.QueueFull:
            metrics.SHARED_RUN_RECORDS.labels("put", "dropped").inc()

    def start(self) -> None:
        if self._task is None and self.enabled:
            self._task = asyncio.create_task(self._run(), name="shared-runs")

    async def close(self, flush_s: float = 2.0) -> None:
        """Put what is queued (for up to `flush_s`), then stop."""
        if self._task is None:
            return
        self._closing.set()
        try:  # every queued record put, the one being put included
            await asyncio.wait_for(self._queue.join(), flush_s)
        except TimeoutError:
            log.warning("%d finished runs were not shared before stopping", self._queue.qsize())
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        self._task = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        last = -math.inf  # when the previous transaction started
        while True:
            batch = [await self._queue.get()]
            wait = last + BATCH_INTERVAL_S - loop.time()
            if wait > 0 and self._queue.qsize() + 1 < BATCH_RECORDS and not self._closing.is_set():
                # Busy: what finishes meanwhile goes in the same transaction. A full
                # batch goes at once (the interval never caps how many records per
                # second are shared), and a clean stop does not wait either.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._closing.wait(), wait)
            while len(batch) < BATCH_RECORDS and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            last = loop.time()
            try:
                await self.put_many(batch)
            finally:
                for _ in batch:
                    self._queue.task_done()

    async def put(self, record: RunRecord) -> bool:
        """Share one record now; False (counted, logged once) when it could not be."""
        return await self.put_many([record]) == 1

    async def put_many(self, records: Sequence[RunRecord]) -> int:
        """Share `records` now, in as few etcd transactions as their bounds allow; how
        many were shared (the others counted as failed or too large, logged once)."""
        encoded: list[tuple[str, bytes]] = []
        for record in records:
            value = encode_bounded(record, self.max_record_bytes)
            if value is None:
                metrics.SHARED_RUN_RECORDS.labels("put", "too_large").inc()
                log.warning(
                    "run %s is too large to share (over %d bytes)",
                    record.finished.run_id,
                    self.max_record_bytes,
                )
                continue
            encoded.append((etcd.run_key(record.tenant, record.finished.run_id), value))
        shared, start = 0, 0
        while start < len(encoded):
            end, size = start, 0
            while end < len(encoded) and end - start < BATCH_RECORDS:
                size += len(encoded[end][1])
                if end > start and size > BATCH_BYTES:
                    break
                end += 1
            if await self._put_batch(encoded[start:end]):
                shared += end - start
            start = end
        return shared

    async def _put_batch(self, batch: Sequence[tuple[str, bytes]]) -> bool:
        """One transaction: the batch's puts under the current lease, and the deletes of
        this router's oldest records past `per_router`. etcd refuses a transaction naming
        a key twice: a key put twice in the batch is put once (its last value), and a new
        record already past the bound is not put at all (the old code put it, then deleted it)."""
        values: dict[str, bytes] = {}
        for key, value in batch:
            values[key] = value
        added = [key for key in values if not (self._mine and self._mine[-1] == key)]
        excess = max(len(self._mine) + len(added) - self.per_router, 0)
        deleted = list(itertools.islice(self._mine, min(excess, len(self._mine))))
        skipped = set(added[: excess - len(deleted)])
        try:
            lease = await self._current_lease()
            tx = self._client.transactions
            ops = [
                tx.put(key.encode(), value, lease=lease)
                for key, value in values.items()
                if key not in skipped
            ]
            ops += [tx.delete(key.encode()) for key in deleted if key not in values]  # once each
            await self._client.transaction(compare=[], success=ops, failure=[])
        except asyncio.CancelledError:
            raise
        except FAILURES as exc:
            metrics.SHARED_RUN_RECORDS.labels("put", "failed").inc(len(batch))
            self._lease = None  # it may be gone (etcd restarted): grant another
            if not self._put_failing:
                log.warning(
                    "cannot share finished runs in etcd (%s); kept in this router only until it answers", exc
                )
                self._put_failing = True
            return False
        self._mine.extend(added)
        for _ in range(excess):
            self._mine.popleft()
        metrics.SHARED_RUN_RECORDS.labels("put", "ok").inc(len(batch))
        if self._put_failing:
            log.info("finished runs are shared in etcd again")
            self._put_failing = False
        return True

    async def _current_lease(self) -> int:
        now = time.monotonic()
        if self._lease is None or now - self._lease_at >= self.lease_every_s:
            lease = await self._client.lease(self.retention_s)
            self._lease, self._lease_at = lease.id, now
        return self._lease

    # ----- reading ------------------------------------------------------------------------

    async def lookup(self, tenant: str, run_id: str) -> list[RunRecord]:
        """The tenant's shared records that `run_id` may name: the run itself, runs whose id
        starts with it, else (a program id) the tenant's newest. [] when etcd fails."""
        if not self.enabled:
            return []
        try:
            found = await etcd.get_prefix_newest(self._client, etcd.run_key(tenant, run_id), PREFIX_MATCHES)
            if not found:
                found = await etcd.get_prefix_newest(self._client, etcd.runs_prefix(tenant), self.list_limit)
        except FAILURES as exc:
            self._read_failed(exc)
            return []
        return self._decoded(tenant, found)

    async def listing(self, tenant: str) -> list[RunRecord]:
        """The tenant's newest `list_limit` shared records; [] when etcd fails."""
        if not self.enabled:
            return []
        try:
            found = await etcd.get_prefix_newest(self._client, etcd.runs_prefix(tenant), self.list_limit)
        except FAILURES as exc:
            self._read_failed(exc)
            return []
        return self._decoded(tenant, found)

    def _read_failed(self, exc: BaseException) -> None:
        metrics.SHARED_RUN_RECORDS.labels("read", "failed").inc()
        if not self._read_failing:
            log.warning("cannot read shared runs from etcd (%s); answering with this router's own", exc)
            self._read_failing = True

    def _decoded(self, tenant: str, found: Sequence[tuple[str, bytes]]) -> list[RunRecord]:
        metrics.SHARED_RUN_RECORDS.labels("read", "ok").inc()
        self._read_failing = False
        decoded = []
        for key, value in found:
            try:
                record = decode(value)
            except ValueError as exc:
                log.warning("skipping shared run record %s: %s", key, exc)
                continue
            if record.tenant == tenant:  # the key says so too; never trust one alone
                decoded.append(record)
        return decoded


async def find_run(
    local: RunStore, shared: SharedRuns | None, run_id: str, chain: str, tenant: str
) -> RunRecord:
    """GetRun: this router's records first, then the shared ones. A dynamic program's
    record comes joined with the other records of the program (`join_program`: it
    moved between routers), this router's and the shared ones (those that ended)."""
    if run_id:
        try:
            record = local.find(run_id, chain, tenant=tenant)
        except (NotFound, InvalidArgument):  # too short a prefix may still be a program id elsewhere
            if shared is None:
                raise
        else:
            if not record.program_id:
                return record
            others = await shared.listing(tenant) if shared is not None else []
            pool = merge(local.of_tenant(tenant), others)
            if record.program_id == run_id:  # by program id: its newest record, wherever it is
                record = find_in(pool, run_id, chain, tenant)
            return join_program(pool, record)
        found = await shared.lookup(tenant, run_id)
    else:
        found = await shared.listing(tenant) if shared is not None else []
    pool = merge(local.of_tenant(tenant), found)
    return join_program(pool, find_in(pool, run_id, chain, tenant))


async def chain_runs(
    local: RunStore, shared: SharedRuns | None, chain: str, last: int, tenant: str
) -> list[RunRecord]:
    """GetChainStats: the tenant's ended runs of `chain`, this router's and the shared ones."""
    found = await shared.listing(tenant) if shared is not None else []
    return of_chain(merge(local.of_chain(chain, tenant=tenant), found), chain, last, tenant)
