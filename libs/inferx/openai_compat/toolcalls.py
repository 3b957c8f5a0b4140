"""Tool calls out of a model's text, in the format its chat template asks for. Three
formats, named as vLLM's `--tool-call-parser` names them:

`hermes` (Qwen2.5, Hermes, the generated tiny model): blocks anywhere in the reply,

    Let me look that up.
    <tool_call>
    {"name": "lookup_order", "arguments": {"order_id": "7"}}
    </tool_call>

`llama3_json` (Llama 3.1-3.3, Llama 4's JSON mode): the whole reply is the calls, JSON
objects separated by `;` (or whitespace), optionally after `<|python_tag|>`:

    <|python_tag|>{"name": "lookup_order", "parameters": {"order_id": "7"}}; {"name": ...}

`mistral`: content, then `[TOOL_CALLS]` and the calls, as a JSON list (before v11
tokenizers) or as `name[ARGS]{...}` (v11 and later; `name{...}` is read too), the
marker repeated before each further call:

    [TOOL_CALLS][{"name": "lookup_order", "arguments": {"order_id": "7"}}]
    [TOOL_CALLS]lookup_order[ARGS]{"order_id": "7"}[TOOL_CALLS]track[ARGS]{"id": "T"}

A call is a JSON object with a non-empty string `name` and object `arguments` (or a
JSON string of one; `parameters` is read as `arguments`; none is `{}`); it becomes an
OpenAI tool call (an id, type "function", the name, the arguments as a JSON string).
The text around the calls is the message content (None when only whitespace is left).
What does not read as calls stays in the content as the model wrote it, markers
included: garbage never fails a call. Where vLLM's parsers differ: its llama3_json
parser (whole replies) picks JSON objects out of surrounding prose, and its mistral
parser drops text after the calls and skips list entries that are not calls; here
a llama3_json reply is calls only when it is nothing but calls (as vLLM's streaming
reads it), a Mistral section is calls only when every entry is one, and text after
a Mistral call stays content.

One state machine per format serves both replies: `feed` takes the text piece by piece
(as a stream brings it) and gives back what can be told so far, content and whole tool
calls; `finish` gives the rest. Whatever the pieces, the content joined and the calls
are those of `split_tool_calls` on the whole text (tests/unit/test_tool_calls.py checks
it with hypothesis for every format). Content is held back only while it may still turn
out to be calls (a partial marker; a Hermes block; a Mistral section; a llama3_json
reply that begins like calls, until its end or until it cannot be calls) and when it is
whitespace that a tool call may follow. Pure code: no I/O.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

HERMES, LLAMA3_JSON, MISTRAL = "hermes", "llama3_json", "mistral"
FORMATS = (HERMES, LLAMA3_JSON, MISTRAL)
# A model whose template says nothing about tool calls (and no operator's choice): the
# format InferX's generic rendering and most open models use.
DEFAULT_FORMAT = HERMES

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"

_DECODER = json.JSONDecoder()
_MISTRAL_NAME = re.compile(r"[A-Za-z0-9_.:-]+")


def check_format(name: str) -> str:
    """`name` when it is a known format; ValueError naming the known ones otherwise."""
    if name not in FORMATS:
        raise ValueError(f"unknown tool-call format {name!r}: expected one of {', '.join(FORMATS)}")
    return name


def detect_format(template: str | None) -> str | None:
    """The format a chat template asks its model to write calls in, None when it does
    not say (no template, or one without tools)."""
    if not template:
        return None
    if OPEN in template:
        return HERMES
    if TOOL_CALLS in template:
        return MISTRAL
    if PYTHON_TAG in template or "ipython" in template:  # Llama 3's tool-result role
        return LLAMA3_JSON
    return None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    index: int  # its place among the reply's tool calls (OpenAI's stream index)
    id: str
    name: str
    arguments: str  # a JSON object, as text

    def as_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class Content:
    text: str


Event = Content | ToolCall


def _arguments_json(arguments: Any) -> str | None:
    """Arguments (an object, or the JSON text of one) as JSON text; None otherwise."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    try:
        return json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except ValueError:  # NaN or Infinity: not JSON
        return None


def call_of(value: Any) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a decoded call object, None when it is not one."""
    if not isinstance(value, dict):
        return None
    name = value.get("name")
    if not isinstance(name, str) or not name.strip():
        return None
    arguments = _arguments_json(value.get("arguments", value.get("parameters", {})))
    return None if arguments is None else (name, arguments)


def parse_block(inner: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a Hermes block's inside, None when it is not a call."""
    try:
        value = json.loads(inner)
    except (ValueError, RecursionError):
        return None
    return call_of(value)


def _decode(text: str, start: int) -> tuple[Any, int] | None:
    """The JSON value at `start` and where it ends; None when there is none (yet)."""
    try:
        return _DECODER.raw_decode(text, start)
    except (ValueError, RecursionError):
        return None


def _partial(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (and may finish it)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ToolCallParser:
    """What every format shares: content's whitespace beside calls, call numbering.
    A format's subclass implements `_drain`."""

    format = ""

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        self._new_id = new_id
        self._buffer = ""  # text not decided yet
        self._whitespace = ""  # trailing whitespace of the content so far, not sent yet
        self._after_call = False  # the last thing decided was a tool call
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        out: list[Event] = []
        self._drain(out, final=False)
        return out

    def finish(self) -> list[Event]:
        """The rest, once the text has ended."""
        out: list[Event] = []
        self._drain(out, final=True)
        if self._whitespace and not self._after_call:
            out.append(Content(self._whitespace))
        self._whitespace = ""
        return out

    def _drain(self, out: list[Event], *, final: bool) -> None:
        raise NotImplementedError

    def _text(self, text: str, out: list[Event]) -> None:
        if not text:
            return
        text = self._whitespace + text
        body = text.rstrip()
        self._whitespace = text[len(body) :]
        if body:
            out.append(Content(body))
            self._after_call = False

    def _call(self, name: str, arguments: str, out: list[Event]) -> None:
        self._whitespace = ""  # whitespace between content and a call is not content
        call = ToolCall(len(self.calls), self._new_id(), name, arguments)
        self.calls.append(call)
        out.append(call)
        self._after_call = True


class HermesParser(ToolCallParser):
    """`<tool_call>{...}</tool_call>` blocks anywhere; a block the text ends in before
    its `</tool_call>` is read the same way."""

    format = HERMES

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(new_id)
        self._in_block = False  # the buffer is a block's inside so far

    def _drain(self, out: list[Event], *, final: bool) -> None:
        while True:
            if self._in_block:
                end = self._buffer.find(CLOSE)
                if end < 0 and not final:
                    return
                inner = self._buffer if end < 0 else self._buffer[:end]
                raw = OPEN + inner + ("" if end < 0 else CLOSE)
                self._buffer = "" if end < 0 else self._buffer[end + len(CLOSE) :]
                self._in_block = False
                parsed = parse_block(inner)
                if parsed is None:
                    self._text(raw, out)
                else:
                    self._call(*parsed, out)
                continue
            start = self._buffer.find(OPEN)
            if start >= 0:
                self._text(self._buffer[:start], out)
                self._buffer = self._buffer[start + len(OPEN) :]
                self._in_block = True
                continue
            keep = 0 if final else _partial(self._buffer, OPEN)
            self._text(self._buffer[: len(self._buffer) - keep], out)
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return


_MAYBE = "maybe"  # a llama3_json reply so far that may still turn out to be calls


def _llama_calls(text: str, *, final: bool) -> list[tuple[str, str]] | None | str:
    """The calls a llama3_json reply is (None: it is not calls). Before the reply has
    ended, _MAYBE while it may still be: only a whole JSON object that is not a call, or
    a character after one that is no separator, says no early (a whole object is the
    same object whatever follows it)."""
    text = text.lstrip()
    pos = len(PYTHON_TAG) if text.startswith(PYTHON_TAG) else 0
    calls: list[tuple[str, str]] = []
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos == len(text):
            return (calls or None) if final else _MAYBE
        if text[pos] != "{":
            return None
        decoded = _decode(text, pos)
        if decoded is None:
            return None if final else _MAYBE
        call = call_of(decoded[0])
        if call is None:
            return None
        calls.append(call)
        pos = decoded[1]
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos < len(text) and text[pos] == ";":
            pos += 1
        elif pos < len(text) and text[pos] != "{":
            return None


class Llama3JsonParser(ToolCallParser):
    """A reply that is nothing but calls (see the module's docstring). A reply that
    starts otherwise streams as content at once; one that starts like calls is held
    until it ends or cannot be calls."""

    format = LLAMA3_JSON

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(new_id)
        self._state = "start"  # start (undecided) | calls (may be calls) | content

    def _drain(self, out: list[Event], *, final: bool) -> None:
        if self._state == "start":
            head = self._buffer.lstrip()
            if head.startswith(("{", PYTHON_TAG)):
                self._state = "calls"
            elif final or (head and not PYTHON_TAG.startswith(head)):
                self._state = "content"
            else:
                return  # only whitespace, or a partial <|python_tag|>, so far
        if self._state == "calls":
            calls = _llama_calls(self._buffer, final=final)
            if calls == _MAYBE:
                return
            if isinstance(calls, list):
                for call in calls:
                    self._call(*call, out)
                self._buffer = ""
                return
            self._state = "content"
        self._text(self._buffer, out)
        self._buffer = ""


def _mistral_section(section: str) -> tuple[list[tuple[str, str]], str] | None:
    """The calls of what follows a reply's first [TOOL_CALLS], and the text after the
    last one; None when it is not all calls."""
    calls: list[tuple[str, str]] = []
    segments = section.split(TOOL_CALLS)
    rest = ""
    for index, segment in enumerate(segments):
        text = segment.lstrip()
        if text.startswith(("[", "{")):  # a JSON list of calls, or one call (before v11)
            decoded = _decode(text, 0)
            if decoded is None:
                return None
            value, end = decoded
            items = value if isinstance(value, list) else [value]
            found = [call_of(item) for item in items]
            if not found or any(call is None for call in found):
                return None
            calls += [call for call in found if call is not None]
        else:  # name[ARGS]{...}, or name{...} (v11 and later)
            name, marker, arguments = text.partition(ARGS)
            if not marker:
                brace = text.find("{")
                if brace < 0:
                    return None
                name, arguments = text[:brace], text[brace:]
            name, arguments = name.strip(), arguments.lstrip()
            decoded = _decode(arguments, 0) if arguments.startswith("{") else None
            if not _MISTRAL_NAME.fullmatch(name) or decoded is None:
                return None
            parsed = _arguments_json(decoded[0])
            if parsed is None:
                return None
            calls.append((name, parsed))
            text, end = arguments, decoded[1]
        rest = text[end:]
        if rest.strip() and index < len(segments) - 1:
            return None  # text between calls: not the format
    return calls, rest


class MistralParser(ToolCallParser):
    """Content, then from the first [TOOL_CALLS] on, calls (held until the reply ends)."""

    format = MISTRAL

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(new_id)
        self._in_calls = False  # the buffer is what follows [TOOL_CALLS] so far

    def _drain(self, out: list[Event], *, final: bool) -> None:
        if not self._in_calls:
            start = self._buffer.find(TOOL_CALLS)
            if start < 0:
                keep = 0 if final else _partial(self._buffer, TOOL_CALLS)
                self._text(self._buffer[: len(self._buffer) - keep], out)
                self._buffer = self._buffer[len(self._buffer) - keep :]
                return
            self._text(self._buffer[:start], out)
            self._buffer = self._buffer[start + len(TOOL_CALLS) :]
            self._in_calls = True
        if not final:
            return
        section, self._buffer = self._buffer, ""
        parsed = _mistral_section(section)
        if parsed is None:
            self._text(TOOL_CALLS + section, out)
            return
        calls, rest = parsed
        for call in calls:
            self._call(*call, out)
        self._text(rest, out)


_PARSERS: dict[str, type[ToolCallParser]] = {
    HERMES: HermesParser,
    LLAMA3_JSON: Llama3JsonParser,
    MISTRAL: MistralParser,
}


def parser_for(format_: str = DEFAULT_FORMAT, new_id: Callable[[], str] = new_call_id) -> ToolCallParser:
    """A fresh parser for one reply in `format_` (ValueError for an unknown one)."""
    return _PARSERS[check_format(format_)](new_id)


def split_tool_calls(
    text: str, new_id: Callable[[], str] = new_call_id, format_: str = DEFAULT_FORMAT
) -> tuple[str | None, list[ToolCall]]:
    """The content (None when nothing but whitespace is left beside tool calls) and the
    tool calls of a whole reply."""
    parser = parser_for(format_, new_id)
    events = parser.feed(text) + parser.finish()
    content = "".join(event.text for event in events if isinstance(event, Content))
    if parser.calls and not content.strip():
        return None, parser.calls
    return content, parser.calls
