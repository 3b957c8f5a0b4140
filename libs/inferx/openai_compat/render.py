"""Messages (and tool specs) -> one prompt string: InferX's simple chat rendering.

Workers do not apply the model's own chat template yet, so the router renders the chat
itself, the same way for every model:

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

from inferx.openai_compat.schema import ChatMessage

GENERATION_MARK = "<|assistant|>\n"


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(", ", ": "), ensure_ascii=False)


def message_text(message: ChatMessage) -> str:
    """The text of a message's content (text parts joined); '' when it has none."""
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    return "".join(part.text for part in message.content)


def render_chat(
    messages: Sequence[ChatMessage],
    tools: Sequence[dict[str, Any]] | None = None,
    tool_choice: str | dict[str, Any] | None = None,
) -> str:
    """The prompt for `messages`, ending with the generation mark."""
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
    if tool_choice is not None:
        lines.append("<|tool_choice|>")
        lines.append(tool_choice if isinstance(tool_choice, str) else _json(tool_choice))
    return "\n".join(lines) + "\n" + GENERATION_MARK
