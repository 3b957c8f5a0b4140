"""Anthropic's Messages API (`POST /v1/messages`: Claude Code, the Claude Agent SDK and
the `anthropic` SDKs pointed at InferX with ANTHROPIC_BASE_URL) as a chat call, as
vLLM's server reads it: the request is read into a `ChatCompletionRequest` (so a
Messages call is a model hop of its program exactly as a chat call is: the same
rendering, tool-call parsing, limits and scheduling), and the reply is written back as
a `message` or its stream of events. Pure: dicts and pydantic models.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

from inferx.openai_compat.errors import ErrorReply, InvalidField
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

ROLES = ("user", "assistant")
# Claude Code starts its system prompt with a block holding a per-request hash, which
# would make every call's prompt differ from its first tokens on (no prefix cache hit);
# vLLM's server drops it too.
BILLING_HEADER = "x-anthropic-billing-header"
# Blocks that hold an earlier reply's thinking: left out of the chat, as chat templates
# leave out earlier reasoning.
THINKING_BLOCKS = ("thinking", "redacted_thinking")
# Kinds of part in a tool result that are not text (see _tool_result_text).
NON_TEXT_RESULTS = ("image", "document")

# Anthropic's error types by HTTP status (what its SDKs read; anything else: api_error).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


class MessagesRequest(BaseModel):
    """The body of `POST /v1/messages`. Fields that change nothing here (`metadata`,
    `service_tier`, `cache_control` on blocks, `thinking`, `output_config.effort`) are
    accepted; ones that ask for what InferX cannot give are a 400 naming them."""

    model_config = ConfigDict(extra="ignore")
    model: str = Field(min_length=1)
    messages: list[Any] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[Any] | None = None
    stop_sequences: list[str] | None = None
    stream: StrictBool | None = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    mcp_servers: list[Any] | None = None
    container: Any = None

    @field_validator("max_tokens", "temperature", "top_p", "top_k", mode="before")
    @classmethod
    def _numbers(cls, value: Any) -> Any:
        return _not_a_bool(value)

    @field_validator("top_k")
    @classmethod
    def _no_top_k(cls, value: Any) -> Any:
        return _refuse(value, lambda v: False, "InferX's engines sample with temperature and top_p only")

    @field_validator("mcp_servers")
    @classmethod
    def _no_mcp(cls, value: Any) -> Any:
        return _refuse(value, lambda v: not v, "MCP servers run by the API; give their tools as `tools`")

    @field_validator("container")
    @classmethod
    def _no_container(cls, value: Any) -> Any:
        return _refuse(value, lambda v: False, "containers for server tools")

    def chat_request(self) -> ChatCompletionRequest:
        """The same call as a chat completion; InvalidField naming this API's fields."""
        one_call = (self.tool_choice or {}).get("disable_parallel_tool_use") is True
        chat = {
            "model": self.model,
            "messages": _messages(self.system, self.messages),
            "max_tokens": self.max_tokens,
            "stream": self.stream,
            "stop": self.stop_sequences,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "tools": _chat_tools(self.tools) if self.tools is not None else None,
            "tool_choice": _chat_tool_choice(self.tool_choice),
            "parallel_tool_calls": False if one_call else None,
            "response_format": _response_format(self.output_config),
        }
        return chat_request_from(
            chat,
            {"messages": "messages", "stop": "stop_sequences", "response_format": "output_config.format"},
        )


def _blocks(value: Any, param: str) -> list[dict[str, Any]]:
    """A content field as a list of blocks (a string is one text block)."""
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if not isinstance(value, list):
        raise InvalidField(param, "expected a string or a list of content blocks")
    for index, block in enumerate(value):
        if not isinstance(block, dict):
            raise InvalidField(f"{param}[{index}]", f"expected a content block, got {type(block).__name__}")
    return value


def _text_of(block: dict[str, Any], param: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise InvalidField(f"{param}.text", "expected a string")
    return text


def _system(system: str | list[Any] | None) -> str:
    """The system prompt: a string, or text blocks joined (Claude Code's billing
    header block left out: see BILLING_HEADER)."""
    texts = []
    for index, block in enumerate(_blocks(system, "system") if system is not None else []):
        if block.get("type") != "text":
            raise InvalidField(f"system[{index}].type", f"expected 'text', got {block.get('type')!r}")
        text = _text_of(block, f"system[{index}]")
        if not text.startswith(BILLING_HEADER):
            texts.append(text)
    return "".join(texts)


def _tool_result_text(block: dict[str, Any], param: str) -> str:
    """A tool result's text. An image or document in it (Claude Code's Read of a picture)
    becomes a line saying one was left out: the client put it there, not the user, and
    it stays in every later call of the session, so refusing it would refuse the whole
    session from then on."""
    content = block.get("content")
    if content is None:
        return ""
    texts = []
    for index, part in enumerate(_blocks(content, f"{param}.content")):
        kind = part.get("type")
        if kind in NON_TEXT_RESULTS:
            texts.append(f"[{kind} left out: this model reads text only]")
            continue
        if kind != "text":
            raise InvalidField(f"{param}.content[{index}].type", f"only text is supported, got {kind!r}")
        texts.append(_text_of(part, f"{param}.content[{index}]"))
    return "\n".join(texts)


def _messages(system: str | list[Any] | None, given: list[Any]) -> list[dict[str, Any]]:
    """`system` and `messages` as chat messages: an assistant turn's `tool_use` blocks
    its tool calls, a user turn's `tool_result` blocks tool messages ahead of the turn's
    text (as vLLM's server orders them), earlier thinking left out."""
    messages: list[dict[str, Any]] = []
    if prompt := _system(system):
        messages.append({"role": "system", "content": prompt})
    for index, message in enumerate(given):
        param = f"messages[{index}]"
        if not isinstance(message, dict):
            raise InvalidField(param, f"expected an object, got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise InvalidField(f"{param}.role", f"expected one of {', '.join(ROLES)}, got {role!r}")
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        blocks = _blocks(message.get("content"), f"{param}.content")
        if not blocks:
            raise InvalidField(f"{param}.content", "no content blocks")
        for number, block in enumerate(blocks):
            where, kind = f"{param}.content[{number}]", block.get("type")
            if kind == "text":
                texts.append(_text_of(block, where))
            elif kind == "tool_use" and role == "assistant":
                calls.append(_tool_call(block, where))
            elif kind == "tool_result" and role == "user":
                call_id = block.get("tool_use_id")
                if not isinstance(call_id, str) or not call_id:
                    raise InvalidField(f"{where}.tool_use_id", "expected a non-empty string")
                messages.append(
                    {"role": "tool", "tool_call_id": call_id, "content": _tool_result_text(block, where)}
                )
            elif kind not in THINKING_BLOCKS or role != "assistant":
                raise InvalidField(f"{where}.type", f"{kind!r} blocks are not supported in a {role} message")
        # A user turn of tool results alone is those tool messages; an assistant turn that
        # only thought stays a turn (templates want the roles to alternate).
        if texts or calls or role == "assistant":
            turn: dict[str, Any] = {"role": role, "content": "".join(texts) if texts or not calls else None}
            if calls:
                turn["tool_calls"] = calls
            messages.append(turn)
    return messages


def _tool_call(block: dict[str, Any], param: str) -> dict[str, Any]:
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input", {})
    if not isinstance(call_id, str) or not call_id:
        raise InvalidField(f"{param}.id", "expected a non-empty string")
    if not isinstance(name, str) or not name:
        raise InvalidField(f"{param}.name", "expected a non-empty string")
    if not isinstance(arguments, dict):
        raise InvalidField(f"{param}.input", "expected an object")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def _chat_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """Custom tools (`name`, `description`, `input_schema`) as chat function tools;
    Anthropic's own tool types (bash, text editor, web search, ...) are refused."""
    chat = []
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise InvalidField(f"tools[{index}]", f"expected an object, got {type(tool).__name__}")
        if tool.get("type", "custom") != "custom":
            raise InvalidField(
                f"tools[{index}].type", f"{tool.get('type')!r}: only custom tools are supported"
            )
        name, schema = tool.get("name"), tool.get("input_schema")
        if not isinstance(name, str) or not name:
            raise InvalidField(f"tools[{index}].name", "expected a non-empty string")
        if not isinstance(schema, dict):
            raise InvalidField(f"tools[{index}].input_schema", "expected a JSON schema object")
        function = {"name": name, "parameters": schema}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        chat.append({"type": "function", "function": function})
    return chat


def _chat_tool_choice(choice: dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None:
        return None
    kind = choice.get("type")
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidField("tool_choice.name", "expected a non-empty string")
        return {"type": "function", "function": {"name": name}}
    chat = {"auto": "auto", "any": "required", "none": "none"}.get(kind) if isinstance(kind, str) else None
    if chat is None:
        raise InvalidField("tool_choice.type", f"expected one of auto, any, tool, none, got {kind!r}")
    return chat


def _response_format(output_config: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (output_config or {}).get("format")
    if fmt is None:
        return None
    if (
        not isinstance(fmt, dict)
        or fmt.get("type") != "json_schema"
        or not isinstance(fmt.get("schema"), dict)
    ):
        raise InvalidField("output_config.format", 'expected {"type": "json_schema", "schema": {...}}')
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


# ----- the reply ---------------------------------------------------------------------------


def message_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """`usage` as Anthropic words it: `input_tokens` are the prompt tokens not read from
    the prefix cache (`cache_read_input_tokens`); cache writes are not counted (0)."""
    return {
        "input_tokens": max(0, prompt_tokens - cached_tokens),
        "output_tokens": completion_tokens,
        "cache_read_input_tokens": cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def stop_reason(engine_reason: str, called: bool) -> str:
    """`max_tokens` when the reply was cut, `tool_use` when it called tools, else
    `end_turn` (a reply ended by one of `stop_sequences` too: InferX's engines do not
    say which stop ended a reply)."""
    if engine_reason == "length":
        return "max_tokens"
    return "tool_use" if called else "end_turn"


def _arguments(call: ToolCall) -> dict[str, Any]:
    arguments = json.loads(call.arguments)  # the parsers give a JSON object
    return arguments if isinstance(arguments, dict) else {}


class MessageWriter(ReplyItems):
    """One call's `message`, built from what its `ReplyReader` reads, and the events of
    its stream on the way (Anthropic's order: `message_start`; per content block
    `content_block_start`, its deltas, `content_block_stop`; `message_delta` with the
    stop reason and usage; `message_stop`)."""

    def __init__(self, message_id: str, model: str) -> None:
        self.message_id = message_id
        self._model = model
        self._blocks: list[dict[str, Any]] = []
        self._open: str | None = None  # the kind of text block being written: "text" or "thinking"

    def message(self, reason: str | None, usage: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self._model,
            "content": [dict(block) for block in self._blocks],
            "stop_reason": reason,
            "stop_sequence": None,
            "usage": usage,
        }

    def start(self) -> list[dict[str, Any]]:
        return [{"type": "message_start", "message": self.message(None, message_usage(0, 0, 0))}]

    @property
    def _called(self) -> bool:
        return any(block["type"] == "tool_use" for block in self._blocks)

    def end(self, engine_reason: str, usage: dict[str, Any]) -> list[dict[str, Any]]:
        delta = {"stop_reason": stop_reason(engine_reason, self._called), "stop_sequence": None}
        return [
            *self._close(),
            {"type": "message_delta", "delta": delta, "usage": usage},
            {"type": "message_stop"},
        ]

    def whole(self, reader: ReplyReader, engine_reason: str, usage: dict[str, Any]) -> dict[str, Any]:
        """The message of a call whose reader read the reply to its end (not streamed)."""
        self.events(reader.read())
        self._close()
        return self.message(stop_reason(engine_reason, self._called), usage)

    def failed(self, error: dict[str, Any]) -> list[dict[str, Any]]:
        """The stream's last event when the call fails after it started (`error`:
        Anthropic's error body)."""
        return [error]

    def _text(self, event: Content | Reasoning) -> list[dict[str, Any]]:
        kind = "text" if isinstance(event, Content) else "thinking"
        out: list[dict[str, Any]] = []
        if self._open != kind:
            out += self._close()
            block = (
                {"type": "text", "text": ""}
                if kind == "text"
                else {"type": "thinking", "thinking": "", "signature": ""}
            )
            self._blocks.append(block)
            self._open = kind
            out.append(
                {"type": "content_block_start", "index": len(self._blocks) - 1, "content_block": dict(block)}
            )
        block = self._blocks[-1]
        block[kind] += event.text
        delta = (
            {"type": "text_delta", "text": event.text}
            if kind == "text"
            else {"type": "thinking_delta", "thinking": event.text}
        )
        out.append({"type": "content_block_delta", "index": len(self._blocks) - 1, "delta": delta})
        return out

    def _close(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        self._open = None
        return [{"type": "content_block_stop", "index": len(self._blocks) - 1}]

    def _call(self, call: ToolCall) -> list[dict[str, Any]]:
        block = {"type": "tool_use", "id": call.id, "name": call.name, "input": _arguments(call)}
        self._blocks.append(block)
        index = len(self._blocks) - 1
        return [
            {"type": "content_block_start", "index": index, "content_block": {**block, "input": {}}},
            {
                "type": "content_block_delta",
                "index": index,
                "delta": {"type": "input_json_delta", "partial_json": call.arguments},
            },
            {"type": "content_block_stop", "index": index},
        ]


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def error_reply(reply: ErrorReply) -> ErrorReply:
    """An OpenAI-shaped error reply (`errors.error_reply`) in Anthropic's shape, with
    the same status and headers: `{"type": "error", "error": {"type", "message"}}`."""
    message = reply.body["error"]["message"]
    body = {
        "type": "error",
        "error": {"type": ERROR_TYPES.get(reply.status, "api_error"), "message": message},
    }
    return ErrorReply(reply.status, body, reply.headers)
