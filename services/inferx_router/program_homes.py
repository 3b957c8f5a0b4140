"""Which router holds each open dynamic program (issue #15), so that a program whose
calls land on two routers (L4 balancing, a router restart) stays one program: its hop
count goes on, and its records are linked (`RunRecord.continues_run_id`) so that
`inferx trace <program id>` shows all its calls (`shared_runs.join_program`).

In etcd, `/inferx/v1/programs/<tenant>/<program id>` = `Marker`: the router holding
the program's open record, that record's run id and first hop index. Writes: one put
when a router opens a record of a program, one delete when it ends it (the client's
end mark, idle, eviction), both in the background, under the router's own lease (a
router that dies takes its markers with it). Reads: one get on the first call of a
program a router does not know (its watch of the prefix may lag a marker put a moment
ago); none on the calls after it. Every router mirrors the prefix (one watch): that is
how a holder hears that another router asks for its program.

A call of a program this router holds no record of:
  * no marker: a new program; it starts at hop 0 at once;
  * the marker of another router: this router asks for the program (a transaction puts
    the marker with `to` = this router, if it is still what the mirror showed). The
    holder, watching, hands it over (`ProgramBook.hand_over`: no more calls into its
    record, which ends once its calls in flight do and is shared as any ended record)
    and answers with the marker of a handed-over program (`router` ""): the hop index
    its next call would have had and its record's run id. This router continues from
    there, linked to that record. Only this call waits, for a few etcd round trips, and
    at most `handoff_wait_s`: a holder that died (its marker lasts until its lease
    ends) is not waited for longer; the program then continues from the dead holder's
    first hop index (a lower bound: its record is lost with it).
Two first calls of one new program on two routers at the same moment (before either
marker is seen) make two records, each counting from 0; the later marker wins.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass

import aetcd

from inferx import etcd
from inferx_router import metrics
from inferx_router.programs import END, EVICTED, IDLE, Program, ProgramBook

log = logging.getLogger("inferx.router.programs")

DEFAULT_HANDOFF_WAIT_S = 1.0


@dataclass(frozen=True)
class Marker:
    router: str  # the instance holding the open record; "" = handed over
    run_id: str  # its record (handed over: the record the next one continues)
    hop_index: int  # its record's first hop index (handed over: the next call's)
    lease: int = 0  # the holder's lease (a request to hand over is put under it)
    to: str = ""  # a router that asked for the program

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @staticmethod
    def decode(value: bytes | None) -> Marker | None:
        """None for no value or one that is not a marker (a newer format: ignored)."""
        if not value:
            return None
        try:
            document = json.loads(value)
            return Marker(
                router=str(document["router"]),
                run_id=str(document["run_id"]),
                hop_index=int(document["hop_index"]),
                lease=int(document.get("lease", 0)),
                to=str(document.get("to", "")),
            )
        except (ValueError, KeyError, TypeError):
            return None


@dataclass(frozen=True)
class Continuation:
    """Where a program new to this router continues: its next call's hop index, and
    the record of it that this one continues ("" = none)."""

    hop_index: int = 0
    run_id: str = ""


def continuation_of(marker: Marker | None, me: str) -> Continuation | None:
    """What a marker says without asking anyone (pure); None: ask its holder."""
    if marker is None or marker.router == me:
        # no program, or ours although this router has no record of it (it ended a
        # moment ago, the delete is on its way): a new one
        return Continuation()
    if not marker.router:
        return Continuation(marker.hop_index, marker.run_id)
    return None


def key_parts(key: str) -> tuple[str, str] | None:
    """(tenant, program id) of a marker's key; None for a key of another form."""
    rest = key.removeprefix(etcd.PROGRAMS)
    tenant, slash, program_id = rest.partition("/")
    return (tenant, program_id) if rest != key and slash and program_id else None


class ProgramHomes:
    def __init__(
        self,
        client: aetcd.Client,
        instance_id: str,
        book: ProgramBook,
        *,
        lease_ttl_s: int,
        handoff_wait_s: float = DEFAULT_HANDOFF_WAIT_S,
    ) -> None:
        self._client = client
        self.instance_id = instance_id
        self.book = book
        self.handoff_wait_s = handoff_wait_s
        self.mirror = etcd.PrefixMirror(client, etcd.PROGRAMS, on_event=self._changed)
        self._keeper = etcd.LeaseKeeper(client, ttl_s=lease_ttl_s)
        self._writes: asyncio.Queue[Callable[[], Awaitable[None]]] = asyncio.Queue()
        self._writer: asyncio.Task[None] | None = None
        self._waiting: dict[str, asyncio.Future[Marker | None]] = {}
        self._mine: set[str] = set()  # markers this router put for records open here
        self.handed_over = 0  # programs this router gave to another (tests, logs)

    # ----- life cycle ------------------------------------------------------------------

    def start(self) -> None:
        self._keeper.start()
        if self._writer is None:
            self._writer = asyncio.create_task(self._write_all(), name="program-homes")

    async def close(self) -> None:
        """Stop. The open programs are handed over to whichever router their next call
        reaches (their records end, `moved`, and are shared; the markers of handed-over
        programs last the book's idle time); then the lease is revoked, so this router's
        other markers go at once."""
        await self._hand_over_all()
        if self._writer is not None:
            try:  # what is queued (a hand-over answer) first, briefly
                await asyncio.wait_for(self._writes.join(), 1.0)
            except TimeoutError:
                pass
            self._writer.cancel()
            try:
                await self._writer
            except asyncio.CancelledError:
                pass
            self._writer = None
        await self._keeper.close(revoke=True)

    async def _write_all(self) -> None:
        """The markers' writes in the order they were made (a delete after its put)."""
        while True:
            write = await self._writes.get()
            try:
                await write()
            except asyncio.CancelledError:
                raise
            except etcd.ETCD_DOWN_ERRORS as exc:
                log.warning("program marker write failed (%s); the lease bounds what is left", exc)
            finally:
                self._writes.task_done()

    # ----- this router's programs -------------------------------------------------------

    def opened(self, program: Program) -> None:
        """This router opened a record of the program (with an id): say so."""
        key = etcd.program_key(program.tenant, program.program_id)
        self._mine.add(key)

        async def put() -> None:
            marker = Marker(
                self.instance_id, program.run_id, program.first_hop_index, lease=self._keeper.lease_id or 0
            )
            await self._keeper.put(key, marker.encode())

        self._writes.put_nowait(put)

    def ended(self, program: Program) -> None:
        """The program's record ended here: by its end mark, idle or evicted, the marker
        goes (a later call starts afresh, as on one router); handed over, the answer
        stands; full, the next record's marker replaces it."""
        if not program.program_id or program.ended not in (END, IDLE, EVICTED):
            return
        key = etcd.program_key(program.tenant, program.program_id)
        if self.book.get(program.tenant, program.program_id) is not None:
            return  # a new record of it is open here already: its marker stands
        self._writes.put_nowait(lambda: self._delete_if_mine(key))

    async def _delete_if_mine(self, key: str) -> None:
        if key in self._mine:  # not handed over meanwhile
            self._mine.discard(key)
            await self._keeper.delete(key)

    async def _hand_over_all(self) -> None:
        programs = [p for p in self.book.open_programs() if p.program_id]
        if not programs:
            return
        try:
            lease = await self._client.lease(max(int(self.book.idle_s), 1))
        except etcd.ETCD_DOWN_ERRORS as exc:
            log.warning("cannot hand %d open programs over (%s)", len(programs), exc)
            return
        for program in programs:
            key = etcd.program_key(program.tenant, program.program_id)
            handed = self.book.hand_over(program.tenant, program.program_id)
            self._mine.discard(key)
            self._keeper.forget(key)
            if handed is None:
                continue
            answer = Marker("", handed.run_id, handed.next_hop_index)
            self._writes.put_nowait(self._putter(key, answer, lease.id))
        log.info("handed %d open programs over on stopping", len(programs))

    def _putter(self, key: str, marker: Marker, lease: int | None) -> Callable[[], Awaitable[None]]:
        async def put() -> None:
            await self._client.put(key.encode(), marker.encode(), lease=lease)

        return put

    # ----- a program new to this router --------------------------------------------------

    async def arrive(self, tenant: str, program_id: str) -> Continuation:
        """Where a program this router holds no record of continues (see the module's
        doc): at once, unless another router holds it (then it is asked for)."""
        key = etcd.program_key(tenant, program_id)
        raw = self.mirror.items.get(key)
        if raw is None:
            # New to the mirror. The watch may lag a marker put a moment ago (a client's
            # calls moving faster than it under load): etcd itself says, once per program
            # a router sees for the first time.
            try:
                current = await self._client.get(key.encode())
            except etcd.ETCD_DOWN_ERRORS as exc:
                log.warning("cannot look program %s up (%s): a new record of it", key, exc)
                return Continuation()
            raw = current.value if current is not None else None
        for _ in range(3):  # the marker may change under the request: read it again
            marker = Marker.decode(raw)
            found = continuation_of(marker, self.instance_id)
            if found is not None:
                return found
            assert marker is not None and raw is not None
            answer = await self._ask(key, raw, marker)
            if answer is not None:
                return answer
            try:  # from etcd itself: the mirror may not have seen the change yet
                current = await self._client.get(key.encode())
            except etcd.ETCD_DOWN_ERRORS:
                return Continuation(marker.hop_index, marker.run_id)
            raw = current.value if current is not None else None
        return Continuation()

    async def _ask(self, key: str, raw: bytes, marker: Marker) -> Continuation | None:
        """Ask the holder for the program; None when the marker changed meanwhile."""
        future: asyncio.Future[Marker | None] = asyncio.get_running_loop().create_future()
        self._waiting[key] = future
        try:
            asked = Marker(marker.router, marker.run_id, marker.hop_index, marker.lease, to=self.instance_id)
            tx = self._client.transactions
            try:
                done, _ = await self._client.transaction(
                    compare=[tx.value(key.encode()) == raw],
                    success=[tx.put(key.encode(), asked.encode(), lease=marker.lease or None)],
                    failure=[],
                )
            except etcd.ETCD_DOWN_ERRORS as exc:
                log.warning("cannot ask router %s for program %s (%s)", marker.router, key, exc)
                return Continuation(marker.hop_index, marker.run_id)
            if not done:
                return None
            try:
                answer = await asyncio.wait_for(future, self.handoff_wait_s)
            except TimeoutError:
                log.warning(
                    "router %s did not hand program %s over within %.1f s (gone?): continuing from hop %d",
                    marker.router,
                    key,
                    self.handoff_wait_s,
                    marker.hop_index,
                )
                metrics.PROGRAM_HANDOVERS.labels("unanswered").inc()
                return Continuation(marker.hop_index, marker.run_id)
            if answer is None:  # it ended there meanwhile (or its holder's lease did)
                return Continuation()
            metrics.PROGRAM_HANDOVERS.labels("taken").inc()
            return Continuation(answer.hop_index, answer.run_id)
        finally:
            if self._waiting.get(key) is future:
                del self._waiting[key]

    # ----- the watch ---------------------------------------------------------------------

    def _changed(self, key: str, value: bytes | None) -> None:
        marker = Marker.decode(value)
        waiter = self._waiting.get(key)
        if waiter is not None and not waiter.done() and (marker is None or not marker.router):
            waiter.set_result(marker)
        if (
            marker is not None
            and marker.router == self.instance_id
            and marker.to
            and marker.to != self.instance_id
        ):
            self._hand_over(key, marker)

    def _hand_over(self, key: str, marker: Marker) -> None:
        parts = key_parts(key)
        program = self.book.hand_over(*parts) if parts is not None else None
        self._mine.discard(key)
        if program is None:  # not open here any more: the asker starts afresh
            log.info("program %s asked for by router %s is not open here", key, marker.to)
            self._writes.put_nowait(lambda: self._keeper.delete(key))
            return
        self.handed_over += 1
        metrics.PROGRAM_HANDOVERS.labels("given").inc()
        log.info("program %s moved to router %s at hop %d", key, marker.to, program.next_hop_index)
        answer = Marker("", program.run_id, program.next_hop_index)

        async def put() -> None:
            self._keeper.forget(key)  # the asker's marker replaces it; never put again
            lease = self._keeper.lease_id  # gone with this router if the asker never reads it
            await self._client.put(key.encode(), answer.encode(), lease=lease)

        self._writes.put_nowait(put)
