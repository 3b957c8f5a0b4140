"""argparse types for whole-number options: a value out of range is a usage error
naming the option (argparse's), never a traceback from deeper down (a protobuf field's
"Value out of range", a stack started for -1 chains)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from inferx import MAX_UINT32


def whole_number(minimum: int = 0, maximum: int = MAX_UINT32) -> Callable[[str], int]:
    """A type for `add_argument`: an int in [minimum, maximum]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        if value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum:,}, got {value:,}")
        return value

    return parse


count = whole_number(0)  # 0 and up, within a uint32 (0 usually means "not set" or "no limit")
at_least_one = whole_number(1)
port = whole_number(0, 65535)


def duration_ms(text: str) -> float:
    """A duration (``500ms``, ``3s``, ``8h``) in ms, positive and at most 30 days."""
    from inferx.chain.durations import ValueFormatError, parse_duration_ms

    try:
        ms = parse_duration_ms(text)
    except ValueFormatError as exc:
        raise argparse.ArgumentTypeError(exc.problem) from None
    if ms > 30 * 24 * 3_600_000:
        raise argparse.ArgumentTypeError(f"at most 30 days, got {text!r}")
    return ms


def amount(text: str) -> float:
    """A price or budget: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value != value or value in (float("inf"), float("-inf")) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value
