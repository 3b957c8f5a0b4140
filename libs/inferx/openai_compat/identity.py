"""Program identity: which agent program a call is a hop of, from its headers and body.

InferX's own headers (these win over everything below):

    X-InferX-Program       an agent run id (1-256 visible ASCII characters, no spaces);
                           calls with the same id are hops of one program (one chain key:
                           the scheduler keeps them on one worker and learns their gaps)
    X-InferX-Program-Name  what kind of program it is (1-64 of [A-Za-z0-9._-]): its "chain"
                           in `inferx stats` and the metrics (default `openai`)
    X-InferX-Tier          realtime | standard | batch (default standard)
    X-InferX-Deadline-Ms   this call's deadline, in ms from its arrival (1 .. 86,400,000)
    X-InferX-Program-End   true | false: the program ends after this call (its KV is let go)
    X-InferX-KV-Retention-S  seconds to keep the program's KV after this call (0 = let it
                           go at once; agentic_context's kv_retention_ttl), at most the
                           scheduler's --max-hold-s

For drop-in use, without X-InferX-Program the program id comes from, in this order:

  1. vLLM router's program contract: the body's `vllm_xargs.agentic_context` (or a
     top-level `agentic_context`), an object or a JSON string of one (docs/concepts.md: its fields);
  2. the body's `agent_hint` (`session_id`, `parent_session_id`, `blocks_parent`,
     `expected_resume`), vLLM router's older contract;
  3. agent frameworks' session headers: `X-Claude-Code-Session-Id` (with
     `X-Claude-Code-Agent-Id`, `X-Claude-Code-Parent-Agent-Id`), Codex's `Session-Id`
     (with `Thread-Id`), and `X-Session-Id`;
  4. the body's `session_params.session_id` or `session_id`.

A session (or task) with an agent in it is the program `<session>:<agent>`; without one,
the program `<session>`. The body's `user` is not an identity (OpenAI defines it as the
end user, for abuse monitoring: one user's unrelated conversations are not one program),
and neither are request or trace ids. Without any of these a call is a program of one hop.

A bad value, or a field of `agentic_context` / `agent_hint` InferX does not know, is an
InvalidField naming it (`agentic_context.<field>`), never a silent guess. Pure code.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from inferx.openai_compat.errors import InvalidField
from inferx.scheduling.views import TIER_BY_NAME, Tier

PROGRAM = "X-InferX-Program"
PROGRAM_NAME = "X-InferX-Program-Name"
TIER = "X-InferX-Tier"
DEADLINE_MS = "X-InferX-Deadline-Ms"
PROGRAM_END = "X-InferX-Program-End"
KV_RETENTION = "X-InferX-KV-Retention-S"

# Agent frameworks' session headers: (session, agent within it, the agent's parent agent).
SESSION_HEADERS: tuple[tuple[str, str | None, str | None], ...] = (
    ("X-Claude-Code-Session-Id", "X-Claude-Code-Agent-Id", "X-Claude-Code-Parent-Agent-Id"),
    ("Session-Id", "Thread-Id", None),  # Codex
    ("X-Session-Id", None, None),
)

MAX_DEADLINE_MS = 86_400_000
MAX_SECONDS = 1e15  # seconds given in a body are capped here before any arithmetic
MAX_CONTEXT_CHARS = 16 * 1024  # agentic_context given as a JSON string
DEFAULT_PROGRAM_NAME = "openai"
DEFAULT_PRIORITY = 2  # a chain node's default priority rank ("normal"; 0 high .. 3 low)
_PROGRAM_ID = re.compile(r"[\x21-\x7e]{1,256}")
_PROGRAM_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
_TRUE, _FALSE = {"true", "1", "yes"}, {"false", "0", "no"}


@dataclass(frozen=True)
class ProgramIdentity:
    program_id: str = ""  # "" = none: a one-hop program
    tier: Tier = Tier.STANDARD
    deadline_ms: int | None = None  # relative to the call's arrival; None = the router's default
    program_end: bool = False
    name: str = DEFAULT_PROGRAM_NAME  # the program's kind: its chain name in records and metrics
    parent_program_id: str = ""  # the program that started this one (kept in its record)
    priority: int = DEFAULT_PRIORITY  # the hops' priority rank, 0 (high) .. 3 (low)
    # The client's KV retention hint: seconds to keep the program's KV after this call
    # (HopContext.kv_retention_s: the chain-aware policy holds it that long, at most its
    # --max-hold-s); 0 = let go at once; None = the policy's priced hold.
    kv_retention_s: float | None = None


# ----- values ----------------------------------------------------------------------------------


def check_program_id(param: str, value: str) -> str:
    if not _PROGRAM_ID.fullmatch(value):
        raise InvalidField(param, "expected 1-256 visible ASCII characters (no spaces)")
    return value


def check_program_name(param: str, value: str) -> str:
    if not _PROGRAM_NAME.fullmatch(value):
        raise InvalidField(param, "expected 1-64 characters of letters, digits and . _ -")
    return value


def parse_tier(param: str, raw: str) -> Tier:
    if raw.lower() not in TIER_BY_NAME:
        raise InvalidField(param, f"expected realtime, standard or batch, got {raw!r}")
    return TIER_BY_NAME[raw.lower()]


def check_deadline_ms(param: str, value: int) -> int:
    if not 1 <= value <= MAX_DEADLINE_MS:
        raise InvalidField(param, f"expected 1 to {MAX_DEADLINE_MS:,} milliseconds, got {value}")
    return value


def check_retention_s(param: str, value: float) -> float:
    """A KV retention hint in seconds: finite, at least 0 (capped at MAX_SECONDS)."""
    if not math.isfinite(value) or value < 0:
        raise InvalidField(param, f"expected a number of seconds, at least 0, got {value!r}")
    return float(min(value, MAX_SECONDS))


def priority_rank(priority: int) -> int:
    """vLLM router's priority (larger first, default 0) as a hop's priority rank:
    2 and more high (0), 1 medium (1), 0 normal (2), below 0 low (3)."""
    return 2 - max(-1, min(priority, 2))


def _scoped(group: str, agent: str | None) -> str:
    """`<group>:<agent>`, or the group alone; an agent id already scoped stays as it is."""
    if not agent:
        return group
    return agent if agent.startswith(f"{group}:") else f"{group}:{agent}"


# ----- headers ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Given:
    """What one source says; None = it says nothing about that."""

    program_id: str | None = None
    tier: Tier | None = None
    deadline_ms: int | None = None
    end: bool | None = None
    parent: str | None = None
    priority: int | None = None
    kv_retention_s: float | None = None


_SAYS_NOTHING = _Given()  # shared: a frozen dataclass costs microseconds to build per call


def _first(attr: str, *sources: _Given) -> Any:
    """The first source's `attr` that says something (None when none does)."""
    for source in sources:
        value = getattr(source, attr)
        if value is not None:
            return value
    return None


def _inferx_headers(get: Callable[[str], str | None]) -> tuple[_Given, str | None]:
    program = get(PROGRAM) or None
    if program is not None:
        check_program_id(PROGRAM, program)
    name = get(PROGRAM_NAME)
    if name is not None:
        check_program_name(PROGRAM_NAME, name)
    tier = parse_tier(TIER, raw) if (raw := get(TIER)) is not None else None
    deadline_ms = None
    if (raw := get(DEADLINE_MS)) is not None:
        if not raw.isdigit() or not 1 <= int(raw) <= MAX_DEADLINE_MS:
            raise InvalidField(
                DEADLINE_MS, f"expected a whole number of milliseconds, 1 to {MAX_DEADLINE_MS:,}, got {raw!r}"
            )
        deadline_ms = int(raw)
    end = None
    if (raw := get(PROGRAM_END)) is not None:
        if raw.lower() not in _TRUE | _FALSE:
            raise InvalidField(PROGRAM_END, f"expected true or false, got {raw!r}")
        end = raw.lower() in _TRUE
    retention_s = None
    if (raw := get(KV_RETENTION)) is not None:
        try:
            retention_s = float(raw)
        except ValueError:
            raise InvalidField(KV_RETENTION, f"expected a number of seconds, got {raw!r}") from None
        retention_s = check_retention_s(KV_RETENTION, retention_s)
    if program is None and tier is None and deadline_ms is None and end is None and retention_s is None:
        return _SAYS_NOTHING, name
    given = _Given(
        program_id=program, tier=tier, deadline_ms=deadline_ms, end=end, kv_retention_s=retention_s
    )
    return given, name


def _session_headers(get: Callable[[str], str | None]) -> _Given:
    for session_header, agent_header, parent_header in SESSION_HEADERS:
        session = get(session_header)
        if not session:
            continue
        check_program_id(session_header, session)
        agent = get(agent_header) if agent_header else None
        parent = get(parent_header) if parent_header else None
        for header, value in ((agent_header, agent), (parent_header, parent)):
            if value and header:
                check_program_id(header, value)
        program = check_program_id(session_header, _scoped(session, agent or None))
        if parent:
            parent_id = _scoped(session, parent)
        elif agent:
            parent_id = session  # a subagent of the session's lead agent
        else:
            parent_id = None
        return _Given(program_id=program, parent=parent_id)
    return _SAYS_NOTHING


# ----- body fields -----------------------------------------------------------------------------


class _Fields:
    """Typed reads of one JSON object's fields, errors naming `<where>.<field>`; null
    counts as absent, and every field read is marked known."""

    def __init__(self, where: str, data: Mapping[str, Any]) -> None:
        self.where = where
        self.data = data
        self.known: set[str] = set()

    def _raw(self, *names: str) -> tuple[str, Any] | None:
        self.known.update(names)
        for name in names:
            value = self.data.get(name)
            if value is not None:
                return name, value
        return None

    def param(self, name: str) -> str:
        return f"{self.where}.{name}"

    def ident(self, *names: str) -> str | None:
        found = self._raw(*names)
        return _id_value(self.param(found[0]), found[1]) if found is not None else None

    def text(self, *names: str) -> str | None:
        found = self._raw(*names)
        if found is not None and not isinstance(found[1], str):
            raise InvalidField(self.param(found[0]), "expected a string")
        return found[1] if found is not None else None

    def flag(self, *names: str) -> bool | None:
        found = self._raw(*names)
        if found is not None and not isinstance(found[1], bool):
            raise InvalidField(self.param(found[0]), "expected true or false")
        return found[1] if found is not None else None

    def integer(self, *names: str, minimum: int | None = None) -> int | None:
        found = self._raw(*names)
        if found is None:
            return None
        name, value = found
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidField(self.param(name), "expected an integer")
        if minimum is not None and value < minimum:
            raise InvalidField(self.param(name), f"expected at least {minimum}, got {value}")
        return value

    def seconds(self, *names: str) -> float | None:
        found = self._raw(*names)
        if found is None:
            return None
        name, value = found
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidField(self.param(name), "expected a number of seconds")
        if value < 0:
            raise InvalidField(self.param(name), f"expected at least 0 seconds, got {value}")
        seconds = float(min(value, MAX_SECONDS))  # a huge integer would not convert
        if not math.isfinite(seconds):
            raise InvalidField(self.param(name), "expected a number of seconds")
        return seconds

    def reject_unknown(self) -> None:
        unknown = sorted(set(self.data) - self.known)
        if unknown:
            raise InvalidField(
                self.param(unknown[0]),
                f"unknown field; {self.where} takes {', '.join(sorted(self.known))}",
            )


def _id_value(param: str, value: Any) -> str:
    """An id given as a JSON string or integer."""
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise InvalidField(param, "expected a string (or an integer) id")
    text = str(value).strip()
    if not text:
        raise InvalidField(param, "must not be empty")
    return check_program_id(param, text)


def _object(param: str, value: Any) -> Mapping[str, Any]:
    """An object, or a JSON string of one (vLLM router accepts both for agentic_context)."""
    if isinstance(value, str):
        if len(value) > MAX_CONTEXT_CHARS:
            raise InvalidField(param, f"longer than {MAX_CONTEXT_CHARS:,} characters")
        try:
            value = json.loads(value)
        except ValueError:
            raise InvalidField(param, "expected an object, or a JSON string of one") from None
    if not isinstance(value, dict):
        raise InvalidField(param, "expected an object, or a JSON string of one")
    return value


def _agentic_context(body: Mapping[str, Any]) -> _Given | None:
    """vLLM router's `agentic_context` (see the mapping table in docs/concepts.md)."""
    xargs = body.get("vllm_xargs")
    if xargs is not None and not isinstance(xargs, dict):
        raise InvalidField("vllm_xargs", "expected an object")
    nested = (xargs or {}).get("agentic_context")
    top = body.get("agentic_context")
    if nested is not None and top is not None:
        raise InvalidField("agentic_context", "give it once: top-level or in vllm_xargs, not both")
    if nested is None and top is None:
        return None
    where = "vllm_xargs.agentic_context" if nested is not None else "agentic_context"
    fields = _Fields(where, _object(where, nested if nested is not None else top))
    program = fields.ident("program_id")
    task = fields.ident("task_id")
    session = fields.ident("session_id")
    agent = fields.ident("agent_id")
    parent = fields.ident("parent_program_id", "parent_id")
    parent_agent = fields.ident("parent_agent_id")
    deadline_s = fields.seconds("deadline", "deadline_seconds")
    priority = fields.integer("priority")
    kv_retention_s = fields.seconds("kv_retention_ttl", "kv_retention_ttl_seconds")
    expected_resume = fields.flag("expected_resume")
    tier_name = fields.text("tier")  # InferX's own: vLLM router has no tiers
    # Accepted and not used by InferX (vLLM router's lineage and hints).
    fields.ident("root_program_id", "root_id")
    fields.ident("request_id")
    fields.text("agent_role")
    fields.text("spawn_reason", "subagent_type", "agent_type")
    fields.flag("blocks_parent", "blocking_parent")
    fields.integer("step_id", minimum=0)
    fields.integer("expected_output_length", "expected_output_tokens", minimum=0)
    fields.reject_unknown()
    group = task or session
    if program is None and group is not None:
        program = check_program_id(fields.param("program_id"), _scoped(group, agent))
    if parent is None and parent_agent and group is not None:
        parent = check_program_id(fields.param("parent_agent_id"), _scoped(group, parent_agent))
    if program is None and (parent is not None or agent is not None):
        raise InvalidField(
            fields.param("program_id"), "required (or task_id / session_id) with an agent or a parent"
        )
    if parent is not None and parent == program:
        raise InvalidField(fields.param("parent_program_id"), "must differ from the program id")
    deadline_ms = None
    if deadline_s is not None:
        deadline_ms = check_deadline_ms(fields.param("deadline"), math.ceil(min(deadline_s, 1e12) * 1000))
    return _Given(
        program_id=program,
        tier=parse_tier(fields.param("tier"), tier_name) if tier_name is not None else None,
        deadline_ms=deadline_ms,
        end=None if expected_resume is None else not expected_resume,
        parent=parent,
        priority=priority,
        kv_retention_s=kv_retention_s,
    )


def _agent_hint(body: Mapping[str, Any]) -> _Given | None:
    raw = body.get("agent_hint")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise InvalidField("agent_hint", "expected an object")
    fields = _Fields("agent_hint", raw)
    session = fields.ident("session_id")
    parent = fields.ident("parent_session_id")
    fields.flag("blocks_parent")
    expected_resume = fields.flag("expected_resume")
    fields.reject_unknown()
    if session is None:
        raise InvalidField("agent_hint.session_id", "required")
    return _Given(
        program_id=session, parent=parent, end=None if expected_resume is None else not expected_resume
    )


def _body_session(body: Mapping[str, Any]) -> _Given:
    """`session_params.session_id` or `session_id` (what vLLM router hashes sessions by)."""
    params = body.get("session_params")
    if isinstance(params, dict) and params.get("session_id") is not None:
        return _Given(program_id=_id_value("session_params.session_id", params["session_id"]))
    if body.get("session_id") is not None:
        return _Given(program_id=_id_value("session_id", body["session_id"]))
    return _SAYS_NOTHING


# ----- all together ----------------------------------------------------------------------------


def parse_identity(headers: Mapping[str, str], body: Mapping[str, Any] | None = None) -> ProgramIdentity:
    """The identity a call's headers (names are case-insensitive) and JSON body give."""
    lower = {name.lower(): value.strip() for name, value in headers.items()}

    def get(name: str) -> str | None:
        return lower.get(name.lower())

    own, name = _inferx_headers(get)
    body = body or {}
    context = _agentic_context(body) or _SAYS_NOTHING
    hint = _agent_hint(body) or _SAYS_NOTHING
    sessions = _session_headers(get)
    in_body = _body_session(body)
    program = _first("program_id", own, context, hint, sessions, in_body) or ""
    end = _first("end", own, context, hint)
    if end and not program:
        param = PROGRAM_END if own.end else "agentic_context.expected_resume"
        raise InvalidField(
            param, f"needs a program ({PROGRAM} or a session): a call without one is a program of one hop"
        )
    priority = _first("priority", context)
    parent = _first("parent", context, hint, sessions) or ""
    if parent == program:
        parent = ""
    return ProgramIdentity(
        program_id=program,
        tier=_first("tier", own, context) or Tier.STANDARD,
        deadline_ms=_first("deadline_ms", own, context),
        program_end=bool(end) and bool(program),
        name=name or DEFAULT_PROGRAM_NAME,
        parent_program_id=parent if program else "",
        priority=DEFAULT_PRIORITY if priority is None else priority_rank(priority),
        kv_retention_s=_first("kv_retention_s", own, context) if program else None,
    )


def identity_of_fields(
    *,
    program_id: str = "",
    name: str = "",
    tier: int = 0,
    deadline_ms: int = 0,
    program_end: bool = False,
    parent_program_id: str = "",
    priority: int = 0,
    kv_retention_s: float | None = None,
) -> ProgramIdentity:
    """The identity of a `Router.CallModel` request (its fields are the headers' twins;
    0 and "" mean not given). Errors name the field."""
    if program_id:
        check_program_id("program_id", program_id)
    if name:
        check_program_name("program_name", name)
    if tier not in (0, 1, 2, 3):
        raise InvalidField("tier", f"unknown value {tier}")
    if deadline_ms:
        check_deadline_ms("deadline_ms", deadline_ms)
    if program_end and not program_id:
        raise InvalidField("program_end", "needs program_id (a call without one is a program of one hop)")
    if parent_program_id:
        check_program_id("parent_program_id", parent_program_id)
        if not program_id:
            raise InvalidField("parent_program_id", "needs program_id")
        if parent_program_id == program_id:
            raise InvalidField("parent_program_id", "must differ from program_id")
    if kv_retention_s is not None:
        kv_retention_s = check_retention_s("kv_retention_s", kv_retention_s)
    return ProgramIdentity(
        program_id=program_id,
        tier=Tier(tier) if tier else Tier.STANDARD,
        deadline_ms=deadline_ms or None,
        program_end=program_end,
        name=name or DEFAULT_PROGRAM_NAME,
        parent_program_id=parent_program_id,
        priority=priority_rank(priority),
        kv_retention_s=kv_retention_s if program_id else None,
    )
