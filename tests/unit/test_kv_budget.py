"""The scheduler's local KV budget (issue #14): hops reserve and release from a budget
leased from the memory-pool, with no call; it asks for more ahead of need and returns
idle budget; random sequences never exceed the granted budget and never leak."""

from __future__ import annotations

import math

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from inferx_scheduler.budget import HOP, LOOKAHEAD, VALID_FRACTION, WINDOW_SYNCS, LocalBudget


def granted(tokens: dict[str, int], now: float = 0.0, ttl_s: float = 10.0) -> LocalBudget:
    """A budget that declared and was granted `tokens` per worker at `now`."""
    budget = LocalBudget()
    for worker_id in tokens:
        assert budget.reserve(worker_id, 1, now) is None  # unknown worker, no lease yet: a miss
    budget.begin_sync(now)
    budget.apply_grants(tokens, now, ttl_s)
    return budget


def test_nothing_is_reserved_before_a_grant_and_the_miss_asks_for_one() -> None:
    budget = LocalBudget()
    assert budget.reserve("w", 100, now=0) is None
    assert budget.grow_wanted  # the sync is woken at once
    (row,) = budget.begin_sync(now=0)
    assert not budget.grow_wanted
    # demand 100 (the miss) + spare max(2 x 100, 50)
    assert (row.worker_id, row.target_tokens, row.reserved_tokens) == ("w", 300, 0)
    budget.apply_grants({"w": 300}, sent_at=0, ttl_s=10)
    res = budget.reserve("w", 100, now=1, run_id="r", hop_id="h")
    assert res is not None and (res.worker_id, res.tokens, res.kind) == ("w", 100, HOP)
    assert (budget.used("w"), budget.granted("w")) == (100, 300)


def test_reserve_release_within_the_budget() -> None:
    budget = granted({"w": 1000})
    a = budget.reserve("w", 600, now=1)
    assert a is not None
    assert budget.reserve("w", 401, now=1) is None  # 600 + 401 > 1000: beyond the budget
    b = budget.reserve("w", 400, now=1)
    assert b is not None and budget.used("w") == 1000
    assert budget.release(a.reservation_id) and not budget.release(a.reservation_id)
    assert budget.release(b.reservation_id)
    assert budget.used("w") == 0 and budget.reservations() == []


def test_the_lease_is_used_only_for_part_of_its_length_from_when_it_was_asked() -> None:
    budget = granted({"w": 1000}, now=0.0, ttl_s=10.0)
    assert budget.valid_until == VALID_FRACTION * 10.0
    assert budget.reserve("w", 10, now=VALID_FRACTION * 10.0 - 0.01) is not None
    assert budget.reserve("w", 10, now=VALID_FRACTION * 10.0) is None  # before the pool's own expiry
    assert budget.grow_wanted


def test_lookahead_leases_end_by_themselves() -> None:
    budget = granted({"w": 1000})
    ahead = budget.reserve("w", 300, now=1, kind=LOOKAHEAD, lease_s=4)
    assert ahead is not None and ahead.expires_at == 5 and ahead.kind == LOOKAHEAD
    assert budget.expire(now=4.9) == 0 and budget.used("w") == 300
    assert budget.expire(now=5) == 1 and budget.used("w") == 0
    with pytest.raises(ValueError):
        budget.reserve("w", 1, now=1, lease_s=math.inf)
    with pytest.raises(ValueError):
        budget.reserve("w", 0, now=1)


def test_a_hop_takes_over_its_lookahead_on_a_full_budget() -> None:
    budget = granted({"w": 1000, "v": 1000})
    ahead = budget.reserve("w", 300, now=1, kind=LOOKAHEAD, lease_s=30)
    assert ahead is not None and budget.reserve("w", 700, now=1) is not None  # full
    assert budget.reserve("w", 301, now=1, replaces=ahead.reservation_id) is None  # too big: it stays
    assert budget.get(ahead.reservation_id) is not None
    hop = budget.reserve("w", 300, now=1, replaces=ahead.reservation_id)
    assert hop is not None and budget.get(ahead.reservation_id) is None and budget.used("w") == 1000
    # On another worker the look-ahead's room is not free for the hop, but it goes.
    ahead2 = budget.reserve("v", 200, now=1, kind=LOOKAHEAD, lease_s=30)
    assert ahead2 is not None
    moved = budget.reserve("w", 100, now=1, replaces=ahead2.reservation_id)
    assert moved is None  # w is full; the look-ahead on v stays since nothing was granted
    budget.release(hop.reservation_id)
    moved = budget.reserve("w", 100, now=1, replaces=ahead2.reservation_id)
    assert moved is not None and budget.get(ahead2.reservation_id) is None and budget.used("v") == 0


def test_above_the_high_usage_mark_only_realtime_or_a_takeover_is_reserved_here() -> None:
    budget = LocalBudget()
    budget.reserve("w", 1, now=0)
    budget.begin_sync(0)
    budget.apply_grants({"w": 1000}, 0, 10, engine_usage={"w": 0.9}, high_usage_ratio=0.85)
    budget.grow_wanted = False
    assert budget.reserve("w", 10, now=1) is None
    assert not budget.grow_wanted  # the memory-pool decides this one; the budget is not short
    assert budget.reserve("w", 10, now=1, protected=True) is not None
    ahead = budget.reserve("w", 10, now=1, kind=LOOKAHEAD, lease_s=5, protected=True)
    assert ahead is not None
    assert budget.reserve("w", 10, now=1, replaces=ahead.reservation_id) is not None


def test_asks_ahead_of_need_at_the_low_water_mark() -> None:
    budget = granted({"w": 1000})
    budget.grow_wanted = False
    assert budget.reserve("w", 400, now=1) is not None
    assert not budget.grow_wanted  # 600 free: room for the next hop of 400
    assert budget.reserve("w", 300, now=1) is not None
    assert budget.grow_wanted  # 300 free < the largest recent request (400): sync now
    (row,) = budget.begin_sync(now=1)
    assert row.target_tokens == 700 + max(2 * 400, 350)  # demand + spare
    assert row.reserved_tokens == 700 and row.reservations == 2
    assert budget.granted("w") == 1000  # a raise waits for the grant
    budget.apply_grants({"w": 1200}, sent_at=1, ttl_s=10)  # the pool had only 200 more
    assert budget.granted("w") == 1200


def test_idle_budget_is_returned_and_the_worker_forgotten() -> None:
    budget = granted({"w": 10_000})
    res = budget.reserve("w", 100, now=1)
    assert res is not None
    (row,) = budget.begin_sync(now=1)
    assert row.target_tokens == 300  # 10,000 > 2 x (100 + 200): lowered at once, before the call
    assert budget.granted("w") == 300
    budget.apply_grants({"w": 300}, sent_at=1, ttl_s=10)
    budget.release(res.reservation_id)
    # Kept while the window remembers the hop (WINDOW_SYNCS periods after the last one
    # it was reserved in), then returned at once, and the worker forgotten.
    syncs = 0
    while rows := budget.begin_sync(now=2 + syncs):
        assert [r.target_tokens for r in rows] == [300]
        budget.apply_grants({r.worker_id: r.target_tokens for r in rows}, sent_at=2 + syncs, ttl_s=10)
        syncs += 1
    assert syncs == WINDOW_SYNCS + 1
    assert budget.workers() == [] and budget.granted("w") == 0


def test_a_grant_below_what_is_used_leaves_no_room_until_released() -> None:
    budget = granted({"w": 1000})
    a = budget.reserve("w", 800, now=1)
    assert a is not None
    budget.begin_sync(now=1)
    budget.apply_grants({"w": 500}, sent_at=1, ttl_s=10)  # the pool lost our lease; others took room
    assert budget.reserve("w", 1, now=1) is None
    budget.release(a.reservation_id)
    assert budget.reserve("w", 500, now=1) is not None


def test_forget_grants_when_the_grantor_is_gone() -> None:
    budget = granted({"w": 1000})
    a = budget.reserve("w", 100, now=1)
    budget.forget_grants()
    assert budget.granted("w") == 0 and budget.reserve("w", 1, now=1) is None
    assert a is not None and budget.release(a.reservation_id) and budget.used("w") == 0


# ----- random sequences ---------------------------------------------------------------

WORKERS = ("a", "b")


class BudgetMachine(RuleBasedStateMachine):
    """Reservations, releases, look-ahead expiry, syncs and grants in any order (the
    pool grants any amount, possibly less than asked or than is used): what is reserved
    here never exceeds what was granted when it was reserved, the books always add up,
    and once everything is released or expired nothing is left."""

    def __init__(self) -> None:
        super().__init__()
        self.budget = LocalBudget()
        self.now = 0.0
        self.live: dict[str, tuple[str, int, float]] = {}  # id -> (worker, tokens, expires_at)
        self.issued: list[str] = []
        self.in_flight: list = []  # declarations sent, not answered yet

    @rule(worker=st.sampled_from(WORKERS), tokens=st.integers(1, 400), ahead=st.booleans(), data=st.data())
    def reserve(self, worker, tokens, ahead, data) -> None:
        replaces = ""
        if self.issued and data.draw(st.booleans(), label="replace"):
            replaces = data.draw(st.sampled_from(self.issued), label="replaces")
        lease = data.draw(st.floats(0.1, 20), label="lease") if ahead else None
        before = self.budget.granted(worker)
        res = self.budget.reserve(
            worker,
            tokens,
            self.now,
            kind=LOOKAHEAD if ahead else HOP,
            lease_s=lease,
            replaces=replaces,
        )
        self._expire_model()
        if res is None:
            return
        assert self.budget.used(worker) <= before  # never beyond the granted budget
        assert self.now < self.budget.valid_until
        if replaces:
            self.live.pop(replaces, None)
        self.live[res.reservation_id] = (worker, tokens, res.expires_at)
        self.issued.append(res.reservation_id)

    @precondition(lambda self: self.issued)
    @rule(data=st.data())
    def release(self, data) -> None:
        rid = data.draw(st.sampled_from(self.issued))
        assert self.budget.release(rid) == (rid in self.live)
        self.live.pop(rid, None)

    @rule(dt=st.floats(0, 5))
    def tick(self, dt) -> None:
        self.now += dt
        self.budget.expire(self.now)
        self._expire_model()

    @rule()
    def send(self) -> None:
        before = {w: self.budget.granted(w) for w in self.budget.workers()}
        rows = self.budget.begin_sync(self.now)
        self._expire_model()
        for row in rows:
            assert row.target_tokens >= row.reserved_tokens == self.budget.used(row.worker_id)
            assert self.budget.granted(row.worker_id) <= before.get(row.worker_id, 0)  # lowered only
        self.in_flight.append((self.now, rows))

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data(), ttl=st.floats(1, 30))
    def answer(self, data, ttl) -> None:
        sent_at, rows = self.in_flight.pop(0)
        grants = {row.worker_id: data.draw(st.integers(0, row.target_tokens + 100)) for row in rows}
        self.budget.apply_grants(grants, sent_at, ttl)

    @precondition(lambda self: self.in_flight)
    @rule()
    def lost(self) -> None:
        self.in_flight.pop(0)

    @rule()
    def forget(self) -> None:
        self.budget.forget_grants()

    def _expire_model(self) -> None:
        self.live = {rid: r for rid, r in self.live.items() if r[2] > self.now}

    @invariant()
    def books_add_up(self) -> None:
        assert {r.reservation_id for r in self.budget.reservations()} == set(self.live)
        for worker in WORKERS:
            mine = sum(t for w, t, _ in self.live.values() if w == worker)
            assert self.budget.used(worker) == mine >= 0
            assert self.budget.granted(worker) >= 0

    def teardown(self) -> None:
        for rid in list(self.live):
            assert self.budget.release(rid)
        assert self.budget.reservations() == []
        assert all(self.budget.used(w) == 0 for w in WORKERS)
        # and with nothing used, a whole window of syncs (and the one that sees it end)
        # returns every token and forgets every worker
        for k in range(WINDOW_SYNCS + 2):
            self.budget.begin_sync(self.now + k)
        assert self.budget.workers() == []


BudgetMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_budget_state_machine = BudgetMachine.TestCase
