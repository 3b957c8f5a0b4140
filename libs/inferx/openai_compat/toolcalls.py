"""Tool calls out of a model's text: Hermes/Qwen-style blocks, as the templates of Qwen2.5,
Hermes and the generated tiny model ask the model to write them:

    Let me look that up.
    <tool_call>
    {"name": "lookup_order", "arguments": {"order_id": "7"}}
    </tool_call>

Each well-formed block becomes an OpenAI tool call (an id, type "function", the name,
the arguments as a JSON string); the text around the blocks is the message content
(None when only whitespace is left). A block that is not a JSON object with a string
`name` and an object `arguments` (or a JSON string of one; `parameters` is read as
`arguments`; none is `{}`) stays in the content as the model wrote it: garbage never
fails a call. A block the text ends in before its `</tool_call>` is read the same way.

One state machine serves both replies: `ToolCallParser.feed` takes the text piece by
piece (as a stream brings it) and gives back what can be told so far, content and whole
tool calls; `finish` gives the rest. Whatever the pieces, the content joined and the
calls are those of `split_tool_calls` on the whole text (tests/unit/test_tool_calls.py
checks it with hypothesis). Content is held back only while it may still turn out to
be a block (a partial `<tool_call>` tag, the inside of a block) and when it is
whitespace that a tool call may follow.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"


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


def parse_block(inner: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a block's inside, None when it is not a call."""
    try:
        value = json.loads(inner)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict):
        return None
    name = value.get("name")
    if not isinstance(name, str) or not name.strip():
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    try:
        return name, json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except ValueError:  # NaN or Infinity: not JSON
        return None


def _partial_open(text: str) -> int:
    """Length of the longest end of `text` that begins `<tool_call>` (and may finish it)."""
    for size in range(min(len(text), len(OPEN) - 1), 0, -1):
        if OPEN.startswith(text[-size:]):
            return size
    return 0


class ToolCallParser:
    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        self._new_id = new_id
        self._buffer = ""  # text not looked at yet (outside a block), or the block's inside so far
        self._in_block = False
        self._whitespace = ""  # trailing whitespace of the content so far, not sent yet
        self._after_call = False  # the last thing decided was a tool call
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        return self._drain(final=False)

    def finish(self) -> list[Event]:
        """The rest, once the text has ended."""
        return self._drain(final=True)

    def _drain(self, *, final: bool) -> list[Event]:
        out: list[Event] = []
        while True:
            if self._in_block:
                end = self._buffer.find(CLOSE)
                if end < 0 and not final:
                    break
                inner = self._buffer if end < 0 else self._buffer[:end]
                raw = OPEN + inner + ("" if end < 0 else CLOSE)
                self._buffer = "" if end < 0 else self._buffer[end + len(CLOSE) :]
                self._in_block = False
                self._block(raw, inner, out)
                continue
            start = self._buffer.find(OPEN)
            if start >= 0:
                self._text(self._buffer[:start], out)
                self._buffer = self._buffer[start + len(OPEN) :]
                self._in_block = True
                continue
            keep = 0 if final else _partial_open(self._buffer)
            self._text(self._buffer[: len(self._buffer) - keep], out)
            self._buffer = self._buffer[len(self._buffer) - keep :]
            break
        if final:
            if self._whitespace and not self._after_call:
                out.append(Content(self._whitespace))
            self._whitespace = ""
        return out

    def _text(self, text: str, out: list[Event]) -> None:
        if not text:
            return
        text = self._whitespace + text
        body = text.rstrip()
        self._whitespace = text[len(body) :]
        if body:
            out.append(Content(body))
            self._after_call = False

    def _block(self, raw: str, inner: str, out: list[Event]) -> None:
        parsed = parse_block(inner)
        if parsed is None:
            self._text(raw, out)
            return
        self._whitespace = ""  # whitespace between content and a call is not content
        call = ToolCall(len(self.calls), self._new_id(), *parsed)
        self.calls.append(call)
        out.append(call)
        self._after_call = True


def split_tool_calls(text: str, new_id: Callable[[], str] = new_call_id) -> tuple[str | None, list[ToolCall]]:
    """The content (None when nothing but whitespace is left beside tool calls) and the
    tool calls of a whole reply."""
    parser = ToolCallParser(new_id)
    events = parser.feed(text) + parser.finish()
    content = "".join(event.text for event in events if isinstance(event, Content))
    if parser.calls and not content.strip():
        return None, parser.calls
    return content, parser.calls
