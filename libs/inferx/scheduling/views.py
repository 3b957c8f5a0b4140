"""What a scheduling policy sees: a hop (who it belongs to, how big, how urgent) and the
workers of its pool. Plain frozen dataclasses, built by the live scheduler from
protobufs and by the simulator from a trace, so one policy serves both."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import IntEnum
from functools import cached_property
from typing import overload

from inferx.scheduling.engine_fit import EngineSample
from inferx.tokens import DEFAULT_MAX_TOKENS


class Tier(IntEnum):
    """A chain's SLO tier; lower is more urgent. The values are those of the proto enum
    `inferx.v1.Tier`, so codecs convert with `Tier(value)` / `int(tier)`."""

    UNSPECIFIED = 0
    REALTIME = 1
    STANDARD = 2
    BATCH = 3

    @classmethod
    def parse(cls, name: str) -> Tier:
        """From the config's spelling (`realtime`, `standard`, `batch`)."""
        return TIER_BY_NAME[name]

    @property
    def label(self) -> str:
        """The config's spelling; unspecified counts as standard."""
        return TIER_NAMES.get(self, "standard")

    @property
    def rank(self) -> Tier:
        """What the tier means for ordering: unspecified is standard."""
        return self if self in TIER_NAMES else Tier.STANDARD


TIER_REALTIME = Tier.REALTIME
TIER_STANDARD = Tier.STANDARD
TIER_BATCH = Tier.BATCH
TIER_NAMES: dict[int, str] = {Tier.REALTIME: "realtime", Tier.STANDARD: "standard", Tier.BATCH: "batch"}
TIER_BY_NAME: dict[str, Tier] = {name: Tier(tier) for tier, name in TIER_NAMES.items()}

HopKey = tuple[str, str]  # (run id, hop id): one hop of one run, everywhere


@dataclass(frozen=True)
class HopView:
    """One model hop as every scheduling decision sees it: built once per hop at the
    service edge (`inferx_scheduler.codec`) or by the simulator, then carried as is.
    Token counts are estimates made once (`inferx.tokens`); the deadline is monotonic."""

    pool: str
    run_id: str
    hop_id: str
    session_id: str = ""
    tier: int = Tier.UNSPECIFIED  # a Tier; unspecified is treated as standard
    node_priority: int = 2  # the chain config's node priority, 0 (high) .. 3 (low)
    prompt_tokens: int = 0
    max_tokens: int = DEFAULT_MAX_TOKENS
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
    # The kind of program the hop belongs to (its chain config's or the OpenAI front's
    # program name, and its tier): what tool/think gaps are learned per; "" = unknown.
    program: str = ""
    # The prompt's leading blocks as (key, tokens), keyed as the workers key the blocks
    # they report in KV events (`inferx.scheduling.prefix_index`): with an index fed by
    # those events a policy knows exactly which worker holds how much of the prompt.
    # () = unknown. The simulator knows every segment of the prompt (what hashing the
    # text gives); live, the keys of the chain's previous context as its worker reported
    # them (the prompt starts with that context).
    prompt_blocks: tuple[tuple[str, int], ...] = ()
    # The worker the chain's latest hop in this pool ran on, as the caller (the router)
    # saw it; "" = unknown. A hint for a policy that has no record of the chain (after a
    # partition moved to another scheduler): its own record wins.
    last_worker_id: str = ""
    # The client's hint: seconds to keep the chain's context held after this hop (a
    # dynamic program's kv_retention_ttl); None = none given, 0 = let it go at once.
    # What the client says of its own next gap, not read from a trace.
    kv_retention_s: float | None = None

    @cached_property  # read for every queued hop on every pass
    def chain_key(self) -> str:
        """A session's hops share a context (and a worker) across runs; else the run."""
        return self.session_id or self.run_id

    @property
    def key(self) -> HopKey:
        return (self.run_id, self.hop_id)

    @cached_property  # read for every queued hop on every pass
    def tier_rank(self) -> Tier:
        return Tier(self.tier) if self.tier in TIER_NAMES else Tier.STANDARD

    @cached_property  # read for every queued hop on every pass
    def kv_tokens(self) -> int:
        """KV the hop pins while it runs: its whole prompt plus what it may generate."""
        return self.prompt_tokens + self.max_tokens


@dataclass(eq=False)
class QueuedHop:
    """A hop in (or leaving) a pool's queue: its view, and the queue's books on it."""

    view: HopView
    enqueued_at: float
    seq: int = 0
    worker_id: str | None = None  # set once assigned
    engine_priority: int = 0  # what the engine should order by (lower first)
    # What the policy made of the client's KV retention hint when the hop finished
    # (`inferx.scheduling.retention.client_hold`); "" = no hint, or a policy without holds.
    retention_hint: str = ""
    kv_at_dispatch: int = 0  # its worker's KV in flight once it started there (the queue's count)
    # What its worker reported of the engine's speed when it finished, with the KV in
    # flight meanwhile (`inferx.scheduling.engine_fit`); None when it reported nothing.
    engine_sample: EngineSample | None = None

    @property
    def pool(self) -> str:
        return self.view.pool

    @property
    def run_id(self) -> str:
        return self.view.run_id

    @property
    def hop_id(self) -> str:
        return self.view.hop_id


@dataclass(frozen=True)
class WorkerSlots:
    """A live worker as the scheduler knows it (from its etcd registration)."""

    worker_id: str
    max_concurrency: int
    kv_capacity_tokens: int = 0  # 0 = unknown: memory checks are skipped
    # Its KV offload tier in host memory (evicted prefixes are loaded back from there
    # instead of re-prefilled): tokens, and how fast a load runs (0 = not reported).
    host_kv_capacity_tokens: int = 0
    host_kv_load_tokens_per_s: float = 0.0


@dataclass(frozen=True)
class WorkerView:
    worker_id: str
    max_concurrency: int
    in_flight: int = 0
    kv_capacity_tokens: int = 0
    kv_in_flight: int = 0  # estimated KV of the hops running there
    host_kv_capacity_tokens: int = 0  # its KV offload tier (see WorkerSlots)
    host_kv_load_tokens_per_s: float = 0.0

    @property
    def has_slot(self) -> bool:
        return self.in_flight < max(self.max_concurrency, 1)

    @property
    def slot_load(self) -> float:
        return self.in_flight / max(self.max_concurrency, 1)

    def with_hop(self, kv_tokens: int) -> WorkerView:
        return self.with_load(self.in_flight + 1, self.kv_in_flight + kv_tokens)

    def with_load(self, in_flight: int, kv_in_flight: int) -> WorkerView:
        """This worker running `in_flight` hops holding `kv_in_flight` tokens (built
        directly: `dataclasses.replace` costs ~5 us, and this runs twice per hop)."""
        return WorkerView(
            self.worker_id,
            self.max_concurrency,
            in_flight,
            self.kv_capacity_tokens,
            kv_in_flight,
            self.host_kv_capacity_tokens,
            self.host_kv_load_tokens_per_s,
        )


@dataclass(frozen=True)
class Admission:
    accept: bool = True
    reason: str = ""
    retry_after_s: float = 0.0


ACCEPT = Admission()


_generations = itertools.count(1)


class PoolWorkers(Sequence[WorkerView]):
    """A pool's workers as the dispatch queue keeps them between decisions: one view per
    worker, replaced in place as hops start and finish, with lookup by id and pool-wide
    sums kept as they change. A policy handed one need not scan the pool to find a
    worker or to total its load, which is what keeps a decision's cost flat as the
    cluster grows; any other sequence of views means the same, read by scanning.
    `generation` changes whenever the membership (or a worker's slots) does, so what a
    policy indexed by worker can tell when to rebuild."""

    def __init__(self, pool: str, views: Sequence[WorkerView] = ()) -> None:
        self.pool = pool
        self.generation = next(_generations)
        self._views: dict[str, WorkerView] = {}
        self._order: list[str] = []
        self.slots = 0  # sum of max(max_concurrency, 1)
        self.in_flight = 0
        self.kv_capacity_tokens = 0
        self.kv_in_flight = 0
        self.with_slot = 0  # workers with a free slot
        for view in views:
            if view.worker_id in self._views:
                continue  # a worker registered twice counts once, as a dict of views would
            self._order.append(view.worker_id)
            self._views[view.worker_id] = view
            self.slots += max(view.max_concurrency, 1)
            self.kv_capacity_tokens += view.kv_capacity_tokens
            self._add(view, 1)

    def _add(self, view: WorkerView, sign: int) -> None:
        self.in_flight += sign * view.in_flight
        self.kv_in_flight += sign * view.kv_in_flight
        self.with_slot += sign * view.has_slot

    def get(self, worker_id: str | None) -> WorkerView | None:
        return self._views.get(worker_id) if worker_id is not None else None

    def replace(self, view: WorkerView) -> None:
        """A worker's load changed (same slots and capacity)."""
        old = self._views[view.worker_id]
        self._add(old, -1)
        self._views[view.worker_id] = view
        self._add(view, 1)

    @property
    def any_slot(self) -> bool:
        return self.with_slot > 0

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[WorkerView]:
        views = self._views
        return (views[worker_id] for worker_id in self._order)

    @overload
    def __getitem__(self, index: int) -> WorkerView: ...
    @overload
    def __getitem__(self, index: slice) -> list[WorkerView]: ...
    def __getitem__(self, index: int | slice) -> WorkerView | list[WorkerView]:
        if isinstance(index, slice):
            return [self._views[worker_id] for worker_id in self._order[index]]
        return self._views[self._order[index]]
