"""Durations and availability figures as they are written in chain configs.

A duration is either a number (milliseconds, the unit everything in InferX works
in) or a string with a unit: ``"500ms"``, ``"3s"``, ``"1.5s"``, ``"2m"``, ``"1h"``.
A string without a unit (``"500"``) is milliseconds too, so JSON written by
other tools that quotes numbers still loads. Zero, negative, infinite and
unparsable values are rejected: every duration in a chain is a timeout or a TTL,
and none of those is meaningful at or below zero.

Availability is a percentage string (``"99.9%"``) or a fraction in (0, 1]
(``0.999``). A bare number above 1 is rejected rather than read as a percentage,
because ``99.9`` and ``0.999`` silently meaning the same thing invites mistakes
like ``1.5`` being read as 1.5%.

Errors are `ValueFormatError` (a ValueError) whose message names the thing being
parsed (``timeout must be a positive duration like 500ms, 3s or 1m, got '-3s'``);
`.problem` holds the same text without the name, for callers that print the
field name themselves.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation

__all__ = [
    "ValueFormatError",
    "format_duration_ms",
    "parse_availability",
    "parse_duration_ms",
]

_UNIT_MS: dict[str, float] = {"ms": 1.0, "s": 1_000.0, "m": 60_000.0, "h": 3_600_000.0}

# A non-negative decimal (optionally in exponent form, which is what repr() of a
# large float produces) followed by an optional unit. A leading sign is
# deliberately not accepted, so "-3s" fails here with the same message as "abc".
_DURATION_RE = re.compile(r"^\s*((?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*(ms|s|m|h)?\s*$")

_DURATION_PROBLEM = "must be a positive duration like 500ms, 3s or 1m"
_AVAILABILITY_PROBLEM = "must be a percentage like 99.9% or a fraction in (0, 1]"


class ValueFormatError(ValueError):
    """A duration or availability that cannot be used.

    ``str(error)`` is the full sentence; ``.problem`` is the part after the name.
    """

    def __init__(self, what: str, problem: str) -> None:
        super().__init__(f"{what} {problem}")
        self.what = what
        self.problem = problem


def _show(value: object) -> str:
    """The offending value as it should appear in an error message (short)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def parse_duration_ms(value: object, *, what: str = "value") -> float:
    """Milliseconds of a duration written as ``500ms``/``3s``/``2m``/``1h`` or a number of ms.

    `what` names the value in the error message (e.g. ``"timeout"``).
    """
    ms: float | None = None
    # bool is an int subclass; `timeout: true` is a mistake, not 1 ms.
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        ms = float(value)
    elif isinstance(value, str):
        match = _DURATION_RE.match(value)
        if match is not None:
            number, unit = match.groups()
            ms = float(number) * _UNIT_MS[unit or "ms"]  # huge values become inf, rejected below
    if ms is None or not math.isfinite(ms) or ms <= 0:
        raise ValueFormatError(what, f"{_DURATION_PROBLEM}, got {_show(value)}")
    return ms


def format_duration_ms(ms: float) -> str:
    """The canonical text of a duration: milliseconds with the ``ms`` unit.

    Always milliseconds (never "3s") so the normalised form is unambiguous and
    ``parse_duration_ms(format_duration_ms(x)) == x`` holds exactly: repr() of a
    float is the shortest string that reads back as the same float.
    """
    if float(ms).is_integer() and abs(ms) < 1e15:
        return f"{int(ms)}ms"
    return f"{float(ms)!r}ms"


def parse_availability(value: object, *, what: str = "availability") -> float:
    """The availability target as a fraction in (0, 1], from ``"99.9%"`` or ``0.999``."""
    fraction: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        fraction = float(value)
    elif isinstance(value, str):
        text = value.strip()
        try:
            if text.endswith("%"):
                # Decimal so that "99.9%" becomes exactly 0.999, not 0.9990000000000001.
                fraction = float(Decimal(text[:-1].strip()) / 100)
            else:
                fraction = float(Decimal(text))
        except (InvalidOperation, ValueError):
            fraction = None
    if fraction is None or not math.isfinite(fraction) or not 0 < fraction <= 1:
        raise ValueFormatError(what, f"{_AVAILABILITY_PROBLEM}, got {_show(value)}")
    return fraction


def parse_quiet_hours(text: str) -> tuple[tuple[float, float], ...]:
    """``"22-6,13-14"`` -> ((22, 6), (13, 14)); "" -> (). ValueError naming the bad part."""
    spans = []
    for part in filter(None, (piece.strip() for piece in text.split(","))):
        start, sep, end = part.partition("-")
        try:
            if not sep:
                raise ValueError
            span = (float(start), float(end))
        except ValueError:
            raise ValueError(f"quiet hours: {part!r} is not START-END in hours (e.g. 22-6)") from None
        if not (0 <= span[0] <= 24 and 0 <= span[1] <= 24) or span[0] == span[1]:
            raise ValueError(f"quiet hours: {part!r} is not a span of hours within 0-24")
        spans.append(span)
    return tuple(spans)
