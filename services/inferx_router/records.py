"""The router's memory of its recent runs, for `inferx trace` and `inferx stats`
without a tracing backend.

Pure logic (no I/O): a bounded store of finished runs, each node's place in time,
the critical path, and per-node percentiles with the node that makes the P99.

Timing model: a node starts when its last dependency finishes (that is how ChainRun
schedules it) and runs for its reported latency, so start and end offsets -- and
the critical path -- follow from the DAG and the latencies alone. A dynamic program
(calls of the OpenAI front or `CallModel`: `programs.py`) has no declared DAG: its
record gives each call's observed start (`starts_ms`), and each call depends on the
call that finished last before it started.

A dynamic program's record is kept from its first call on, with status `running`
until it ends; `find` takes its program id as well as its run id.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from inferx.auth.model import DEFAULT_TENANT
from inferx.chain.schema import ChainConfig
from inferx.errors import InvalidArgument, NotFound
from inferx.stats import percentile
from inferx.v1 import router_pb2

DEFAULT_CAPACITY = 1000
KEEP_OUTPUT_CHARS = 200  # enough to recognise an answer, bounded memory per run
MIN_PREFIX = 4
RUNNING = "running"  # the status of a dynamic program that has not ended yet


@dataclass(frozen=True)
class RunRecord:
    chain: str
    tier: str
    started_unix_ms: int
    trace_id: str
    depends_on: Mapping[str, tuple[str, ...]]
    finished: router_pb2.ChainFinished
    tenant: str = DEFAULT_TENANT  # whose run it is: other tenants are told it does not exist
    # Dynamic programs only: the id the client gave (without its tenant), the program
    # that started it, and each call's start in ms since the program's first call.
    program_id: str = ""
    parent_program_id: str = ""
    starts_ms: Mapping[str, float] = field(default_factory=dict)
    # The program's hop index of this record's call-0 (a record continues the count of
    # the one before it), and the record of the same program this one continues when
    # the program moved here from another router ("" = none).
    first_hop_index: int = 0
    continues_run_id: str = ""
    # A child run of a `type: chain` node: the parent run's id and that node's.
    parent_run_id: str = ""
    parent_node_id: str = ""


@dataclass(frozen=True)
class NodeTiming:
    node_id: str
    start_ms: float
    end_ms: float
    critical: bool


def node_timings(
    hops: Sequence[router_pb2.NodeFinished],
    depends_on: Mapping[str, Sequence[str]],
    starts_ms: Mapping[str, float] | None = None,
) -> list[NodeTiming]:
    """Start/end offsets of every hop (in `hops` order) and whether it is on the
    critical path: the chain of nodes, each gating the next, that ends last. With
    `starts_ms` (a dynamic program's observed starts) a node starts there instead."""
    latency = {hop.node_id: hop.latency_ms for hop in hops}
    end: dict[str, float] = {}

    def finish(node_id: str, seen: tuple[str, ...] = ()) -> float:
        if node_id in end:
            return end[node_id]
        if node_id in seen:  # a cycle cannot be configured; do not loop if it were
            return 0.0
        if starts_ms is not None and node_id in starts_ms:
            start = starts_ms[node_id]
        else:
            deps = [d for d in depends_on.get(node_id, ()) if d in latency]
            start = max((finish(d, (*seen, node_id)) for d in deps), default=0.0)
        end[node_id] = start + latency.get(node_id, 0.0)
        return end[node_id]

    for hop in hops:
        finish(hop.node_id)
    critical: set[str] = set()
    current = max(end, key=lambda n: end[n], default=None)
    while current is not None:
        critical.add(current)
        deps = [d for d in depends_on.get(current, ()) if d in end]
        current = max(deps, key=lambda d: end[d], default=None)
    return [
        NodeTiming(
            hop.node_id,
            end[hop.node_id] - latency[hop.node_id],
            end[hop.node_id],
            hop.node_id in critical,
        )
        for hop in hops
    ]


@dataclass(frozen=True)
class Percentiles:
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Percentiles:
        """Linear interpolation (few, finite samples: no jumps between runs). No samples
        gives zeros: the wire message has no "absent", and the sample count says so."""
        if not values:
            return cls(0.0, 0.0, 0.0, 0.0)
        return cls(
            percentile(values, 50, method="linear"),
            percentile(values, 90, method="linear"),
            percentile(values, 99, method="linear"),
            max(values),
        )


@dataclass(frozen=True)
class NodeStats:
    node_id: str
    node_type: str
    samples: int
    latency: Percentiles
    queue: Percentiles
    errors: int
    retries: int
    degraded: int
    cache_hits: int
    critical_ratio: float  # share of runs where it was on the critical path
    p99_contribution_ms: float  # mean excess over its median in the tail runs
    p99_share: float  # of the tail's total excess, 0..1


@dataclass(frozen=True)
class ChainStats:
    chain: str
    runs: int
    ok: int
    slo_met: int
    slo_ms: float
    latency: Percentiles
    nodes: list[NodeStats] = field(default_factory=list)
    top_node: str = ""  # the node that contributes most to the P99
    cost: Percentiles = Percentiles(0.0, 0.0, 0.0, 0.0)  # per run (inferx.pricing)
    cost_total: float = 0.0


def chain_stats(chain: str, records: Sequence[RunRecord]) -> ChainStats:
    """Per-node P50/P90/P99 over `records`, and which node makes the chain's P99.

    The tail runs are those at or above the chain's P99. In each, every node on the
    critical path contributes its latency above its own median (jitter that a node
    off the critical path has cannot delay the chain). The node with the largest mean
    contribution is the one to fix; with no tail excess at all (identical runs), it is
    the node with the widest P99-P50 spread.
    """
    runs = [r.finished for r in records]
    totals = [f.latency_ms for f in runs]
    chain_p = Percentiles.of(totals)
    order: list[str] = []
    per_node: dict[str, list[router_pb2.NodeFinished]] = {}
    for finished in runs:
        for hop in finished.hops:
            if hop.node_id not in per_node:
                order.append(hop.node_id)
                per_node[hop.node_id] = []
            per_node[hop.node_id].append(hop)
    ran = {n: [h for h in hops if h.status != "skipped" or h.latency_ms > 0] for n, hops in per_node.items()}
    # A node that never ran (always skipped) has no median; 0 means any latency is excess.
    median = {
        n: percentile([h.latency_ms for h in hops], 50, method="linear") if hops else 0.0
        for n, hops in ran.items()
    }
    timings = [{t.node_id: t for t in timings_of(r)} for r in records]
    tail = [i for i, total in enumerate(totals) if total >= chain_p.p99]
    excess: dict[str, float] = dict.fromkeys(order, 0.0)
    for i in tail:
        for hop in runs[i].hops:
            timing = timings[i].get(hop.node_id)
            if timing is not None and timing.critical:
                excess[hop.node_id] += max(0.0, hop.latency_ms - median.get(hop.node_id, 0.0))
    contribution = {n: excess[n] / len(tail) for n in order} if tail else dict.fromkeys(order, 0.0)
    total_excess = sum(contribution.values())
    nodes = []
    for node_id in order:
        hops = per_node[node_id]
        nodes.append(
            NodeStats(
                node_id=node_id,
                node_type=hops[-1].node_type,
                samples=len(ran[node_id]),
                latency=Percentiles.of([h.latency_ms for h in ran[node_id]]),
                queue=Percentiles.of([h.queue_ms for h in ran[node_id] if h.model]),
                errors=sum(1 for h in hops if h.status not in ("ok", "skipped")),
                retries=sum(h.retries for h in hops),
                degraded=sum(1 for h in hops if h.degradation),
                cache_hits=sum(1 for h in hops if h.cache_hit),
                critical_ratio=(
                    sum(1 for t in timings if node_id in t and t[node_id].critical) / len(records)
                    if records
                    else 0.0
                ),
                p99_contribution_ms=contribution[node_id],
                p99_share=contribution[node_id] / total_excess if total_excess > 0 else 0.0,
            )
        )
    return ChainStats(
        chain=chain,
        runs=len(runs),
        ok=sum(1 for f in runs if f.status == "ok"),
        slo_met=sum(1 for f in runs if f.slo_met),
        slo_ms=runs[-1].slo_ms if runs else 0.0,
        latency=chain_p,
        nodes=nodes,
        top_node=_top_node(nodes),
        cost=Percentiles.of([f.cost for f in runs]),
        cost_total=sum(f.cost for f in runs),
    )


def _top_node(nodes: Sequence[NodeStats]) -> str:
    if not nodes:
        return ""
    best = max(nodes, key=lambda n: n.p99_contribution_ms)
    if best.p99_contribution_ms > 0:
        return best.node_id
    widest = max(nodes, key=lambda n: n.latency.p99 - n.latency.p50)
    return widest.node_id if widest.latency.p99 > widest.latency.p50 else ""


def timings_of(record: RunRecord) -> list[NodeTiming]:
    return node_timings(record.finished.hops, record.depends_on, record.starts_ms or None)


class RunStore:
    """The last `capacity` finished runs, oldest evicted first.

    `publish`, when set, is given every record that has finished (a chain run when it is
    added, a dynamic program when it ends): the router sets it to put the record in the
    shared store (`shared_runs`), so that every router can answer for it."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self._runs: OrderedDict[str, RunRecord] = OrderedDict()
        self._capacity = capacity
        self.publish: Callable[[RunRecord], None] | None = None

    def finished(self, record: RunRecord) -> None:
        """`record` will not change any more: hand it to `publish`."""
        if self.publish is not None:
            self.publish(record)

    def of_tenant(self, tenant: str) -> list[RunRecord]:
        """The tenant's kept records, oldest first."""
        return [r for r in self._runs.values() if r.tenant == tenant]

    @property
    def capacity(self) -> int:
        return self._capacity

    @capacity.setter
    def capacity(self, value: int) -> None:
        self._capacity = max(value, 0)
        self._evict()

    def __len__(self) -> int:
        return len(self._runs)

    def add(self, record: RunRecord) -> None:
        self._runs[record.finished.run_id] = record
        self._runs.move_to_end(record.finished.run_id)
        self._evict()

    def _evict(self) -> None:
        while len(self._runs) > self._capacity:
            self._runs.popitem(last=False)

    def find(self, run_id: str = "", chain: str = "", *, tenant: str = DEFAULT_TENANT) -> RunRecord:
        """By full id or unique prefix, or a dynamic program's id (or unique prefix: its
        latest record); with no id, the latest run (of `chain`, if given). Only the
        tenant's runs: another tenant's run is "not found", never "forbidden"."""
        if not run_id:
            for record in reversed(self._runs.values()):
                if record.tenant == tenant and (not chain or record.chain == chain):
                    return record
            where = f" of chain '{chain}'" if chain else ""
            raise NotFound(f"no recent run{where} is kept by this router")
        exact = self._runs.get(run_id)
        if exact is not None and exact.tenant == tenant:
            return exact
        mine = [r for r in reversed(self._runs.values()) if r.tenant == tenant]  # newest first
        program = next((r for r in mine if r.program_id == run_id), None)
        if program is not None:
            return program
        if len(run_id) < MIN_PREFIX:
            raise InvalidArgument(f"run id '{run_id}': give at least {MIN_PREFIX} characters")
        matches = [r for r in mine if r.finished.run_id.startswith(run_id)]
        if not matches:
            matches = [r for r in mine if r.program_id.startswith(run_id)]
            if len({r.program_id for r in matches}) == 1:
                return matches[0]  # one program's latest record
        if len(matches) > 1:
            raise InvalidArgument(f"run id '{run_id}' matches {len(matches)} runs; give more characters")
        if not matches:
            raise NotFound(
                f"run '{run_id}' is not among the last {self._capacity} runs of this router "
                "(raise --recent-runs to keep more)"
            )
        return matches[0]

    def of_chain(self, chain: str, last: int = 0, *, tenant: str = DEFAULT_TENANT) -> list[RunRecord]:
        """The tenant's kept runs of the chain, oldest first; `last` > 0 keeps only the newest
        `last`. Dynamic programs still running are left out (their latency is not known yet)."""
        runs = [
            r
            for r in self._runs.values()
            if r.chain == chain and r.tenant == tenant and r.finished.status != RUNNING
        ]
        return runs[-last:] if last > 0 else runs


# The router's store; __main__ sets its capacity from --recent-runs.
RECENT = RunStore()


def record_run(
    config: ChainConfig,
    finished: router_pb2.ChainFinished,
    *,
    tier: str,
    trace_id: str = "",
    tenant: str = DEFAULT_TENANT,
    store: RunStore = RECENT,
    parent_run_id: str = "",
    parent_node_id: str = "",
) -> RunRecord:
    """Keep a finished run (outputs shortened: the store is for timings, not answers)."""
    kept = router_pb2.ChainFinished()
    kept.CopyFrom(finished)
    kept.output = shorten(kept.output)
    for hop in kept.hops:
        hop.output, hop.reasoning = shorten(hop.output), shorten(hop.reasoning)
    record = RunRecord(
        chain=config.name,
        tier=tier,
        started_unix_ms=int(time.time() * 1000 - finished.latency_ms),
        trace_id=trace_id,
        depends_on={node.id: tuple(node.depends_on) for node in config.nodes},
        finished=kept,
        tenant=tenant,
        parent_run_id=parent_run_id,
        parent_node_id=parent_node_id,
    )
    store.add(record)
    store.finished(record)
    return record


def shorten(text: str) -> str:
    """An output as a record keeps it."""
    return text if len(text) <= KEEP_OUTPUT_CHARS else text[: KEEP_OUTPUT_CHARS - 1] + "…"


# ----- protobuf ----------------------------------------------------------------------------


def run_trace_message(record: RunRecord) -> router_pb2.RunTrace:
    reply = router_pb2.RunTrace(
        chain=record.chain,
        tier=record.tier,
        started_unix_ms=record.started_unix_ms,
        trace_id=record.trace_id,
        finished=record.finished,
        program_id=record.program_id,
        parent_program_id=record.parent_program_id,
        parent_run_id=record.parent_run_id,
        parent_node_id=record.parent_node_id,
    )
    for timing in timings_of(record):
        reply.timings.add(
            node_id=timing.node_id,
            start_ms=timing.start_ms,
            end_ms=timing.end_ms,
            critical=timing.critical,
            depends_on=record.depends_on.get(timing.node_id, ()),
        )
    return reply


def _percentiles_message(p: Percentiles) -> router_pb2.LatencyPercentiles:
    return router_pb2.LatencyPercentiles(p50_ms=p.p50, p90_ms=p.p90, p99_ms=p.p99, max_ms=p.max)


def chain_stats_message(stats: ChainStats) -> router_pb2.ChainStats:
    reply = router_pb2.ChainStats(
        chain=stats.chain,
        runs=stats.runs,
        ok=stats.ok,
        slo_met=stats.slo_met,
        slo_ms=stats.slo_ms,
        latency=_percentiles_message(stats.latency),
        top_node=stats.top_node,
        cost=router_pb2.CostPercentiles(
            p50=stats.cost.p50, p99=stats.cost.p99, max=stats.cost.max, total=stats.cost_total
        ),
    )
    for node in stats.nodes:
        reply.nodes.add(
            node_id=node.node_id,
            node_type=node.node_type,
            samples=node.samples,
            latency=_percentiles_message(node.latency),
            queue=_percentiles_message(node.queue),
            errors=node.errors,
            retries=node.retries,
            degraded=node.degraded,
            cache_hits=node.cache_hits,
            critical_ratio=node.critical_ratio,
            p99_contribution_ms=node.p99_contribution_ms,
            p99_share=node.p99_share,
        )
    return reply
