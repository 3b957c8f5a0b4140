"""A program whose calls move between routers (issue #15), the pure parts: the marker
a router keeps in etcd for each program it holds open, what a router new to a program
makes of it, the book handing a program over, and the program's records joined into one
trace (`shared_runs.join_program`). The etcd exchange itself runs in
tests/integration/test_programs_across_routers.py."""

from __future__ import annotations

import asyncio

from inferx import etcd
from inferx.openai_compat.identity import ProgramIdentity
from inferx.v1 import router_pb2
from inferx_router import shared_runs
from inferx_router.program_homes import Continuation, Marker, ProgramHomes, continuation_of, key_parts
from inferx_router.programs import MOVED, ProgramBook, Ticket
from inferx_router.records import RUNNING, RunStore, run_trace_message


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def router_book(name: str, clock: Clock, store: RunStore) -> ProgramBook:
    """A router's book; its wall clock follows `clock` (unix 1.7e9 + clock)."""
    ids = iter(f"{name}-run{n}" for n in range(100))
    return ProgramBook(
        store, clock=clock, wall=lambda: 1_700_000_000.0 + clock.now, new_run_id=lambda: next(ids)
    )


def done(book: ProgramBook, ticket: Ticket, clock: Clock, seconds: float = 0.5) -> None:
    clock.now += seconds
    book.finish(ticket, router_pb2.NodeFinished(status="ok", worker_id="w-0"))


def test_marker_round_trip_and_garbage() -> None:
    marker = Marker("router-a", "run1", 7, lease=42, to="router-b")
    assert Marker.decode(marker.encode()) == marker
    assert Marker.decode(b"") is None and Marker.decode(None) is None
    assert Marker.decode(b"{not json") is None and Marker.decode(b'{"router": "x"}') is None


def test_what_a_router_new_to_a_program_makes_of_its_marker() -> None:
    assert continuation_of(None, "me") == Continuation()  # a new program
    assert continuation_of(Marker("me", "r", 3), "me") == Continuation()  # ours, just ended
    assert continuation_of(Marker("", "r", 9), "me") == Continuation(9, "r")  # handed over
    assert continuation_of(Marker("other", "r", 3), "me") is None  # held elsewhere: ask


def test_marker_keys_keep_program_ids_with_slashes() -> None:
    key = etcd.program_key("acme", "agent/7")
    assert key_parts(key) == ("acme", "agent/7")
    assert key_parts(etcd.run_key("acme", "x")) is None and key_parts(etcd.PROGRAMS + "acme/") is None


def test_a_record_continues_the_count_and_links_to_the_one_before() -> None:
    clock, store = Clock(), RunStore()
    book = router_book("b", clock, store)
    ticket = book.begin(ProgramIdentity("p"), first_hop_index=5, continues_run_id="a-run0")
    assert ticket.opened and ticket.hop_index == 5 and ticket.node_id == "call-0"
    record = ticket.program.record
    assert (record.first_hop_index, record.continues_run_id) == (5, "a-run0")
    done(book, ticket, clock)
    again = book.begin(ProgramIdentity("p"), first_hop_index=99)  # open here: the hint is not used
    assert not again.opened and again.hop_index == 6


def test_hand_over_ends_the_record_now_or_when_its_calls_in_flight_are_done() -> None:
    clock, store = Clock(), RunStore()
    book = router_book("a", clock, store)
    first = book.begin(ProgramIdentity("idle"))
    done(book, first, clock)
    handed = book.hand_over("default", "idle")
    assert handed is not None and handed.next_hop_index == 1 and handed.ended == MOVED
    assert handed.finished.status == "ok" and book.get("default", "idle") is None
    busy = book.begin(ProgramIdentity("busy"))
    book.begin(ProgramIdentity("busy"))
    handed = book.hand_over("default", "busy")
    assert handed is not None and handed.next_hop_index == 2 and not handed.ended  # a call runs
    done(book, busy, clock)
    assert handed.ended == "" and handed.finished.status == RUNNING
    assert book.hand_over("default", "busy") is None  # not open here any more
    assert book.begin(ProgramIdentity("busy")).opened  # a later call here: a new record


def test_the_records_of_a_program_that_moved_are_joined_into_one_trace() -> None:
    clock, store_a, store_b = Clock(), RunStore(), RunStore()
    a, b = router_book("a", clock, store_a), router_book("b", clock, store_b)
    for _ in range(2):
        done(a, a.begin(ProgramIdentity("p")), clock)
    clock.now += 1.0
    handed = a.hand_over("default", "p")
    assert handed is not None
    moved_on = b.begin(
        ProgramIdentity("p"), first_hop_index=handed.next_hop_index, continues_run_id=handed.run_id
    )
    done(b, moved_on, clock)
    done(b, b.begin(ProgramIdentity("p")), clock)
    # an older program of the same id, not linked: not joined
    old = router_book("old", Clock(0.0), RunStore()).begin(ProgramIdentity("p"))
    records = [*store_a.of_tenant("default"), *store_b.of_tenant("default"), old.program.record]

    joined = shared_runs.join_program(records, store_b.find("p"))
    assert [h.node_id for h in joined.finished.hops] == ["call-0", "call-1", "call-2", "call-3"]
    assert joined.finished.run_id == "b-run0" and joined.finished.status == RUNNING  # b's is open
    assert joined.started_unix_ms == handed.record.started_unix_ms
    timings = run_trace_message(joined).timings
    assert [t.start_ms for t in timings] == [0.0, 500.0, 2000.0, 2500.0]
    assert [list(t.depends_on) for t in timings] == [[], ["call-0"], ["call-1"], ["call-2"]]
    # from either end of the link, the same calls
    from_a = shared_runs.join_program(records, handed.record)
    assert [h.node_id for h in from_a.finished.hops] == [h.node_id for h in joined.finished.hops]
    # a record of no program, or linked to nothing it finds, is itself
    assert shared_runs.join_program([], handed.record) is handed.record


def test_get_run_by_program_id_joins_the_parts_a_router_finds() -> None:
    clock, store = Clock(), RunStore()
    a = router_book("a", clock, store)
    done(a, a.begin(ProgramIdentity("p")), clock)
    handed = a.hand_over("default", "p")
    assert handed is not None
    # the program came back to this router: its second record continues the first
    back = a.begin(ProgramIdentity("p", program_end=True), first_hop_index=3, continues_run_id=handed.run_id)
    done(a, back, clock)
    found = asyncio.run(shared_runs.find_run(store, None, "p", "", "default"))
    assert [h.node_id for h in found.finished.hops] == ["call-0", "call-3"]
    assert found.finished.status == "ok"


def test_shared_records_keep_the_link_and_older_ones_read_without_it() -> None:
    clock, store = Clock(), RunStore()
    book = router_book("b", clock, store)
    ticket = book.begin(ProgramIdentity("p"), first_hop_index=4, continues_run_id="a-run0")
    done(book, ticket, clock)
    record = shared_runs.decode(shared_runs.encode(ticket.program.record))
    assert (record.first_hop_index, record.continues_run_id) == (4, "a-run0")
    older = shared_runs.encode(ticket.program.record).replace(b',"first_hop_index":4', b"")
    assert shared_runs.decode(older.replace(b',"continues_run_id":"a-run0"', b"")).first_hop_index == 0


# ----- the exchange between two routers, over a fake etcd ------------------------------------


class FakeEtcd:
    """Just what ProgramHomes uses of aetcd: put/get/delete, leases, a compare-and-put
    transaction; every change is delivered to the routers' mirrors (as their watch would)."""

    class _Tx:
        class _Value:
            def __init__(self, key: bytes) -> None:
                self.key = key

            def __eq__(self, other: object) -> bool | tuple:  # type: ignore[override]
                return ("value", self.key, other)

        def value(self, key: bytes) -> FakeEtcd._Tx._Value:
            return FakeEtcd._Tx._Value(key)

        def put(self, key: bytes, value: bytes, lease: int | None = None) -> tuple:
            return ("put", key, value)

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}
        self.transactions = FakeEtcd._Tx()
        self.watchers: list[ProgramHomes] = []
        self._leases = 0

    def _notify(self, key: bytes) -> None:
        for homes in self.watchers:
            value = self.data.get(key)
            if value is None:
                homes.mirror.items.pop(key.decode(), None)
            else:
                homes.mirror.items[key.decode()] = value
            homes._changed(key.decode(), value)

    async def put(self, key: bytes, value: bytes, lease: int | None = None) -> None:
        self.data[key] = value
        self._notify(key)

    async def get(self, key: bytes):
        value = self.data.get(key)
        return None if value is None else type("KV", (), {"value": value})()

    async def delete(self, key: bytes) -> None:
        self.data.pop(key, None)
        self._notify(key)

    async def transaction(self, compare, success, failure):
        ok = all(self.data.get(key) == value for _, key, value in compare)
        for _, key, value in success if ok else failure:
            await self.put(key, value)
        return ok, []

    async def lease(self, ttl: int):
        self._leases += 1
        return type("Lease", (), {"id": self._leases})()

    async def refresh_lease(self, lease_id: int):
        return type("Refresh", (), {"TTL": 10})()

    async def revoke_lease(self, lease_id: int) -> None:
        pass


def two_routers(fake: FakeEtcd, wait_s: float = 1.0) -> tuple[ProgramHomes, ProgramHomes, Clock]:
    clock = Clock()
    homes = []
    for name in ("a", "b"):
        book = router_book(name, clock, RunStore())
        home = ProgramHomes(fake, f"router-{name}", book, lease_ttl_s=10, handoff_wait_s=wait_s)
        book.on_end = home.ended
        fake.watchers.append(home)
        homes.append(home)
    return homes[0], homes[1], clock


async def settle(*homes: ProgramHomes) -> None:
    for home in homes:
        await home._writes.join()


def test_a_program_held_by_another_router_is_handed_over_with_its_count() -> None:
    async def main() -> None:
        fake = FakeEtcd()
        a, b, clock = two_routers(fake)
        a.start()
        b.start()
        await asyncio.sleep(0)  # the keepers take their leases
        for _ in range(3):
            ticket = a.book.begin(ProgramIdentity("p"))
            if ticket.opened:
                a.opened(ticket.program)
            done(a.book, ticket, clock)
        await settle(a)
        key = etcd.program_key("default", "p").encode()
        held = Marker.decode(fake.data[key])
        assert held is not None and held.router == "router-a" and held.run_id == "a-run0"
        found = await b.arrive("default", "p")  # a's watch hands it over meanwhile
        assert found == Continuation(3, "a-run0")
        assert a.book.get("default", "p") is None and a.handed_over == 1
        ticket = b.book.begin(
            ProgramIdentity("p"), first_hop_index=found.hop_index, continues_run_id=found.run_id
        )
        b.opened(ticket.program)
        done(b.book, ticket, clock)
        await settle(a, b)
        mine = Marker.decode(fake.data[key])
        assert mine is not None and (mine.router, mine.hop_index) == ("router-b", 3)
        # b's program ends (its end mark): its marker goes; a later call anywhere is new
        done(b.book, b.book.begin(ProgramIdentity("p", program_end=True)), clock)
        await settle(b)
        assert key not in fake.data
        assert await a.arrive("default", "p") == Continuation()
        await a.close()
        await b.close()

    asyncio.run(main())


def test_a_holder_that_does_not_answer_is_waited_for_at_most_the_hand_over_wait() -> None:
    async def main() -> None:
        fake = FakeEtcd()
        _, b, _ = two_routers(fake, wait_s=0.2)
        fake.watchers = [b]  # router a is dead: nobody hands its program over
        key = etcd.program_key("default", "p").encode()
        fake.data[key] = Marker("router-a", "a-run4", 7, lease=1).encode()
        b.mirror.items[key.decode()] = fake.data[key]
        started = asyncio.get_running_loop().time()
        found = await b.arrive("default", "p")
        waited = asyncio.get_running_loop().time() - started
        assert found == Continuation(7, "a-run4")  # the dead holder's record start: a lower bound
        assert 0.2 <= waited < 1.0

    asyncio.run(main())
