"""`openai`: any OpenAI-compatible server (vLLM's `vllm serve`, SGLang, TGI, Ollama, ...)
behind an InferX worker. A chat (`EngineRequest.chat`) streams from the server's
`/v1/chat/completions`, so the server renders it with the model's own chat template and
may read tool calls with its own parser and enforce `tool_choice`; a prompt streams from
`/v1/completions`. `--openai-chat-endpoint off` sends chats as InferX's generic rendering
to `/v1/completions` too (for servers without a chat endpoint). Closing the stream when a
hop is abandoned makes the server abort the request.

What the server does not report, InferX cannot know: KV capacity comes from
`--openai-kv-capacity-tokens`, and cached prompt tokens only where the server fills
`usage.prompt_tokens_details.cached_tokens` (vLLM with `--enable-prompt-tokens-details`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from inferx_worker.engines.registry import register_engine

if TYPE_CHECKING:
    from inferx_worker.config import WorkerSettings

import contextlib
import json
from collections.abc import AsyncGenerator
from typing import Any

import httpx

from inferx.chat_template import Chat
from inferx.openai_compat.reasoning import DEEPSEEK_R1, END_THINK, QWEN3, THINK, check_reasoning_parser
from inferx.openai_compat.toolcalls import DEFAULT_FORMAT, ToolCallWriter, check_format
from inferx_worker.engines.base import (
    Engine,
    EngineCapacity,
    EngineChunk,
    EngineError,
    EngineLoad,
    EngineRequest,
)

CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"


def server_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A chat's messages (made ready for templates: `inferx.openai_compat.render`) as
    OpenAI's API takes them: a tool call's `arguments` as JSON text, not an object."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            message = {**message, "tool_calls": [_text_arguments(call) for call in calls]}
        out.append(message)
    return out


def _text_arguments(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or isinstance(function.get("arguments"), str | None):
        return call
    arguments = json.dumps(function["arguments"], ensure_ascii=False)
    return {**call, "function": {**function, "arguments": arguments}}


class CompletionText:
    """The text of a streamed completion (/v1/completions), its usage and finish reason."""

    def __init__(self) -> None:
        self.finish_reason = ""
        self.usage: dict[str, Any] = {}

    def event(self, event: dict[str, Any]) -> str:
        if event.get("usage"):
            self.usage = event["usage"]
        text = []
        for choice in event.get("choices") or ():
            text.append(choice.get("text") or "")
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return "".join(text)

    def finish(self) -> str:
        return ""


class ChatDeltas:
    """The text of a streamed chat completion, as the engine's chunks carry it.

    Content deltas are text as they come. Tool calls the server already read out of the
    model's text arrive apart (`delta.tool_calls`: an index, then the name and the
    arguments in pieces); they are written back into the text in `tool_format`, each
    once it is whole (a call with a higher index, a new call -- another id -- at its
    index, content, or the end follows it). Why
    text rather than a structured field: everything after the engine -- the worker's
    GenerateChunk, the scheduler's hop events, the router's reply reader that both
    fronts share, the run record's output -- carries the reply as text and reads tool
    calls out of it in the pool's format; writing them back in that format keeps one
    path (and one `tool_choice` check) for every engine, at the cost of the server's
    call ids (the router gives its own, as it does for every engine). The format is the
    worker's `--tool-call-format` (auto: hermes, what the routers read when a worker
    names none); `ToolCallWriter` says what each format can carry. Pure: no I/O."""

    def __init__(self, tool_format: str = DEFAULT_FORMAT, *, reasoning_parser: str = "") -> None:
        self._writer = ToolCallWriter(tool_format)
        # With a `reasoning_parser` (the one the routers read this worker's replies
        # with), the server's reasoning_content (or vLLM's newer `reasoning`) is written
        # back as a reasoning model writes it: <think>, the thinking, </think>, then the
        # answer, which both parsers read apart. A reply without thinking is the answer
        # alone -- except for deepseek_r1, which reads a reply without </think> as all
        # thinking: it gets an empty <think></think> first. Without a parser the
        # reasoning is dropped: it is not the reply's.
        self._reasoning_parser = reasoning_parser
        self._thinking: bool | None = None if reasoning_parser else False  # None: not begun
        self._calls: dict[int, tuple[str, str]] = {}  # index -> (name, arguments) so far, not written yet
        self._written = 0  # calls written so far
        self._ids: dict[int, str] = {}  # index -> the server's id of the call at it
        # Whitespace content after a call, held: when another call follows it is dropped
        # (a pythonic or Granite list, a DeepSeek section, cannot hold it between calls,
        # and closing the list for it would turn every call into text); when content
        # follows, it is written before that content.
        self._space = ""
        self._in_calls = False  # the last thing the server sent was (part of) a call
        self.finish_reason = ""
        self.usage: dict[str, Any] = {}

    def event(self, event: dict[str, Any]) -> str:
        """The text one streamed chunk adds (usage and finish reason are kept)."""
        if event.get("usage"):
            self.usage = event["usage"]
        text: list[str] = []
        for choice in event.get("choices") or ():
            delta = choice.get("delta") or {}
            thought = delta.get("reasoning_content") or delta.get("reasoning")
            if thought and self._thinking is not False:
                # (reasoning after the answer has begun has no place in the text: dropped)
                text += [THINK if self._thinking is None else "", thought]
                self._thinking = True
            content = delta.get("content")
            if content or delta.get("tool_calls"):
                text.append(self._end_thinking())
            if content:
                if not content.strip() and self._in_calls:
                    self._space += content  # between calls, or trailing: see __init__
                else:
                    # Content after calls: they are whole, and their section ends before it.
                    text += [self._flush(), self._writer.close(), self._space, content]
                    self._space, self._in_calls = "", False
            for call in delta.get("tool_calls") or ():
                index = call.get("index", self._written + len(self._calls))
                if not isinstance(index, int) or isinstance(index, bool):  # it orders the calls
                    raise TypeError(f"a tool call's index is {index!r}, not an integer")
                self._space, self._in_calls = "", True  # whitespace between calls is not content
                # A new call (its id) where one is under way: servers that number each
                # chunk's calls from 0 (Ollama's) use an index again. The earlier one is whole.
                call_id = call.get("id") or ""
                renewed = index in self._calls and call_id not in ("", self._ids.get(index, ""))
                text.append(self._flush(below=index + 1 if renewed else index))  # earlier ones are whole
                self._ids[index] = call_id or self._ids.get(index, "")
                function = call.get("function") or {}
                name, arguments = self._calls.get(index, ("", ""))
                self._calls[index] = (  # OpenAI's deltas: each piece adds to the field
                    name + (function.get("name") or ""),
                    arguments + (function.get("arguments") or ""),
                )
            if choice.get("finish_reason"):
                # "tool_calls" is the router's to say (it reads the calls back from the text).
                reason = choice["finish_reason"]
                self.finish_reason = "stop" if reason == "tool_calls" else reason
        return "".join(text)

    def finish(self) -> str:
        """The calls not written yet, and the end of their section, once the stream has ended."""
        text, self._space = self._end_thinking() + self._flush() + self._writer.close() + self._space, ""
        return text

    def _end_thinking(self) -> str:
        """What ends the thinking before the first answer (see __init__)."""
        if self._thinking is False:
            return ""
        begun, self._thinking = self._thinking, False
        if begun:
            return END_THINK
        return THINK + END_THINK if self._reasoning_parser == DEEPSEEK_R1 else ""

    def _flush(self, below: int | None = None) -> str:
        text = []
        for index in sorted(self._calls):
            if below is not None and index >= below:
                break
            text.append(self._writer.call(*self._calls.pop(index)))
            self._written += 1
        return "".join(text)


class OpenAIEngine(Engine):
    name = "openai"

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str = "",
        kv_capacity_tokens: int = 100_000,
        max_concurrency: int = 32,
        send_priority: bool = True,
        chat_endpoint: bool = True,
        tool_call_format: str = DEFAULT_FORMAT,
        reasoning_parser: str = QWEN3,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model_path = model
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._capacity = EngineCapacity(kv_capacity_tokens, max_concurrency, 0)
        self._send_priority = send_priority
        self._chat_endpoint = chat_endpoint
        self.tool_call_format = check_format(tool_call_format)  # how server-parsed calls are written
        # The routers' parser for this worker's replies: the server's reasoning is written
        # back for it (ChatDeltas); "": dropped.
        self.reasoning_parser = check_reasoning_parser(reasoning_parser)
        self._client: httpx.AsyncClient | None = None
        self._running = 0

    def writes_tool_call_format(self) -> str | None:
        return self.tool_call_format if self._chat_endpoint else None

    def writes_reasoning_parser(self) -> str | None:
        # The server's reasoning comes apart and is written back between explicit tags.
        return (self.reasoning_parser or None) if self._chat_endpoint else None

    async def start(self) -> None:
        self._client = httpx.AsyncClient(base_url=self.base_url, headers=self._headers, timeout=None)
        try:
            reply = await self._client.get("/v1/models", timeout=10)
            reply.raise_for_status()
        except httpx.HTTPError as exc:
            raise EngineError(
                f"the OpenAI-compatible server at {self.base_url} is not answering: {exc}"
            ) from exc
        served = [m.get("id") for m in reply.json().get("data", [])]
        if served and self.model_path not in served:
            raise EngineError(
                f"{self.base_url} serves {', '.join(map(str, served))}, not '{self.model_path}' "
                "(set --model-path to one of them)"
            )

    async def stop(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def capacity(self) -> EngineCapacity:
        return self._capacity

    def load(self) -> EngineLoad:
        return EngineLoad(self._running, 0, 0.0)

    def sends_chats(self) -> bool:
        return self._chat_endpoint

    def _sampling(self, request: EngineRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model_path,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if request.max_tokens is not None:  # else the server's own: up to the context room
            body["max_tokens"] = request.max_tokens
        if request.seed is not None:
            body["seed"] = request.seed
        if request.stop:
            body["stop"] = list(request.stop)
        if request.response_format is not None:
            body["response_format"] = request.response_format
        if self._send_priority:
            body["priority"] = request.priority  # vLLM's priority scheduling; others ignore it
        return body

    def _body(self, request: EngineRequest) -> dict[str, Any]:
        return {**self._sampling(request), "prompt": request.prompt}

    def _chat_body(self, request: EngineRequest, chat: Chat) -> dict[str, Any]:
        body = {**self._sampling(request), "messages": server_messages(chat.messages)}
        if chat.tools:
            body["tools"] = chat.tools
        if chat.tool_choice is not None:
            body["tool_choice"] = chat.tool_choice
        return body

    async def generate(self, request: EngineRequest) -> AsyncGenerator[EngineChunk, None]:
        if self._client is None:
            raise EngineError("the openai engine is not started")
        chat = request.chat if self._chat_endpoint else None
        path = COMPLETIONS_PATH if chat is None else CHAT_PATH
        body = self._body(request) if chat is None else self._chat_body(request, chat)
        reader = (
            CompletionText()
            if chat is None
            else ChatDeltas(self.tool_call_format, reasoning_parser=self.reasoning_parser)
        )
        self._running += 1
        try:
            # aclosing: a hop given up closes the HTTP stream at once, and the server aborts.
            async with contextlib.aclosing(self._events(path, body)) as events:
                async for event in events:
                    try:
                        text = reader.event(event)
                    except (AttributeError, TypeError) as exc:  # a field of another type than OpenAI's
                        raise EngineError(
                            f"{self.base_url}{path} streamed an event this engine cannot read ({exc}): "
                            f"{json.dumps(event)[:200]}"
                        ) from None
                    if text:
                        yield EngineChunk(text=text)
            if text := reader.finish():
                yield EngineChunk(text=text)
        finally:
            self._running -= 1
        prompt_tokens, completion_tokens, cached_tokens = self._usage(reader.usage, path)
        yield EngineChunk(
            text="",
            finished=True,
            finish_reason=reader.finish_reason or "stop",
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            cached_prompt_tokens=cached_tokens,
        )

    def _usage(self, usage: Any, path: str) -> tuple[int, int, int]:
        """(prompt, completion, cached prompt) tokens of the server's `usage`; EngineError
        naming the server for one not in OpenAI's shape (a traceback otherwise)."""
        try:
            details = usage.get("prompt_tokens_details") or {}
            counts = (
                usage.get("prompt_tokens", 0),
                usage.get("completion_tokens", 0),
                details.get("cached_tokens") or 0,
            )
            if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts):
                raise TypeError("token counts are not whole numbers")
        except (AttributeError, TypeError) as exc:
            shown = json.dumps(usage)[:200]
            raise EngineError(
                f"{self.base_url}{path} sent a usage this engine cannot read ({exc}): {shown}"
            ) from None
        return counts

    async def _events(self, path: str, body: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        """The server's streamed events (server-sent `data:` lines) up to `[DONE]`.
        EngineError for a refusal (4xx: caused by a ValueError, so the worker answers
        INVALID_ARGUMENT), a failure (5xx, or an error event mid-stream) or a broken
        connection, naming the server's URL and its message."""
        assert self._client is not None
        url = self.base_url + path
        try:
            async with self._client.stream("POST", path, json=body) as reply:
                if reply.status_code >= 400:
                    detail = _error_detail((await reply.aread()).decode(errors="replace"))
                    if reply.status_code == 404 and path == CHAT_PATH:
                        detail += (
                            " (no chat endpoint there? start the worker with --openai-chat-endpoint off)"
                        )
                    cause = ValueError(detail) if reply.status_code < 500 else RuntimeError(detail)
                    raise EngineError(f"{url} answered {reply.status_code}: {detail}") from cause
                async for line in reply.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    try:
                        event = json.loads(data)
                    except (ValueError, RecursionError):
                        raise EngineError(f"{url} streamed a line that is not JSON: {data[:200]}") from None
                    if not isinstance(event, dict):
                        raise EngineError(f"{url} streamed a line that is not a JSON object: {data[:200]}")
                    if event.get("error"):
                        raise EngineError(f"{url} failed mid-stream: {_error_detail(json.dumps(event))}")
                    yield event
        except httpx.HTTPError as exc:
            raise EngineError(f"{url}: {exc}") from exc


def _error_detail(body: str) -> str:
    """The message of an error reply: OpenAI's {"error": {"message": ...}}, vLLM's
    {"message": ...}, else the body itself (cut at 500 characters)."""
    try:
        value = json.loads(body)
    except ValueError:
        return body.strip()[:500]
    error = value.get("error", value) if isinstance(value, dict) else value
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error["message"][:500]
    if isinstance(error, str):
        return error[:500]
    return body.strip()[:500]


@register_engine(
    "openai",
    summary="any OpenAI-compatible server (vLLM, SGLang, TGI, Ollama) over HTTP",
    standalone=False,  # needs that server running
)
def from_settings(settings: WorkerSettings) -> OpenAIEngine:
    return OpenAIEngine(
        settings.openai_base_url,
        settings.model_path,
        api_key=settings.openai_api_key,
        kv_capacity_tokens=settings.openai_kv_capacity_tokens,
        max_concurrency=settings.max_num_seqs,
        chat_endpoint=settings.openai_chat_endpoint == "on",
        # The format server-parsed calls are written back in, which the worker registers
        # for the routers (auto: hermes, the routers' default).
        tool_call_format=DEFAULT_FORMAT if settings.tool_call_format == "auto" else settings.tool_call_format,
        # auto: qwen3, which reads the tags ChatDeltas writes; none: no thinking is written.
        reasoning_parser={"auto": QWEN3, "none": ""}.get(
            settings.reasoning_parser, settings.reasoning_parser
        ),
    )
