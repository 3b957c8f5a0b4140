"""A model's own chat template (Jinja, as Hugging Face tokenizers ship it), rendered
without transformers: what the sim worker uses for the model directory it is given.

The environment is the one `transformers.PreTrainedTokenizerBase.apply_chat_template`
renders in (sandboxed, `trim_blocks`/`lstrip_blocks`, `loopcontrols`, its `tojson`
filter, `raise_exception` and `strftime_now`, the tokenizer's special tokens as
variables), so a template renders here exactly as it does there
(tests/unit/test_chat_template.py compares the two). The vLLM worker uses its
tokenizer's own `apply_chat_template`.

    template = ChatTemplate.from_model_dir(Path(".inferx/models/tiny-llama"))
    prompt = template.render(messages, tools=tools)   # ends with the generation prompt
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from inferx.openai_compat import json_text

# Where a model directory keeps its template: transformers >= 4.43 writes
# chat_template.jinja, older ones a "chat_template" key in tokenizer_config.json.
TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The template could not render this chat (it raised, or it is not valid Jinja)."""


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant tokens with
    it for training masks): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # transformers' own: the built-in filter escapes HTML characters, this one does not.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(format_: str) -> str:
    return datetime.now().strftime(format_)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


class ChatTemplate:
    def __init__(
        self, source: str, special_tokens: Mapping[str, str] | None = None, origin: str = ""
    ) -> None:
        """`source`: the Jinja text; `special_tokens`: bos_token, eos_token, ... as the
        template sees them; `origin`: where it was read from (for messages)."""
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self.origin = origin
        try:
            self._compiled = _environment().from_string(source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template{self._where()} is not valid Jinja: {exc}") from None

    def _where(self) -> str:
        return f" from {self.origin}" if self.origin else ""

    @classmethod
    def from_model_dir(cls, path: Path) -> ChatTemplate | None:
        """The template a model directory ships, None when it has none (or `path` is not
        a directory). A named-template list ([{"name": "default", "template": ...}, ...])
        gives its "default" one. ChatTemplateError when the template is not valid Jinja."""
        path = Path(path)
        config: dict[str, Any] = {}
        if (path / TOKENIZER_CONFIG).is_file():
            loaded = json.loads((path / TOKENIZER_CONFIG).read_text(encoding="utf-8"))
            config = loaded if isinstance(loaded, dict) else {}
        tokens = {
            name: text for name in _SPECIAL_TOKENS if (text := _token_text(config.get(name))) is not None
        }
        if (path / TEMPLATE_FILE).is_file():
            origin = path / TEMPLATE_FILE
            return cls(origin.read_text(encoding="utf-8"), tokens, str(origin))
        source = config.get("chat_template")
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if not isinstance(source, str) or not source:
            return None
        return cls(source, tokens, str(path / TOKENIZER_CONFIG))

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **variables: Any,
    ) -> str:
        """The prompt for `messages` (and `tools`, OpenAI tool specs), with the
        generation prompt at the end unless told otherwise. ChatTemplateError when the
        template refuses the chat (raise_exception) or fails on it."""
        try:
            return self._compiled.render(
                **self.special_tokens,
                **variables,
                messages=list(messages),
                tools=list(tools) if tools else None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
            )
        # What the template said, not where it lives: this message goes back to the
        # caller (a 400), and a server's file paths are not the client's business (the
        # worker names its template file when it loads it).
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the model's chat template: {exc}") from None
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise ChatTemplateError(f"the model's chat template failed on this chat: {exc!r}") from None


@dataclass(frozen=True)
class Chat:
    """A chat to render: what GenerateRequest.chat_json carries."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    # The client's tool_choice, as it gave it (templates do not read it; an engine that
    # sends the chat to a server's /v1/chat/completions passes it on).
    tool_choice: str | dict[str, Any] | None = None

    @classmethod
    def from_json(cls, raw: str) -> Chat:
        """ValueError naming what is wrong when `raw` is not {"messages": [{...}, ...],
        "tools": [{...}, ...], "tool_choice": "auto" | {...}} (tools, tool_choice optional)."""
        try:
            value = json_text.loads(raw)
        except ValueError as exc:
            raise ValueError(f"chat_json: not JSON ({exc})") from None
        except RecursionError:
            raise ValueError("chat_json: nested too deeply") from None
        if not isinstance(value, dict):
            raise ValueError("chat_json: expected a JSON object")
        messages, tools = value.get("messages"), value.get("tools")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ValueError("chat_json.messages: expected a non-empty list of objects")
        if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
            raise ValueError("chat_json.tools: expected a list of objects")
        choice = value.get("tool_choice")
        if choice is not None and not isinstance(choice, str | dict):
            raise ValueError("chat_json.tool_choice: expected a string or an object")
        return cls(messages, tools or None, choice)
