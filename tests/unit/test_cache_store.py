"""The cache service's store: TTL, LRU eviction under a byte bound, bounded lists."""

from inferx.ttlcache import TtlLruStore


def test_hit_miss_and_ttl() -> None:
    store = TtlLruStore(max_bytes=1000, default_ttl_s=10)
    assert store.get("k", now=0) is None
    store.put("k", b"v", now=0)
    assert store.get("k", now=5) == (b"v", 5)
    assert store.get("k", now=10) is None
    assert (store.stats.hits, store.stats.misses, store.stats.expirations) == (1, 2, 1)


def test_per_put_ttl_overrides_default() -> None:
    store = TtlLruStore(default_ttl_s=100)
    store.put("k", b"v", now=0, ttl_s=1)
    assert store.get("k", now=2) is None


def test_lru_eviction_keeps_recently_used_within_the_bound() -> None:
    store = TtlLruStore(max_bytes=10, default_ttl_s=100)
    store.put("a", b"aaaa", now=0)
    store.put("b", b"bbbb", now=0)
    store.get("a", now=1)  # a is now the most recently used
    store.put("c", b"cccc", now=2)
    assert store.get("b", now=3) is None
    assert store.get("a", now=3) is not None
    assert store.bytes_used <= 10
    assert store.stats.evictions == 1


def test_oversized_value_is_not_stored() -> None:
    store = TtlLruStore(max_bytes=4)
    store.put("big", b"12345", now=0)
    assert len(store) == 0 and store.bytes_used == 0


def test_append_keeps_the_newest_items() -> None:
    store = TtlLruStore()
    for i in range(5):
        store.append("s", str(i).encode(), now=i, max_items=3)
    assert store.get_list("s", now=5) == [b"2", b"3", b"4"]
    assert store.get_list("other", now=5) == []


def test_sweep_drops_expired() -> None:
    store = TtlLruStore(default_ttl_s=1)
    store.put("a", b"1", now=0)
    store.put("b", b"2", now=0, ttl_s=5)
    assert store.sweep(now=2) == 1
    assert len(store) == 1 and store.bytes_used == 1


def test_invalidate_by_key_and_prefix() -> None:
    store = TtlLruStore()
    for key in ("tool:a:1:x", "tool:a:2:y", "tool:b:1:z"):
        store.put(key, b"v", now=0)
    assert store.invalidate(key="tool:b:1:z") == 1
    assert store.invalidate(key="missing") == 0
    assert store.invalidate(prefix="tool:a:") == 2
    assert len(store) == 0 and store.bytes_used == 0
