"""Calls of the OpenAI-compatible front as hops of programs (pure code).

A call with `X-InferX-Program: P` is a hop of program P: its run id is P, so every
call of P has the same chain key (`HopView.chain_key`) and the scheduler keeps P on the
worker holding its context, holds that context across the client's tool gaps, and
learns the gaps. Its remaining hops are unknown (None) until a call says the program
ends (`X-InferX-Program-End: true`, remaining hops 0: the scheduler lets the context go).
A call without a program is a program of one hop (its own run id, remaining hops 0).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from inferx.openai_compat.identity import ProgramIdentity
from inferx_router.hops import ModelHop

CHAIN_NAME = "openai"  # what the scheduler and metrics see as the chain of a front's call
DEFAULT_PRIORITY = 2  # a chain node's default priority rank ("normal")


@dataclass
class ProgramBook:
    """How many calls each program has made so far (its next hop index), for the most
    recently seen `capacity` programs; a program's entry goes when it ends."""

    capacity: int = 10_000
    _calls: OrderedDict[str, int] = field(default_factory=OrderedDict)

    def next_index(self, program_id: str) -> int:
        index = self._calls.pop(program_id, 0)
        self._calls[program_id] = index + 1
        while len(self._calls) > self.capacity:
            self._calls.popitem(last=False)
        return index

    def end(self, program_id: str) -> None:
        self._calls.pop(program_id, None)

    def __len__(self) -> int:
        return len(self._calls)


@dataclass(frozen=True)
class Call:
    """One call as the front validated it."""

    call_id: str  # the response id (chatcmpl-..., cmpl-...): unique per call
    model: str
    prompt: str
    max_tokens: int
    temperature: float
    chat_json: str = ""  # a chat call's messages and tools (inferx.openai_compat.render.chat_json)


def program_hop(
    call: Call, identity: ProgramIdentity, book: ProgramBook, *, now_unix_ms: int, default_timeout_ms: int
) -> tuple[ModelHop, float]:
    """The model hop for `call` and its time limit in seconds. Counts the call in `book`
    (and forgets the program there when this call ends it)."""
    if identity.program_id:
        run_id = identity.program_id
        hop_index = book.next_index(run_id)
        remaining: int | None = 0 if identity.program_end else None
        if identity.program_end:
            book.end(run_id)
    else:
        run_id, hop_index, remaining = call.call_id, 0, 0
    timeout_ms = identity.deadline_ms or default_timeout_ms
    hop = ModelHop(
        run_id=run_id,
        hop_id=f"call-{hop_index}-{call.call_id}",  # unique even if the book forgot the program
        session_id="",  # the chain key is the run id: the program
        chain_name=CHAIN_NAME,
        chain_version=0,
        tier=identity.tier,
        priority=DEFAULT_PRIORITY,
        deadline_unix_ms=now_unix_ms + timeout_ms,
        hop_index=hop_index,
        remaining_hops=remaining,
        remaining_critical_path_ms=0.0,  # unknown: nobody declared the program's shape
        next_hops=(),
        model=call.model,
        prompt=call.prompt,
        max_tokens=call.max_tokens,
        temperature=call.temperature,
        chat_json=call.chat_json,
    )
    return hop, timeout_ms / 1000
