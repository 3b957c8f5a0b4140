"""JSON text in and out of the OpenAI front, fast where that changes nothing.

A long agent call's body is tens of KB of JSON read on every call and written again for
the worker's chat template (`render.chat_json`): with the standard library that was
~0.35 ms of the router's CPU per 35 KB call (issue #16), with orjson a fifth of it. orjson
differs from `json` in ways that must not reach a caller, so it is used only where it
reads or writes the same values:

* it reads integers past 64 bits as floats (json keeps them exact): a text with a run
  of 19 or more digits is read by `json` instead;
* it refuses non-UTF-8 bytes (RFC 8259's UTF-16/32), a BOM and lone surrogates, which
  `json` reads: those texts go to `json` too, and the caller checks what it gets;
* it writes NaN as null and refuses integers past 64 bits: `loads` refuses NaN and
  Infinity (and numbers past a double, which `json` would read as inf) as the
  non-JSON they are, so no value it returned writes differently; a big integer is
  written by `json`.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import orjson

# Digits -> NUL: a run of 19 NULs is a run of 19 digits (no NUL is left in a text orjson read).
_DIGITS_AS_NUL = bytes.maketrans(b"0123456789", b"\0" * 10)
_LONG_RUN = b"\0" * 19
_LONG_DIGITS = re.compile(r"\d{19}")


def _not_json(constant: str) -> float:
    raise ValueError(f"{constant} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"{text} is out of a double's range")
    return value


def _loads_json(text: bytes | str) -> Any:
    return json.loads(text, parse_constant=_not_json, parse_float=_finite)


def _may_hold_big_integers(text: bytes | str) -> bool:
    if isinstance(text, bytes):
        return _LONG_RUN in text.translate(_DIGITS_AS_NUL)
    return _LONG_DIGITS.search(text) is not None


def loads(text: bytes | str) -> Any:
    """The value of a JSON text, as `json.loads` reads it, except that NaN, Infinity and
    numbers a double cannot hold are refused (ValueError, as for any text that is not
    JSON; RecursionError for one nested past the decoder)."""
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        return _loads_json(text)  # json's errors, or what it reads that orjson does not
    if _may_hold_big_integers(text):
        return _loads_json(text)
    return value


def dumps(value: Any, *, sendable: bool = False) -> str:
    """Compact JSON text of a value `loads` returned (or built of such values), as
    `json.dumps(value, separators=(",", ":"), ensure_ascii=False)` writes it. With
    `sendable`, what orjson refuses is written with ASCII escapes instead, so that a lone
    surrogate still encodes as UTF-8 (text going out on the wire)."""
    try:
        return orjson.dumps(value).decode()
    except TypeError:  # an integer past 64 bits, a lone surrogate, a key that is not a str
        return json.dumps(value, separators=(",", ":"), ensure_ascii=sendable)
