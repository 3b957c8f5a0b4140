"""The foundation dispatch policy: FCFS inside a pool, least-loaded worker with room."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferx.scheduling.queue import DispatchQueue, QueueFull, WorkerSlots


def test_fcfs_order_and_least_loaded_worker() -> None:
    q = DispatchQueue()
    for i in range(4):
        q.submit("p", "run", f"h{i}", now=i)
    workers = {"p": [WorkerSlots("a", 2), WorkerSlots("b", 2)]}
    assigned = q.assign(workers)
    assert [h.hop_id for h in assigned] == ["h0", "h1", "h2", "h3"]
    assert sorted(h.worker_id or "" for h in assigned) == ["a", "a", "b", "b"]
    assert assigned[0].worker_id != assigned[1].worker_id  # spread, not piled on one
    assert q.queued("p") == 0 and q.running("p") == 4


def test_hops_wait_for_a_free_slot_then_go() -> None:
    q = DispatchQueue()
    first = q.submit("p", "r", "1", 0)
    second = q.submit("p", "r", "2", 0)
    assert [h.hop_id for h in q.assign({"p": [WorkerSlots("a", 1)]})] == ["1"]
    assert q.queued("p") == 1
    assert q.assign({"p": [WorkerSlots("a", 1)]}) == []
    q.finished(first)
    assert [h.hop_id for h in q.assign({"p": [WorkerSlots("a", 1)]})] == ["2"]
    q.finished(second)
    assert q.in_flight("a") == 0 and q.dispatched("a") == 2


def test_pools_are_independent_and_unknown_pools_wait() -> None:
    q = DispatchQueue()
    q.submit("x", "r", "1", 0)
    q.submit("y", "r", "2", 0)
    assigned = q.assign({"x": [WorkerSlots("a", 4)]})
    assert [h.hop_id for h in assigned] == ["1"]
    assert q.queued("y") == 1


def test_queue_bound_raises_queue_full() -> None:
    q = DispatchQueue(max_queued_per_pool=2)
    q.submit("p", "r", "1", 0)
    q.submit("p", "r", "2", 0)
    with pytest.raises(QueueFull, match="pool 'p'"):
        q.submit("p", "r", "3", 0)


def test_cancel_and_drain() -> None:
    q = DispatchQueue()
    a = q.submit("p", "r", "a", 0)
    q.submit("p", "r", "b", 0)
    assert q.cancel(a)
    assert not q.cancel(a)
    assert [h.hop_id for h in q.drain_pool("p")] == ["b"]
    assert q.queued("p") == 0


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["submit", "assign", "finish"]), st.integers(0, 5)), max_size=60))
def test_no_worker_ever_exceeds_its_concurrency(ops) -> None:
    q = DispatchQueue()
    workers = {"p": [WorkerSlots("a", 2), WorkerSlots("b", 3)]}
    running = []
    for op, n in ops:
        if op == "submit":
            q.submit("p", "r", str(n), 0)
        elif op == "assign":
            running += q.assign(workers)
        elif running:
            q.finished(running.pop(n % len(running)))
        assert q.in_flight("a") <= 2 and q.in_flight("b") <= 3
        assert q.running("p") == len(running)


def test_queued_hops_counted_per_tier() -> None:
    from inferx.scheduling.views import HopView

    q = DispatchQueue()
    q.submit("p", "r1", "a", 0, HopView("p", "r1", "a", tier=1))
    q.submit("p", "r2", "b", 0, HopView("p", "r2", "b", tier=3))
    q.submit("p", "r3", "c", 0, HopView("p", "r3", "c", tier=3))
    q.submit("p", "r4", "d", 0)  # no tier: counted as standard
    assert q.queued_by_tier("p") == {"realtime": 1, "batch": 2, "standard": 1}
    assert q.queued_by_tier("other") == {}
