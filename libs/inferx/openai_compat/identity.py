"""Program identity from request headers: which agent program a call is a hop of.

    X-InferX-Program      an agent run id ([A-Za-z0-9._:-], at most 128 characters); calls
                          with the same id are hops of one program (one chain key: the
                          scheduler keeps them on one worker and learns their gaps)
    X-InferX-Tier         realtime | standard | batch (default standard)
    X-InferX-Deadline-Ms  this call's deadline, in ms from its arrival (1 .. 86,400,000)
    X-InferX-Program-End  true | false: the program ends after this call (its KV is let go)

Without X-InferX-Program a call is a program of one hop. A bad value is an InvalidField
naming the header.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from inferx.openai_compat.errors import InvalidField
from inferx.scheduling.views import TIER_BY_NAME, Tier

PROGRAM = "X-InferX-Program"
TIER = "X-InferX-Tier"
DEADLINE_MS = "X-InferX-Deadline-Ms"
PROGRAM_END = "X-InferX-Program-End"

MAX_DEADLINE_MS = 86_400_000
_PROGRAM_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_TRUE, _FALSE = {"true", "1", "yes"}, {"false", "0", "no"}


@dataclass(frozen=True)
class ProgramIdentity:
    program_id: str = ""  # "" = none: a one-hop program
    tier: Tier = Tier.STANDARD
    deadline_ms: int | None = None  # relative to the call's arrival; None = the router's default
    program_end: bool = False


def parse_identity(headers: Mapping[str, str]) -> ProgramIdentity:
    """The identity a call's headers give (header names are case-insensitive)."""
    lower = {name.lower(): value.strip() for name, value in headers.items()}

    def get(name: str) -> str | None:
        return lower.get(name.lower())

    program = get(PROGRAM) or ""
    if program and not _PROGRAM_ID.fullmatch(program):
        raise InvalidField(PROGRAM, "expected 1-128 characters of letters, digits and . _ : -")
    tier = Tier.STANDARD
    if (raw := get(TIER)) is not None:
        if raw.lower() not in TIER_BY_NAME:
            raise InvalidField(TIER, f"expected realtime, standard or batch, got {raw!r}")
        tier = TIER_BY_NAME[raw.lower()]
    deadline_ms = None
    if (raw := get(DEADLINE_MS)) is not None:
        if not raw.isdigit() or not 1 <= int(raw) <= MAX_DEADLINE_MS:
            raise InvalidField(
                DEADLINE_MS, f"expected a whole number of milliseconds, 1 to {MAX_DEADLINE_MS:,}, got {raw!r}"
            )
        deadline_ms = int(raw)
    end = False
    if (raw := get(PROGRAM_END)) is not None:
        if raw.lower() not in _TRUE | _FALSE:
            raise InvalidField(PROGRAM_END, f"expected true or false, got {raw!r}")
        end = raw.lower() in _TRUE
    if end and not program:
        raise InvalidField(PROGRAM_END, f"needs {PROGRAM} (a call without it is a program of one hop)")
    return ProgramIdentity(program, tier, deadline_ms, end)
