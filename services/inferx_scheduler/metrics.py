"""Prometheus metrics of the scheduler (labels: pool and worker, both bounded)."""

from prometheus_client import Counter, Gauge, Histogram

QUEUE_DEPTH = Gauge("inferx_scheduler_queue_depth", "Hops waiting for a worker", ["pool"])
QUEUE_WAIT_SECONDS = Histogram(
    "inferx_scheduler_queue_wait_seconds",
    "Time a hop waited for a worker",
    ["pool"],
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
DISPATCHES = Counter("inferx_scheduler_dispatches_total", "Hops dispatched", ["pool", "worker"])
HOP_ERRORS = Counter("inferx_scheduler_hop_errors_total", "Hops that failed", ["pool", "code"])
SHED = Counter("inferx_scheduler_shed_total", "Hops refused because a queue was full", ["pool"])

# Queue depth by tier as well as pool (issue #6). Kept apart from QUEUE_DEPTH so the
# existing pool-only calls stay valid; the servicer sets it where it sets QUEUE_DEPTH.
QUEUED_BY_TIER = Gauge("inferx_scheduler_queued_hops", "Hops waiting for a worker, by tier", ["pool", "tier"])


def set_queued_by_tier(pool: str, counts: dict[str, int]) -> None:
    """`counts`: tier name (realtime|standard|batch) -> hops of that tier queued in `pool`."""
    for tier in ("realtime", "standard", "batch"):
        QUEUED_BY_TIER.labels(pool, tier).set(counts.get(tier, 0))


REDISPATCHES = Counter(
    "inferx_scheduler_redispatches_total", "Hops sent to another worker after theirs failed", ["pool"]
)

LOOKAHEAD = Counter(
    "inferx_scheduler_lookahead_total",
    "Look-ahead reservations for a chain's next hop, by outcome: reserved, no_room, "
    "refused (by the memory-pool), used (the hop ran where room was kept), moved (it ran elsewhere)",
    ["pool", "outcome"],
)
