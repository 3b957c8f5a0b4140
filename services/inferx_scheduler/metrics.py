"""Prometheus metrics of the scheduler (labels: pool and worker, both bounded)."""

from prometheus_client import Counter, Gauge, Histogram

from inferx.metric_children import child

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
        child(QUEUED_BY_TIER, pool, tier).set(counts.get(tier, 0))


# The engine figures the policy prices time with, per pool: as told (--engine-profile,
# else Llama-3-8B's) until learned from finished hops (`inferx.scheduling.engine_fit`).
ENGINE_PREFILL_RATE = Gauge(
    "inferx_scheduler_engine_prefill_tokens_per_second",
    "Prompt tokens per second the pool's engines prefill, as the scheduler prices it",
    ["pool"],
)
ENGINE_KV_READ = Gauge(
    "inferx_scheduler_engine_kv_read_seconds_per_token",
    "What a decode step costs per token of KV in flight on its worker, as the scheduler prices it",
    ["pool"],
)
# What the scheduler sizes prompts by: characters per engine token, learned per pool
# from the counts workers report (`inferx.tokens.TokenRatio`; unset: the prior, 3).
PROMPT_CHARS_PER_TOKEN = Gauge(
    "inferx_scheduler_prompt_chars_per_token",
    "Prompt characters per engine token in the pool, as learned from its workers' counts",
    ["pool"],
)

KV_RETENTION_HINTS = Counter(
    "inferx_scheduler_kv_retention_hints_total",
    "Finished hops whose client gave a KV retention hint (kv_retention_ttl), by what the policy "
    "made of it: held (for the hint), capped (at --max-hold-s), released (hint 0: let go at once), "
    "priced (the policy's own hold: --client-retention cap or off), ended (the program's last call), "
    "not_applied (another of its hops still ran, or the policy holds nothing)",
    ["pool", "outcome"],
)

REDISPATCHES = Counter(
    "inferx_scheduler_redispatches_total", "Hops sent to another worker after theirs failed", ["pool"]
)

LOOKAHEAD = Counter(
    "inferx_scheduler_lookahead_total",
    "Look-ahead reservations for a chain's next hop, by outcome: reserved, no_room, "
    "refused (by the memory-pool), used (the hop ran where room was kept), moved (it ran elsewhere), "
    "late (made after its hop arrived: released at once)",
    ["pool", "outcome"],
)

# The leased KV budget (issue #14): hops reserved from it locally vs beyond it (those go
# to the memory-pool's Reserve), the budget syncs, and the budget per worker.
KV_RESERVATIONS = Counter(
    "inferx_scheduler_kv_reservations_total",
    "KV reservations by where they were made: budget (locally, no call) or beyond_budget (the "
    "memory-pool's Reserve), and kind (hop|lookahead)",
    ["path", "kind"],
)
KV_BUDGET_SYNCS = Counter(
    "inferx_scheduler_kv_budget_syncs_total", "SyncBudget calls to the memory-pool by result", ["result"]
)
KV_BUDGET_GRANTED = Gauge(
    "inferx_scheduler_kv_budget_tokens", "KV budget the memory-pool granted this scheduler", ["worker"]
)
KV_BUDGET_USED = Gauge(
    "inferx_scheduler_kv_budget_reserved_tokens",
    "KV tokens reserved from this scheduler's budget",
    ["worker"],
)
_budget_workers: set[str] = set()


def publish_budget(rows: dict[str, tuple[int, int]]) -> None:
    """`rows`: worker -> (granted, reserved) after a sync."""
    for worker, (granted, used) in rows.items():
        KV_BUDGET_GRANTED.labels(worker).set(granted)
        KV_BUDGET_USED.labels(worker).set(used)
    for gone in _budget_workers - set(rows):
        KV_BUDGET_GRANTED.remove(gone)
        KV_BUDGET_USED.remove(gone)
    _budget_workers.clear()
    _budget_workers.update(rows)


# Partitions by model pool (issue #15): hops refused because this instance does not own
# their pool, by outcome: redirected (the answer names the owner) or no_owner (none yet).
NOT_OWNER = Counter(
    "inferx_scheduler_not_owner_total",
    "Hops refused for a pool this scheduler does not own: redirected (owner named) or no_owner",
    ["pool", "outcome"],
)
OWNED_PARTITIONS = Gauge(
    "inferx_scheduler_owned_partitions", "Model pools this scheduler owns (1) under its etcd lease", ["pool"]
)
