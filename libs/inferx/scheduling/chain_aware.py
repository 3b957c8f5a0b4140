"""The chain-aware policy: schedule whole agent chains, not single calls.

Order of the queue (lower first), computed when the queue is looked at:
  1. SLO tier: realtime, standard, batch. A hop waiting longer than
     `tier_starvation_s` moves up one tier, so batch work cannot starve forever.
  2. Chains already under way before new chains: abandoning a half-done chain wastes
     the work it already received and keeps its context pinned in KV.
  3. Context-length bucket of the tokens the hop must prefill (its prompt minus the
     context its chain left on its worker): short hops first. A hop waiting longer
     than `starvation_s` counts as the shortest bucket (the starvation bound).
  4. Progress (`progress`): `slack` = deadline - remaining critical path (least
     slack first), `attained` = most service received first, `fcfs` = chain arrival.
Worker choice (chain affinity, per pool): a chain's hop goes to the worker that holds
its prefix while that worker has room; if the worker is busy it may wait there for as
long as moving would cost (re-prefilling the context elsewhere), then falls back to
the worker with the most free KV. "Room" is memory-aware: a slot, and the hop's KV
fits in `kv_budget` of the worker's KV after what is running and what is held there
for idle chains.
Reuse window: affinity lasts `reuse_window_hops` hops on one worker; the next hop is
then placed by load again (it stays unless another worker has `rebalance_margin` more
free room), so one long chain cannot pin a hot worker for ever.
Keeping KV across tool calls: between its hops (a tool call, think time) a chain's
context is held on its worker -- no other chain is placed there on that room -- for
as long as holding is expected to cost less than re-prefilling it, priced from the
gaps this program's chains have shown so far (`kv_retention="priced"`,
`inferx.scheduling.retention`), or for `kv_warm_s` (`"fixed"`); after that it is only
a cache the engine may evict. On a worker with a KV offload tier (host memory its
engine evicts prefixes to, reported by the worker), letting go costs the load back
from host memory rather than a re-prefill (`offload_retention`), so the hold is
shorter. With `strict_holds` no hop runs over held room at all
(its own worker's included). A chain whose last hop finished (`remaining_hops == 0`)
lets go at once.
Look-ahead (`plan_ahead`): when a chain's next hop will need another pool (a bigger
model) or a much longer context, room is held for it on the worker it will go to
until the hop arrives or the hold expires; the scheduler mirrors the hold with a
memory-pool reservation under a lease.
Realtime guard (`realtime_guard`): a continuous-batching engine runs every admitted
sequence in each step, so a realtime hop's every token waits for the prefill chunks
admitted with it and for reading the KV of every running sequence. So next to
running realtime hops, a heavy prefill of another tier waits (at most `guard_wait_s`)
and other tiers' running KV stays under `guard_kv_share` of the worker, and under
what adds `guard_kv_read_steps` bare decode steps to each step there -- a cap scaled
down while realtime hops of the pool finish stretched (`guard_adaptive`: what a
realtime token can afford to read depends on what else slows it, which grows with the
load) and back up with time on track -- while their chains still have slack (at
most `guard_max_wait_s` per hop, and at most `guard_slack_share` of the chain's slack
on arrival over all its hops). Tiers with slack give way, but a chain of many hops
does not give way on every one of them. With `realtime_moves` (off by default) a
realtime hop also goes where it loses least (admitted prefill still to run + the
re-prefill of what the worker lacks of its context + reading the others' KV), which
moves short chats off a worker busy with a long prefill.
Admission: new batch chains wait while the pool is loaded past `batch_wait_load`
(new standard chains past `standard_wait_load`), and are shed (RESOURCE_EXHAUSTED,
with a retry hint) when the load is past `shed_load` and `shed_queue` batch hops per
worker already wait. Realtime work is never held back or shed by the policy.
Exact prefix location (`exact_prefix`, off by default): with an index fed by the
workers' KV events (`inferx.scheduling.prefix_index`, as llm-d's precise prefix-cache
scorer), what a worker holds of a hop's prompt is read, not guessed from where the
chain last ran, for a chain under way: its prefill estimate (buckets, the realtime
guard) counts the blocks really cached there; its affinity patience, whether a home
whose copy was evicted still holds it, and placement (favouring the worker holding most
of its context, up to `rebalance_margin` of room) count only its own context, past a
shared system prompt. A new chain is estimated and placed as without the index:
counting the shared prompt herds a program's new chains onto the workers that hold it.
A worker the index has no events from falls back to the estimate.
Overload control (`overload_control`, off by default; `inferx.scheduling.overload`):
past capacity, while realtime (standard) hops finish stretched, new standard and batch
(batch) chains wait to start within an AIMD window of chains under way, and are shed
past `overload_shed_factor` windows' worth waiting.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from pydantic import TypeAdapter, ValidationError

from inferx.scheduling.engine_fit import EngineFit
from inferx.scheduling.overload import ChainWindow, GuardScale, RecentStretch
from inferx.scheduling.prefix_index import PrefixIndex
from inferx.scheduling.registry import register_policy
from inferx.scheduling.retention import HINT_ENDED, HINT_PRICED, GapModel, client_hold, offload_fits
from inferx.scheduling.views import (
    ACCEPT,
    TIER_BATCH,
    TIER_REALTIME,
    TIER_STANDARD,
    Admission,
    HopView,
    PoolWorkers,
    QueuedHop,
    WorkerView,
)


@dataclass(frozen=True)
class ChainAwareConfig:
    """Time constants are seconds of *workload* time; `time_scaled` divides them when
    the workload is replayed faster than real time (benchmarks with --speed)."""

    progress: Literal["slack", "attained", "fcfs"] = "slack"
    buckets: tuple[int, ...] = (1024, 4096, 16384)  # prefill tokens: < each is a bucket
    starvation_s: float = 10.0
    tier_starvation_s: float = 120.0
    kv_budget: float = 0.9  # of a worker's KV the hops running there may pin
    # Realtime protection: other tiers' running contexts stay under this share of KV,
    # because every decode step reads them all (step time grows with it).
    shared_kv_share: float = 0.5
    prefill_tokens_per_s: float = 15_000.0  # what moving a context to a new worker costs
    affinity_wait_factor: float = 1.0
    max_affinity_wait_s: float = 5.0
    batch_wait_load: float = 0.8
    standard_wait_load: float = 0.95
    shed_load: float = 0.98
    shed_queue: int = 64  # batch hops waiting per worker before new batch chains are shed
    retry_after_s: float = 5.0
    chain_ttl_s: float = 300.0  # forget a chain (and its affinity) after this long idle
    reuse_window_hops: int = 4  # hops on one worker before placement is decided again; 0 = no limit
    rebalance_margin: float = 0.2  # after the window, move only for this much more free room
    # Between its hops (tool calls, think time) a chain's context is held on its worker,
    # so no other chain is placed on that room: "priced" holds it for as long as that is
    # expected to cost less than re-prefilling it, from the gaps learned so far
    # (`inferx.scheduling.retention`); "fixed" holds it `kv_warm_s`.
    kv_retention: Literal["priced", "fixed"] = "priced"
    max_hold_s: float = 600.0  # "priced": the longest hold (a client's hint too, in every mode)
    # A client's KV retention hint (HopView.kv_retention_s: a dynamic program's
    # kv_retention_ttl) for the gap after its hop: "override" holds for the hint instead
    # of the price (the client knows its next gap; the price only its kind's past ones),
    # "cap" lets it only shorten the hold, "off" ignores it. 0 lets go at once.
    # `inferx.scheduling.retention.client_hold`.
    client_retention: Literal["override", "cap", "off"] = "override"
    # "priced": a chain whose remaining hops were unknown (a dynamic program) forgotten
    # idle -- it never came back within `chain_ttl_s` -- counts as a gap of inf, so the
    # price learns how often such programs end after a hop, not only the gaps of those
    # that returned. Off: the holds assume every program comes back.
    learn_program_ends: bool = True
    # "priced": a re-prefill's GPU time counts this many times (its chunks stall every
    # sequence decoding beside it). Measured (coding workload, 3 seeds): 3 holds through
    # think times but not test runs and beat both 1 and the fixed 30 s.
    reprefill_cost_factor: float = 3.0
    # "priced", on a worker with a KV offload tier: a context let go is loaded back from
    # host memory (if it takes at most `offload_share` of the tier), so letting go costs
    # the cheaper of that and the re-prefill. `host_load_tokens_per_s` is the load rate
    # assumed when the worker reports a tier but not its rate (Llama-3-8B's 128 KiB per
    # token over ~25 GB/s of PCIe 4.0).
    offload_retention: bool = True
    offload_share: float = 0.5
    host_load_tokens_per_s: float = 190_000.0
    clock_scale: float = 1.0  # set by `time_scaled`: rates workers report run this much faster
    # Holds are real: no hop runs over another chain's held room on any worker (else
    # they only keep other chains from being *placed* on it). Off by default: on the
    # coding workload the waiting it causes cost more than the re-prefills it saved.
    strict_holds: bool = False
    # A hop may run over room held for chains of a less urgent tier (their idle context
    # may then be evicted): under overload, realtime is not kept waiting by batch holds.
    tiered_holds: bool = False  # off by default: measured worse on long contexts (evictions)
    # Tiers protected under overload (`inferx.scheduling.overload`): while hops of a tier
    # finish stretched (the median queueing + service of its last
    # `overload_stretch_hops` hops over `overload_max_stretch` times their time alone on
    # the engine, or one hop over `overload_hop_stretch`), new chains of the tiers below
    # wait to start -- as many run as an AIMD window allows -- and are shed
    # (RESOURCE_EXHAUSTED, a retry hint) once more than `overload_shed_factor` windows'
    # worth of them wait.
    # Off by default: it lowers the capacity at SLO (mix 2.04 -> 1.61, research 0.273 ->
    # 0.206 chains/s: it sheds chains near capacity that would have made it).
    overload_control: bool = False
    # A realtime chain's SLO is 3x its time alone. On mix its hops' median stretch is
    # ~1.9 at the capacity at SLO and 2.5 past it by a fifth: the lower tiers are held
    # back from 2.25x, and a new chain past one window's worth waiting is shed at once
    # (waiting longer it misses anyway). A single hop past 2.5x says so too: on coding
    # and research on the 7B profile the median alone reacted too late at 2x the
    # strongest peer's capacity (realtime 97% / 99%, 88% / 94% on the worst seed); with
    # it, >= 99% on mix, research and coding (every seed) and research 7B (the median).
    # A median over 32 hops reacted too late on research (docs/benchmarks.md, "Past
    # capacity").
    overload_max_stretch: float = 2.25
    overload_stretch_hops: int = 16
    overload_hop_stretch: float = 2.5
    overload_cooldown_s: float = 5.0
    overload_min_chains: float = 2.0
    overload_shed_factor: float = 1.0
    # Where a prompt's blocks are cached, from the workers' KV events (an index the
    # scheduler / simulator attaches), instead of where the chain last ran.
    exact_prefix: bool = False
    # A chain this policy has no record of in a pool (a new partition owner after a
    # failover, a restart, a chain forgotten idle) starts from where the caller says its
    # latest hop there ran (`HopView.last_worker_id`), when that worker is in the pool:
    # its context is still cached there. The policy's own record always wins.
    worker_hints: bool = True
    kv_warm_s: float = 30.0  # "fixed": how long an idle chain's context is held on its worker
    # Realtime guard: a decode step carries the prefill chunks of everything admitted with
    # it, so a long prefill next to a realtime hop stalls every one of its tokens.
    realtime_guard: bool = True
    heavy_prefill_tokens: int = 2048  # a non-realtime hop prefilling more than this is "heavy"
    guard_wait_s: float = 3.0  # a heavy hop waits this long at most for its worker's realtime hops
    # Every decode step reads the KV of every running sequence: next to realtime hops,
    # other tiers' running KV stays under this share of the worker's capacity (room for
    # realtime's own contexts) ...
    guard_kv_share: float = 0.25
    # ... and under what adds this many of the engine's bare decode steps to each step
    # (`decode_step_s` / `kv_read_s_per_token` tokens per step): the cost to realtime is
    # read time, and an engine with more KV memory does not read it faster, so a share
    # of the memory alone lets more KV next to realtime the bigger the memory (on the
    # 7B MHA profile with 4x its memory, capacity at SLO fell from 1.38x to 1.07x the
    # best peer's). 1.1: what the share came to on the two calibrated profiles (0.85
    # steps on Llama-3-8B / A100, 1.1 on the 7B MHA one), which keep their caps.
    guard_kv_read_steps: float = 1.1
    # ... scaled (within [guard_scale_min, guard_scale_max]) by how realtime hops fare
    # there: one that finished more than `guard_max_stretch` times slower than alone
    # shrinks it, hops on track let it grow back (`inferx.scheduling.overload.GuardScale`).
    guard_adaptive: bool = True
    guard_max_stretch: float = 3.0
    guard_scale_min: float = 0.25
    guard_scale_max: float = 1.0
    guard_cooldown_s: float = 5.0
    guard_recover_s: float = 60.0
    guard_max_wait_s: float = 30.0  # ... while their chains have slack, for at most this long
    # ... and only while the chain's hops have waited, in all, less than this share of
    # the slack it had when it arrived (its deadline - arrival - expected path): a
    # chain of many hops gives way on each of them, so the bound is per chain.
    guard_slack_share: float = 0.5
    # A realtime hop moves off its chain's worker when another costs it less by
    # `realtime_move_margin_s` (`_least_stalled`: prefill admitted ahead of it, the
    # re-prefill of what that worker lacks of its context, reading the KV there for the
    # request's max_tokens). Off by default: in steady state the moves cost more than
    # they saved (3 seeds, docs/benchmarks.md "Realtime hops stay on their worker":
    # mix 2.134 -> 2.278 chains/s without them, research 7B 0.0998 -> 0.107, coding
    # 0.0231 -> 0.0242; mix 7B and the held-out h3 one bisection step down, the rest
    # level): chats left their cached contexts for workers that only looked less
    # loaded. Not only because the KV read is counted at max_tokens (several times a
    # chat's reply): priced at a learned reply length the moves still lost (mix seed 1
    # 2.484 against 2.594, research 7B median 0.0927 against 0.107).
    realtime_moves: bool = False
    realtime_move_margin_s: float = 0.2
    # Placing a chain of another tier, a worker's room score (its free share of KV and
    # slots) loses this times the share of the pool's hops in flight that are realtime
    # hops running there: other tiers' contexts gather where realtime runs least, so
    # realtime decodes read less of them. Weighed by all hops in flight, it is small
    # where realtime is a small part of the load (which then stays balanced) and
    # large where realtime is much of it. 0: placed by room alone.
    realtime_apart: float = 2.0
    kv_read_s_per_token: float = 0.08e-6  # a decode step's cost per context token in the batch
    decode_step_s: float = 0.010  # a decode step with no KV to read (the weights'; Llama-3-8B, A100)
    # Learn the two engine figures above per pool from what its workers report of each
    # finished hop (`inferx.scheduling.engine_fit`); what the options say is the prior.
    learn_engine: bool = True

    def __post_init__(self) -> None:
        if not 0 < self.guard_scale_min <= self.guard_scale_max:
            raise ValueError("guard_scale_min must be > 0 and <= guard_scale_max")
        if self.guard_max_stretch <= 1:
            raise ValueError("guard_max_stretch must be > 1 (a hop is never faster than alone)")
        if self.realtime_apart < 0:
            raise ValueError("realtime_apart must be >= 0 (0: placed by room alone)")
        if self.overload_stretch_hops < 1:
            raise ValueError("overload_stretch_hops must be at least 1")

    def time_scaled(self, factor: float) -> ChainAwareConfig:
        """The same policy on a clock running `factor` times faster."""
        if factor <= 0:
            raise ValueError("time scale must be positive")
        return replace(
            self,
            starvation_s=self.starvation_s / factor,
            tier_starvation_s=self.tier_starvation_s / factor,
            max_affinity_wait_s=self.max_affinity_wait_s / factor,
            chain_ttl_s=self.chain_ttl_s / factor,
            kv_warm_s=self.kv_warm_s / factor,
            max_hold_s=self.max_hold_s / factor,
            overload_cooldown_s=self.overload_cooldown_s / factor,
            retry_after_s=self.retry_after_s / factor,
            guard_wait_s=self.guard_wait_s / factor,
            guard_max_wait_s=self.guard_max_wait_s / factor,
            guard_cooldown_s=self.guard_cooldown_s / factor,
            guard_recover_s=self.guard_recover_s / factor,
            realtime_move_margin_s=self.realtime_move_margin_s / factor,
            prefill_tokens_per_s=self.prefill_tokens_per_s * factor,
            host_load_tokens_per_s=self.host_load_tokens_per_s * factor,
            clock_scale=self.clock_scale * factor,
            kv_read_s_per_token=self.kv_read_s_per_token / factor,
            decode_step_s=self.decode_step_s / factor,
        )


@dataclass
class ChainState:
    first_seen: float
    last_seen: float
    worker_id: str | None = None
    context_tokens: int = 0  # what the chain left cached on worker_id
    attained_s: float = 0.0
    hops_done: int = 0
    in_flight: int = 0
    window_hops: int = 0  # hops run on worker_id since the chain was (re)placed there
    held_tokens: int = 0  # KV of worker_id held for the chain while none of its hops runs
    held_until: float = 0.0
    queued_s: float = 0.0  # how long its hops waited in the queue, in all
    initial_slack_s: float | None = None  # deadline - arrival - expected path; None: no deadline
    tier: int = TIER_STANDARD  # the tier of its latest hop (what its held room is ranked by)
    idle_since: float | None = None  # when its last hop ended (none of its hops is queued or running)
    open_ended: bool = False  # its latest hop did not know how many hops follow (a dynamic program)
    program_kind: str = ""  # what its gaps are learned under (`_program_kind`)


ChainKey = tuple[str, str]  # (pool, chain key): affinity is per pool (a chain may use several models)


@dataclass
class _PoolIndex:
    """What the policy keeps per pool so that a decision need not scan the pool (when
    the queue hands it a `PoolWorkers`): its workers ordered by placement score (most
    room first), and by the KV running on them (the realtime guard's cost grows with
    it), and the KV held for chains on them. Entries of workers whose load or held room
    changed are re-sorted when the index is next read."""

    generation: int  # of the PoolWorkers it was built from
    members: frozenset[str]
    rank: dict[str, int]  # worker id -> its place in id order (ties go to the larger id)
    by_room: list[tuple[float, int, int, str]]  # (-room, in flight, -rank, id), ascending
    room_key: dict[str, tuple[float, int, int, str]]
    by_kv: list[tuple[int, int, str]]  # (KV in flight, hops in flight, id), ascending
    kv_key: dict[str, tuple[int, int, str]]
    held: int = 0  # sum of resident() over the members
    epoch: int = 0  # bumped whenever a member's load or held room changes
    dirty: set[str] = field(default_factory=set)
    # (realtime?, tiers whose holds count) -> (epoch, the smallest hop's KV that fitted
    # on no worker of the pool as a newcomer): bigger hops need not look until it changes.
    no_room: dict[tuple[bool, int], tuple[int, int]] = field(default_factory=dict)
    capacities_seen: bool = False  # order() has recorded the members' KV capacities


class ChainAwarePolicy:
    name = "chain-aware"

    def __init__(self, config: ChainAwareConfig | None = None) -> None:
        self.config = config or ChainAwareConfig()
        self._chains: OrderedDict[ChainKey, ChainState] = OrderedDict()  # least recent first
        self._pools_of: dict[str, set[str]] = {}  # chain key -> the pools it has state in
        # KV held for idle chains and look-aheads, per (worker, tier of the chain).
        self._held: dict[tuple[str, int], int] = {}
        self._hold_expiry: list[tuple[float, int, ChainKey]] = []  # heap of (until, seq, chain)
        self._hold_seq = itertools.count()
        self._pass_load: float | None = None
        self._realtime_running: dict[str, int] = {}  # worker -> realtime hops in flight
        self._prefill_until: dict[str, float] = {}  # worker -> when its admitted prefills end (estimate)
        self._windows: dict[tuple[str, int], ChainWindow] = {}  # (pool, protected tier) -> window
        self._active: dict[ChainKey, int] = {}  # non-realtime chains under way -> tier
        self._active_count: Counter[tuple[str, int]] = Counter()  # (pool, tier) -> chains under way
        self._stretch: dict[tuple[str, int], RecentStretch] = {}  # (pool, tier) -> its hops' stretch
        self._guard_scales: dict[str, GuardScale] = {}  # pool -> the guard's KV cap scale
        self._fastest_token_s: dict[str, float] = {}  # pool -> the fastest decode token seen (realtime)
        self._engines: dict[str, EngineFit] = {}  # pool -> its engine's figures, as learned
        self._dispatched_prefill: dict[tuple[str, str], int] = {}  # hop key -> prefill tokens expected
        self._gaps = GapModel()  # learned tool/think gaps per program kind (priced retention)
        self._kv_capacity: dict[str, int] = {}  # worker -> KV tokens, as last seen
        self._host_kv: dict[str, tuple[int, float]] = {}  # worker -> its offload tier (tokens, load rate)
        self._prefix_index: PrefixIndex | None = None  # KV-event-fed block locations (exact_prefix)
        self._held_sum: dict[str, int] = {}  # worker -> its held KV over all tiers
        self._indexes: dict[str, _PoolIndex] = {}  # pool -> index (PoolWorkers only)
        self._index_of: dict[str, list[_PoolIndex]] = {}  # worker -> indexes it is in
        # Per pool, bumped whenever the state of its chains (affinity, holds, slack spent,
        # windows, chains under way) may have changed: with the index epoch (its workers'
        # load and held room) it is the `pass_stamp` that lets the queue skip a pool
        # nothing happened to.
        self._pool_epoch: Counter[str] = Counter()

    def use_prefix_index(self, index: PrefixIndex) -> bool:
        self._prefix_index = index
        return self.config.exact_prefix

    def _exact_known(self, hop: HopView) -> bool:
        """Exact prefix locations may answer for this hop (`exact_prefix`, an index, keys)."""
        return self.config.exact_prefix and self._prefix_index is not None and bool(hop.prompt_blocks)

    def _exact_cached(self, hop: HopView, worker_id: str | None, *, own: bool = True) -> int | None:
        """Tokens of a chain under way's prompt cached on the worker, from the KV-event
        index: with `own`, only its own context (what the worker holds past the shared
        prefix, `prefix_tokens`, when the router names one); without, everything (what
        the hop would really prefill there). None when that is off or does not know (no
        events from the worker, no prompt keys) -- and for a chain not under way, which
        has no context of its own anywhere and is placed and estimated as without the
        index.

        Why: counting the shared system prompt where the chain is placed, or a new
        chain's small exact prefill estimate where it is held, herds every new chain of a
        program onto the workers that already hold that prompt -- measured on the
        simulator's mix at 0.43x the capacity of the estimate (the session log, `git show
        afbf7ed:docs/benchmarks.md`, "Own context only"). Only the prefill estimate of a
        chain under way takes the whole match (own=False): that is the work the engine
        will do."""
        index = self._prefix_index
        if not self.config.exact_prefix or index is None or worker_id is None or not hop.prompt_blocks:
            return None
        if not index.knows(worker_id) or not self._under_way(hop):
            return None
        matched = min(index.match(worker_id, hop.prompt_blocks), hop.prompt_tokens)
        shared = hop.prefix_tokens if hop.prefix_id and own else 0
        return max(matched - shared, 0)

    # ----- chain state ------------------------------------------------------------------

    @staticmethod
    def _key(hop: HopView) -> ChainKey:
        return (hop.pool, hop.chain_key)

    def chain(self, chain_key: str, pool: str | None = None) -> ChainState | None:
        """The state of a chain (in `pool`, or in any pool when None)."""
        for (state_pool, key), state in self._chains.items():
            if key == chain_key and (pool is None or state_pool == pool):
                return state
        return None

    def _touch(self, key: ChainKey, now: float) -> ChainState:
        self._pool_epoch[key[0]] += 1
        state = self._chains.get(key)
        if state is None:
            state = self._chains[key] = ChainState(first_seen=now, last_seen=now)
            self._pools_of.setdefault(key[1], set()).add(key[0])
        state.last_seen = now
        self._chains.move_to_end(key)
        self._expire(now)
        return state

    def _expire(self, now: float) -> None:
        while self._hold_expiry and self._hold_expiry[0][0] <= now:
            _, _, key = heapq.heappop(self._hold_expiry)
            state = self._chains.get(key)
            if state is not None and state.held_tokens and state.held_until <= now:
                self._hold(key, state, 0, 0.0)
        while self._chains:
            key, state = next(iter(self._chains.items()))
            if now - state.last_seen <= self.config.chain_ttl_s or state.in_flight:
                return
            self._forget(key)

    def _forget(self, key: ChainKey) -> None:
        self._pool_epoch[key[0]] += 1
        state = self._chains[key]
        if state.idle_since is not None and state.open_ended and self.config.learn_program_ends:
            self._gaps.observe_end(state.program_kind)  # it never came back
        self._hold(key, state, 0, 0.0)
        del self._chains[key]
        pools = self._pools_of[key[1]]
        pools.discard(key[0])
        if not pools:
            del self._pools_of[key[1]]
        tier = self._active.pop(key, None)
        if tier is not None:
            self._active_count[(key[0], tier)] -= 1

    def _hold(self, key: ChainKey, state: ChainState, tokens: int, until: float) -> None:
        """Hold `tokens` of the chain's worker's KV for it until `until` (0: let go)."""
        self._pool_epoch[key[0]] += 1
        if state.worker_id is None:
            tokens = 0
        delta = tokens - state.held_tokens
        if delta and state.worker_id is not None:
            slot = (state.worker_id, state.tier)
            old = self._held.get(slot, 0)
            new = self._held[slot] = max(0, old + delta)
            if new != old:
                self._held_changed(state.worker_id, new - old)
        state.held_tokens, state.held_until = tokens, until
        if tokens:
            heapq.heappush(self._hold_expiry, (until, next(self._hold_seq), key))

    def resident(self, worker_id: str, up_to_tier: int = TIER_BATCH) -> int:
        """KV held on the worker for chains between hops and for look-aheads (of chains
        whose tier is `up_to_tier` or more urgent)."""
        if up_to_tier >= TIER_BATCH:
            return self._held_sum.get(worker_id, 0)
        return sum(self._held.get((worker_id, tier), 0) for tier in range(TIER_REALTIME, up_to_tier + 1))

    # ----- indexes over a pool's workers ------------------------------------------------

    def _held_changed(self, worker_id: str, delta: int) -> None:
        self._held_sum[worker_id] = self._held_sum.get(worker_id, 0) + delta
        for index in self._index_of.get(worker_id, ()):
            index.held += delta
        self._load_changed(worker_id)

    def _load_changed(self, worker_id: str) -> None:
        """The worker's load or held room changed: its index entries are stale."""
        for index in self._index_of.get(worker_id, ()):
            index.dirty.add(worker_id)
            index.epoch += 1

    def _room_key(self, worker: WorkerView, rank: int) -> tuple[float, int, int, str]:
        # The placement score of a worker that is not the chain's own (see `_choose`),
        # negated so that ascending order is best first.
        return (-self._headroom(worker), worker.in_flight, -rank, worker.worker_id)

    def _index(self, pool: PoolWorkers) -> _PoolIndex:
        index = self._indexes.get(pool.pool)
        if index is None or index.generation != pool.generation:
            return self._build_index(pool)
        if index.dirty:
            for worker_id in index.dirty:
                worker = pool.get(worker_id)
                if worker is None:
                    continue
                room = self._room_key(worker, index.rank[worker_id])
                old_room = index.room_key[worker_id]
                if room != old_room:
                    del index.by_room[bisect.bisect_left(index.by_room, old_room)]
                    bisect.insort(index.by_room, room)
                    index.room_key[worker_id] = room
                kv = (worker.kv_in_flight, worker.in_flight, worker_id)
                old_kv = index.kv_key[worker_id]
                if kv != old_kv:
                    del index.by_kv[bisect.bisect_left(index.by_kv, old_kv)]
                    bisect.insort(index.by_kv, kv)
                    index.kv_key[worker_id] = kv
            index.dirty.clear()
        return index

    def _build_index(self, pool: PoolWorkers) -> _PoolIndex:
        old = self._indexes.get(pool.pool)
        if old is not None:
            for worker_id in old.members:
                self._index_of[worker_id].remove(old)
        rank = {worker_id: n for n, worker_id in enumerate(sorted(w.worker_id for w in pool))}
        room_key = {w.worker_id: self._room_key(w, rank[w.worker_id]) for w in pool}
        kv_key = {w.worker_id: (w.kv_in_flight, w.in_flight, w.worker_id) for w in pool}
        index = _PoolIndex(
            generation=pool.generation,
            members=frozenset(rank),
            rank=rank,
            by_room=sorted(room_key.values()),
            room_key=room_key,
            by_kv=sorted(kv_key.values()),
            kv_key=kv_key,
            held=sum(self.resident(worker_id) for worker_id in rank),
        )
        for worker_id in rank:
            self._index_of.setdefault(worker_id, []).append(index)
        self._indexes[pool.pool] = index
        return index

    @staticmethod
    def _find(workers: Sequence[WorkerView], worker_id: str | None) -> WorkerView | None:
        if isinstance(workers, PoolWorkers):
            return workers.get(worker_id)
        return next((w for w in workers if w.worker_id == worker_id), None)

    def _set_tier(self, key: ChainKey, state: ChainState, tier: int) -> None:
        if tier != state.tier:
            tokens, until = state.held_tokens, state.held_until
            self._hold(key, state, 0, 0.0)
            state.tier = tier
            self._hold(key, state, tokens, until)

    # ----- ordering ---------------------------------------------------------------------

    def _under_way(self, hop: HopView) -> bool:
        state = self._chains.get(self._key(hop))
        return hop.hop_index > 0 or (state is not None and state.hops_done > 0)

    def _prefill_estimate(self, hop: HopView, worker_id: str | None = None) -> int:
        """Tokens the hop must prefill: its prompt minus the context its chain left on
        the worker (`worker_id`, or wherever the chain's context is)."""
        state = self._chains.get(self._key(hop))
        where = worker_id if worker_id is not None else (state.worker_id if state is not None else None)
        exact = self._exact_cached(hop, where, own=False)
        if exact is not None:
            return hop.prompt_tokens - exact
        cached = 0
        if state is not None and state.worker_id and (worker_id is None or worker_id == state.worker_id):
            cached = state.context_tokens
        return max(hop.prompt_tokens - cached, 0)

    def bucket(self, hop: HopView) -> int:
        tokens = self._prefill_estimate(hop)
        for index, bound in enumerate(self.config.buckets):
            if tokens < bound:
                return index
        return len(self.config.buckets)

    def _tier(self, queued: QueuedHop, now: float) -> int:
        tier: int = queued.view.tier_rank
        if now - queued.enqueued_at > self.config.tier_starvation_s:
            tier = max(TIER_REALTIME, tier - 1)
        return tier

    def _progress(self, hop: HopView) -> float:
        state = self._chains.get(self._key(hop))
        mode = self.config.progress
        if mode == "slack" and hop.deadline is not None:
            # Slack = deadline - now - remaining; `now` is common to all, so drop it.
            return hop.deadline - hop.remaining_critical_path_s
        if mode == "attained":
            return -(state.attained_s if state else 0.0)
        return state.first_seen if state else math.inf

    def sort_key(self, queued: QueuedHop, now: float) -> tuple:
        # What `_tier`, `_under_way`, `bucket` and `_progress` say, with the chain looked
        # up once: this runs for every queued hop on every pass.
        hop = queued.view
        config = self.config
        state = self._chains.get((hop.pool, hop.chain_key))
        waited = now - queued.enqueued_at
        tier: int = hop.tier_rank
        if waited > config.tier_starvation_s:
            tier = max(TIER_REALTIME, tier - 1)
        under_way = hop.hop_index > 0 or (state is not None and state.hops_done > 0)
        bucket = 0
        if waited <= config.starvation_s:
            cached = state.context_tokens if state is not None and state.worker_id else 0
            tokens = max(hop.prompt_tokens - cached, 0)
            bucket = len(config.buckets)
            for index, bound in enumerate(config.buckets):
                if tokens < bound:
                    bucket = index
                    break
        if config.progress == "slack" and hop.deadline is not None:
            progress = hop.deadline - hop.remaining_critical_path_s
        elif config.progress == "attained":
            progress = -(state.attained_s if state else 0.0)
        else:
            progress = state.first_seen if state else math.inf
        return (tier, 0 if under_way else 1, bucket, progress, queued.seq)

    def order(
        self, queued: Sequence[QueuedHop], workers: Sequence[WorkerView], now: float
    ) -> Iterable[QueuedHop]:
        self._expire(now)  # room whose hold ended is free for this pass
        # Load is taken once per pass: hops held back stay held back for this pass.
        self._pass_load = self.load(workers)
        index = self._index(workers) if isinstance(workers, PoolWorkers) else None
        if index is None or not index.capacities_seen:  # they change only with the worker set
            for worker in workers:
                self._kv_capacity[worker.worker_id] = worker.kv_capacity_tokens
                tier = (worker.host_kv_capacity_tokens, worker.host_kv_load_tokens_per_s)
                self._host_kv[worker.worker_id] = tier
            if index is not None:
                index.capacities_seen = True
        return sorted(queued, key=lambda q: self.sort_key(q, now))

    def wake_at(self, queued: QueuedHop, now: float) -> float | None:
        """When waiting alone may change this hop's fate (affinity patience runs out,
        the starvation bounds pass); None if only other events can."""
        times = self.wake_times(queued)
        shared = self.shared_wake()
        if shared is not None:
            times.append(shared)
        future = [t for t in times if t > now]
        return min(future) if future else None

    def wake_times(self, queued: QueuedHop) -> list[float]:
        """The hop's own times in `wake_at` (they change only with its chain's state)."""
        times = [queued.enqueued_at + self.config.tier_starvation_s]
        if self.config.realtime_guard and queued.view.tier_rank != TIER_REALTIME:
            times.append(queued.enqueued_at + self.config.guard_wait_s)
        state = self._chains.get(self._key(queued.view))
        if state is not None and state.worker_id is not None:
            times.append(queued.enqueued_at + self._patience(state, queued.view))
        return times

    def shared_wake(self) -> float | None:
        """The time in `wake_at` common to every hop: the next held room to come free."""
        return self._hold_expiry[0][0] if self._hold_expiry else None

    # ----- skipping pools nothing happened to (`DispatchQueue(skip_idle_pools=True)`) ---

    def pass_stamp(self, pool: str) -> tuple[int, int, int] | None:
        """Changes whenever anything `choose_worker` reads for the pool's hops may have
        changed, other than the time (see `recheck_at`): its chains' state, and its
        workers' load and held room. None: no stamp can be given (exact prefix
        locations change with every KV event; no index of the pool yet)."""
        index = self._indexes.get(pool)
        if index is None or self.config.exact_prefix:
            return None
        return (self._pool_epoch[pool], index.generation, index.epoch)

    def advance(self, now: float) -> None:
        """What `order` does with the time alone: holds that ended let go, chains idle
        past their TTL forgotten (the queue calls it where it skips a pass)."""
        self._expire(now)

    def recheck_at(self, queued: QueuedHop, now: float) -> float | None:
        """The earliest time after `now` at which `choose_worker`'s answer for this hop
        may change with the time alone (nothing else changing; see `pass_stamp`): the
        tier starvation bound, the affinity patience, the realtime guard's waits and the
        chain's slack (the budget, the deadline). None: never. Ordering by starvation
        is not here: when no hop can go, their order changes nothing. A little early
        (conservative) against rounding: a pass a hair too early is only a full pass."""
        hop = queued.view
        config = self.config
        enqueued = queued.enqueued_at
        times = [enqueued + config.tier_starvation_s]
        state = self._chains.get(self._key(hop))
        if state is not None and state.worker_id is not None:
            times.append(enqueued + self._patience(state, hop))
        if config.realtime_guard and hop.tier_rank != TIER_REALTIME:
            times.append(enqueued + config.guard_wait_s)
            times.append(enqueued + config.guard_max_wait_s)
            if hop.deadline is not None:
                times.append(hop.deadline - hop.remaining_critical_path_s)  # `_may_wait`: late
            if state is not None and state.initial_slack_s is not None:
                budget = config.guard_slack_share * max(state.initial_slack_s, 0.0)
                times.append(enqueued + budget - state.queued_s)  # `_may_wait`: budget spent
        # Each condition flips once (they are monotone in time); those that flipped well
        # before `now` are settled. One within rounding of `now` makes it `now`: recheck.
        future = [t - 1e-6 for t in times if t + 1e-6 > now]
        return min(future) if future else None

    def engine_priority(self, queued: QueuedHop, now: float) -> int:
        key = self.sort_key(queued, now)
        return (key[0] - 1) * 16 + key[1] * 8 + key[2]

    # ----- load and admission -----------------------------------------------------------

    def load(self, workers: Sequence[WorkerView]) -> float:
        """Busiest of slots and KV (running + idle chains' contexts) across the pool."""
        if isinstance(workers, PoolWorkers):  # the same sums, kept up to date
            if not workers.slots:
                return 1.0
            load = workers.in_flight / workers.slots
            if workers.kv_capacity_tokens:
                used = workers.kv_in_flight + self._index(workers).held
                load = max(load, used / workers.kv_capacity_tokens)
            return load
        slots = sum(max(w.max_concurrency, 1) for w in workers)
        if not slots:
            return 1.0
        load = sum(w.in_flight for w in workers) / slots
        capacity = sum(w.kv_capacity_tokens for w in workers)
        if capacity:
            used = sum(w.kv_in_flight + self.resident(w.worker_id) for w in workers)
            load = max(load, used / capacity)
        return load

    def admit(
        self,
        hop: HopView,
        workers: Sequence[WorkerView],
        queued: Sequence[QueuedHop],
        now: float,
    ) -> Admission:
        self._pool_epoch[hop.pool] += 1
        self._observe_gap(hop, now)
        state = self._touch(self._key(hop), now)
        if state.initial_slack_s is None and hop.deadline is not None:
            state.initial_slack_s = hop.deadline - now - hop.remaining_critical_path_s
        if state.worker_id is None and hop.last_worker_id and self.config.worker_hints:
            self._adopt_hint(state, hop, workers)
        refusal = self._overload_refusal(hop, queued)
        if refusal is not None:
            self._forget(self._key(hop))
            return refusal
        if hop.tier_rank != TIER_BATCH or self._under_way(hop) or not workers:
            return ACCEPT
        load = self.load(workers)
        if load >= self.config.shed_load:
            waiting = sum(1 for q in queued if q.view.tier_rank == TIER_BATCH)
            if waiting >= self.config.shed_queue * len(workers):
                return Admission(
                    False,
                    f"pool '{hop.pool}' is {load:.0%} loaded and {waiting} batch hops wait",
                    self.config.retry_after_s,
                )
        return ACCEPT

    def _adopt_hint(self, state: ChainState, hop: HopView, workers: Sequence[WorkerView]) -> None:
        """No record of where the chain ran in this pool: take the caller's word for it
        (the worker its latest hop here ran on), as if this policy had placed it there,
        unless that worker is not (or no longer) in the pool. The context it left there
        is not known: the prompt is taken for it (the prompt starts with the chain's
        context; what was added since, a tool result, a new turn, is usually small next
        to it), so the chain waits for its worker as long as moving would cost."""
        if self._find(workers, hop.last_worker_id) is None:
            return
        state.worker_id = hop.last_worker_id
        state.context_tokens = hop.prompt_tokens
        state.window_hops = 0

    def _overload_refusal(self, hop: HopView, queued: Sequence[QueuedHop]) -> Admission | None:
        """A new chain whose tier's window is full is refused once more than
        `overload_shed_factor` windows' worth of new chains of its tier already wait:
        the last in line would wait about that many chain lifetimes."""
        if not self.config.overload_control or self._under_way(hop) or not self._overloaded(hop):
            return None
        tier = hop.tier_rank
        window = self._window(hop.pool, tier)
        waiting = sum(1 for q in queued if q.view.tier_rank == tier and not self._under_way(q.view))
        if waiting < window.limit * self.config.overload_shed_factor:
            return None
        return Admission(
            False,
            f"pool '{hop.pool}' is overloaded: {waiting} new {tier.label} chains wait to "
            f"start and at most {window.limit:.0f} may run beside the more urgent tiers",
            self.config.retry_after_s,
        )

    def _window(self, pool: str, tier: int) -> ChainWindow:
        """The window of chains of `tier` (standard or batch) that may be under way."""
        window = self._windows.get((pool, tier))
        if window is None:
            window = self._windows[(pool, tier)] = ChainWindow(
                min_limit=self.config.overload_min_chains, cooldown_s=self.config.overload_cooldown_s
            )
        return window

    def _engine(self, pool: str) -> EngineFit:
        fit = self._engines.get(pool)
        if fit is None:
            fit = self._engines[pool] = EngineFit(
                self.config.prefill_tokens_per_s, self.config.kv_read_s_per_token
            )
        return fit

    def _prefill_rate(self, pool: str) -> float:
        """Prompt tokens per second the pool's engines prefill (as learned, else as told)."""
        fit = self._engines.get(pool)
        return fit.prefill_tokens_per_s if fit is not None else self.config.prefill_tokens_per_s

    def _kv_read(self, pool: str) -> float:
        """Seconds a decode step of the pool's engines pays per token of KV in flight."""
        fit = self._engines.get(pool)
        return fit.kv_read_s_per_token if fit is not None else self.config.kv_read_s_per_token

    def _guard_kv_tokens(self, worker: WorkerView, pool: str) -> float:
        """Other tiers' KV in flight the realtime guard lets run next to realtime hops on
        the worker: a share of its memory, and what reading adds `guard_kv_read_steps`
        bare decode steps to each step. The latter from the engine's calibration (told,
        or Llama-3-8B's), not from the figures learned: the ratio of the two is the
        model's weight bytes over its KV bytes per token, the same on any GPU, and a
        slope learned live is too noisy to set a cap by (docs/benchmarks.md)."""
        config = self.config
        cap = config.guard_kv_share * worker.kv_capacity_tokens if worker.kv_capacity_tokens else math.inf
        if config.kv_read_s_per_token > 0:
            cap = min(cap, config.guard_kv_read_steps * config.decode_step_s / config.kv_read_s_per_token)
        if config.guard_adaptive:
            scale = self._guard_scales.get(pool)
            if scale is not None:
                cap *= scale.scale
        return cap

    def _guard_scale(self, pool: str) -> GuardScale:
        scale = self._guard_scales.get(pool)
        if scale is None:
            config = self.config
            scale = self._guard_scales[pool] = GuardScale(
                min_scale=config.guard_scale_min,
                max_scale=config.guard_scale_max,
                cooldown_s=config.guard_cooldown_s,
                recover_s=config.guard_recover_s,
            )
        return scale

    def engine_fit(self, pool: str) -> EngineFit | None:
        """What the policy learned of the pool's engine (None: nothing, or told to not learn)."""
        return self._engines.get(pool)

    @property
    def _watches_stretch(self) -> bool:
        """Whether finished hops' stretch is measured: overload control and the adaptive
        realtime guard act on it."""
        config = self.config
        return config.overload_control or (config.realtime_guard and config.guard_adaptive)

    def _observe_stretch(self, queued: QueuedHop, now: float, context_tokens: int, service_s: float) -> None:
        """A finished hop of a protected tier says whether its tier is still served well.
        Realtime stretched shrinks the realtime guard's KV cap (`guard_adaptive`) and,
        under overload control, both lower tiers' windows, standard stretched the batch
        one; hops served well let them grow back (standard's first)."""
        hop = queued.view
        config = self.config
        prefill = self._dispatched_prefill.pop(hop.key, 0)
        output = context_tokens - hop.prompt_tokens if context_tokens else 0
        tier = hop.tier_rank
        guard = tier == TIER_REALTIME and config.realtime_guard and config.guard_adaptive
        overload = config.overload_control and tier != TIER_BATCH
        if output <= 0 or not (guard or overload):
            return
        # Against the engine's own figures, not against recent hops: under load every hop
        # is slow, and a baseline learned from them calls that on track (measured on mix:
        # against the fastest recent hops, realtime's median stretch read 1.16 at half
        # the capacity and 1.15 at twice it; against the engine, 1.26 and 3.79). But not
        # faster than the engine has ever been seen to run a token (its bare step as told
        # may be another GPU's or model's: Llama-3-8B / A100 untold).
        prefill_s = prefill / self._prefill_rate(hop.pool)
        fastest = self._fastest_token_s.get(hop.pool, math.inf)
        if tier == TIER_REALTIME:
            ran = max(service_s - prefill_s, 0.0) / output
            fastest = self._fastest_token_s[hop.pool] = min(fastest, ran)
        per_token = config.decode_step_s + context_tokens * self._kv_read(hop.pool)
        if fastest < math.inf:
            per_token = max(per_token, fastest)
        alone = prefill_s + output * per_token
        waited = max(now - service_s - queued.enqueued_at, 0.0)
        stretch = (waited + service_s) / alone if alone > 0 else 1.0
        if guard:
            scale = self._guard_scale(hop.pool)
            if stretch > config.guard_max_stretch:
                scale.at_risk(now)
            else:
                scale.on_track(now)
        if not overload:
            return
        meter = self._stretch.get((hop.pool, tier))
        if meter is None:
            meter = self._stretch[(hop.pool, tier)] = RecentStretch(config.overload_stretch_hops)
        typical = meter.observe(stretch)
        if typical is None:
            return
        batch, standard = self._window(hop.pool, TIER_BATCH), self._window(hop.pool, TIER_STANDARD)
        batch_active = self._active_count[(hop.pool, TIER_BATCH)]
        standard_active = self._active_count[(hop.pool, TIER_STANDARD)]
        if typical > config.overload_max_stretch or stretch > config.overload_hop_stretch:
            batch.at_risk(batch_active, now)
            if tier == TIER_REALTIME:
                standard.at_risk(standard_active, now)
        elif tier == TIER_REALTIME and standard.limited:
            standard.on_track(standard_active)
        else:
            batch.on_track(batch_active)

    def _overloaded(self, hop: HopView) -> bool:
        """A new chain of this tier must wait: its tier's window is full."""
        tier = hop.tier_rank
        if tier == TIER_REALTIME:
            return False
        return not self._window(hop.pool, tier).admits(self._active_count[(hop.pool, tier)])

    @staticmethod
    def _program_kind(hop: HopView) -> str:
        """What gaps are learned per: the program the chain runs, as far as the scheduler
        can tell (its chain config / program name and tier, else the shared prefix its
        prompts start with -- which programs of different shapes may share), else its pool."""
        return hop.program or hop.prefix_id or hop.pool

    def _observe_gap(self, hop: HopView, now: float) -> None:
        state = self._chains.get(self._key(hop))
        if state is not None and state.idle_since is not None:
            self._gaps.observe(self._program_kind(hop), now - state.idle_since)
            state.idle_since = None

    def _hold_s(self, hop: HopView, worker_id: str, tokens: int) -> float:
        if self.config.kv_retention == "fixed":
            return self.config.kv_warm_s
        return self._gaps.price(
            self._program_kind(hop),
            kv_capacity_tokens=self._kv_capacity.get(worker_id, 0),
            # A re-prefill stalls every sequence decoding beside it, not just its own.
            prefill_tokens_per_s=self._prefill_rate(hop.pool) / self.config.reprefill_cost_factor,
            max_hold_s=self.config.max_hold_s,
            reload_tokens_per_s=self._reload_rate(worker_id, tokens),
        )

    def _reload_rate(self, worker_id: str, tokens: int) -> float:
        """How fast `tokens` of context let go on the worker come back from its offload
        tier; 0 when it has none (or the context would not likely stay there)."""
        if not self.config.offload_retention:
            return 0.0
        host_tokens, rate = self._host_kv.get(worker_id, (0, 0.0))
        if not offload_fits(tokens, host_tokens, self.config.offload_share):
            return 0.0
        return rate * self.config.clock_scale if rate else self.config.host_load_tokens_per_s

    def _held_back(self, hop: HopView, load: float) -> bool:
        if self._under_way(hop):
            return False
        if hop.tier_rank == TIER_BATCH:
            return load > self.config.batch_wait_load
        if hop.tier_rank == TIER_STANDARD:
            return load > self.config.standard_wait_load
        return False

    # ----- worker choice ----------------------------------------------------------------

    def _fits(self, worker: WorkerView, hop: HopView, placing: bool, own_held: int = 0) -> bool:
        """Room for the hop: a slot, KV for it next to what runs there and, when placing
        a chain on a worker, next to what is held there for other chains (`own_held`
        is the chain's own hold on this worker, which the hop itself may use)."""
        if not worker.has_slot:
            return False
        if not worker.kv_capacity_tokens:
            return True
        # Priced holds are real: nothing runs over another chain's held room, on the
        # chain's own worker either (that would make the engine evict it). Only room
        # held for chains as urgent as this one counts: a realtime hop may run over a
        # batch chain's idle context (tiers are protected under overload).
        strict = self.config.strict_holds
        up_to = hop.tier_rank if self.config.tiered_holds else TIER_BATCH
        held = max(0, self.resident(worker.worker_id, up_to) - own_held) if placing or strict else 0
        if worker.in_flight == 0 and not (strict and held):
            return True  # an idle worker takes any hop, even one larger than the budget
        capacity = worker.kv_capacity_tokens
        running = worker.kv_in_flight + hop.kv_tokens
        # Moving a chain's context onto a worker where other tiers already fill their
        # share would slow its realtime decodes; on the chain's own worker the context is
        # there already, and sending it elsewhere would only add a re-prefill.
        if placing and hop.tier_rank != TIER_REALTIME and running > capacity * self.config.shared_kv_share:
            return False
        return running + held <= capacity * self.config.kv_budget

    def _headroom(self, worker: WorkerView, own_held: int = 0) -> float:
        if worker.kv_capacity_tokens:
            used = worker.kv_in_flight + self.resident(worker.worker_id) - own_held
            return 1 - max(used / worker.kv_capacity_tokens, worker.slot_load)
        return 1 - worker.slot_load

    def _apart(self, hop: HopView, worker: WorkerView, in_flight: int) -> float:
        """What placing a non-realtime hop on `worker` loses of its room score for the
        realtime hops running there, out of the pool's `in_flight` (`realtime_apart`)."""
        if hop.tier_rank == TIER_REALTIME or not self.config.realtime_apart:
            return 0.0
        here = self._realtime_running.get(worker.worker_id, 0)
        if not here:
            return 0.0
        return self.config.realtime_apart * here / max(in_flight, 1)

    def _patience(self, state: ChainState, hop: HopView) -> float:
        cached = self._exact_cached(hop, state.worker_id)
        tokens = state.context_tokens if cached is None else cached
        moving_cost_s = tokens / self._prefill_rate(hop.pool)
        return min(self.config.max_affinity_wait_s, moving_cost_s * self.config.affinity_wait_factor)

    def _window_over(self, state: ChainState) -> bool:
        window = self.config.reuse_window_hops
        return window > 0 and state.window_hops >= window

    def _own_held(self, state: ChainState | None, worker: WorkerView) -> int:
        return state.held_tokens if state is not None and state.worker_id == worker.worker_id else 0

    def choose_worker(self, queued: QueuedHop, workers: Sequence[WorkerView], now: float) -> str | None:
        hop = queued.view
        load = self._pass_load if self._pass_load is not None else self.load(workers)
        if self._held_back(hop, load) and not self._starved(queued, now):
            return None
        if self.config.overload_control and not self._under_way(hop) and self._overloaded(hop):
            return None  # waits for a chain below the protected tier to end (no starvation escape)
        chosen = self._choose(queued, workers, now)
        if chosen is None or not self.config.realtime_guard:
            return chosen
        if hop.tier_rank == TIER_REALTIME:
            return self._least_stalled(hop, workers, chosen, now) if self.config.realtime_moves else chosen
        if self._realtime_running.get(chosen):
            waited = now - queued.enqueued_at
            if (
                self._prefill_estimate(hop, chosen) > self.config.heavy_prefill_tokens
                and waited < self.config.guard_wait_s
            ):
                return None  # its prefill would stall the realtime decodes there: wait for them
            worker = self._find(workers, chosen)
            assert worker is not None
            if (
                worker.kv_in_flight + hop.kv_tokens > self._guard_kv_tokens(worker, hop.pool)
                and waited < self.config.guard_max_wait_s
                and self._may_wait(queued, now)
            ):
                return None  # its KV would slow every realtime decode step there
        return chosen

    def _may_wait(self, queued: QueuedHop, now: float) -> bool:
        """The chain still has slack to give way with: its hops' waiting so far (this
        one's included) is under its budget, and the hop is not late already."""
        hop = queued.view
        if hop.deadline is not None and hop.deadline - now - hop.remaining_critical_path_s <= 0:
            return False
        state = self._chains.get(self._key(hop))
        if state is None or state.initial_slack_s is None:
            return True
        budget = self.config.guard_slack_share * max(state.initial_slack_s, 0.0)
        return state.queued_s + (now - queued.enqueued_at) < budget

    def _prefill_wait_s(self, worker_id: str, now: float) -> float:
        return max(self._prefill_until.get(worker_id, 0.0) - now, 0.0)

    def _least_stalled(self, hop: HopView, workers: Sequence[WorkerView], chosen: str, now: float) -> str:
        """A realtime hop goes where it waits least behind admitted prefills, counting
        the re-prefill of its own context on a worker that does not hold it."""
        rate, per_token = self._prefill_rate(hop.pool), self._kv_read(hop.pool)

        def cost(worker: WorkerView) -> float:
            # Seconds it would lose there: waiting behind admitted prefills, prefilling
            # what the worker lacks of its context, reading the others' KV each token.
            stall = self._prefill_wait_s(worker.worker_id, now)
            prefill = self._prefill_estimate(hop, worker.worker_id) / rate
            kv_read = hop.max_tokens * worker.kv_in_flight * per_token
            return stall + prefill + kv_read

        here = self._find(workers, chosen)
        if here is None:
            return chosen
        state = self._chains.get(self._key(hop))
        if isinstance(workers, PoolWorkers) and not self._exact_known(hop):
            # (Known exactly, any worker may hold part of the prompt: the indexed visit's
            # bound -- the whole prompt prefilled off the chain's own worker -- would not hold.)
            return self._least_stalled_indexed(hop, workers, state, here, cost)
        fitting = [w for w in workers if self._fits(w, hop, True, self._own_held(state, w))]
        best = min(fitting, key=lambda w: (cost(w), w.in_flight, w.worker_id), default=here)
        return best.worker_id if cost(best) + self.config.realtime_move_margin_s < cost(here) else chosen

    def _least_stalled_indexed(
        self,
        hop: HopView,
        pool: PoolWorkers,
        state: ChainState | None,
        here: WorkerView,
        cost: Callable[[WorkerView], float],
    ) -> str:
        """`_least_stalled` without scanning the pool: workers other than the chain's
        own are visited by the KV running on them, least first. Their cost is at least
        the prefill of the whole prompt plus reading that KV (no stall), so the visit
        stops once that bound exceeds the best cost found (nothing later can be the
        least) or can no longer beat staying where it is by the margin."""
        margin = self.config.realtime_move_margin_s
        here_cost = cost(here)
        best: WorkerView | None = None
        best_key: tuple[float, int, str] | None = None

        def consider(worker: WorkerView) -> None:
            nonlocal best, best_key
            if self._fits(worker, hop, True, self._own_held(state, worker)):
                key = (cost(worker), worker.in_flight, worker.worker_id)
                if best_key is None or key < best_key:
                    best, best_key = worker, key

        home_id = state.worker_id if state is not None else None
        home = pool.get(home_id) if home_id else None
        if home is not None:
            consider(home)  # its cost counts only what it lacks of the context
        prefill = max(hop.prompt_tokens, 0) / self._prefill_rate(hop.pool)
        per_token = self._kv_read(hop.pool)
        by_kv = self._index(pool).by_kv
        found_at: int | None = None  # KV in flight of the best found in this visit, if exact
        i = 0
        while i < len(by_kv):
            kv, _, worker_id = by_kv[i]
            bound = 0.0 + prefill + hop.max_tokens * kv * per_token  # `cost` with no stall
            if bound + margin >= here_cost or (best_key is not None and bound > best_key[0]):
                break
            if found_at == kv:
                # The best so far has this KV and costs no more than the bound, and the
                # rest of its group come after it in (hops in flight, id): none of them
                # can be less. Idle workers (a large group at low load) end here.
                i = bisect.bisect_left(by_kv, (kv + 1,))
                continue
            i += 1
            if worker_id == home_id:
                continue
            worker = pool.get(worker_id)
            assert worker is not None
            before = best
            consider(worker)
            if best is not before and best_key is not None and best_key[0] == bound:
                found_at = kv
        if best is None or best_key is None:
            return here.worker_id
        return best.worker_id if best_key[0] + margin < here_cost else here.worker_id

    def _choose(self, queued: QueuedHop, workers: Sequence[WorkerView], now: float) -> str | None:
        hop = queued.view
        state = self._chains.get(self._key(hop))
        home = None
        if state is not None and state.worker_id is not None:
            home = self._find(workers, state.worker_id)
        if (
            home is not None
            and state is not None
            and state.context_tokens
            and self._exact_cached(hop, home.worker_id) == 0
        ):
            home = None  # the context it left there was evicted: nothing ties the chain there
        if home is not None and state is not None:
            if self._fits(home, hop, placing=False, own_held=self._own_held(state, home)):
                if not self._window_over(state):
                    return home.worker_id
                # Past its reuse window: placed by load again (below).
            elif now - queued.enqueued_at < self._patience(state, hop):
                return None  # cheaper to wait for the warm worker than to re-prefill
        margin = self.config.rebalance_margin
        exact = self._exact_known(hop)

        if isinstance(workers, PoolWorkers):
            in_flight = workers.in_flight
        else:
            in_flight = sum(w.in_flight for w in workers)

        def score(worker: WorkerView) -> tuple:
            # Past its reuse window a chain is placed by load, but its own worker (which
            # holds its prefix) wins unless another has clearly more room. Known exactly,
            # every worker gets the bonus in proportion to what it holds of the prompt.
            cached = self._exact_cached(hop, worker.worker_id) if exact else None
            if cached is not None and hop.prompt_tokens:
                bonus = margin * cached / hop.prompt_tokens
            else:
                bonus = margin if home is not None and worker is home else 0.0
            room = (
                self._headroom(worker, self._own_held(state, worker))
                + bonus
                - self._apart(hop, worker, in_flight)
            )
            return (room, -worker.in_flight, worker.worker_id)

        if isinstance(workers, PoolWorkers) and not exact:
            # The same choice without scanning: the best other worker is the first that
            # fits in score order (only the chain's own worker scores differently; with
            # exact prefix locations every worker may, so that case scans below).
            candidates = [w for w in (self._most_room(workers, hop, home),) if w is not None]
            if home is not None and self._fits(home, hop, False, self._own_held(state, home)):
                candidates.append(home)
        else:
            # Home, where the context already is, is judged as when the chain stays there.
            candidates = [w for w in workers if self._fits(w, hop, w is not home, self._own_held(state, w))]
        if not candidates:
            return None
        return max(candidates, key=score).worker_id

    def _most_room(self, pool: PoolWorkers, hop: HopView, home: WorkerView | None) -> WorkerView | None:
        """The worker other than `home` with the best placement score where the hop fits
        as a newcomer, or None. When none fits, not even `home` as a newcomer, hops at
        least as big (of the same kind) skip the search until a worker's load changes."""
        index = self._index(pool)
        memo_key = (hop.tier_rank == TIER_REALTIME, hop.tier_rank if self.config.tiered_holds else TIER_BATCH)
        memo = index.no_room.get(memo_key)
        if memo is not None and memo[0] == index.epoch and hop.kv_tokens >= memo[1]:
            return None
        home_id = home.worker_id if home is not None else None
        apart = self.config.realtime_apart if hop.tier_rank != TIER_REALTIME else 0.0
        # With `realtime_apart`, the best score (`_choose`'s: room less the penalty, then
        # fewer hops in flight, then the id) among the workers that fit. The index runs
        # in that order without the penalty, which only lowers a score: once a worker's
        # unpenalised key is no better than the best found, none after it can be.
        best: tuple[tuple[float, int, str], WorkerView] | None = None
        for negated_room, in_flight, _, worker_id in index.by_room:
            if best is not None and (-negated_room, -in_flight, worker_id) <= best[0]:
                break
            if worker_id == home_id:
                continue
            worker = pool.get(worker_id)
            if worker is not None and self._fits(worker, hop, True):
                if not apart:
                    return worker
                score = -negated_room - self._apart(hop, worker, pool.in_flight)
                key = (score, -in_flight, worker_id)
                if best is None or key > best[0]:
                    best = (key, worker)
        if best is not None:
            return best[1]
        if home is None or not self._fits(home, hop, True):
            if memo is None or memo[0] != index.epoch or hop.kv_tokens < memo[1]:
                index.no_room[memo_key] = (index.epoch, hop.kv_tokens)
        return None

    def plan_ahead(self, hop: HopView, workers: Sequence[WorkerView], until: float, now: float) -> str | None:
        """Hold room for a chain's coming hop (`hop` describes it: its pool, size) on the
        worker it will run on -- the chain's worker in that pool if it has room, else
        the one with the most -- until `until`; None when no worker has room. The hop
        then finds its room held there (affinity). While a hop of the chain runs in the
        pool (a grown next hop of the same model), only its worker is a candidate."""
        key = self._key(hop)
        state = self._touch(key, now)
        self._set_tier(key, state, hop.tier_rank)
        if state.worker_id is None and hop.last_worker_id and self.config.worker_hints:
            self._adopt_hint(state, hop, workers)  # hold it where the chain's context is
        tokens = hop.kv_tokens

        def room(worker: WorkerView) -> bool:
            if not worker.kv_capacity_tokens:
                return True
            used = worker.kv_in_flight + self.resident(worker.worker_id) - self._own_held(state, worker)
            return used + tokens <= worker.kv_capacity_tokens * self.config.kv_budget

        home = self._find(workers, state.worker_id)
        target = home if home is not None and room(home) else None
        if state.in_flight and target is None:
            # A hop of the chain runs in this pool now: its next one follows it on the
            # same worker (its context is there), so that is the only place to hold.
            return None
        if target is None:
            fitting = [w for w in workers if room(w)]
            if not fitting:
                return None
            target = max(fitting, key=lambda w: (self._headroom(w, self._own_held(state, w)), w.worker_id))
        if target.worker_id != state.worker_id:
            self._hold(key, state, 0, 0.0)
            state.worker_id, state.context_tokens, state.window_hops = target.worker_id, 0, 0
        self._hold(key, state, max(tokens, state.held_tokens), until)
        return target.worker_id

    def drop_ahead(self, hop: HopView) -> None:
        """The look-ahead could not be backed (memory-pool refused): let the room go."""
        state = self._chains.get(self._key(hop))
        if state is not None:  # while a hop runs, the only hold is a look-ahead
            self._hold(self._key(hop), state, 0, 0.0)

    def _starved(self, queued: QueuedHop, now: float) -> bool:
        return now - queued.enqueued_at > self.config.tier_starvation_s

    # ----- bookkeeping ------------------------------------------------------------------

    def on_dispatch(self, queued: QueuedHop, worker_id: str, now: float) -> None:
        self._load_changed(worker_id)  # the queue counts the hop on it now
        self._pool_epoch[queued.pool] += 1
        key = self._key(queued.view)
        prefill = self._prefill_estimate(queued.view, worker_id)
        if self._watches_stretch:
            self._dispatched_prefill[queued.view.key] = prefill
        start = max(self._prefill_until.get(worker_id, 0.0), now)
        self._prefill_until[worker_id] = start + prefill / self._prefill_rate(queued.pool)
        if queued.view.tier_rank == TIER_REALTIME:
            self._realtime_running[worker_id] = self._realtime_running.get(worker_id, 0) + 1
        state = self._touch(key, now)
        state.queued_s += now - queued.enqueued_at
        tier = queued.view.tier_rank
        if tier != TIER_REALTIME and key not in self._active:
            self._active[key] = tier
            self._active_count[(key[0], tier)] += 1
        self._hold(key, state, 0, 0.0)  # its KV now counts as running there
        state.tier = queued.view.tier_rank
        if state.worker_id != worker_id:
            state.context_tokens = 0  # the new worker holds none of it yet
            state.window_hops = 0
        elif self._window_over(state):
            state.window_hops = 0  # placed again (on the same worker): a new window
        state.worker_id = worker_id
        state.in_flight += 1

    def on_finish(self, queued: QueuedHop, now: float, context_tokens: int, service_s: float) -> None:
        hop = queued.view
        self._pool_epoch[hop.pool] += 1  # its chain's state, the pool's windows
        if queued.worker_id is not None:
            self._load_changed(queued.worker_id)  # the queue no longer counts the hop there
        if self.config.learn_engine and queued.engine_sample is not None:
            self._engine(hop.pool).observe(queued.engine_sample)
        if self._watches_stretch and queued.worker_id is not None:
            self._observe_stretch(queued, now, context_tokens, service_s)
        if hop.tier_rank == TIER_REALTIME and queued.worker_id is not None:
            self._realtime_running[queued.worker_id] = max(
                0, self._realtime_running.get(queued.worker_id, 0) - 1
            )
        key = self._key(hop)
        state = self._chains.get(key)
        if state is None or queued.worker_id is None:
            return
        state.in_flight = max(0, state.in_flight - 1)
        state.last_seen = now
        self._chains.move_to_end(key)
        state.attained_s += service_s
        state.hops_done += 1
        if queued.worker_id == state.worker_id:
            state.window_hops += 1
            if context_tokens:
                state.context_tokens = max(state.context_tokens, context_tokens)
        if state.in_flight:
            return
        if hop.remaining_hops == 0 and not hop.session_id:
            self._forget(key)  # the run's last hop: nothing of it will be reused
            if hop.kv_retention_s is not None:
                queued.retention_hint = HINT_ENDED  # the program's end mark wins over its hint
            return
        state.idle_since = now
        state.open_ended = hop.remaining_hops is None
        state.program_kind = self._program_kind(hop)
        # A look-ahead made while the hop ran (room for a grown next hop) stays as long
        # as it was meant to; the context hold below only adds to it.
        ahead = state.held_tokens if state.held_until > now else 0
        tokens, until = max(state.context_tokens, ahead), state.held_until if ahead else now
        hold_s = self._hold_s(hop, queued.worker_id, state.context_tokens)
        if hop.kv_retention_s is None:
            if hold_s > 0:
                # A little past the learned gap, so a chain back right on time finds it held.
                until = max(until, now + hold_s * 1.05)
        else:  # the client said how long to keep it: as long as it said (see `client_hold`)
            hold_s, queued.retention_hint = client_hold(
                hold_s,
                hop.kv_retention_s,
                mode=self.config.client_retention,
                max_hold_s=self.config.max_hold_s,
            )
            if hold_s > 0:  # a priced hold keeps its margin; the client's is as it said
                until = max(until, now + hold_s * (1.05 if queued.retention_hint == HINT_PRICED else 1.0))
        if until > now:
            self._hold(key, state, tokens, until)
        elif state.held_tokens:
            self._hold(key, state, 0, 0.0)

    def on_chain_end(self, chain_key: str, now: float) -> None:
        for pool in sorted(self._pools_of.get(chain_key, ())):
            self._forget((pool, chain_key))


_CONFIG = TypeAdapter(ChainAwareConfig)


@register_policy(
    "chain-aware",
    summary="tiers, chains under way first, slack to deadline, affinity with a reuse window, "
    "KV held warm between hops, look-ahead reservations, admission control",
    options=tuple(ChainAwareConfig.__dataclass_fields__),
)
def _chain_aware(time_scale: float = 1.0, **options: object) -> ChainAwarePolicy:
    """Options are checked and converted to their declared types ("1e9" -> 1e9); a bad
    one is a ValueError naming it."""
    try:
        config = _CONFIG.validate_python(options)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        raise ValueError(f"chain-aware option {where}: {error['msg']}") from None
    return ChainAwarePolicy(config.time_scaled(time_scale) if time_scale != 1.0 else config)
