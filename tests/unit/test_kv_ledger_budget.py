"""KV ledger budgets (issue #14): schedulers lease budgets of KV tokens per worker; all
budgets and reservations together never exceed a worker's usable KV, several holders
included; budgets end with their lease, their holder or their worker."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from inferx_memory_pool.ledger import (
    LOOKAHEAD,
    BudgetWant,
    InsufficientCapacity,
    KvLedger,
)


def ledger_with(capacity: int = 1000, **kwargs) -> KvLedger:
    ledger = KvLedger(headroom_ratio=0.2, **kwargs)
    ledger.set_workers({"w": ("pool", capacity)})  # usable 800
    return ledger


def test_budgets_of_all_holders_and_reservations_share_the_usable_capacity() -> None:
    ledger = ledger_with()
    assert ledger.sync_budget("s1", [BudgetWant("w", 500)], now=0) == {"w": 500}
    assert ledger.sync_budget("s2", [BudgetWant("w", 500)], now=0) == {"w": 300}  # what was free
    assert ledger.committed("w") == 800 and ledger.leased("w") == 800 and ledger.reserved("w") == 0
    with pytest.raises(InsufficientCapacity):  # a Reserve beyond budgets finds no room either
        ledger.reserve("w", 1, now=0)
    # s1 returns 200: s2 may grow into it; a Reserve may take what is left
    assert ledger.sync_budget("s1", [BudgetWant("w", 300)], now=1) == {"w": 300}
    assert ledger.sync_budget("s2", [BudgetWant("w", 400)], now=1) == {"w": 400}
    ledger.reserve("w", 100, now=1)
    with pytest.raises(InsufficientCapacity):
        ledger.reserve("w", 1, now=1)
    assert ledger.sync_budget("s2", [BudgetWant("w", 900)], now=1) == {"w": 400}  # no more room


def test_a_declaration_is_the_whole_budget_and_idempotent() -> None:
    ledger = KvLedger(headroom_ratio=0.2)
    ledger.set_workers({"a": ("p", 1000), "b": ("p", 1000)})
    want = [BudgetWant("a", 300), BudgetWant("b", 200)]
    assert ledger.sync_budget("s", want, now=0, seq=1) == {"a": 300, "b": 200}
    assert ledger.sync_budget("s", want, now=0, seq=2) == {"a": 300, "b": 200}  # nothing granted twice
    assert ledger.leased("a") == 300
    assert ledger.sync_budget("s", [BudgetWant("a", 100)], now=0, seq=3) == {"a": 100}  # b returned
    assert ledger.leased("b") == 0
    # A late duplicate (seq not above the last applied) changes nothing.
    assert ledger.sync_budget("s", want, now=0, seq=2) == {"a": 100}
    assert ledger.sync_budget("s", [BudgetWant("x", 10)], now=0, seq=4) == {}  # unknown worker: none
    assert ledger.leased("a") == 0


def test_budgets_end_with_their_lease_their_holder_and_their_worker() -> None:
    ledger = ledger_with(budget_ttl_s=10)
    ledger.sync_budget("s1", [BudgetWant("w", 100)], now=0, ttl_s=3)
    ledger.sync_budget("s2", [BudgetWant("w", 100)], now=0, ttl_s=60)  # capped at the pool's 10 s
    ledger.sync_budget("s3", [BudgetWant("w", 100)], now=0)
    assert ledger.leased("w") == 300
    ledger.sync_budget("s1", [BudgetWant("w", 100)], now=2.5, ttl_s=3)  # renewed until 5.5
    ledger.expire(now=5)
    assert ledger.budget_of("s1", "w") == 100
    ledger.expire(now=5.5)
    assert ledger.budget_of("s1", "w") == 0 and ledger.leased("w") == 200
    assert ledger.drop_holder("s2") == 0  # budgets are not counted as reservations ...
    assert ledger.budget_of("s2", "w") == 0  # ... but go with their holder
    ledger.expire(now=9.9)
    assert ledger.budget_of("s3", "w") == 100
    ledger.set_workers({})
    assert ledger.budgets() == []
    with pytest.raises(ValueError):
        ledger.sync_budget("", [], now=0)
    with pytest.raises(ValueError):
        ledger.sync_budget("s", [], now=0, ttl_s=0)


def test_snapshot_shows_what_holders_reserved_from_their_budgets() -> None:
    ledger = ledger_with()
    ledger.reserve("w", 50, now=0, kind=LOOKAHEAD)
    ledger.sync_budget("s1", [BudgetWant("w", 400, 120, 3, 20, 1)], now=0)
    ledger.sync_budget("s2", [BudgetWant("w", 100, 0, 0, 0, 0)], now=0)
    (row,) = ledger.snapshot(now=0)
    assert (row.reserved_tokens, row.reservations) == (50 + 120, 1 + 3)
    assert (row.lookahead_tokens, row.lookahead_reservations) == (50 + 20, 1 + 1)
    assert (row.leased_tokens, row.budget_holders) == (500, 2)
    # The reported part is inside the budget: it is not counted against capacity twice.
    assert ledger.committed("w") == 550
    # A holder with no budget left but reservations still reported stays visible.
    ledger.sync_budget("s2", [BudgetWant("w", 0, 10, 1, 0, 0)], now=1)
    (row,) = ledger.snapshot(now=1)
    assert (row.leased_tokens, row.budget_holders, row.reserved_tokens) == (400, 2, 180)
    ledger.sync_budget("s2", [], now=1)
    assert ledger.snapshot(now=1)[0].budget_holders == 1


class BudgetLedgerMachine(RuleBasedStateMachine):
    """Reservations and budget declarations of several holders, time, holder deaths and
    workers leaving, in any order: budgets and reservations never exceed usable KV,
    grants follow the rule exactly, and everything ends with its lease."""

    CAPACITY = {"a": ("p", 1000), "b": ("p", 500)}
    HOLDERS = ("s1", "s2", "s3")

    def __init__(self) -> None:
        super().__init__()
        self.ledger = KvLedger(headroom_ratio=0.2, reservation_ttl_s=40, budget_ttl_s=10)
        self.present = set(self.CAPACITY)
        self.ledger.set_workers(dict(self.CAPACITY))
        self.now = 0.0
        self.seq = dict.fromkeys(self.HOLDERS, 0)

    @rule(worker=st.sampled_from(sorted(CAPACITY)), tokens=st.integers(1, 400))
    def reserve(self, worker, tokens) -> None:
        free = self.ledger.usable(worker) - self.ledger.committed(worker) if worker in self.present else 0
        try:
            self.ledger.reserve(worker, tokens, self.now, lease_s=5)
        except InsufficientCapacity:
            assert tokens > free
            return
        except Exception:
            assert worker not in self.present
            return
        assert tokens <= free

    @rule(
        holder=st.sampled_from(HOLDERS),
        wants=st.dictionaries(st.sampled_from(["a", "b", "gone"]), st.integers(0, 900), max_size=3),
        ttl=st.floats(0.5, 20),
        stale=st.booleans(),
    )
    def declare(self, holder, wants, ttl, stale) -> None:
        self.ledger.expire(self.now)
        before = {w: self.ledger.budget_of(holder, w) for w in self.CAPACITY}
        free = {
            w: max(0, self.ledger.usable(w) - self.ledger.committed(w))
            for w in self.CAPACITY
            if w in self.present
        }
        seq = self.seq[holder] if stale else self.seq[holder] + 1
        self.seq[holder] = max(self.seq[holder], seq)
        grants = self.ledger.sync_budget(
            holder,
            [BudgetWant(w, t, reserved_tokens=min(t, 10)) for w, t in wants.items()],
            self.now,
            ttl_s=ttl,
            seq=seq,
        )
        if stale and seq > 0:
            assert grants == {w: g for w, g in before.items() if g or w in grants}  # nothing changed
            return
        for w in self.CAPACITY:
            target = wants.get(w, 0) if w in self.present else 0
            expected = target if target <= before[w] else before[w] + min(target - before[w], free.get(w, 0))
            assert self.ledger.budget_of(holder, w) == expected
        assert "gone" not in grants

    @rule(dt=st.floats(0, 8))
    def tick(self, dt) -> None:
        self.now += dt
        self.ledger.expire(self.now)

    @rule(holder=st.sampled_from(HOLDERS))
    def holder_dies(self, holder) -> None:
        self.ledger.drop_holder(holder)
        self.seq[holder] = 0  # its declarations are forgotten with it
        assert all(b.holder != holder for b in self.ledger.budgets())

    @rule(worker=st.sampled_from(sorted(CAPACITY)))
    def worker_leaves_or_comes_back(self, worker) -> None:
        self.present ^= {worker}
        self.ledger.set_workers({w: self.CAPACITY[w] for w in self.present})

    @invariant()
    def never_over_capacity(self) -> None:
        for worker in self.present:
            assert 0 <= self.ledger.committed(worker) <= self.ledger.usable(worker)
        for lease in self.ledger.budgets():
            assert lease.worker_id in self.present and lease.granted >= 0
            assert lease.expires_at > self.now or lease.expires_at == self.now  # expired lazily
        for row in self.ledger.snapshot():
            assert row.leased_tokens == self.ledger.leased(row.worker_id)

    def teardown(self) -> None:
        self.ledger.expire(self.now + 41)  # every lease has run out: nothing is left
        assert self.ledger.budgets() == [] and self.ledger.reservations() == []


BudgetLedgerMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
test_budget_ledger_state_machine = BudgetLedgerMachine.TestCase
