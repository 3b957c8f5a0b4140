"""KV ledger: headroom kept free, reservations never negative and never leaked."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from inferx_memory_pool.ledger import (
    HOP,
    KINDS,
    LOOKAHEAD,
    InsufficientCapacity,
    KvLedger,
    UnknownWorker,
)


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


# ----- look-ahead reservations, leases, holders ------------------------------------------


def full_worker_with_lookahead() -> tuple[KvLedger, str]:
    """One worker (usable 800): a 300-token look-ahead and a 500-token hop fill it."""
    ledger = KvLedger(headroom_ratio=0.2)
    ledger.set_workers({"w": ("p", 1000)})
    ahead = ledger.reserve("w", 300, now=0, kind=LOOKAHEAD, holder="s1")
    ledger.reserve("w", 500, now=0, holder="s1")
    return ledger, ahead.reservation_id


def test_replaces_on_the_same_worker_swaps_atomically() -> None:
    ledger, ahead = full_worker_with_lookahead()
    with pytest.raises(InsufficientCapacity):
        ledger.reserve("w", 300, now=1)  # the kept room is not free for anybody else
    hop = ledger.reserve("w", 300, now=1, kind=HOP, replaces=ahead)
    assert ledger.get(ahead) is None
    assert hop.kind == HOP and ledger.reserved("w") == 800
    row = ledger.snapshot()[0]
    assert (row.reservations, row.lookahead_tokens, row.lookahead_reservations) == (2, 0, 0)
    assert not ledger.release(ahead)


def test_replaces_may_take_less_or_more_than_was_kept_within_usable() -> None:
    ledger, ahead = full_worker_with_lookahead()
    ledger.reserve("w", 200, now=0, replaces=ahead)  # less: the rest is free again
    assert ledger.reserved("w") == 700
    ledger = KvLedger(headroom_ratio=0.2)
    ledger.set_workers({"w": ("p", 1000)})
    ahead = ledger.reserve("w", 200, now=0, kind=LOOKAHEAD).reservation_id
    ledger.reserve("w", 500, now=0)
    hop = ledger.reserve("w", 300, now=0, replaces=ahead)  # more: 500 + 300 = 800 fits
    assert ledger.reserved("w") == 800 and hop.tokens == 300


def test_refused_replacement_keeps_the_lookahead() -> None:
    ledger, ahead = full_worker_with_lookahead()
    with pytest.raises(InsufficientCapacity):
        ledger.reserve("w", 301, now=0, replaces=ahead)  # 500 + 301 > 800
    assert ledger.get(ahead) is not None and ledger.reserved("w") == 800


def test_replaces_on_another_worker_releases_it_without_counting_it() -> None:
    ledger = KvLedger(headroom_ratio=0.2)
    ledger.set_workers({"a": ("p", 1000), "b": ("p", 1000)})
    ahead = ledger.reserve("a", 300, now=0, kind=LOOKAHEAD).reservation_id
    ledger.reserve("b", 600, now=0)
    with pytest.raises(InsufficientCapacity):
        ledger.reserve("b", 300, now=0, replaces=ahead)  # a's tokens are not free on b
    assert ledger.get(ahead) is not None  # refused: the look-ahead stays
    hop = ledger.reserve("b", 200, now=0, replaces=ahead)
    assert hop.worker_id == "b" and ledger.get(ahead) is None
    assert ledger.reserved("a") == 0 and ledger.reserved("b") == 800


def test_replaces_an_unknown_or_expired_id_reserves_normally() -> None:
    ledger = KvLedger(headroom_ratio=0.2)
    ledger.set_workers({"w": ("p", 1000)})
    ahead = ledger.reserve("w", 300, now=0, kind=LOOKAHEAD, lease_s=5).reservation_id
    ledger.reserve("w", 500, now=0)
    with pytest.raises(InsufficientCapacity):
        ledger.reserve("w", 100, now=1, replaces="r999")  # unknown: nothing is freed
    hop = ledger.reserve("w", 300, now=5, replaces=ahead)  # it expired at 5: a plain reserve
    assert ledger.get(ahead) is None and ledger.get(hop.reservation_id) == hop
    assert ledger.reserved("w") == 800


def test_a_hop_taking_over_its_kept_room_is_not_refused_for_high_usage() -> None:
    ledger, ahead = full_worker_with_lookahead()
    ledger.set_engine_usage("w", 0.9)
    with pytest.raises(InsufficientCapacity, match="90% KV usage"):
        ledger.reserve("w", 300, now=0)  # no room kept for it: conservative admission applies
    assert ledger.reserve("w", 300, now=0, replaces=ahead).tokens == 300
    assert ledger.get(ahead) is None


def test_lease_defaults_by_kind_and_explicit_lease() -> None:
    ledger = KvLedger(reservation_ttl_s=300, lookahead_ttl_s=30)
    ledger.set_workers({"w": ("p", 10_000)})
    assert ledger.reserve("w", 1, now=10).expires_at == 310
    assert ledger.reserve("w", 1, now=10, kind=LOOKAHEAD).expires_at == 40
    short = ledger.reserve("w", 1, now=10, kind=LOOKAHEAD, lease_s=1.5)
    assert short.expires_at == 11.5
    assert ledger.reserve("w", 1, now=10, lease_s=7).expires_at == 17
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="lease_s"):
            ledger.reserve("w", 1, now=10, lease_s=bad)
    with pytest.raises(ValueError, match="kind"):
        ledger.reserve("w", 1, now=10, kind="later")  # type: ignore[arg-type]
    assert [r.reservation_id for r in ledger.reservations()] == ["r1", "r2", "r3", "r4"]
    assert ledger.snapshot(now=11.5)[0].reservations == 3  # snapshot(now) expires what is due
    assert ledger.snapshot(now=40)[0].lookahead_reservations == 0


def test_kinds_in_snapshot() -> None:
    ledger = KvLedger(headroom_ratio=0.2)
    ledger.set_workers({"a": ("p", 1000), "b": ("q", 1000)})
    ledger.reserve("a", 100, now=0, kind=LOOKAHEAD)
    ledger.reserve("a", 50, now=0, kind=LOOKAHEAD)
    ledger.reserve("a", 200, now=0)
    ledger.reserve("b", 10, now=0, kind=HOP)
    a, b = ledger.snapshot()
    assert (a.reserved_tokens, a.reservations, a.lookahead_tokens, a.lookahead_reservations) == (
        350,
        3,
        150,
        2,
    )
    assert (b.reserved_tokens, b.reservations, b.lookahead_tokens, b.lookahead_reservations) == (10, 1, 0, 0)


def test_drop_holder() -> None:
    ledger = KvLedger()
    ledger.set_workers({"w": ("p", 10_000)})
    for holder in ("s1", "s1", "s2", "s3", ""):
        ledger.reserve("w", 10, now=0, holder=holder, kind=LOOKAHEAD if holder == "s3" else HOP)
    assert ledger.drop_holder("s1") == 2
    assert ledger.drop_holder("s1") == 0
    assert ledger.drop_holder("") == 0  # "no holder" is not a holder
    assert sorted(r.holder for r in ledger.reservations()) == ["", "s2", "s3"]
    assert ledger.drop_holder("s3") == 1  # a look-ahead goes with its holder too
    assert ledger.drop_holder("s2") == 1
    assert [r.holder for r in ledger.reservations()] == [""]  # the holder-less one stays
    assert ledger.reserved("w") == 10


class LedgerMachine(RuleBasedStateMachine):
    """Random reserve / release / time / holder deaths / workers leaving and coming back,
    checked against a plain model of which reservations must be live."""

    CAPACITY = {"a": ("p", 1000), "b": ("p", 500), "c": ("q", 250)}
    HOLDERS = ("s1", "s2", "s3")

    def __init__(self) -> None:
        super().__init__()
        self.ledger = KvLedger(headroom_ratio=0.2, reservation_ttl_s=40, lookahead_ttl_s=8)
        self.present = set(self.CAPACITY)
        self.ledger.set_workers(dict(self.CAPACITY))
        self.dead: set[str] = set()
        self.now = 0.0
        self.model: dict[str, tuple[str, int, float, str]] = {}  # id -> (worker, tokens, expiry, holder)
        self.issued: list[str] = []

    def _model_expire(self) -> None:
        self.model = {rid: r for rid, r in self.model.items() if r[2] > self.now}

    def _model_reserved(self, worker: str) -> int:
        return sum(tokens for w, tokens, _, _ in self.model.values() if w == worker)

    @rule(
        worker=st.sampled_from(sorted(CAPACITY)),
        tokens=st.integers(1, 450),
        kind=st.sampled_from(KINDS),
        holder=st.sampled_from(("", *HOLDERS)),
        lease=st.one_of(st.none(), st.floats(0.5, 60)),
        data=st.data(),
    )
    def reserve(self, worker, tokens, kind, holder, lease, data) -> None:
        if holder in self.dead:
            holder = ""  # a dead holder does not reserve
        replaces = data.draw(st.sampled_from(["", "r0", *self.issued[-10:]]), label="replaces")
        self._model_expire()
        old = self.model.get(replaces)
        freed = old[1] if old is not None and old[0] == worker else 0
        try:
            res = self.ledger.reserve(
                worker, tokens, self.now, holder=holder, lease_s=lease, kind=kind, replaces=replaces
            )
        except UnknownWorker:
            assert worker not in self.present
            return
        except InsufficientCapacity:
            assert worker in self.present
            assert self._model_reserved(worker) - freed + tokens > self.ledger.usable(worker)
            return
        assert worker in self.present
        assert self._model_reserved(worker) - freed + tokens <= self.ledger.usable(worker)
        assert res.kind == kind and res.holder == holder and res.expires_at > self.now
        self.model.pop(replaces, None)
        self.model[res.reservation_id] = (worker, tokens, res.expires_at, holder)
        self.issued.append(res.reservation_id)

    @precondition(lambda self: self.issued)
    @rule(data=st.data())
    def release(self, data) -> None:
        rid = data.draw(st.sampled_from(self.issued), label="release")
        assert self.ledger.release(rid) == (rid in self.model)
        self.model.pop(rid, None)

    @rule(dt=st.floats(0, 20))
    def tick(self, dt) -> None:
        self.now += dt
        self._model_expire()
        expected = len(self.ledger.reservations()) - len(self.model)
        assert self.ledger.expire(self.now) == expected

    @rule(holder=st.sampled_from(HOLDERS))
    def holder_dies(self, holder) -> None:
        self.dead.add(holder)
        self.ledger.drop_holder(holder)
        self.model = {rid: r for rid, r in self.model.items() if r[3] != holder}

    @rule(holder=st.sampled_from(HOLDERS))
    def holder_comes_back(self, holder) -> None:
        self.dead.discard(holder)

    @rule(worker=st.sampled_from(sorted(CAPACITY)))
    def worker_leaves_or_comes_back(self, worker) -> None:
        self.present ^= {worker}
        self.ledger.set_workers({w: self.CAPACITY[w] for w in self.present})
        self.model = {rid: r for rid, r in self.model.items() if r[0] in self.present}

    @invariant()
    def accounting_holds(self) -> None:
        live = self.ledger.reservations()
        assert {r.reservation_id for r in live} == set(self.model)
        assert all(r.expires_at > self.now for r in live)
        assert all(r.worker_id in self.present for r in live)
        assert not any(r.holder in self.dead for r in live)
        rows = self.ledger.snapshot()
        assert {row.worker_id for row in rows} == self.present
        for row in rows:
            assert 0 <= row.reserved_tokens <= row.usable_tokens
            assert 0 <= row.lookahead_tokens <= row.reserved_tokens
            assert row.reserved_tokens == self.ledger.reserved(row.worker_id)
        assert sum(row.reserved_tokens for row in rows) == sum(r.tokens for r in live)
        assert sum(row.reservations for row in rows) == len(live)
        assert sum(row.lookahead_tokens for row in rows) == sum(r.tokens for r in live if r.kind == LOOKAHEAD)

    def teardown(self) -> None:
        # Nothing leaks: after every lease has run out, the ledger is empty.
        assert all(row.reserved_tokens == 0 for row in self.ledger.snapshot(now=self.now + 61))
        assert self.ledger.reservations() == []


LedgerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_ledger_state_machine = LedgerMachine.TestCase


def test_a_new_leader_starts_from_a_fresh_ledger_with_the_same_workers_and_usage() -> None:
    from inferx_memory_pool.ledger import BudgetWant

    ledger = KvLedger(headroom_ratio=0.2, budget_ttl_s=7.0)
    ledger.set_workers({"w": ("pool", 1000)})
    ledger.set_engine_usage("w", 0.5)
    ledger.reserve("w", 300, now=0)
    ledger.sync_budget("s1", [BudgetWant("w", 200)], now=0, seq=5)
    fresh = ledger.fresh()
    assert fresh.reserved("w") == 0 and fresh.leased("w") == 0 and fresh.budgets() == []
    assert fresh.usable("w") == 800 and fresh.engine_usage("w") == 0.5 and fresh.budget_ttl_s == 7.0
    # the scheduler's next sync (its numbering goes on) is applied, not taken for a late one
    assert fresh.sync_budget("s1", [BudgetWant("w", 200, reserved_tokens=50)], now=1, seq=6) == {"w": 200}
