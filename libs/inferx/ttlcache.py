"""A TTL + LRU store bounded in bytes (pure: time passed in).

Used for tool results (key = tool + version + canonical arguments) and for agent
session memory (bounded lists). Least recently used entries go first when the
byte bound is reached; expired entries are dropped when touched or swept.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from inferx.v1 import cache_pb2


@dataclass
class Entry:
    value: bytes | list[bytes]
    stored_at: float
    expires_at: float

    @property
    def size(self) -> int:
        if isinstance(self.value, list):
            return sum(len(v) for v in self.value)
        return len(self.value)


@dataclass
class StoreStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    expirations: int = 0


@dataclass
class TtlLruStore:
    max_bytes: int = 64 * 1024 * 1024
    default_ttl_s: float = 300.0
    stats: StoreStats = field(default_factory=StoreStats)
    _entries: OrderedDict[str, Entry] = field(default_factory=OrderedDict)
    _bytes: int = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes_used(self) -> int:
        return self._bytes

    def _live(self, key: str, now: float) -> Entry | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry.expires_at <= now:
            self._remove(key)
            self.stats.expirations += 1
            return None
        self._entries.move_to_end(key)
        return entry

    def get(self, key: str, now: float) -> tuple[bytes, float] | None:
        """(value, age in seconds) or None; counts a hit or a miss."""
        entry = self._live(key, now)
        if entry is None or isinstance(entry.value, list):
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        return entry.value, now - entry.stored_at

    def put(self, key: str, value: bytes, now: float, ttl_s: float = 0.0) -> None:
        self._set(key, Entry(value, now, now + (ttl_s or self.default_ttl_s)))

    def append(self, key: str, value: bytes, now: float, ttl_s: float = 0.0, max_items: int = 50) -> None:
        entry = self._live(key, now)
        items = list(entry.value) if entry is not None and isinstance(entry.value, list) else []
        items.append(value)
        self._set(key, Entry(items[-max_items:], now, now + (ttl_s or self.default_ttl_s)))

    def get_list(self, key: str, now: float) -> list[bytes]:
        entry = self._live(key, now)
        if entry is None or not isinstance(entry.value, list):
            return []
        return list(entry.value)

    def sweep(self, now: float) -> int:
        expired = [k for k, e in self._entries.items() if e.expires_at <= now]
        for key in expired:
            self._remove(key)
        self.stats.expirations += len(expired)
        return len(expired)

    def invalidate(self, key: str = "", prefix: str = "") -> int:
        """Drop `key`, or every key starting with `prefix`; returns how many went."""
        doomed = [key] if key and key in self._entries else []
        if prefix:
            doomed = [k for k in self._entries if k.startswith(prefix)]
        for k in doomed:
            self._remove(k)
        return len(doomed)

    def _set(self, key: str, entry: Entry) -> None:
        if key in self._entries:
            self._remove(key)
        if entry.size > self.max_bytes:
            return  # larger than the whole cache: not worth evicting everything for
        self._entries[key] = entry
        self._bytes += entry.size
        while self._bytes > self.max_bytes:
            oldest = next(iter(self._entries))
            self._remove(oldest)
            self.stats.evictions += 1

    def _remove(self, key: str) -> None:
        entry = self._entries.pop(key)
        self._bytes -= entry.size


def stats_message(store: TtlLruStore) -> cache_pb2.CacheStats:
    """A store's statistics as the protobuf both cache tiers report."""
    s = store.stats
    return cache_pb2.CacheStats(
        entries=len(store),
        bytes=store.bytes_used,
        max_bytes=store.max_bytes,
        hits=s.hits,
        misses=s.misses,
        evictions=s.evictions,
        expirations=s.expirations,
    )
