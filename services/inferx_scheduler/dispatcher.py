"""The live side of the pure `DispatchQueue` + `Policy`: futures for waiting hops,
the worker set from etcd, a timer for decisions that wait on time alone."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from inferx.errors import Unavailable
from inferx.metric_children import child
from inferx.pools import PoolDirectory
from inferx.scheduling.engine_fit import EngineSample, LearnsEngine
from inferx.scheduling.prefix_index import ChainContexts, PrefixIndex
from inferx.scheduling.queue import DispatchQueue, QueuedHop, WorkerSlots
from inferx.scheduling.registry import make_policy
from inferx.scheduling.views import HopView
from inferx.tokens import TokenRatio
from inferx.v1 import common_pb2
from inferx_scheduler import metrics

_SlotsKey = tuple[tuple[bool, ...], bool]


class HopDispatcher:
    """Glue between the pure DispatchQueue + Policy and the live world (futures, etcd)."""

    def __init__(
        self,
        directory: PoolDirectory,
        max_queued_per_pool: int,
        policy: str = "chain-aware",
        usable: Callable[[str], bool] | None = None,
        time_scale: float = 1.0,
        policy_options: dict[str, object] | None = None,
    ) -> None:
        self.directory = directory
        self.queue = DispatchQueue(
            max_queued_per_pool, make_policy(policy, time_scale=time_scale, **(policy_options or {}))
        )
        # Which worker holds which prefix blocks (fed by `kv_events.KvEventSubscriber`),
        # and the block keys of each chain's latest contexts (from its workers' replies),
        # kept only for a policy that places by them (exact prefix).
        self.prefix_index = PrefixIndex()
        self.contexts = ChainContexts()
        # pool -> engine tokens per prompt character, from what its workers counted
        self.token_ratios: dict[str, TokenRatio] = {}
        self.reads_prompt_blocks = self.queue.policy.use_prefix_index(self.prefix_index)
        self._waiters: dict[int, asyncio.Future[str]] = {}
        self._engine_fits: dict[str, int] = {}  # pool -> the refit its engine gauges show
        decides = self.queue.policy
        self._learns: LearnsEngine | None = decides if isinstance(decides, LearnsEngine) else None
        self._wake: asyncio.TimerHandle | None = None
        self._usable = usable or (lambda worker_id: True)
        # Without the memory-pool nobody guards KV capacity: run at half concurrency.
        self.conservative = False
        self._depth_changed: set[str] = set()  # pools whose queue gauges are due
        # pool -> (its workers dict, (usable flags, conservative), the slots made of them)
        self._slots_cache: dict[str, tuple[object, _SlotsKey, tuple[WorkerSlots, ...]]] = {}

    def token_ratio(self, pool: str) -> TokenRatio:
        """The pool's engine tokens per prompt character (the prior until learned)."""
        ratio = self.token_ratios.get(pool)
        if ratio is None:
            ratio = self.token_ratios[pool] = TokenRatio()
        return ratio

    def counted_tokens(self, pool: str, prompt_chars: int, prompt_tokens: int) -> None:
        """A finished hop's prompt as its worker counted it: the pool's ratio learns it."""
        ratio = self.token_ratio(pool)
        ratio.observe(prompt_chars, prompt_tokens)
        if ratio.learned:
            child(metrics.PROMPT_CHARS_PER_TOKEN, pool).set(1 / ratio.tokens_per_char)

    def submit(self, view: HopView) -> tuple[QueuedHop, asyncio.Future[str]]:
        """Queue a hop; the future resolves to the worker it is assigned to."""
        hop = self.queue.submit(view.pool, view.run_id, view.hop_id, time.monotonic(), view)
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._waiters[hop.seq] = future
        self._publish_depth(view.pool)
        self.dispatch()
        return hop, future

    def cancel(self, hop: QueuedHop) -> None:
        self._waiters.pop(hop.seq, None)
        if self.queue.cancel(hop):
            self._publish_depth(hop.pool)

    def finished(
        self,
        hop: QueuedHop,
        context_tokens: int = 0,
        service_s: float = 0.0,
        engine: EngineSample | None = None,
    ) -> None:
        self.queue.finished(
            hop, time.monotonic(), context_tokens=context_tokens, service_s=service_s, engine=engine
        )
        if engine is not None and self._learns is not None:
            self._publish_engine(self._learns, hop.pool)
        self.dispatch()

    def _publish_engine(self, policy: LearnsEngine, pool: str) -> None:
        """The pool's engine figures as gauges, when the policy has refitted them."""
        fit = policy.engine_fit(pool)
        if fit is None or self._engine_fits.get(pool) == fit.fits:
            return
        self._engine_fits[pool] = fit.fits
        child(metrics.ENGINE_PREFILL_RATE, pool).set(fit.prefill_tokens_per_s)
        child(metrics.ENGINE_KV_READ, pool).set(fit.kv_read_s_per_token)

    def dispatch(self) -> None:
        registered = {pool: bool(workers) for pool, workers in self.directory.workers_by_pool.items()}
        slots = {pool: self._slots(pool, workers) for pool, workers in self.directory.workers_by_pool.items()}
        now = time.monotonic()
        assigned = self.queue.assign(slots, now)
        self._schedule_wake(now)
        for hop in assigned:
            future = self._waiters.pop(hop.seq, None)
            if future is None or future.done():
                self.queue.finished(hop)  # its caller left meanwhile
                continue
            future.set_result(hop.worker_id or "")
        for pool in self.queue.pools():
            self._publish_depth(pool)
            if not registered.get(pool):
                # The pool's last worker left: fail its queued hops now, not at their deadline.
                for hop in self.queue.drain_pool(pool):
                    future = self._waiters.pop(hop.seq, None)
                    if future is not None and not future.done():
                        future.set_exception(Unavailable(f"all workers of pool '{pool}' left"))

    def _slots(self, pool: str, workers: dict[str, common_pb2.WorkerInfo]) -> tuple[WorkerSlots, ...]:
        """The pool's usable workers (circuit closed) as the queue takes them. Dispatch runs
        on every hop's submit and finish; the same tuple is handed over while nothing
        changed (the directory replaces a pool's dict when its registrations change), so
        neither side rebuilds anything for it."""
        usable = tuple(self._usable(worker_id) for worker_id in workers)
        cached = self._slots_cache.get(pool)
        if cached is not None and cached[0] is workers and cached[1] == (usable, self.conservative):
            return cached[2]
        slots = tuple(
            WorkerSlots(
                w.worker_id,
                self._concurrency(w.max_concurrency),
                w.kv_capacity_tokens,
                w.host_kv_capacity_tokens,
                w.host_kv_load_tokens_per_s,
            )
            for w, ok in zip(workers.values(), usable, strict=True)
            if ok
        )
        self._slots_cache[pool] = (workers, (usable, self.conservative), slots)
        return slots

    def _publish_depth(self, pool: str) -> None:
        """The pool's queue gauges, set once per event-loop turn however many hops were
        submitted, dispatched or finished in it (they were set on every one: ~3% of the
        scheduler's CPU under load, issue #14); a scrape sees them at most a turn late."""
        if not self._depth_changed:
            try:
                asyncio.get_running_loop().call_soon(self.publish_depth_now)
            except RuntimeError:  # no loop (a synchronous caller): now
                self._depth_changed.add(pool)
                self.publish_depth_now()
                return
        self._depth_changed.add(pool)

    def publish_depth_now(self) -> None:
        changed, self._depth_changed = self._depth_changed, set()
        for pool in changed:
            child(metrics.QUEUE_DEPTH, pool).set(self.queue.queued(pool))
            metrics.set_queued_by_tier(pool, self.queue.queued_by_tier(pool))

    def _concurrency(self, max_concurrency: int) -> int:
        limit = max_concurrency or 1
        return max(1, limit // 2) if self.conservative else limit

    def _schedule_wake(self, now: float) -> None:
        """Some queued hops wait on time alone (affinity patience, starvation bounds):
        look again then, even if nothing else happens."""
        wake = self.queue.next_wake
        if wake is None:
            return
        if self._wake is not None:
            if self._wake.when() <= asyncio.get_running_loop().time() + (wake - now):
                return
            self._wake.cancel()
        self._wake = asyncio.get_running_loop().call_later(max(wake - now, 0.005), self._woken)

    def _woken(self) -> None:
        self._wake = None
        self.dispatch()
