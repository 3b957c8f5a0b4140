"""KV memory of one simulated engine: shared, reference-counted prefix entries plus each
sequence's private tokens, with LRU eviction of entries nobody uses (vLLM's automatic
prefix caching keeps freed blocks as cache until it needs the memory).

Accounting is in tokens; a prompt is a sequence of `Segment`s whose keys name the
content *and everything before it* (a prefix), so a hit on segment i means the
engine may skip prefilling segments 0..i. The live `sim` engine uses one segment per
16-token block (keyed by a running hash, like vLLM); the virtual-time simulator uses
coarser segments (a shared system prompt, then one per hop input and output).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

from inferx.sim.host_kv import HostKv


@dataclass(frozen=True)
class Segment:
    key: str | None  # None: never shared or cached (e.g. a partial trailing block)
    tokens: int


@dataclass
class _Entry:
    tokens: int
    refs: int


class KvListener(Protocol):
    """Told of every cache entry stored and evicted: the engine's KV events (vLLM's
    BlockStored / BlockRemoved), which a scheduler's prefix index is fed from."""

    def stored(self, key: str, tokens: int) -> None: ...

    def removed(self, key: str) -> None: ...


class KvPool:
    def __init__(self, capacity_tokens: int, host: HostKv | None = None) -> None:
        self.listener: KvListener | None = None  # told of blocks stored and removed (KV events)
        self.capacity = capacity_tokens
        self.host = host  # the offload tier evicted entries go to; None: they are lost
        self._entries: dict[str, _Entry] = {}
        self._lru: OrderedDict[str, None] = OrderedDict()  # refs == 0, least recent first
        self._evictable = 0
        self.used = 0  # entries (pinned or not) + private tokens
        self.evictions = 0

    @property
    def free(self) -> int:
        return self.capacity - self.used

    @property
    def available(self) -> int:
        """Free now or after evicting every unpinned cache entry."""
        return self.free + self._evictable

    @property
    def pinned(self) -> int:
        return self.used - self._evictable

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def tokens_of(self, key: str) -> int:
        return self._entries[key].tokens

    def make_room(self, tokens: int) -> bool:
        """Evict least-recently-used unpinned entries until `tokens` fit."""
        while self.free < tokens and self._lru:
            key, _ = self._lru.popitem(last=False)
            entry = self._entries.pop(key)
            self._evictable -= entry.tokens
            self.used -= entry.tokens
            self.evictions += 1
            if self.host is not None:
                self.host.store(key, entry.tokens)
            if self.listener is not None:
                self.listener.removed(key)
        return self.free >= tokens

    def acquire(self, key: str) -> None:
        entry = self._entries[key]
        if entry.refs == 0:
            del self._lru[key]
            self._evictable -= entry.tokens
        entry.refs += 1

    def release(self, key: str) -> None:
        entry = self._entries[key]
        entry.refs -= 1
        if entry.refs == 0:
            self._lru[key] = None  # most recently used end
            self._evictable += entry.tokens

    def insert(self, key: str, tokens: int, *, pinned: bool) -> None:
        """Add an entry; the caller has made room for it."""
        if self.host is not None:
            self.host.discard(key)  # recomputed into the GPU: one tier holds an entry
        self._entries[key] = _Entry(tokens, 1 if pinned else 0)
        self.used += tokens
        if self.listener is not None:
            self.listener.stored(key, tokens)
        if not pinned:
            self._lru[key] = None
            self._evictable += tokens

    def alloc_private(self, tokens: int) -> None:
        self.used += tokens

    def free_private(self, tokens: int) -> None:
        self.used -= tokens
