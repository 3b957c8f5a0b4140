"""Consistent hashing: even spread, and adding a replica moves only its share."""

from collections import Counter

from inferx.hashring import HashRing

KEYS = [f"tool:vector_search:1:{i}" for i in range(20_000)]


def test_keys_spread_evenly() -> None:
    ring = HashRing(["a:1", "b:1", "c:1", "d:1"])
    counts = Counter(ring.owner(k) for k in KEYS)
    assert set(counts) == {"a:1", "b:1", "c:1", "d:1"}
    assert max(counts.values()) < 1.25 * len(KEYS) / 4


def test_adding_a_replica_moves_only_its_share() -> None:
    ring = HashRing(["a:1", "b:1", "c:1", "d:1"])
    before = {k: ring.owner(k) for k in KEYS}
    ring.set_members(["a:1", "b:1", "c:1", "d:1", "e:1"])
    moved = [k for k in KEYS if ring.owner(k) != before[k]]
    assert all(ring.owner(k) == "e:1" for k in moved)  # keys only move to the newcomer
    assert 0.12 < len(moved) / len(KEYS) < 0.28  # about 1/5


def test_empty_ring_has_no_owner() -> None:
    assert HashRing().owner("k") is None


def test_walk_starts_at_the_owner_and_visits_every_member_once() -> None:
    ring = HashRing(["a:1", "b:1", "c:1", "d:1"])
    for key in KEYS[:200]:
        walk = list(ring.walk(key))
        assert walk[0] == ring.owner(key)
        assert sorted(walk) == ["a:1", "b:1", "c:1", "d:1"]
    # The fallback order differs between keys, so a hot owner's overflow spreads out.
    assert len({tuple(ring.walk(k))[1] for k in KEYS[:200]}) > 1
    assert list(HashRing().walk("k")) == []
