"""Prometheus metrics of the memory-pool: KV capacity, reservations and how full each
pool and worker is (the `> 85%` alert reads the usage ratios), the room kept by look-ahead
reservations, and reservations dropped because their holder died, the budgets leased to schedulers, and
the calls answered by method. Labels: pool, worker, result, kind, method."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import Counter, Gauge

from inferx_memory_pool.ledger import KINDS, WorkerLedger

KV_CAPACITY = Gauge("inferx_memory_kv_capacity_tokens", "KV capacity reported by workers", ["pool"])
KV_RESERVED = Gauge("inferx_memory_kv_reserved_tokens", "KV tokens reserved (hops and look-aheads)", ["pool"])
KV_USAGE = Gauge("inferx_memory_kv_usage_ratio", "Reserved / capacity KV tokens of each pool", ["pool"])
WORKER_KV_USAGE = Gauge(
    "inferx_memory_worker_kv_usage_ratio", "Reserved / capacity KV tokens of each worker", ["pool", "worker"]
)
ENGINE_KV_USAGE = Gauge(
    "inferx_memory_engine_kv_usage_ratio",
    "KV-cache usage each worker's engine reports (0..1)",
    ["pool", "worker"],
)
ACTIVE = Gauge("inferx_memory_active_reservations", "Reservations currently held", ["pool"])
WORKER_LOOKAHEAD = Gauge(
    "inferx_memory_worker_lookahead_tokens",
    "KV tokens of each worker kept by look-ahead reservations for chains' next hops",
    ["pool", "worker"],
)
RESERVATIONS = Counter(
    "inferx_memory_reservations_total",
    "Reservation requests by result (granted|refused) and kind (hop|lookahead)",
    ["result", "kind"],
)
for _result in ("granted", "refused"):  # every series exists from the start: rate() needs them
    for _kind in KINDS:
        RESERVATIONS.labels(_result, _kind)
WORKER_LEASED = Gauge(
    "inferx_memory_worker_leased_tokens",
    "KV tokens of each worker leased to schedulers as budgets (used or not)",
    ["pool", "worker"],
)
METHODS = ("Reserve", "Release", "SyncBudget", "GetUsage")
CALLS = Counter("inferx_memory_calls_total", "Calls the memory-pool answered, by method", ["method"])
for _method in METHODS:
    CALLS.labels(_method)
HOLDER_DROPPED = Counter(
    "inferx_memory_holder_dropped_reservations_total",
    "Reservations dropped because their holder's registration ended (it died) before releasing them",
)


_workers_seen: set[tuple[str, str]] = set()


def publish(rows: Iterable[WorkerLedger]) -> None:
    """Set every gauge from a ledger snapshot (after each change)."""
    capacity: dict[str, int] = {}
    reserved: dict[str, int] = {}
    active: dict[str, int] = {}
    workers: set[tuple[str, str]] = set()
    for row in rows:
        capacity[row.pool] = capacity.get(row.pool, 0) + row.capacity_tokens
        reserved[row.pool] = reserved.get(row.pool, 0) + row.reserved_tokens
        active[row.pool] = active.get(row.pool, 0) + row.reservations
        workers.add((row.pool, row.worker_id))
        WORKER_KV_USAGE.labels(row.pool, row.worker_id).set(_ratio(row.reserved_tokens, row.capacity_tokens))
        ENGINE_KV_USAGE.labels(row.pool, row.worker_id).set(row.engine_usage_ratio)
        WORKER_LOOKAHEAD.labels(row.pool, row.worker_id).set(row.lookahead_tokens)
        WORKER_LEASED.labels(row.pool, row.worker_id).set(row.leased_tokens)
    # A worker that left must not keep alerting with its last value.
    for gone in _workers_seen - workers:
        WORKER_KV_USAGE.remove(*gone)
        ENGINE_KV_USAGE.remove(*gone)
        WORKER_LOOKAHEAD.remove(*gone)
        WORKER_LEASED.remove(*gone)
    _workers_seen.clear()
    _workers_seen.update(workers)
    for pool, tokens in capacity.items():
        KV_CAPACITY.labels(pool).set(tokens)
        KV_RESERVED.labels(pool).set(reserved[pool])
        KV_USAGE.labels(pool).set(_ratio(reserved[pool], tokens))
        ACTIVE.labels(pool).set(active[pool])


def _ratio(part: int, whole: int) -> float:
    return part / whole if whole > 0 else 0.0
