"""A reasoning model's thinking, read out of its reply text as vLLM's reasoning parsers
do, so that OpenAI clients get it apart (`reasoning_content`) and tool calls are read
from the answer only (a call the model merely thinks about is not made).

Two parsers, named as vLLM's `--reasoning-parser` (pure; no I/O):

`deepseek_r1` (DeepSeek-R1 and its distills; QwQ): the chat template opens the thinking
in the prompt, so the reply starts inside it (an opening `<think>` it writes again is
dropped) and everything up to `</think>` is reasoning, the rest the answer. A reply that
never closes its thinking is reasoning throughout, as in vLLM.

`qwen3` (Qwen3, and the `openai` engine, which writes a server's reasoning back between
explicit tags): reasoning only when the reply begins with `<think>` (after whitespace);
a reply that does not is answer throughout.

Streamed, text is given as soon as it cannot be part of a tag: only a possible partial
`<think>` or `</think>` at the end of the text so far is held back, so the reasoning and
answer of any split of a reply are those of the whole (tests/unit/test_reasoning.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from inferx.openai_compat.toolcalls import partial_end

DEEPSEEK_R1, QWEN3 = "deepseek_r1", "qwen3"
REASONING_PARSERS = (DEEPSEEK_R1, QWEN3)
THINK, END_THINK = "<think>", "</think>"


def check_reasoning_parser(name: str) -> str:
    """`name` when it is a known reasoning parser ("" for none); ValueError otherwise."""
    if name and name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}: expected one of {', '.join(REASONING_PARSERS)}")
    return name


@dataclass(frozen=True)
class Reasoning:
    """A piece of the model's thinking (OpenAI-compatible servers' `reasoning_content`)."""

    text: str


class ReasoningSplitter:
    """One reply's text, fed in pieces, as Reasoning pieces and answer text (str)."""

    def __init__(self, parser: str) -> None:
        self.parser = check_reasoning_parser(parser)
        if not parser:
            raise ValueError("a reasoning splitter needs a parser")
        # start: whether a <think> opens the reply is not decided yet; thinking: until
        # </think>; answer: the rest.
        self._state = "start"
        self._buffer = ""

    def feed(self, text: str) -> list[Reasoning | str]:
        self._buffer += text
        return self._drain(final=False)

    def finish(self) -> list[Reasoning | str]:
        return self._drain(final=True)

    def _drain(self, *, final: bool) -> list[Reasoning | str]:
        out: list[Reasoning | str] = []
        if self._state == "start":
            head = self._buffer.lstrip()
            if head.startswith(THINK):
                self._buffer = head[len(THINK) :]
                self._state = "thinking"
            elif not final and THINK.startswith(head):
                return out  # whitespace, or a partial <think>, so far
            else:
                self._state = "thinking" if self.parser == DEEPSEEK_R1 else "answer"
        if self._state == "thinking":
            end = self._buffer.find(END_THINK)
            if end < 0:
                keep = 0 if final else partial_end(self._buffer, END_THINK)
                thought = self._buffer[: len(self._buffer) - keep]
                self._buffer = self._buffer[len(self._buffer) - keep :]
                if thought:
                    out.append(Reasoning(thought))
                return out
            if end:
                out.append(Reasoning(self._buffer[:end]))
            self._buffer = self._buffer[end + len(END_THINK) :]
            self._state = "answer"
        if self._buffer:
            out.append(self._buffer)
            self._buffer = ""
        return out


def split_reasoning(text: str, parser: str) -> tuple[str | None, str]:
    """The reasoning (None when there is none) and the answer of a whole reply."""
    splitter = ReasoningSplitter(parser)
    pieces = splitter.feed(text) + splitter.finish()
    thought = "".join(p.text for p in pieces if isinstance(p, Reasoning))
    return thought or None, "".join(p for p in pieces if isinstance(p, str))
