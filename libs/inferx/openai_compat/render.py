"""A chat as the front hands it to workers: the chat itself (`chat_json`, which a worker
renders with its model's own chat template) and InferX's generic rendering of it
(`render_chat`: what a worker whose model has no template runs, and what the
scheduler's token estimates read).

`chat_json` is {"messages": [...], "tools": [...], "tool_choice": ...} in OpenAI's
shapes, made ready for templates as vLLM's server makes them: text parts joined into
one string, a tool call's
`arguments` given as an object where they are a JSON object's text, and the roles
templates know (`developer` is sent as `system`, the old `function` as `tool`).

The generic rendering, the same for every model:

    <|tools|>                       (only when `tools` is given: one JSON spec a line)
    {"function": {...}, "type": "function"}
    <|system|>
    You are a helpful agent.
    <|user|>
    Where is my order?
    <|assistant|>
    <|tool_calls|>                  (an assistant turn's tool calls: one JSON call a line)
    {"function": {"arguments": "{}", "name": "lookup"}, "id": "call_1", "type": "function"}
    <|tool|> call_1                 (a tool result, with the call id it answers)
    {"status": "shipped"}
    <|tool_choice|>                 (only when `tool_choice` is given)
    auto
    <|assistant|>                   (the turn the model is to write)

Tool specs come first and `tool_choice` last, so the rendering of an agent loop's next
call starts with the whole rendering of its previous call up to the generation mark:
the engine's prefix cache (and InferX's affinity) reuse it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from inferx.openai_compat import json_text
from inferx.openai_compat.schema import ChatMessage

GENERATION_MARK = "<|assistant|>\n"
SYSTEM_ROLES = ("system", "developer")  # the instructions an agent sends every program first


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(", ", ": "), ensure_ascii=False)


def message_text(message: ChatMessage) -> str:
    """The text of a message's content (text parts joined); '' when it has none."""
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    return "".join(part.text for part in message.content)


_TEMPLATE_ROLES = {"developer": "system", "function": "tool"}


def template_message(message: ChatMessage) -> dict[str, Any]:
    """One message as chat templates read it (see the module's docstring)."""
    out: dict[str, Any] = {
        "role": _TEMPLATE_ROLES.get(message.role, message.role),
        "content": message.content if message.content is None else message_text(message),
    }
    if message.name:
        out["name"] = message.name
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        out["tool_calls"] = [_template_tool_call(call) for call in message.tool_calls]
    return out


def _template_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json_text.loads(function["arguments"])
    except (ValueError, RecursionError):
        return call  # not JSON: the template gets the text as it came
    if not isinstance(arguments, dict):
        return call
    return {**call, "function": {**function, "arguments": arguments}}


def chat_json(
    messages: Sequence[ChatMessage],
    tools: Sequence[dict[str, Any]] | None = None,
    tool_choice: str | dict[str, Any] | None = None,
) -> str:
    """The chat a worker renders with its model's template (HopRequest.chat_json); the
    tool_choice rides along for workers that send the chat to a server whole (the
    `openai` engine), which may enforce it."""
    chat: dict[str, Any] = {"messages": [template_message(m) for m in messages]}
    if tools:
        chat["tools"] = list(tools)
    if tool_choice is not None:
        chat["tool_choice"] = tool_choice
    return json_text.dumps(chat)


def render_chat(
    messages: Sequence[ChatMessage],
    tools: Sequence[dict[str, Any]] | None = None,
    tool_choice: str | dict[str, Any] | None = None,
) -> str:
    """The prompt for `messages`, ending with the generation mark."""
    return render_chat_and_head(messages, tools, tool_choice)[0]


def shared_head(messages: Sequence[ChatMessage], tools: Sequence[dict[str, Any]] | None = None) -> str:
    """What the rendering starts with that other programs of the same agent send too:
    the tool specs and the leading system (or developer) messages, not the conversation
    after them. "" when there is neither."""
    return _head(_rendered(messages[: _system_count(messages)], tools))


def render_chat_and_head(
    messages: Sequence[ChatMessage],
    tools: Sequence[dict[str, Any]] | None = None,
    tool_choice: str | dict[str, Any] | None = None,
) -> tuple[str, str]:
    """(`render_chat`, `shared_head`) of one call, rendering the head once: it is the
    rendering's first lines (a long agent call's tools and instructions, ~35 us to
    render again)."""
    count = _system_count(messages)
    head = _rendered(messages[:count], tools)
    lines = head + _rendered(messages[count:], None)
    if tool_choice is not None:
        lines.append("<|tool_choice|>")
        lines.append(tool_choice if isinstance(tool_choice, str) else _json(tool_choice))
    return "\n".join(lines) + "\n" + GENERATION_MARK, _head(head)


def _system_count(messages: Sequence[ChatMessage]) -> int:
    count = 0
    while count < len(messages) and messages[count].role in SYSTEM_ROLES:
        count += 1
    return count


def _head(lines: list[str]) -> str:
    return "\n".join(lines) + "\n" if lines else ""


def _rendered(messages: Sequence[ChatMessage], tools: Sequence[dict[str, Any]] | None) -> list[str]:
    lines: list[str] = []
    if tools:
        lines.append("<|tools|>")
        lines += [_json(tool) for tool in tools]
    for message in messages:
        head = f"<|{message.role}|>"
        if message.role == "tool" and message.tool_call_id:
            head += f" {message.tool_call_id}"
        elif message.name:
            head += f" {message.name}"
        lines.append(head)
        text = message_text(message)
        if text:
            lines.append(text)
        if message.tool_calls:
            lines.append("<|tool_calls|>")
            lines += [_json(call) for call in message.tool_calls]
    return lines
