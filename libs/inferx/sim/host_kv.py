"""The KV offload tier of one simulated engine: prefix entries the GPU evicted, kept in
host memory (LRU) so a later prompt can load them back over PCIe instead of
re-prefilling them -- what vLLM's native CPU KV offloading and LMCache do.

Exclusive of the GPU pool: an entry is in one tier at a time. `KvPool.make_room` hands
every entry it evicts to `store` (free: vLLM copies blocks to the host asynchronously
as they are computed, so by eviction time the copy exists); a prompt that finds its
prefix here `take`s it, and the engine charges the transfer (`EngineModel`).
"""

from __future__ import annotations

from collections import OrderedDict


class HostKv:
    def __init__(self, capacity_tokens: int) -> None:
        self.capacity = capacity_tokens
        self._entries: OrderedDict[str, int] = OrderedDict()  # key -> tokens, least recent first
        self.used = 0
        self.stored = 0  # entries offloaded from the GPU
        self.evictions = 0  # entries dropped from the host tier (LRU), lost for good
        self.loads = 0  # entries loaded back to the GPU

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def tokens_of(self, key: str) -> int:
        return self._entries[key]

    def store(self, key: str, tokens: int) -> None:
        """Keep an entry the GPU evicted, dropping the least recently used ones for room.
        One larger than the whole tier is dropped."""
        self.discard(key)
        if tokens > self.capacity:
            self.evictions += 1
            return
        while self.used + tokens > self.capacity:
            _, dropped = self._entries.popitem(last=False)
            self.used -= dropped
            self.evictions += 1
        self._entries[key] = tokens
        self.used += tokens
        self.stored += 1

    def take(self, key: str) -> int:
        """Remove an entry being loaded back to the GPU; its tokens."""
        tokens = self._entries.pop(key)
        self.used -= tokens
        self.loads += 1
        return tokens

    def discard(self, key: str) -> None:
        """Forget a copy the GPU now holds anew (recomputed there)."""
        tokens = self._entries.pop(key, None)
        if tokens is not None:
            self.used -= tokens
