"""The front's JSON reading and writing (inferx.openai_compat.json_text: orjson where it
gives the same values, the standard library where it would not), and the chat rendering
done once for the prompt and its shared head (render.render_chat_and_head)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferx.errors import InvalidArgument
from inferx.openai_compat import json_text
from inferx.openai_compat.render import GENERATION_MARK, chat_json, render_chat_and_head, shared_head
from inferx.openai_compat.schema import ChatMessage, CompletionRequest, load_object, parse_body

# Values as JSON has them, with what orjson reads or writes unlike json: integers past 64
# bits (either sign), floats near a double's limits, surrogates, NUL, digits in strings.
texts = st.lists(
    st.one_of(
        st.characters(), st.integers(0xD800, 0xDFFF).map(chr), st.sampled_from(["\0", "1234567890" * 2])
    ),
    max_size=8,
).map("".join)
numbers = (
    st.integers()
    | st.integers(min_value=2**62, max_value=2**70)
    | st.integers(min_value=-(2**70), max_value=-(2**62))
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from([1e308, -1e308, 5e-324, 0.1, -0.0])
)
values = st.recursive(
    st.none() | st.booleans() | numbers | texts,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=16,
)


def reference_loads(raw: bytes | str) -> Any:
    """What the front read before orjson: json.loads, refusing NaN and Infinity."""
    return json.loads(raw, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))


def same(a: Any, b: Any) -> bool:
    """Equal and of the same types all the way down (1 and 1.0 differ; -0.0 and 0.0 too)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return math.copysign(1, a) == math.copysign(1, b) and (a == b or (math.isnan(a) and math.isnan(b)))
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


@settings(max_examples=400, deadline=None)
@given(value=values, ascii_escapes=st.booleans(), as_bytes=st.booleans())
def test_loads_reads_what_json_reads(value: Any, ascii_escapes: bool, as_bytes: bool) -> None:
    text = json.dumps(value, ensure_ascii=ascii_escapes)
    raw: bytes | str = text.encode("utf-8", "surrogatepass") if as_bytes else text
    assert same(json_text.loads(raw), reference_loads(raw))


@settings(max_examples=400, deadline=None)
@given(value=values)
def test_dumps_writes_what_json_writes(value: Any) -> None:
    expected = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    written = json_text.dumps(value)
    assert same(json.loads(written), json.loads(expected))  # the same values; floats may be spelt apart


@pytest.mark.parametrize(
    "raw",
    [b'{"a": NaN}', b'{"a": Infinity}', b'{"a": -Infinity}', b'{"a": 1e400}', b'{"a": -1e999}'],
)
def test_non_json_numbers_are_refused(raw: bytes) -> None:
    """Python's json reads them (as nan and inf); they are not JSON, and orjson would
    write them back as null: a body holding one is a 400."""
    with pytest.raises(ValueError):
        json_text.loads(raw)
    with pytest.raises(InvalidArgument, match="not valid JSON"):
        load_object(raw)


def test_big_integers_stay_exact_in_a_body() -> None:
    """orjson would read this seed as a float; the body keeps the integer (and its range
    check names it)."""
    big = 123456789012345678901234567890
    assert load_object(b'{"seed": %d}' % big)["seed"] == big
    with pytest.raises(InvalidArgument, match="seed"):
        parse_body(CompletionRequest, b'{"model": "m", "prompt": "p", "seed": %d}' % big)


def test_a_body_in_utf16_or_with_a_bom_is_still_read() -> None:
    """RFC 8259 wants UTF-8; json reads UTF-16/32 and a BOM, and so did the front."""
    body = {"model": "m", "prompt": "héllo"}
    for raw in (json.dumps(body).encode("utf-16"), b"\xef\xbb\xbf" + json.dumps(body).encode()):
        assert load_object(raw) == body


messages = st.lists(
    st.builds(
        lambda role, content: ChatMessage.model_validate({"role": role, "content": content}),
        st.sampled_from(["system", "developer", "user", "assistant", "tool"]),
        st.text(max_size=12),
    ),
    min_size=1,
    max_size=6,
)
tool_lists = st.none() | st.lists(
    st.dictionaries(st.sampled_from(["type", "function", "x"]), values, max_size=3), max_size=3
)


@settings(max_examples=200, deadline=None)
@given(chat=messages, tools=tool_lists, choice=st.none() | st.sampled_from(["auto", "required"]))
def test_one_rendering_gives_the_prompt_and_its_head(
    chat: list[ChatMessage], tools: Any, choice: Any
) -> None:
    # (render_chat is this one's prompt; its exact text is pinned in test_openai_compat.py)
    prompt, head = render_chat_and_head(chat, tools, choice)
    assert head == shared_head(chat, tools)
    assert prompt.startswith(head) and prompt.endswith(GENERATION_MARK)


def test_chat_json_reads_tool_arguments_as_json_reads_them() -> None:
    """A tool call's arguments go to the template as an object where they are a JSON
    object's text -- with big integers exact -- and as the text where they are not JSON
    (NaN included)."""
    big = 2**70

    def call(arguments: str) -> ChatMessage:
        return ChatMessage.model_validate(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
                ],
            }
        )

    sent = json.loads(chat_json([call(json.dumps({"n": big}))]))
    assert sent["messages"][0]["tool_calls"][0]["function"]["arguments"] == {"n": big}
    sent = json.loads(chat_json([call('{"n": NaN}')]))
    assert sent["messages"][0]["tool_calls"][0]["function"]["arguments"] == '{"n": NaN}'
