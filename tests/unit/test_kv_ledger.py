"""KV ledger: headroom kept free, reservations never negative and never leaked."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferx_memory_pool.ledger import InsufficientCapacity, KvLedger, UnknownWorker


def test_headroom_is_kept_free() -> None:
    ledger = KvLedger(headroom_ratio=0.2)
    ledger.set_workers({"w": ("pool", 1000)})
    ledger.reserve("w", 800, now=0)
    with pytest.raises(InsufficientCapacity, match="20% headroom"):
        ledger.reserve("w", 1, now=0)


def test_release_and_expiry_return_capacity() -> None:
    ledger = KvLedger(headroom_ratio=0.2, reservation_ttl_s=10)
    ledger.set_workers({"w": ("pool", 1000)})
    a = ledger.reserve("w", 500, now=0)
    ledger.reserve("w", 300, now=0)
    assert ledger.release(a.reservation_id)
    assert not ledger.release(a.reservation_id)
    assert ledger.reserved("w") == 300
    assert ledger.expire(now=10) == 1
    assert ledger.reserved("w") == 0


def test_unknown_worker_and_worker_leaving() -> None:
    ledger = KvLedger()
    with pytest.raises(UnknownWorker):
        ledger.reserve("ghost", 1, now=0)
    ledger.set_workers({"w": ("p", 100), "v": ("p", 100)})
    ledger.reserve("w", 10, now=0)
    ledger.set_workers({"v": ("p", 100)})
    assert [row.worker_id for row in ledger.snapshot()] == ["v"]
    assert ledger.snapshot()[0].reserved_tokens == 0


def test_bad_headroom_rejected() -> None:
    with pytest.raises(ValueError):
        KvLedger(headroom_ratio=1.0)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("reserve"), st.sampled_from(["a", "b"]), st.integers(1, 400)),
            st.tuples(st.just("release"), st.integers(0, 30), st.just(0)),
            st.tuples(st.just("tick"), st.integers(1, 20), st.just(0)),
        ),
        max_size=80,
    )
)
def test_accounting_never_goes_negative_or_over_usable(ops) -> None:
    ledger = KvLedger(headroom_ratio=0.2, reservation_ttl_s=15)
    ledger.set_workers({"a": ("p", 1000), "b": ("p", 500)})
    now = 0.0
    held: list[str] = []
    for op, x, y in ops:
        if op == "reserve":
            try:
                held.append(ledger.reserve(x, y, now).reservation_id)
            except InsufficientCapacity:
                pass
        elif op == "release" and held:
            ledger.release(held.pop(x % len(held)))
        else:
            now += x
            ledger.expire(now)
        for row in ledger.snapshot():
            assert 0 <= row.reserved_tokens <= row.usable_tokens
    for rid in held:
        ledger.release(rid)
    ledger.expire(now + 1000)
    assert all(row.reserved_tokens == 0 and row.reservations == 0 for row in ledger.snapshot())


def test_high_engine_usage_admits_only_protected_work() -> None:
    ledger = KvLedger(headroom_ratio=0.2, high_usage_ratio=0.85)
    ledger.set_workers({"w": ("p", 1000)})
    ledger.set_engine_usage("w", 0.9)
    with pytest.raises(InsufficientCapacity, match="90% KV usage"):
        ledger.reserve("w", 10, now=0)
    assert ledger.reserve("w", 10, now=0, protected=True).tokens == 10
    ledger.set_engine_usage("w", 0.5)
    assert ledger.reserve("w", 10, now=0).tokens == 10
    assert ledger.snapshot()[0].engine_usage_ratio == 0.5
    ledger.set_engine_usage("ghost", 0.99)  # unknown workers are ignored
    assert [row.worker_id for row in ledger.snapshot()] == ["w"]
