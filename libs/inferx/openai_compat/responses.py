"""OpenAI's Responses API (`POST /v1/responses`, the OpenAI Agents SDK's default model
class) as a chat call: the request is read into a `ChatCompletionRequest` (so a
Responses call is a model hop of its program exactly as a chat call is: the same
rendering, tool-call parsing, limits and scheduling), and the reply is written back as a
`response` object or its stream of events. Pure: dicts and pydantic models.

Stateless, as vLLM's server is without its store: the caller sends the whole
conversation as `input` (what the Agents SDK does by default); `previous_response_id`,
`conversation`, stored prompts and background responses are refused, never ignored.
"""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

from inferx.openai_compat.errors import InvalidField
from inferx.openai_compat.reasoning import Reasoning
from inferx.openai_compat.schema import (
    ChatCompletionRequest,
    ReplyItems,
    ReplyReader,
    _not_a_bool,
    _refuse,
    chat_request_from,
)
from inferx.openai_compat.toolcalls import Content, ToolCall

# Item kinds of `input` InferX reads (an item without a type but with a role is a message).
INPUT_ITEMS = ("message", "function_call", "function_call_output", "reasoning")
MESSAGE_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
# `include` values OpenAI defines. All but the log probabilities are vacuous here (InferX
# runs no built-in tools, and earlier reasoning is not sent back to the model, so
# `reasoning.encrypted_content` -- what stateless clients such as Codex ask for -- has
# nothing to carry): accepted. The log probabilities are refused.
INCLUDABLE = (
    "code_interpreter_call.outputs",
    "computer_call_output.output.image_url",
    "file_search_call.results",
    "message.input_image.image_url",
    "reasoning.encrypted_content",
    "web_search_call.action.sources",
    "web_search_call.results",
)
_STATELESS = "InferX keeps no responses: send the whole conversation as `input`"


class ResponsesRequest(BaseModel):
    """The body of `POST /v1/responses`. Fields OpenAI defines that change nothing here
    (`store`, `metadata`, `user`, `reasoning`, `service_tier`, `prompt_cache_key`,
    `safety_identifier`, `max_tool_calls`, `text.verbosity`, `stream_options`) are accepted;
    ones that ask for what InferX cannot give are a 400 naming them."""

    model_config = ConfigDict(extra="ignore")
    model: str = Field(min_length=1)
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: StrictBool | None = False
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    prompt: Any = None
    include: list[str] | None = None
    truncation: str | None = None
    background: StrictBool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @field_validator("max_output_tokens", "temperature", "top_p", "top_logprobs", mode="before")
    @classmethod
    def _numbers(cls, value: Any) -> Any:
        return _not_a_bool(value)

    @field_validator("previous_response_id", "conversation")
    @classmethod
    def _stateless(cls, value: Any) -> Any:
        return _refuse(value, lambda v: False, _STATELESS)

    @field_validator("prompt")
    @classmethod
    def _no_stored_prompt(cls, value: Any) -> Any:
        return _refuse(value, lambda v: False, "stored prompt templates; send `instructions` and `input`")

    @field_validator("include")
    @classmethod
    def _nothing_extra(cls, value: Any) -> Any:
        for index, name in enumerate(value or []):
            if name == "message.output_text.logprobs":
                raise ValueError(f"[{index}]: not supported: InferX's engines return no log probabilities")
            if name not in INCLUDABLE:
                raise ValueError(f"[{index}]: unknown value {name!r}")
        return value

    @field_validator("truncation")
    @classmethod
    def _no_truncation(cls, value: Any) -> Any:
        why = 'InferX does not drop input to fit the context (truncation must be "disabled")'
        return _refuse(value, lambda v: v == "disabled", why)

    @field_validator("background")
    @classmethod
    def _in_the_foreground(cls, value: Any) -> Any:
        return _refuse(value, lambda v: not v, f"background responses; {_STATELESS}")

    @field_validator("top_logprobs")
    @classmethod
    def _no_logprobs(cls, value: Any) -> Any:
        return _refuse(value, lambda v: not v, "InferX's engines return no log probabilities")

    def chat_request(self) -> ChatCompletionRequest:
        """The same call as a chat completion; InvalidField naming this API's fields."""
        chat = {
            "model": self.model,
            "messages": _messages(self.instructions, self.input),
            "stream": self.stream,
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "tools": _chat_tools(self.tools) if self.tools is not None else None,
            "tool_choice": _chat_tool_choice(self.tool_choice),
            "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": _response_format(self.text),
        }
        return chat_request_from(
            chat, {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}
        )


def _text(value: Any, param: str) -> str:
    """A content field as one string: a string, or a list of text parts joined."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise InvalidField(param, "expected a string or a list of text parts")
    texts = []
    for index, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        text = part.get("refusal" if kind == "refusal" else "text") if isinstance(part, dict) else None
        if kind not in (*TEXT_PARTS, "refusal") or not isinstance(text, str):
            shown = kind if kind is not None else type(part).__name__
            raise InvalidField(
                f"{param}[{index}]", f"{shown!r}: only text parts ({', '.join(TEXT_PARTS)}) are supported"
            )
        texts.append(text)
    return "".join(texts)


def _string(item: dict[str, Any], key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (not value and key != "arguments"):
        raise InvalidField(f"{param}.{key}", "expected a non-empty string")
    return value


def _messages(instructions: str | None, given: str | list[Any]) -> list[dict[str, Any]]:
    """`instructions` and `input` as chat messages: an item per message, a model's
    function calls folded into its assistant turn (as chat templates render them, so an
    agent loop's prompts extend each other and hit the prefix cache), their outputs as
    `tool` messages, earlier reasoning left out (chat templates drop it too)."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(given, str):
        return [*messages, {"role": "user", "content": given}]
    for index, item in enumerate(given):
        param = f"input[{index}]"
        if not isinstance(item, dict):
            raise InvalidField(param, f"expected an object, got {type(item).__name__}")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in MESSAGE_ROLES:
                raise InvalidField(
                    f"{param}.role", f"expected one of {', '.join(MESSAGE_ROLES)}, got {role!r}"
                )
            messages.append({"role": role, "content": _text(item.get("content"), f"{param}.content")})
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", param),
                "type": "function",
                "function": {
                    "name": _string(item, "name", param),
                    "arguments": _string(item, "arguments", param),
                },
            }
            turn = messages[-1] if messages else None
            if turn is None or turn["role"] != "assistant":
                turn = {"role": "assistant", "content": None}
                messages.append(turn)
            turn.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", param)
            output = _text(item.get("output"), f"{param}.output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind != "reasoning":
            raise InvalidField(f"{param}.type", f"expected one of {', '.join(INPUT_ITEMS)}, got {kind!r}")
    if not messages:
        raise InvalidField("input", "no message")
    return messages


def _chat_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """Responses' flat function tools as chat tools; other kinds are refused."""
    chat = []
    for index, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise InvalidField(f"tools[{index}].type", f'{kind!r}: only "function" tools are supported')
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidField(f"tools[{index}].name", "expected a non-empty string")
        function = {
            key: tool[key]
            for key in ("name", "description", "parameters", "strict")
            if tool.get(key) is not None
        }
        chat.append({"type": "function", "function": function})
    return chat


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    name = choice.get("name")
    if choice.get("type") != "function" or not isinstance(name, str) or not name:
        raise InvalidField(
            "tool_choice", 'expected "auto", "none", "required" or {"type": "function", "name": "..."}'
        )
    return {"type": "function", "function": {"name": name}}


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as a chat `response_format` (None: free text)."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_schema":
        assert isinstance(fmt, dict)
        spec = {key: fmt[key] for key in ("name", "schema", "strict", "description") if key in fmt}
        return {"type": "json_schema", "json_schema": spec}
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise InvalidField("text.format.type", f"expected one of text, json_object, json_schema, got {kind!r}")


# ----- the reply ---------------------------------------------------------------------------


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """`usage` as the Responses API words it (cache writes are not counted: 0)."""
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
        "output_tokens": completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + completion_tokens,
    }


class ResponseWriter(ReplyItems):
    """One call's `response` object, built from what its `ReplyReader` reads, and the
    events of its stream on the way (OpenAI's order: `response.created` and
    `.in_progress`; per output item `output_item.added`, its content part's or
    arguments' deltas and `.done`s, `output_item.done`; then `response.completed`, or
    `response.incomplete` when the reply hit max_output_tokens). A non-streamed call
    builds the same items and keeps only the object."""

    def __init__(self, response_id: str, created: int, ask: ResponsesRequest) -> None:
        self.response_id = response_id
        self._created = created
        self._ask = ask
        self._items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the message or reasoning item text goes to
        self._sequence = 0

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def response(self, status: str, usage: dict[str, Any] | None = None, reason: str = "") -> dict[str, Any]:
        ask = self._ask
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self._created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": ask.instructions,
            "max_output_tokens": ask.max_output_tokens,
            "model": ask.model,
            "output": [dict(item) for item in self._items],
            "parallel_tool_calls": ask.parallel_tool_calls is not False,
            "previous_response_id": None,
            "temperature": 1.0 if ask.temperature is None else ask.temperature,
            "top_p": 1.0 if ask.top_p is None else ask.top_p,
            "tool_choice": ask.tool_choice if ask.tool_choice is not None else "auto",
            "tools": ask.tools or [],
            "text": {"format": (ask.text or {}).get("format") or {"type": "text"}},
            "truncation": "disabled",
            "store": False,
            "background": False,
            "metadata": ask.metadata or {},
            "usage": usage,
        }

    def start(self) -> list[dict[str, Any]]:
        snapshot = self.response("in_progress")
        return [
            self._event("response.created", response=snapshot),
            self._event("response.in_progress", response=snapshot),
        ]

    def end(self, engine_reason: str, usage: dict[str, Any]) -> list[dict[str, Any]]:
        """The events that close the stream, once the reader has finished."""
        status = "incomplete" if engine_reason == "length" else "completed"
        closing = self._close()
        return [*closing, self._event(f"response.{status}", response=self.response(status, usage))]

    def whole(self, reader: ReplyReader, engine_reason: str, usage: dict[str, Any]) -> dict[str, Any]:
        """The object of a call whose reader read the reply to its end (not streamed)."""
        self.events(reader.read())
        self.end(engine_reason, usage)
        return self.response("incomplete" if engine_reason == "length" else "completed", usage)

    # ----- items ---------------------------------------------------------------------------

    def _text(self, event: Content | Reasoning) -> list[dict[str, Any]]:
        kind = "message" if isinstance(event, Content) else "reasoning"
        out: list[dict[str, Any]] = []
        if self._open is None or self._open["type"] != kind:
            out += self._close()
            out += self._open_item(kind)
        assert self._open is not None
        self._open["_text"].append(event.text)
        delta = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
        out.append(self._event(delta, **self._where(), delta=event.text, **extra))
        return out

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": self._open["_index"], "content_index": 0}

    def _open_item(self, kind: str) -> list[dict[str, Any]]:
        index = len(self._items)
        if kind == "message":
            item = {
                "id": _new_id("msg"),
                "type": "message",
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
        else:
            item = {"id": _new_id("rs"), "type": "reasoning", "summary": [], "content": []}
        self._items.append(item)
        self._open = {"id": item["id"], "type": kind, "_index": index, "_text": []}
        part = _part(kind, "")
        return [
            self._event("response.output_item.added", output_index=index, item=dict(item)),
            self._event("response.content_part.added", **self._where(), part=part),
        ]

    def _close(self) -> list[dict[str, Any]]:
        """The events that end the open text item, its text whole in the item."""
        if self._open is None:
            return []
        where, kind, text = self._where(), self._open["type"], "".join(self._open["_text"])
        item = self._items[self._open["_index"]]
        item["content"] = [_part(kind, text)]
        if kind == "message":
            item["status"] = "completed"
            done = self._event("response.output_text.done", **where, text=text, logprobs=[])
        else:
            done = self._event("response.reasoning_text.done", **where, text=text)
        self._open = None
        return [
            done,
            self._event("response.content_part.done", **where, part=_part(kind, text)),
            self._event("response.output_item.done", output_index=where["output_index"], item=dict(item)),
        ]

    def _call(self, call: ToolCall) -> list[dict[str, Any]]:
        index = len(self._items)
        item = {
            "id": _new_id("fc"),
            "type": "function_call",
            "status": "in_progress",
            "call_id": call.id,
            "name": call.name,
            "arguments": "",
        }
        added = self._event("response.output_item.added", output_index=index, item=dict(item))
        item.update(status="completed", arguments=call.arguments)
        self._items.append(item)
        where = {"item_id": item["id"], "output_index": index}
        return [
            added,
            self._event("response.function_call_arguments.delta", **where, delta=call.arguments),
            self._event(
                "response.function_call_arguments.done", **where, name=call.name, arguments=call.arguments
            ),
            self._event("response.output_item.done", output_index=index, item=dict(item)),
        ]

    def failed(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        """The stream's last event when the call fails after it started (`body`: OpenAI's
        error body, `{"error": {"message", "type", "param", "code"}}`)."""
        error = body["error"]
        return [
            self._event(
                "error", code=error.get("code"), message=error.get("message"), param=error.get("param")
            )
        ]


def _part(kind: str, text: str) -> dict[str, Any]:
    if kind == "message":
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "reasoning_text", "text": text}
