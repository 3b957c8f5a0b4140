"""Dynamic programs: calls of the OpenAI-compatible front (and of `Router.CallModel`)
as hops of agent programs, and the programs as run records (pure bookkeeping).

A call with a program id (`X-InferX-Program`, a session header, `agentic_context`, or
`CallModel`'s `program_id`) is a hop of that program: every call of it has the same
chain key for the scheduler (`<tenant>/<program id>`, `HopView.chain_key`), so the
scheduler keeps it on the worker holding its context, holds that context across the
client's tool gaps, and learns the gaps. Its remaining hops are unknown (None) until a
call says the program ends (remaining hops 0: the scheduler lets the context go at once).
A call without a program id is a program of one hop.

The router keeps each program as a run record (`records.RunStore`, the tenant's, like
a chain run's): one hop per call (`call-0`, `call-1`, ...) with its queue wait, latency,
tokens and worker, status `running` until the program ends, so `inferx trace` shows it
while it runs and `inferx stats <name>` over the ended ones. A program ends
  * with a call marked as its last (`end`): the record ends when that call finishes;
  * after `idle_s` with no call in flight and none arriving (`idle`, by `sweep`). No
    message reaches the scheduler then: it holds the program's KV only as long as its
    priced hold lasts (`inferx.scheduling.retention`, at most the scheduler's
    `--max-hold-s`), then lets it go by itself;
  * when `capacity` programs are open and another starts (`evicted`: the least recently
    active idle one);
  * when its record holds `MAX_CALLS_PER_RECORD` calls (`full`): the next call starts a
    new record (a new run id) of the same program, whose hops continue counting;
  * when another router takes the program over (`moved`, `hand_over`: the client's
    calls now land there, `program_homes`): that router's record continues this one's
    count and links to it (`RunRecord.continues_run_id`).
Another call with the id of an ended program starts a new record of it.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from inferx.auth.model import DEFAULT_TENANT
from inferx.openai_compat.identity import ProgramIdentity
from inferx.v1 import router_pb2
from inferx_router import records
from inferx_router.hops import ModelHop
from inferx_router.records import RUNNING, RunRecord, RunStore

CALL_NODE_TYPE = "model_inference"
MAX_CALLS_PER_RECORD = 1000
DEFAULT_IDLE_S = 300.0
DEFAULT_CAPACITY = 10_000

END, IDLE, EVICTED, FULL, MOVED = "end", "idle", "evicted", "full", "moved"  # why a record ended


@dataclass(frozen=True)
class Call:
    """One call as a front validated it."""

    call_id: str  # the response id (chatcmpl-..., cmpl-...): unique per call
    model: str
    prompt: str
    max_tokens: int
    temperature: float
    chat_json: str = ""  # a chat call's messages and tools (inferx.openai_compat.render.chat_json)
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    response_format_json: str = ""  # OpenAI's response_format, as JSON; "" = free text
    # The shared head its prompt starts with (inferx.tokens.shared_prefix); "" / 0 = none.
    prefix_id: str = ""
    prefix_tokens: int = 0


@dataclass
class Program:
    """One record of a program, open or ended."""

    tenant: str
    program_id: str  # as the client gave it; "" for a program of one call
    name: str  # its chain name in records and metrics
    tier: str
    record: RunRecord
    started: float  # on the book's clock
    last_active: float
    first_hop_index: int = 0  # the scheduler's hop index of this record's first call
    calls: int = 0  # calls begun in this record
    in_flight: int = 0
    ending: bool = False  # its last call has begun (or its record is full)
    ending_reason: str = END  # why it ends once its calls in flight finish
    ended: str = ""  # why it ended (END, IDLE, ...); "" while open
    last_finished: str = ""  # the node id of the call that finished last
    depends_on: dict[str, tuple[str, ...]] = field(default_factory=dict)
    starts_ms: dict[str, float] = field(default_factory=dict)

    @property
    def run_id(self) -> str:
        return self.record.finished.run_id

    @property
    def chain_key(self) -> str:
        """The scheduler's run id for its hops: stable across the program's records."""
        return f"{self.tenant}/{self.program_id}" if self.program_id else self.run_id

    @property
    def finished(self) -> router_pb2.ChainFinished:
        return self.record.finished

    @property
    def next_hop_index(self) -> int:
        """The hop index of the program's next call (after those begun in this record)."""
        return self.first_hop_index + self.calls


@dataclass(frozen=True)
class Ticket:
    """A call admitted into a program: what its hop and its record entry need."""

    program: Program
    node_id: str  # call-<n> in the record
    hop_index: int  # for the scheduler: calls of the program before this one
    begun: float  # on the book's clock
    last: bool  # the program's last call
    opened: bool = False  # this call started the record


class ProgramBook:
    """The open programs (per tenant and program id) and their records in `store`.

    `on_end` is called with each program whose record ended (metrics). `clock` is
    monotonic seconds, `wall` unix seconds: both injectable for tests."""

    def __init__(
        self,
        store: RunStore | None = None,
        *,
        idle_s: float = DEFAULT_IDLE_S,
        capacity: int = DEFAULT_CAPACITY,
        on_end: Callable[[Program], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        new_run_id: Callable[[], str] = lambda: uuid.uuid4().hex[:16],
    ) -> None:
        self.store = store if store is not None else records.RECENT
        self.idle_s = idle_s
        self.capacity = capacity
        self.on_end = on_end
        self._clock = clock
        self._wall = wall
        self._new_run_id = new_run_id
        self._open: OrderedDict[tuple[str, str], Program] = OrderedDict()  # least recently active first

    def __len__(self) -> int:
        """Open programs with an id (a one-call program is never kept open)."""
        return len(self._open)

    def get(self, tenant: str, program_id: str) -> Program | None:
        return self._open.get((tenant, program_id))

    def open_programs(self) -> list[Program]:
        """The open programs with an id, least recently active first."""
        return list(self._open.values())

    # ----- calls -----------------------------------------------------------------------------

    def begin(
        self,
        identity: ProgramIdentity,
        *,
        tenant: str = DEFAULT_TENANT,
        trace_id: str = "",
        first_hop_index: int = 0,
        continues_run_id: str = "",
    ) -> Ticket:
        """Count a call into its program (starting a record when there is none) and keep
        the record in the store; `finish` must follow, whatever happens to the call.
        A record started here counts from `first_hop_index` and continues the record
        `continues_run_id` (where another router held the program: `program_homes`)."""
        now = self._clock()
        key = (tenant, identity.program_id)
        program = self._open.get(key) if identity.program_id else None
        opened = program is None
        if program is not None and program.calls >= MAX_CALLS_PER_RECORD:
            del self._open[key]
            first_hop_index = program.first_hop_index + program.calls
            continues_run_id = ""  # the same router: the count goes on, the record is new
            if program.in_flight:  # it ends when they finish
                program.ending, program.ending_reason = True, FULL
            else:
                self._end(program, FULL)
            program = None
            opened = True
        if program is None:
            program = self._start(tenant, identity, now, trace_id, first_hop_index, continues_run_id)
            if identity.program_id:
                self._open[key] = program
                self._evict()
        else:
            self._open.move_to_end(key)
        last = identity.program_end or not identity.program_id
        if last and identity.program_id:
            self._open.pop(key, None)  # its next call starts a new record
        node_id = f"call-{program.calls}"
        ticket = Ticket(program, node_id, program.first_hop_index + program.calls, now, last, opened)
        program.calls += 1
        program.in_flight += 1
        program.last_active = now
        program.ending = program.ending or last
        program.starts_ms[node_id] = (now - program.started) * 1000
        program.depends_on[node_id] = (program.last_finished,) if program.last_finished else ()
        self.store.add(program.record)  # most recently active: evicted last
        return ticket

    def finish(self, ticket: Ticket, result: router_pb2.NodeFinished) -> None:
        """Record the call (its latency measured here, from `begin`); the program's record
        ends when this was its last call and no other is in flight."""
        program = ticket.program
        now = self._clock()
        kept = program.finished.hops.add()
        kept.CopyFrom(result)
        kept.node_id = ticket.node_id
        kept.node_type = kept.node_type or CALL_NODE_TYPE
        kept.latency_ms = (now - ticket.begun) * 1000
        kept.output = records.shorten(kept.output)
        kept.reasoning = records.shorten(kept.reasoning)
        program.in_flight -= 1
        program.last_active = now
        program.last_finished = ticket.node_id
        program.finished.latency_ms = max(
            program.finished.latency_ms, program.starts_ms[ticket.node_id] + kept.latency_ms
        )
        if program.ending and program.in_flight == 0 and not program.ended:
            self._end(program, program.ending_reason)

    def hand_over(self, tenant: str, program_id: str) -> Program | None:
        """Another router takes the program over: this router takes no more calls into
        its record, which ends (`moved`) once its calls in flight are done. The program
        (its next call's hop index: `next_hop_index`), or None when none is open here."""
        program = self._open.pop((tenant, program_id), None)
        if program is None:
            return None
        if program.in_flight:
            program.ending, program.ending_reason = True, MOVED
        else:
            self._end(program, MOVED)
        return program

    def sweep(self) -> list[Program]:
        """End the programs idle for `idle_s` (no call in flight); the ones ended."""
        now = self._clock()
        idle = [p for p in self._open.values() if p.in_flight == 0 and now - p.last_active >= self.idle_s]
        for program in idle:
            del self._open[(program.tenant, program.program_id)]
            self._end(program, IDLE)
        return idle

    # ----- records ---------------------------------------------------------------------------

    def _start(
        self,
        tenant: str,
        identity: ProgramIdentity,
        now: float,
        trace_id: str,
        first_hop_index: int,
        continues_run_id: str = "",
    ) -> Program:
        finished = router_pb2.ChainFinished(run_id=self._new_run_id(), status=RUNNING)
        depends_on: dict[str, tuple[str, ...]] = {}
        starts_ms: dict[str, float] = {}
        record = RunRecord(
            chain=identity.name,
            tier=identity.tier.label,
            started_unix_ms=int(self._wall() * 1000),
            trace_id=trace_id,
            depends_on=depends_on,
            finished=finished,
            tenant=tenant,
            program_id=identity.program_id,
            parent_program_id=identity.parent_program_id,
            starts_ms=starts_ms,
            first_hop_index=first_hop_index,
            continues_run_id=continues_run_id,
        )
        return Program(
            tenant=tenant,
            program_id=identity.program_id,
            name=identity.name,
            tier=identity.tier.label,
            record=record,
            started=now,
            last_active=now,
            first_hop_index=first_hop_index,
            depends_on=depends_on,
            starts_ms=starts_ms,
        )

    def _evict(self) -> None:
        while len(self._open) > self.capacity:
            victim = next((p for p in self._open.values() if p.in_flight == 0), None)
            if victim is None:
                return  # every open program has a call in flight: over capacity for now
            del self._open[(victim.tenant, victim.program_id)]
            self._end(victim, EVICTED)

    def _end(self, program: Program, why: str) -> None:
        program.ended = why
        finished = program.finished
        failed = [hop for hop in finished.hops if hop.status != "ok"]
        if not failed:
            finished.status = "ok"
        elif any(hop.status in ("timeout", "deadline_exceeded") for hop in failed):
            finished.status = "deadline_exceeded"
        else:
            finished.status = "error"
        finished.slo_met = finished.status == "ok"  # no SLO (slo_ms 0): every call within its deadline
        finished.error = "; ".join(f"{hop.node_id}: {hop.error}" for hop in failed if hop.error)
        self.store.finished(program.record)  # ended: shared with every router (records.RunStore.publish)
        if self.on_end is not None:
            self.on_end(program)


def program_hop(
    call: Call, ticket: Ticket, identity: ProgramIdentity, *, now_unix_ms: int, default_timeout_ms: int
) -> tuple[ModelHop, float]:
    """The model hop for `call` and its time limit in seconds."""
    program = ticket.program
    timeout_ms = identity.deadline_ms or default_timeout_ms
    hop = ModelHop(
        run_id=program.chain_key,
        hop_id=f"call-{ticket.hop_index}-{call.call_id}",  # unique per call
        session_id="",  # the chain key is the run id: the program
        chain_name=program.name,
        chain_version=0,
        tier=identity.tier,
        priority=identity.priority,
        deadline_unix_ms=now_unix_ms + timeout_ms,
        hop_index=ticket.hop_index,
        remaining_hops=0 if ticket.last else None,
        remaining_critical_path_ms=0.0,  # unknown: nobody declared the program's shape
        next_hops=(),
        model=call.model,
        prompt=call.prompt,
        max_tokens=call.max_tokens,
        temperature=call.temperature,
        top_p=call.top_p,
        seed=call.seed,
        stop=call.stop,
        response_format_json=call.response_format_json,
        chat_json=call.chat_json,
        kv_retention_s=identity.kv_retention_s,
        prefix_id=call.prefix_id,
        prefix_tokens=call.prefix_tokens,
    )
    return hop, timeout_ms / 1000
