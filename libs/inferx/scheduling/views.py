"""What a scheduling policy sees: a hop (who it belongs to, how big, how urgent) and the
workers of its pool. Plain frozen dataclasses, built by the live scheduler from
protobufs and by the simulator from a trace, so one policy serves both."""

from __future__ import annotations

from dataclasses import dataclass

TIER_REALTIME = 1
TIER_STANDARD = 2
TIER_BATCH = 3
TIER_NAMES = {TIER_REALTIME: "realtime", TIER_STANDARD: "standard", TIER_BATCH: "batch"}
TIER_BY_NAME = {name: tier for tier, name in TIER_NAMES.items()}


@dataclass(frozen=True)
class HopView:
    pool: str
    run_id: str
    hop_id: str
    session_id: str = ""
    tier: int = 0  # 0 = unspecified: treated as standard
    node_priority: int = 2  # the chain config's node priority, 0 (high) .. 3 (low)
    prompt_tokens: int = 0
    max_tokens: int = 64
    deadline: float | None = None  # the chain's deadline, on the caller's clock
    hop_index: int = 0  # 0 = first hop of its chain, or unknown
    remaining_critical_path_s: float = 0.0  # incl. this hop; 0 = unknown
    remaining_hops: int | None = None  # hops after this one; None = unknown
    # Identity of the shared prefix the prompt starts with (a system prompt / tool specs
    # that other chains send too) and its length in tokens; "" / 0 = unknown. What a
    # prefix-aware router would learn from the prompt text itself; nothing about the
    # hop's output or the chain's future.
    prefix_id: str = ""
    prefix_tokens: int = 0

    @property
    def chain_key(self) -> str:
        """A session's hops share a context (and a worker) across runs; else the run."""
        return self.session_id or self.run_id

    @property
    def tier_rank(self) -> int:
        return self.tier if self.tier in TIER_NAMES else TIER_STANDARD

    @property
    def kv_tokens(self) -> int:
        """KV the hop pins while it runs: its whole prompt plus what it may generate."""
        return self.prompt_tokens + self.max_tokens


@dataclass(eq=False)
class QueuedHop:
    pool: str
    run_id: str
    hop_id: str
    enqueued_at: float
    seq: int = 0
    worker_id: str | None = None  # set once assigned
    view: HopView | None = None
    engine_priority: int = 0  # what the engine should order by (lower first)

    @property
    def hop(self) -> HopView:
        return self.view or HopView(self.pool, self.run_id, self.hop_id)


@dataclass(frozen=True)
class WorkerSlots:
    """A live worker as the scheduler knows it (from its etcd registration)."""

    worker_id: str
    max_concurrency: int
    kv_capacity_tokens: int = 0  # 0 = unknown: memory checks are skipped


@dataclass(frozen=True)
class WorkerView:
    worker_id: str
    max_concurrency: int
    in_flight: int = 0
    kv_capacity_tokens: int = 0
    kv_in_flight: int = 0  # estimated KV of the hops running there

    @property
    def has_slot(self) -> bool:
        return self.in_flight < max(self.max_concurrency, 1)

    @property
    def slot_load(self) -> float:
        return self.in_flight / max(self.max_concurrency, 1)

    def with_hop(self, kv_tokens: int) -> WorkerView:
        return WorkerView(
            self.worker_id,
            self.max_concurrency,
            self.in_flight + 1,
            self.kv_capacity_tokens,
            self.kv_in_flight + kv_tokens,
        )


@dataclass(frozen=True)
class Admission:
    accept: bool = True
    reason: str = ""
    retry_after_s: float = 0.0


ACCEPT = Admission()
