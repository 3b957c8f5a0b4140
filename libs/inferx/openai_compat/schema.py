"""Request bodies of the OpenAI-compatible front (validated), and the response bodies
and stream chunks it sends, in OpenAI's shapes. Pure: dicts and pydantic models."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from inferx.openai_compat import json_text
from inferx.openai_compat.errors import InvalidField, ToolChoiceNotFollowed
from inferx.openai_compat.reasoning import Reasoning, ReasoningSplitter
from inferx.openai_compat.toolcalls import (
    DEFAULT_FORMAT,
    Content,
    Event,
    ToolCall,
    new_call_id,
    parser_for,
)

# What a ReplyReader gives: the answer's content and tool calls, and the thinking.
ReplyEvent = Event | Reasoning

# Fields OpenAI defines that InferX accepts and ignores (documented in docs/api.md):
# presence_penalty, frequency_penalty, logit_bias, user, metadata, store, ... Unknown
# keys are ignored as well. Fields whose answer InferX cannot give (logprobs, echo,
# best_of, the legacy `functions`, audio output) are refused when they ask for it
# (`_refuse`), never ignored.
_LENIENT = ConfigDict(extra="ignore")

TOOL_CHOICES = ("auto", "none", "required")
MAX_STOP_SEQUENCES = 16  # OpenAI takes 4; vLLM sets no limit
RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def _tool_name(tool: dict[str, Any]) -> Any:
    function = tool.get("function")
    return function.get("name") if isinstance(function, dict) else None


def _refuse(value: Any, harmless: Callable[[Any], bool], why: str) -> Any:
    """`value` when it asks for nothing InferX cannot give (None, or `harmless`), else
    a ValueError saying `why` (a 400 naming the field): never a silently lesser answer."""
    if value is None or harmless(value):
        return value
    raise ValueError(f"not supported: {why}")


class ContentPart(BaseModel):
    model_config = _LENIENT
    type: Literal["text"]
    text: str


def _refusal_as_text(part: Any) -> Any:
    if isinstance(part, dict) and part.get("type") == "refusal" and isinstance(part.get("refusal"), str):
        return {"type": "text", "text": part["refusal"]}
    return part


class ChatMessage(BaseModel):
    model_config = _LENIENT
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError("expected a string or a list of text parts")
        if info.data.get("role") == "assistant":  # an earlier reply's refusal, as text (as vLLM reads it)
            value = [_refusal_as_text(part) for part in value]
        for index, part in enumerate(value):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"part {index} ({kind!r}): only text parts are supported")
        return value

    @field_validator("tool_calls")
    @classmethod
    def _named_calls(cls, value: Any) -> Any:
        """An earlier reply's calls as OpenAI gives them, each naming its function (what
        chat templates render), not left for a worker's template to fail on."""
        for index, call in enumerate(value or []):
            name = _tool_name(call)
            if not isinstance(name, str) or not name:
                raise ValueError(
                    f'call {index}: expected {{"id": ..., "type": "function", '
                    f'"function": {{"name": "...", "arguments": "..."}}}}'
                )
        return value


def _not_a_bool(value: Any) -> Any:
    """JSON's true/false where a number goes is a mistake, not 1/0 (pydantic's lax mode
    would read it as one; OpenAI's API refuses it)."""
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {json.dumps(value)}")
    return value


class StreamOptions(BaseModel):
    model_config = _LENIENT
    include_usage: StrictBool = False


class CallRequest(BaseModel):
    model_config = _LENIENT
    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    # JSON's true/false only: pydantic's lax mode would read "yes" or 1 as true.
    stream: StrictBool | None = False  # null: OpenAI's default (false), as for n
    stream_options: StreamOptions | None = None
    n: int | None = Field(1, ge=1, description="one choice per call (n > 1 is refused)")
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**64)
    stop: str | list[str] | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("max_tokens", "temperature", "n", "top_p", "seed", mode="before")
    @classmethod
    def _numbers(cls, value: Any) -> Any:
        return _not_a_bool(value)

    @field_validator("stream_options")
    @classmethod
    def _only_streamed(cls, value: Any, info: ValidationInfo) -> Any:
        """As OpenAI's API (and vLLM's server): options of a stream on a call that is not
        one ask for something (a usage chunk) it will not get."""
        if value is not None and not info.data.get("stream"):
            raise ValueError("only allowed when stream is true")
        return value

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: Any) -> Any:
        return _refuse(value, lambda n: n == 1, f"n={value}: one choice per call (n must be 1)")

    @field_validator("response_format")
    @classmethod
    def _known_format(cls, value: Any) -> Any:
        """OpenAI's three: text, json_object, json_schema (its `json_schema.schema` an
        object); the engine constrains the output to it (vLLM's structured outputs)."""
        if value is None:
            return value
        kind = value.get("type")
        if kind not in RESPONSE_FORMATS:
            raise ValueError(f"type: expected one of {', '.join(RESPONSE_FORMATS)}, got {kind!r}")
        if kind == "json_schema":
            spec = value.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise ValueError('json_schema: expected {"name": ..., "schema": {a JSON schema object}}')
        return value

    @property
    def structured_output(self) -> dict[str, Any] | None:
        """The response_format the engine must follow; None for free text."""
        if self.response_format is None or self.response_format.get("type") == "text":
            return None
        return self.response_format

    @property
    def response_format_json(self) -> str:
        """`structured_output` as JSON for the wire; "" for free text."""
        fmt = self.structured_output
        return "" if fmt is None else json.dumps(fmt, separators=(",", ":"))

    @field_validator("stop")
    @classmethod
    def _stop_sequences(cls, value: Any) -> Any:
        sequences = [value] if isinstance(value, str) else value or []
        if len(sequences) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(sequences)}")
        if any(not sequence for sequence in sequences):
            raise ValueError("a stop sequence is empty")
        return value

    @property
    def stop_sequences(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def output_tokens(self) -> int:
        """Tokens the call may generate; 0 when it does not say: up to the model's
        context room, as OpenAI and vLLM mean it (the engine caps it). Unbounded here:
        the router checks its limit (--max-output-tokens, at most what the wire's uint32
        holds)."""
        return self.max_tokens or 0

    def output_tokens_param(self) -> str:
        """The field `output_tokens` comes from, for error messages."""
        return "max_tokens"

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(CallRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    # For a call of another API read as a chat call (`chat_request_from`): what that API
    # calls the chat fields, so later errors name its fields (chat field -> theirs).
    _field_names: dict[str, str] = PrivateAttr(default_factory=dict)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None  # false: the reply's first tool call only
    logprobs: StrictBool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    functions: list[Any] | None = None  # the deprecated form of tools
    function_call: str | dict[str, Any] | None = None  # ... and of tool_choice
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None

    @field_validator("max_completion_tokens", "top_logprobs", mode="before")
    @classmethod
    def _chat_numbers(cls, value: Any) -> Any:
        return _not_a_bool(value)

    @field_validator("tools")
    @classmethod
    def _function_tools(cls, value: Any) -> Any:
        """OpenAI's function tools, each with a name (what templates render, tool_choice
        names and the reply's calls are read against); "custom" tools are refused."""
        for index, tool in enumerate(value or []):
            if tool.get("type") != "function":
                raise ValueError(
                    f'tool {index}: type {tool.get("type")!r}: only "function" tools are supported'
                )
            name = _tool_name(tool)
            if not isinstance(name, str) or not name:
                raise ValueError(
                    f'tool {index}: expected {{"type": "function", "function": {{"name": "...", ...}}}}'
                )
        return value

    @field_validator("logprobs", "top_logprobs")
    @classmethod
    def _no_logprobs(cls, value: Any) -> Any:
        return _refuse(value, lambda v: not v, "InferX's engines return no log probabilities")

    @field_validator("functions", "function_call")
    @classmethod
    def _no_functions(cls, value: Any, info: ValidationInfo) -> Any:
        instead = "tools" if info.field_name == "functions" else "tool_choice"
        return _refuse(value, lambda v: v in ([], "none"), f"the deprecated form; send {instead}")

    @field_validator("modalities")
    @classmethod
    def _text_out(cls, value: Any) -> Any:
        return _refuse(value, lambda v: set(v) <= {"text"}, "only text output")

    @field_validator("audio")
    @classmethod
    def _no_audio(cls, value: Any) -> Any:
        return _refuse(value, lambda v: False, "only text output")

    @field_validator("tool_choice")
    @classmethod
    def _known_choice(cls, value: Any, info: ValidationInfo) -> Any:
        """OpenAI's choices; "required" and a named function need `tools` (and the name
        one of them), as OpenAI's API and vLLM's server say."""
        if value is None:
            return value
        if isinstance(value, str):
            if value not in TOOL_CHOICES:
                choices = ", ".join(TOOL_CHOICES)
                raise ValueError(f"expected one of {choices} or a named function, got {value!r}")
            if value == "required" and not info.data.get("tools"):
                raise ValueError('"required" needs tools')
            return value
        function = value.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if value.get("type") != "function" or not isinstance(name, str) or not name:
            raise ValueError('expected {"type": "function", "function": {"name": "..."}}')
        offered = [_tool_name(tool) for tool in info.data.get("tools") or []]
        if name not in offered:
            raise ValueError(f"function {name!r} is not among the call's tools")
        return value

    def output_tokens(self) -> int:
        return self.max_completion_tokens or self.max_tokens or 0

    def output_tokens_param(self) -> str:
        field = "max_completion_tokens" if self.max_completion_tokens else "max_tokens"
        return self._field_names.get(field, field)

    @property
    def parses_tool_calls(self) -> bool:
        """Tool calls are read out of the reply when the call offers tools (and does not
        say tool_choice "none")."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forced_tool(self) -> str | None:
        """The function a named tool_choice names."""
        return forced_tool(self.tool_choice)


def forced_tool(tool_choice: str | dict[str, Any] | None) -> str | None:
    """The function a named tool_choice (`{"type": "function", "function": {"name": ...}}`)
    names; None for the others."""
    if not isinstance(tool_choice, dict):
        return None
    function = tool_choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    return name if isinstance(name, str) else None


def check_tool_choice(tool_choice: str | dict[str, Any] | None, calls: list[ToolCall], text: str) -> None:
    """ToolChoiceNotFollowed when tool_choice "required" got a reply without tool calls,
    or a named function a reply without calls or with calls to other functions."""
    name = forced_tool(tool_choice)
    if tool_choice == "required" and not calls:
        raise ToolChoiceNotFollowed('"required"', text)
    if name is not None and (not calls or any(call.name != name for call in calls)):
        raise ToolChoiceNotFollowed(f"function {name!r}", text)


class CompletionRequest(CallRequest):
    prompt: str | list[str]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool | None = None
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: Any) -> Any:
        return _refuse(value, lambda v: False, "InferX's engines return no log probabilities")

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: Any) -> Any:
        return _refuse(value, lambda v: not v, "the reply is the completion only (echo must be false)")

    @field_validator("best_of")
    @classmethod
    def _one_candidate(cls, value: Any) -> Any:
        return _refuse(value, lambda v: v == 1, "one candidate per call (best_of must be 1)")

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: Any) -> Any:
        return _refuse(value, lambda v: not v, "no insertion (fill-in-the-middle) completions")

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, str) or (
            isinstance(value, list) and len(value) == 1 and isinstance(value[0], str)
        ):
            return value
        raise ValueError(
            "expected a string, or a list of one string (several prompts and token ids are not supported)"
        )

    @property
    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


_UNION_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _param(loc: tuple[int | str, ...]) -> str:
    """('messages', 0, 'role') -> 'messages[0].role'."""
    out = ""
    for part in loc:
        if isinstance(part, str) and (part in _UNION_TAGS or "[" in part):
            continue  # which member of a union pydantic tried: not a field
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "body"


M = TypeVar("M", bound=BaseModel)


def parse_body(model: type[M], raw: bytes) -> M:
    """The validated request, or InvalidField naming the first bad field."""
    return validate_body(model, load_object(raw))


def load_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object (its fields unchecked), or InvalidField("body")."""
    try:
        data = json_text.loads(raw)
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise InvalidField("body", f"not valid JSON ({exc})") from None
    except RecursionError:  # JSON nested deeper than the decoder goes: the caller's input
        raise InvalidField("body", "JSON nested too deeply") from None
    if not isinstance(data, dict):
        raise InvalidField("body", f"expected a JSON object, got {type(data).__name__}")
    # JSON's \uXXXX escapes (and bytes `json` decodes with 'surrogatepass') can spell a
    # lone UTF-16 surrogate, which is not text. Only a body read by the `json` fallback
    # can hold one; for the rest this is orjson's write, ~10 us for 35 KB.
    try:
        json_text.dumps(data).encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidField(
            "body", "a string holds a lone UTF-16 surrogate (\\uD800-\\uDFFF): not valid Unicode"
        ) from None
    return data


def validate_body(model: type[M], data: dict[str, Any]) -> M:
    """The validated request from a JSON object, or InvalidField naming the first bad field."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        message = str(first["msg"]).removeprefix("Value error, ")
        raise InvalidField(_param(tuple(first["loc"])), message) from None


def chat_request_from(fields: dict[str, Any], names: dict[str, str]) -> ChatCompletionRequest:
    """A chat completion request for another API's call (the Responses and Messages
    APIs are read as the chat call they mean): `fields` in chat terms, None for not set.
    InvalidField names the field as that API names it (`names`: chat field -> theirs;
    `names["messages"]` for any message field)."""
    try:
        request = validate_body(ChatCompletionRequest, {k: v for k, v in fields.items() if v is not None})
    except InvalidField as exc:
        theirs = names["messages"] if exc.param.startswith("messages") else names.get(exc.param, exc.param)
        raise InvalidField(theirs, exc.message.split(": ", 1)[-1]) from None
    request._field_names = names
    return request


# ----- responses --------------------------------------------------------------------


def finish_reason(engine_reason: str, tool_calls: bool = False) -> str:
    """An engine's finish reason as OpenAI's: 'tool_calls' (the reply called tools),
    'length' (max_tokens reached) or 'stop'."""
    if tool_calls:
        return "tool_calls"
    return "length" if engine_reason == "length" else "stop"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class ReplyReader:
    """What a chat reply says, read as its text comes: content and tool calls. The one
    reading both the HTTP front and `Router.CallModel` use (and the router runs it
    inside the call, so a reply that fails tool_choice is recorded as a failed call).

    With `parse_tool_calls`, tool calls in `tool_format` (inferx.openai_compat.toolcalls)
    are read out of the text: `feed` gives what can be told so far (content, whole calls;
    content held back only while it may be part of a call), `finish` the rest. With a
    "required" or named `tool_choice` everything is held until the reply has ended, and
    `finish` raises ToolChoiceNotFollowed when the reply does not follow it (so nothing
    of a reply that breaks the promise is sent). Without, the text is content as it is.
    With `single_call` (the call said parallel_tool_calls false) only the reply's first
    tool call is given, the others dropped, as vLLM's server does."""

    def __init__(
        self,
        *,
        parse_tool_calls: bool = False,
        tool_format: str = DEFAULT_FORMAT,
        tool_choice: str | dict[str, Any] | None = None,
        new_id: Callable[[], str] = new_call_id,
        reasoning_parser: str = "",
        single_call: bool = False,
    ) -> None:
        self._parser = parser_for(tool_format, new_id) if parse_tool_calls else None
        self._most_calls = 1 if single_call else None
        # A reasoning model's thinking comes first, apart: tool calls are read from the
        # answer only (inferx.openai_compat.reasoning).
        self._splitter = ReasoningSplitter(reasoning_parser) if reasoning_parser else None
        self.tool_choice = tool_choice
        self._hold = parse_tool_calls and (tool_choice == "required" or forced_tool(tool_choice) is not None)
        self._held: list[ReplyEvent] = []
        self._text: list[str] = []  # the whole reply, for ToolChoiceNotFollowed's message
        self._content: list[str] = []
        self._reasoning: list[str] = []

    @property
    def calls(self) -> list[ToolCall]:
        return self._parser.calls[: self._most_calls] if self._parser is not None else []

    @property
    def called(self) -> bool:
        """The reply called tools of its own accord: OpenAI's finish reason 'tool_calls'
        ('stop' for a call a named tool_choice made it make, as OpenAI says)."""
        return bool(self.calls) and forced_tool(self.tool_choice) is None

    @property
    def content(self) -> str | None:
        """The content read so far (all of it after `finish`); None when nothing but
        whitespace is left beside tool calls."""
        text = "".join(self._content)
        return None if self.calls and not text.strip() else text

    @property
    def reasoning(self) -> str | None:
        """The model's thinking read so far; None when there is none (or no parser)."""
        return "".join(self._reasoning) or None

    def feed(self, piece: str) -> list[ReplyEvent]:
        self._text.append(piece)
        return self._answer(self._splitter.feed(piece) if self._splitter else [piece], final=False)

    def read(self) -> list[ReplyEvent]:
        """What the reply said, once read to its end, as one event of each kind in the
        order a reply says them: the thinking, the content, the tool calls."""
        thinking = [Reasoning(self.reasoning)] if self.reasoning else []
        content = [Content(self.content)] if self.content else []
        return [*thinking, *content, *self.calls]

    def finish(self) -> list[ReplyEvent]:
        """The rest, once the reply has ended (ToolChoiceNotFollowed: see the class)."""
        return self._answer(self._splitter.finish() if self._splitter else [], final=True)

    def _answer(self, pieces: list[Reasoning | str], *, final: bool) -> list[ReplyEvent]:
        events: list[ReplyEvent] = []
        for piece in pieces:
            if isinstance(piece, Reasoning):
                events.append(piece)
            elif self._parser is None:
                events += [Content(piece)] if piece else []
            else:
                events += self._parser.feed(piece)
        if final and self._parser is not None:
            events += self._parser.finish()
        if self._most_calls is not None:  # parallel_tool_calls false: the calls past the first go
            events = [e for e in events if not isinstance(e, ToolCall) or e.index < self._most_calls]
        if self._hold:
            self._held += events
            if not final:
                return []
            events, self._held = self._held, []
            assert self._parser is not None  # only a reply read for tool calls is held
            check_tool_choice(self.tool_choice, self.calls, "".join(self._text))
        self._content += [event.text for event in events if isinstance(event, Content)]
        self._reasoning += [event.text for event in events if isinstance(event, Reasoning)]
        return events


class ReplyItems:
    """What the Responses and Messages writers share: a reply's events as the items (or
    content blocks) of one output, text of one kind written into one item until
    something else comes, each tool call an item of its own. Subclasses write each
    kind of item in their API's events."""

    def events(self, events: list[ReplyEvent]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for event in events:
            if isinstance(event, Content | Reasoning):
                if event.text:
                    out += self._text(event)
            else:
                out += self._close()
                out += self._call(event)
        return out

    def _text(self, event: Content | Reasoning) -> list[dict[str, Any]]:
        raise NotImplementedError

    def _close(self) -> list[dict[str, Any]]:
        raise NotImplementedError

    def _call(self, call: ToolCall) -> list[dict[str, Any]]:
        raise NotImplementedError


def reply_reader(
    body: CallRequest, tool_format: str = DEFAULT_FORMAT, reasoning_parser: str = ""
) -> ReplyReader:
    """How a call's reply is read, the same on every front (the router's HTTP and
    `CallModel`, the sim worker's HTTP): a chat call that offers tools gets its tool
    calls read in `tool_format` and its tool_choice checked; a chat call to a reasoning
    model (`reasoning_parser`) gets its thinking apart; other replies are content as
    they come (text completions are the model's text, as vLLM's)."""
    if not isinstance(body, ChatCompletionRequest):
        return ReplyReader()
    return ReplyReader(
        parse_tool_calls=body.parses_tool_calls,
        tool_format=tool_format,
        tool_choice=body.tool_choice if body.parses_tool_calls else None,
        reasoning_parser=reasoning_parser,
        single_call=body.parallel_tool_calls is False,
    )


def chat_completion(
    call_id: str,
    created: int,
    model: str,
    text: str,
    reason: str,
    usage_: dict[str, Any],
    *,
    parse_tool_calls: bool = False,
    tool_format: str = DEFAULT_FORMAT,
    tool_choice: str | dict[str, Any] | None = None,
    new_id: Callable[[], str] = new_call_id,
) -> dict[str, Any]:
    """With `parse_tool_calls`, tool calls in the text (inferx.openai_compat.toolcalls,
    in `tool_format`) become `message.tool_calls` and the finish reason 'tool_calls'
    ('stop' for a named tool_choice, as OpenAI says). A reply that does not follow a
    "required" or named `tool_choice` raises ToolChoiceNotFollowed."""
    reader = ReplyReader(
        parse_tool_calls=parse_tool_calls, tool_format=tool_format, tool_choice=tool_choice, new_id=new_id
    )
    reader.feed(text)
    reader.finish()
    return chat_reply(call_id, created, model, reader, reason, usage_)


def chat_reply(
    call_id: str, created: int, model: str, reader: ReplyReader, reason: str, usage_: dict[str, Any]
) -> dict[str, Any]:
    """A chat completion of a reply `reader` has read to its end."""
    message: dict[str, Any] = {"role": "assistant", "content": reader.content}
    if reader.reasoning is not None:
        message["reasoning_content"] = reader.reasoning
    if reader.calls:
        message["tool_calls"] = [call.as_openai() for call in reader.calls]
    return {
        "id": call_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": finish_reason(reason, reader.called),
                "logprobs": None,
            }
        ],
        "usage": usage_,
    }


def chat_chunk(
    call_id: str,
    created: int,
    model: str,
    delta: dict[str, Any],
    reason: str | None = None,
    *,
    tool_calls: bool = False,
) -> dict[str, Any]:
    return {
        "id": call_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "delta": delta,
                "finish_reason": None if reason is None else finish_reason(reason, tool_calls),
                "logprobs": None,
            }
        ],
    }


class ChatChunks:
    """The chunks of a streamed chat completion, as OpenAI sends them: the role first,
    then content deltas as text arrives; each tool call as two deltas (its index, id,
    type and name with empty arguments; then the arguments), and the finish reason
    'tool_calls' when the reply called tools ('stop' for a named tool_choice). The text
    is read by a `ReplyReader` (see it for what is held back and when `finish` raises
    ToolChoiceNotFollowed): its own, made from the arguments, or `reader`, one the
    router runs inside the call (then `events` and `end` take what it read)."""

    def __init__(
        self,
        call_id: str,
        created: int,
        model: str,
        *,
        parse_tool_calls: bool = False,
        tool_format: str = DEFAULT_FORMAT,
        tool_choice: str | dict[str, Any] | None = None,
        new_id: Callable[[], str] = new_call_id,
        reader: ReplyReader | None = None,
    ) -> None:
        self._head = (call_id, created, model)
        self.reader = reader or ReplyReader(
            parse_tool_calls=parse_tool_calls, tool_format=tool_format, tool_choice=tool_choice, new_id=new_id
        )

    def _chunk(self, delta: dict[str, Any], reason: str | None = None) -> dict[str, Any]:
        return chat_chunk(*self._head, delta, reason, tool_calls=self.reader.called)

    def start(self) -> dict[str, Any]:
        return self._chunk({"role": "assistant", "content": ""})

    def text(self, piece: str) -> list[dict[str, Any]]:
        return self.events(self.reader.feed(piece))

    def finish(self, engine_reason: str) -> list[dict[str, Any]]:
        """The held-back rest, then the chunk with the finish reason."""
        return [*self.events(self.reader.finish()), *self.end(engine_reason)]

    def end(self, engine_reason: str) -> list[dict[str, Any]]:
        """The chunk with the finish reason, once the reader has finished."""
        return [self._chunk({}, engine_reason)]

    def events(self, events: list[ReplyEvent]) -> list[dict[str, Any]]:
        chunks: list[dict[str, Any]] = []
        for event in events:
            if isinstance(event, Content | Reasoning):
                if event.text:
                    key = "content" if isinstance(event, Content) else "reasoning_content"
                    chunks.append(self._chunk({key: event.text}))
                continue
            named = {"index": event.index, "id": event.id, "type": "function"}
            named["function"] = {"name": event.name, "arguments": ""}
            arguments = {"index": event.index, "function": {"arguments": event.arguments}}
            chunks.append(self._chunk({"tool_calls": [named]}))
            chunks.append(self._chunk({"tool_calls": [arguments]}))
        return chunks


def text_completion(
    call_id: str, created: int, model: str, text: str, reason: str | None, usage_: dict[str, Any] | None
) -> dict[str, Any]:
    """A text completion, or (usage None) one chunk of a streamed one."""
    body: dict[str, Any] = {
        "id": call_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": text,
                "finish_reason": None if reason is None else finish_reason(reason),
                "logprobs": None,
            }
        ],
    }
    if usage_ is not None:
        body["usage"] = usage_
    return body


def usage_chunk(call_id: str, created: int, model: str, object_: str, usage_: dict[str, Any]) -> dict:
    """The last chunk of a stream asked for with stream_options.include_usage."""
    return {
        "id": call_id,
        "object": object_,
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage_,
    }


def model_card(name: str, created: int) -> dict[str, Any]:
    """One model as `GET /v1/models/{model}` gives it (and each entry of the list)."""
    return {"id": name, "object": "model", "created": created, "owned_by": "inferx"}


def model_list(names: list[str], created: int) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(name, created) for name in names]}


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event carrying a JSON payload (UTF-8, not ASCII escapes, as vLLM
    writes it). Every streamed token goes through here: orjson writes a chunk in a tenth
    of the standard library's time."""
    body = json_text.dumps(payload, sendable=True)
    return f"data: {body}\n\n"


SSE_DONE = "data: [DONE]\n\n"
