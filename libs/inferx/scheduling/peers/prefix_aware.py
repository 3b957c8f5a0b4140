"""`prefix-aware`: route to the worker whose cache holds the longest prefix of the hop's
prompt, unless the pool is imbalanced; else the least-loaded worker.

Imitates the SGLang router's `cache_aware` policy (sgl-router / sgl-model-gateway,
policies/cache_aware.rs) with its defaults: the pool is *imbalanced* when
max - min in-flight > `balance_abs_threshold` (64) and max > `balance_rel_threshold`
(1.5) x min; then the hop goes to the least-loaded worker. Otherwise it goes to the
worker with the longest prefix match when match / prompt > `cache_threshold` (0.3).
Every routed prompt is inserted into the chosen worker's tree; trees evict least
recently used entries.

What the policy may know of a prompt: HopView carries no text, so its approximate
tree is keyed by prefix *identity* instead of tokens. A prompt is the shared prefix
(`HopView.prefix_id`, `prefix_tokens`: the system prompt / tool specs, as the router
would see in the text) followed by its chain's context (`chain_key`), whose first N
tokens are the same on every hop of the chain because contexts only grow. Per worker
the tree records which shared prefixes it was sent and, per chain key, how many
context tokens it holds; a match is prefix tokens + min(held, this prompt's context).
Differences from SGLang, all in its favour or neutral:
  * the tree also learns a hop's output when it finishes (its context tokens), as a
    KV-event-fed index (llm-d's precise prefix-cache scorer) does; SGLang's text tree
    learns them only when the next prompt arrives;
  * a worker's tree is bounded by that worker's KV capacity (the engine cannot cache
    more), evicted at once, not every `eviction_interval` seconds;
  * below the threshold SGLang picks the worker with the smallest tree (most room);
    here the least-loaded one, ties to the smallest tree (`miss_route` selects);
  * a worker without a free slot is never chosen (the scheduler's slots; SGLang would
    queue at the engine).
The queue is FCFS, nothing is shed, engines keep prefix caching on.

With `exact_prefix` the match is no longer a guess: it is read from an index fed by the
workers' KV events (`inferx.scheduling.prefix_index`), as llm-d's precise prefix-cache
scorer reads its kv-cache index -- the same information chain-aware's `exact_prefix`
gets, so the comparison stays fair. A worker whose events are not (yet) known, or a hop
whose prompt blocks are unknown, falls back to the approximate tree.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Literal

from inferx.scheduling.peers.base import FcfsPeer, free_kv
from inferx.scheduling.prefix_index import PrefixIndex
from inferx.scheduling.registry import register_policy
from inferx.scheduling.views import HopView, QueuedHop, WorkerView

MAX_TREE_TOKENS = 1 << 26  # SGLang's default max_tree_size, used when KV capacity is unknown

Entry = tuple[str, str]  # ("p", prefix id) or ("c", chain key)


class ApproxTree:
    """One worker's cache as the router believes it: entry -> tokens, least recent first."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.entries: OrderedDict[Entry, int] = OrderedDict()
        self.size = 0

    def match(self, hop: HopView) -> int:
        """Tokens of the hop's prompt this worker is believed to hold, from the start."""
        prompt = hop.prompt_tokens
        shared = min(hop.prefix_tokens, prompt) if hop.prefix_id else 0
        context = self.entries.get(("c", hop.chain_key))
        if context is not None:
            # A chain's context sits under its shared prefix (one radix path), so holding
            # the context implies holding the prefix.
            return min(prompt, shared + context)
        if hop.prefix_id and ("p", hop.prefix_id) in self.entries:
            return shared
        return 0

    def insert(self, hop: HopView, context_tokens: int) -> None:
        """Record that the worker now holds the hop's prefix and `context_tokens` of its
        chain's context (beyond the prefix); the prefix is touched last, so LRU evicts
        a chain's context before the prefix other chains share (leaves first)."""
        if context_tokens > 0:
            key: Entry = ("c", hop.chain_key)
            self._put(key, max(context_tokens, self.entries.get(key, 0)))
        if hop.prefix_id and hop.prefix_tokens:
            self._put(("p", hop.prefix_id), hop.prefix_tokens)
        while self.size > self.max_tokens and self.entries:
            _, tokens = self.entries.popitem(last=False)
            self.size -= tokens

    def _put(self, key: Entry, tokens: int) -> None:
        self.size += tokens - self.entries.get(key, 0)
        self.entries[key] = tokens
        self.entries.move_to_end(key)


class PrefixAwarePolicy(FcfsPeer):
    name = "prefix-aware"

    def __init__(
        self,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        miss_route: Literal["least-loaded", "smallest-tree"] = "least-loaded",
        exact_prefix: bool = False,
    ) -> None:
        if not isinstance(exact_prefix, bool):
            raise ValueError(f"prefix-aware option exact_prefix: true or false, not {exact_prefix!r}")
        self.exact_prefix = exact_prefix
        self._index: PrefixIndex | None = None
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.miss_route = miss_route
        self._trees: dict[tuple[str, str], ApproxTree] = {}  # (pool, worker) -> tree

    def use_prefix_index(self, index: PrefixIndex) -> bool:
        self._index = index
        return self.exact_prefix

    def match(self, hop: HopView, worker: WorkerView) -> int:
        """Tokens of the hop's prompt the worker holds: exact from the KV-event index
        when that is on and knows the worker, else the approximate tree's belief."""
        index = self._index
        if self.exact_prefix and index is not None and hop.prompt_blocks and index.knows(worker.worker_id):
            return min(index.match(worker.worker_id, hop.prompt_blocks), hop.prompt_tokens)
        return self.tree(hop.pool, worker).match(hop)

    def tree(self, pool: str, worker: WorkerView) -> ApproxTree:
        key = (pool, worker.worker_id)
        tree = self._trees.get(key)
        if tree is None:
            tree = self._trees[key] = ApproxTree(worker.kv_capacity_tokens or MAX_TREE_TOKENS)
        return tree

    def imbalanced(self, workers: Sequence[WorkerView]) -> bool:
        loads = [w.in_flight for w in workers]
        if not loads:
            return False
        high, low = max(loads), min(loads)
        return high - low > self.balance_abs_threshold and high > self.balance_rel_threshold * low

    def choose_worker(self, queued: QueuedHop, workers: Sequence[WorkerView], now: float) -> str | None:
        free = [w for w in workers if w.has_slot]
        if not free:
            return None
        hop = queued.view
        # SGLang's two modes: balance first when the pool is skewed, else chase the cache.
        if not self.imbalanced(workers) and hop.prompt_tokens > 0:
            matches = {w.worker_id: self.match(hop, w) for w in free}
            best = max(free, key=lambda w: (matches[w.worker_id], -w.in_flight, w.worker_id))
            if matches[best.worker_id] / hop.prompt_tokens > self.cache_threshold:
                return best.worker_id

        def miss_key(w: WorkerView) -> tuple:
            size = self.tree(hop.pool, w).size
            if self.miss_route == "smallest-tree":
                return (size, w.in_flight, w.worker_id)
            return (w.in_flight, size, -free_kv(w), w.worker_id)

        return min(free, key=miss_key).worker_id

    def on_dispatch(self, queued: QueuedHop, worker_id: str, now: float) -> None:
        # As the router inserts the request text into the chosen tenant's tree.
        hop = queued.view
        tree = self._tree_by_id(hop.pool, worker_id)
        if tree is not None:
            tree.insert(hop, hop.prompt_tokens - self._shared(hop))

    def on_finish(self, queued: QueuedHop, now: float, context_tokens: int, service_s: float) -> None:
        hop = queued.view
        if not context_tokens or queued.worker_id is None:
            return  # failed, or unknown: learn nothing
        tree = self._tree_by_id(hop.pool, queued.worker_id)
        if tree is not None:
            tree.insert(hop, context_tokens - self._shared(hop))

    @staticmethod
    def _shared(hop: HopView) -> int:
        return min(hop.prefix_tokens, hop.prompt_tokens) if hop.prefix_id else 0

    def _tree_by_id(self, pool: str, worker_id: str) -> ApproxTree | None:
        # Trees are created in choose_worker, which always runs before a dispatch.
        return self._trees.get((pool, worker_id))


@register_policy(
    "prefix-aware",
    summary="FCFS queue, longest cached-prefix match above 30% unless load is imbalanced, else least-loaded",
    imitates="SGLang router cache_aware (approximate radix tree, balance thresholds 64 / 1.5)",
    options=(
        "cache_threshold",
        "balance_abs_threshold",
        "balance_rel_threshold",
        "miss_route",
        "exact_prefix",
    ),
)
def _prefix_aware(time_scale: float = 1.0, **options: object) -> PrefixAwarePolicy:
    return PrefixAwarePolicy(**options)  # type: ignore[arg-type]
