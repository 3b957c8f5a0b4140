"""Tool calls out of a model's text, in the format its chat template asks for. Six
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

`pythonic` (Llama 3.2 and Llama 4 with vLLM's pythonic templates, ToolACE, Gemma 3's):
the whole reply is a Python list of calls with keyword arguments, optionally between
Llama 4's `<|python_start|>` and `<|python_end|>`. It is read with Python's `ast`
(never run): arguments must be literals (strings, numbers, True/False/None, lists,
tuples, dicts with string keys), which become JSON:

    [lookup_order(order_id="7"), track(id="T", urgent=True)]

`deepseek_v3` (DeepSeek-V3, R1): content, then the calls between DeepSeek's special
tokens (written here with ASCII `|` and `_` for U+FF5C and U+2581), each a type (always
`function`), the name, and the arguments in a JSON code fence:

    <|tool_calls_begin|><|tool_call_begin|>function<|tool_sep|>lookup_order
    ```json
    {"order_id": "7"}
    ```<|tool_call_end|><|tool_calls_end|>

`granite` (IBM Granite 3.x): content, then `<|tool_call|>` (Granite 3.0's token; the
later models' `<tool_call>` too) and a JSON list of calls; a reply that is a bare list
of calls (no marker) is read too:

    <|tool_call|>[{"name": "lookup_order", "arguments": {"order_id": "7"}}]

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
a Mistral call stays content. The same for the later three: text after DeepSeek's or
Granite's calls stays content (vLLM drops it, or reads no calls), a section with one
bad call is not calls, and a pythonic call with positional arguments (which vLLM
drops) is not a call.

One state machine per format serves both replies: `feed` takes the text piece by piece
(as a stream brings it) and gives back what can be told so far, content and whole tool
calls; `finish` gives the rest. Whatever the pieces, the content joined and the calls
are those of `split_tool_calls` on the whole text (tests/unit/test_tool_call_formats.py
checks it with hypothesis for every format). Content is held back only while it may
still turn out to be calls (a partial marker; a Hermes block; a Mistral section; a
DeepSeek section until its end marker; a Granite list until it closes; a llama3_json or
pythonic reply that begins like calls, until its end or until it cannot be calls) and
when it is whitespace that a tool call may follow. Pure code: no I/O.
"""

from __future__ import annotations

import ast
import json
import keyword as python_keyword
import re
import unicodedata
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

HERMES, LLAMA3_JSON, MISTRAL = "hermes", "llama3_json", "mistral"
PYTHONIC, DEEPSEEK_V3, GRANITE = "pythonic", "deepseek_v3", "granite"
FORMATS = (HERMES, LLAMA3_JSON, MISTRAL, PYTHONIC, DEEPSEEK_V3, GRANITE)
# A model whose template says nothing about tool calls (and no operator's choice): the
# format InferX's generic rendering and most open models use.
DEFAULT_FORMAT = HERMES

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
# DeepSeek's special tokens: fullwidth bars (U+FF5C) and lower blocks (U+2581) for spaces.
DS_CALLS_BEGIN = "<\uff5ctool\u2581calls\u2581begin\uff5c>"
DS_CALLS_END = "<\uff5ctool\u2581calls\u2581end\uff5c>"
DS_CALL_BEGIN = "<\uff5ctool\u2581call\u2581begin\uff5c>"
DS_CALL_END = "<\uff5ctool\u2581call\u2581end\uff5c>"
DS_SEP = "<\uff5ctool\u2581sep\uff5c>"
FENCE_JSON, FENCE = "```json", "```"
GRANITE_CALL = "<|tool_call|>"
GRANITE_MARKERS = (GRANITE_CALL, OPEN)  # Granite 3.0's token; the string Granite 3.1+ writes

_DECODER = json.JSONDecoder()
_NAME = re.compile(r"[A-Za-z0-9_.:-]+")  # a function name where the format delimits it by position


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
    # The pythonic templates (vLLM's for Llama 3.2 and 4, ToolACE's, Gemma 3's) show the
    # format in their instructions; they also use Llama's ipython role, so this comes first.
    if "[func_name1(" in template:
        return PYTHONIC
    if DS_CALLS_BEGIN in template and FENCE_JSON in template:  # V3.1's template has no fence
        return DEEPSEEK_V3
    if GRANITE_CALL in template and "<|start_of_role|>" in template:  # Granite's role marks
        return GRANITE
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


def partial_end(text: str, marker: str) -> int:
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
            keep = 0 if final else partial_end(self._buffer, OPEN)
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
            if not _NAME.fullmatch(name) or decoded is None:
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
                keep = 0 if final else partial_end(self._buffer, TOOL_CALLS)
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


# ----- pythonic ---------------------------------------------------------------------------


class _NotLiteral(Exception):
    pass


def _literal(node: ast.expr) -> Any:
    """The JSON value of a literal argument; _NotLiteral for anything else (a name, a call,
    an operation: model text is only ever read, never run)."""
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, str | int | float)):
        return node.value  # bool is an int; bytes, complex and ... are not JSON
    if (
        isinstance(node, ast.UnaryOp)
        and isinstance(node.op, ast.USub | ast.UAdd)
        and isinstance(node.operand, ast.Constant)
        and isinstance(node.operand.value, int | float)
        and not isinstance(node.operand.value, bool)
    ):  # -1 is an operation on 1 in Python's grammar
        return -node.operand.value if isinstance(node.op, ast.USub) else node.operand.value
    if isinstance(node, ast.List | ast.Tuple):
        return [_literal(element) for element in node.elts]
    if isinstance(node, ast.Dict):
        keys = [key.value if isinstance(key, ast.Constant) else None for key in node.keys]
        if not all(isinstance(key, str) for key in keys):  # None: a **spread
            raise _NotLiteral
        return {key: _literal(value) for key, value in zip(keys, node.values, strict=True)}
    raise _NotLiteral


def _pythonic_call(node: ast.expr) -> tuple[str, str] | None:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None  # positional arguments have no names to become JSON keys
    arguments: dict[str, Any] = {}
    for keyword in node.keywords:
        if keyword.arg is None or keyword.arg in arguments:  # **spread; a repeat (Python refuses it)
            return None
        try:
            arguments[keyword.arg] = _literal(keyword.value)
        except (_NotLiteral, RecursionError):
            return None
    encoded = _arguments_json(arguments)
    return None if encoded is None else (node.func.id, encoded)


def _pythonic_head(text: str) -> bool | str:
    """Whether a pythonic reply so far begins as calls do, `[name(` (after an optional
    <|python_start|>): True, False, or _MAYBE while it cannot tell yet. The whole reply
    must pass it too, so that a reply this turns down early is never calls at its end."""
    body = text.lstrip()
    if body.startswith(PYTHON_START):
        body = body[len(PYTHON_START) :].lstrip()
    if not body:
        return _MAYBE
    if body[0] != "[":
        return False
    rest = body[1:].lstrip()
    end = 0
    while end < len(rest) and (rest[end].isalnum() or rest[end] == "_"):
        end += 1
    if end and not rest[:end].isidentifier():
        return False
    after = rest[end:].lstrip()
    if not after:
        return _MAYBE
    return bool(end) and after[0] == "("


def _pythonic_calls(text: str) -> list[tuple[str, str]] | None:
    """The calls a whole pythonic reply is; None when it is not nothing but calls."""
    body = text.strip()
    body = body.removeprefix(PYTHON_START).removesuffix(PYTHON_END).strip()
    if _pythonic_head(body) is not True:
        return None
    try:
        with warnings.catch_warnings():  # an invalid escape in a string warns: not ours to say
            warnings.simplefilter("ignore")
            tree = ast.parse(body, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = [_pythonic_call(element) for element in tree.body.elts]
    return None if any(call is None for call in calls) else [call for call in calls if call is not None]


class PythonicParser(ToolCallParser):
    """A reply that is nothing but a Python list of calls. A reply that starts otherwise
    (or whose start cannot begin `[name(`) streams as content at once; one that starts
    like calls is held until it ends."""

    format = PYTHONIC

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(new_id)
        self._state = "start"  # start (undecided) | calls (may be calls) | content

    def _drain(self, out: list[Event], *, final: bool) -> None:
        if self._state == "start":
            head = self._buffer.lstrip()
            if head.startswith(("[", PYTHON_START)):
                self._state = "calls"
            elif final or (head and not PYTHON_START.startswith(head)):
                self._state = "content"
            else:
                return  # only whitespace, or a partial <|python_start|>, so far
        if self._state == "calls":
            if not final:
                if _pythonic_head(self._buffer) is not False:
                    return
            else:
                calls = _pythonic_calls(self._buffer)
                if calls is not None:
                    for call in calls:
                        self._call(*call, out)
                    self._buffer = ""
                    return
            self._state = "content"
        self._text(self._buffer, out)
        self._buffer = ""


# ----- DeepSeek-V3 --------------------------------------------------------------------------


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _expect(text: str, pos: int, token: str, *, final: bool) -> int | None | str:
    """Where `token` ends when the text at `pos` (after whitespace) is it; _MAYBE while
    the text ends in a part of it; None when it is not there."""
    pos = _skip_space(text, pos)
    if text.startswith(token, pos):
        return pos + len(token)
    return _MAYBE if not final and token.startswith(text[pos:]) else None


def _deepseek_call(text: str, pos: int, *, final: bool) -> tuple[tuple[str, str], int] | None | str:
    """One call after its <tool_call_begin> at `pos` (the type, <tool_sep>, the name, the
    fenced JSON arguments, <tool_call_end>) and where it ends; None when it is not one,
    _MAYBE while it may still be (it is decided only on text that is whole)."""
    sep = text.find(DS_SEP, pos)
    if sep < 0:
        return None if final else _MAYBE
    if text[pos:sep].strip() != "function":
        return None
    fence = text.find(FENCE_JSON, sep)
    if fence < 0:
        return None if final else _MAYBE
    name = text[sep + len(DS_SEP) : fence].strip()
    if not _NAME.fullmatch(name):
        return None
    start = _skip_space(text, fence + len(FENCE_JSON))
    if start == len(text):
        return None if final else _MAYBE
    if text[start] != "{":
        return None
    decoded = _decode(text, start)
    if decoded is None:
        return None if final else _MAYBE
    arguments = _arguments_json(decoded[0])
    if arguments is None:
        return None
    end = _expect(text, decoded[1], FENCE, final=final)
    if isinstance(end, int):
        end = _expect(text, end, DS_CALL_END, final=final)
    if not isinstance(end, int):
        return end
    return (name, arguments), end


def _deepseek_section(text: str, *, final: bool) -> tuple[list[tuple[str, str]], int] | None | str:
    """The calls of what follows <tool_calls_begin> and where the section ends (after its
    <tool_calls_end>, or at the reply's end); None when it is not all calls, _MAYBE
    while it may still be."""
    calls: list[tuple[str, str]] = []
    pos = 0
    while True:
        pos = _skip_space(text, pos)
        if text.startswith(DS_CALLS_END, pos):
            return (calls, pos + len(DS_CALLS_END)) if calls else None
        if text.startswith(DS_CALL_BEGIN, pos):
            parsed = _deepseek_call(text, pos + len(DS_CALL_BEGIN), final=final)
            if not isinstance(parsed, tuple):
                return parsed
            calls.append(parsed[0])
            pos = parsed[1]
            continue
        if final:  # a section the reply ends in, without its end marker
            return (calls, pos) if calls and pos == len(text) else None
        rest = text[pos:]
        return _MAYBE if DS_CALLS_END.startswith(rest) or DS_CALL_BEGIN.startswith(rest) else None


class DeepSeekV3Parser(ToolCallParser):
    """Content, then sections of calls from <tool_calls_begin> to <tool_calls_end>
    (held until they end). A section that is not all calls stays content, its begin
    marker and what follows read again as text."""

    format = DEEPSEEK_V3

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(new_id)
        self._in_calls = False  # the buffer is what follows <tool_calls_begin> so far

    def _drain(self, out: list[Event], *, final: bool) -> None:
        while True:
            if not self._in_calls:
                start = self._buffer.find(DS_CALLS_BEGIN)
                if start < 0:
                    keep = 0 if final else partial_end(self._buffer, DS_CALLS_BEGIN)
                    self._text(self._buffer[: len(self._buffer) - keep], out)
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return
                self._text(self._buffer[:start], out)
                self._buffer = self._buffer[start + len(DS_CALLS_BEGIN) :]
                self._in_calls = True
            parsed = _deepseek_section(self._buffer, final=final)
            if parsed == _MAYBE:
                return
            self._in_calls = False
            if not isinstance(parsed, tuple):
                self._text(DS_CALLS_BEGIN, out)
                continue
            calls, end = parsed
            for call in calls:
                self._call(*call, out)
            self._buffer = self._buffer[end:]


# ----- Granite ------------------------------------------------------------------------------


def _granite_list(text: str, *, final: bool) -> tuple[list[tuple[str, str]], int] | None | str:
    """The calls of the JSON list at the start of `text` (after whitespace) and where it
    ends; None when it is not a list of calls, _MAYBE until the list has closed."""
    pos = _skip_space(text, 0)
    if pos == len(text):
        return None if final else _MAYBE
    if text[pos] != "[":
        return None
    decoded = _decode(text, pos)
    if decoded is None:
        return None if final else _MAYBE
    calls = [call_of(item) for item in decoded[0]]
    if not calls or any(call is None for call in calls):
        return None
    return [call for call in calls if call is not None], decoded[1]


class GraniteParser(ToolCallParser):
    """Content, then a marker and a JSON list of calls (held until the list closes);
    text after the list is content again. A reply that starts (after whitespace) with
    `[` is read as a list of calls without a marker. A marker not followed by a list of
    calls stays content and the text after it is read again."""

    format = GRANITE

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(new_id)
        self._state = "start"  # start (undecided) | content | list (the buffer may be a list)
        self._marker = ""  # the marker before the list ("" for a reply that is a bare list)

    def _drain(self, out: list[Event], *, final: bool) -> None:
        if self._state == "start":
            head = self._buffer.lstrip()
            if head.startswith("["):
                self._state = "list"
            elif head or final:
                self._state = "content"
            else:
                return  # only whitespace so far
        while True:
            if self._state == "content":
                found = [(self._buffer.find(m), m) for m in GRANITE_MARKERS if m in self._buffer]
                if not found:
                    keep = 0 if final else max(partial_end(self._buffer, m) for m in GRANITE_MARKERS)
                    self._text(self._buffer[: len(self._buffer) - keep], out)
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return
                start, self._marker = min(found)
                self._text(self._buffer[:start], out)
                self._buffer = self._buffer[start + len(self._marker) :]
                self._state = "list"
            parsed = _granite_list(self._buffer, final=final)
            if parsed == _MAYBE:
                return
            self._state = "content"
            if not isinstance(parsed, tuple):
                self._text(self._marker, out)
                continue
            calls, end = parsed
            for call in calls:
                self._call(*call, out)
            self._buffer = self._buffer[end:]


_PARSERS: dict[str, type[ToolCallParser]] = {
    HERMES: HermesParser,
    LLAMA3_JSON: Llama3JsonParser,
    MISTRAL: MistralParser,
    PYTHONIC: PythonicParser,
    DEEPSEEK_V3: DeepSeekV3Parser,
    GRANITE: GraniteParser,
}


def parser_for(format_: str = DEFAULT_FORMAT, new_id: Callable[[], str] = new_call_id) -> ToolCallParser:
    """A fresh parser for one reply in `format_` (ValueError for an unknown one)."""
    return _PARSERS[check_format(format_)](new_id)


def _python_literal(value: Any) -> str:
    """A JSON value as the Python literal a pythonic call writes (read back by `_literal`)."""
    if isinstance(value, dict):
        return (
            "{"
            + ", ".join(
                f"{json.dumps(k, ensure_ascii=False)}: {_python_literal(v)}" for k, v in value.items()
            )
            + "}"
        )
    if isinstance(value, list):
        return "[" + ", ".join(_python_literal(v) for v in value) + "]"
    if value is None or isinstance(value, bool):
        return repr(value)
    return json.dumps(value, ensure_ascii=False)  # strings' JSON escapes are Python's too


def _python_name(name: str) -> bool:
    # Python reads identifiers NFKC-normalised (`\ufb01nd` is `find`): a name that changes
    # would read back as a call the server never made.
    return (
        name.isidentifier()
        and not python_keyword.iskeyword(name)
        and unicodedata.normalize("NFKC", name) == name
    )


class ToolCallWriter:
    """Tool calls as a model writing `format_` writes them: text its parser reads back as
    the same calls (name and arguments; the parser gives its own ids). For a server that
    has read the calls out of its model's text and sends them apart (the `openai` engine
    on /v1/chat/completions), so that what follows reads them as every engine's.

    `call` gives the next call's text, `close` what ends the calls written so far (a
    DeepSeek section's end marker, the `]` of a Granite or pythonic list; "" for the
    formats without one), to be written before content that follows calls and at the
    reply's end. `arguments` is a JSON object's text ("" is `{}`). A call the format
    cannot spell -- arguments that are not a JSON object; in pythonic, a name or key
    that is not a Python identifier; in deepseek_v3, a name the format cannot delimit;
    in granite, a blank name -- is written so that no parser takes it for a call: it
    stays content rather than becoming a call the server never made. In deepseek_v3 and
    granite it gets a section of its own (its parser refuses a whole section for one such
    call), written in ASCII, so nothing in it reads as a marker when its text is read
    again. Markers inside JSON strings are written with JSON's escapes, so they cannot
    end a call early.
    As in the model's own text, llama3_json and pythonic replies are calls only when
    they are nothing but calls (content beside them reads as content there)."""

    def __init__(self, format_: str = DEFAULT_FORMAT) -> None:
        self.format = check_format(format_)
        self._written = 0  # calls written
        self._open = False  # a section or list is open
        self._ascii = False  # writing a call its parser refuses (see `call`)

    def call(self, name: str, arguments: str) -> str:
        try:
            value: Any = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError):
            value = None
        spelled = isinstance(value, dict)
        if not spelled:
            value = arguments  # a JSON string where an object belongs: no parser's call
        if (
            not self._ascii
            and self.format in (DEEPSEEK_V3, GRANITE)
            and not (spelled and (_NAME.fullmatch(name) if self.format == DEEPSEEK_V3 else name.strip()))
        ):
            # Its parser refuses a section with one call it cannot read, and reads what was
            # inside again as text: such a call gets a section of its own (the server's
            # other calls stay calls), in ASCII, so no DeepSeek marker is left in it to read.
            before = self.close()
            self._open, self._ascii = False, True
            try:
                return before + self.call(name, arguments) + self.close()
            finally:
                self._ascii = False
        first, self._written = not self._open, self._written + 1
        self._open = self.format in (PYTHONIC, DEEPSEEK_V3, GRANITE)
        if self.format == PYTHONIC:
            head = "[" if first else ", "
            if spelled and _python_name(name) and all(_python_name(key) for key in value):
                try:
                    keywords = ", ".join(f"{key}={_python_literal(v)}" for key, v in value.items())
                    return f"{head}{name}({keywords})"
                except RecursionError:  # nested deeper than Python's parser reads anyway
                    pass
            return f"{head}{name}({json.dumps(arguments)})"  # positional, or no Python: never a call
        if self.format == DEEPSEEK_V3:
            head = DS_CALLS_BEGIN if first else ""
            body = json.dumps(value, ensure_ascii=self._ascii)
            if self._ascii:  # a name that is no name here: quoted, so nothing in it is a marker
                name = json.dumps(name)
            return f"{head}{DS_CALL_BEGIN}function{DS_SEP}{name}\n{FENCE_JSON}\n{body}\n{FENCE}{DS_CALL_END}"
        if self.format == LLAMA3_JSON:
            separator = "; " if self._written > 1 else ""
            return separator + json.dumps({"name": name, "parameters": value}, ensure_ascii=False)
        call = json.dumps({"name": name, "arguments": value}, ensure_ascii=False)
        if self.format == GRANITE:
            return f"{GRANITE_CALL}[{call}" if first else f", {call}"
        if self.format == MISTRAL:  # the JSON form: a name of any spelling reads back
            return TOOL_CALLS + "[" + call.replace(TOOL_CALLS, "\\u005b" + TOOL_CALLS[1:]) + "]"
        escaped = call.replace("</", "<\\/")
        return f"\n{OPEN}\n{escaped}\n{CLOSE}"  # Hermes; whitespace before a call is not content

    def close(self) -> str:
        if not self._open:
            return ""
        self._open = False
        return DS_CALLS_END if self.format == DEEPSEEK_V3 else "]"


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
