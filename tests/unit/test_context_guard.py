"""Context guard: reject, or truncate the oldest middle lines keeping the system line."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from inferx.context_guard import ContextTooLong, check_or_truncate


def words(text: str) -> int:
    return len(text.split())


def test_fitting_prompt_passes_untouched() -> None:
    assert check_or_truncate("a b c", max_context_tokens=10, max_tokens=5, count=words, truncate=False) == (
        "a b c",
        0,
    )


def test_reject_names_the_numbers() -> None:
    with pytest.raises(ContextTooLong, match="prompt has 6 tokens.*max_context_tokens 8"):
        check_or_truncate("a b c d e f", max_context_tokens=8, max_tokens=4, count=words, truncate=False)


def test_truncate_drops_oldest_middle_lines_first() -> None:
    prompt = "SYSTEM rules\nturn1 x x\nturn2 y y\nturn3 z z\nQUESTION now"
    out, dropped = check_or_truncate(prompt, max_context_tokens=10, max_tokens=3, count=words, truncate=True)
    assert out == "SYSTEM rules\nturn3 z z\nQUESTION now"
    assert dropped == 2


def test_truncate_fails_clearly_when_head_and_tail_alone_are_too_long() -> None:
    with pytest.raises(ContextTooLong, match="without its middle lines"):
        check_or_truncate(
            "a b c d\nm\ne f g h", max_context_tokens=6, max_tokens=1, count=words, truncate=True
        )


@given(st.lists(st.text(alphabet="ab ", max_size=12), min_size=1, max_size=12), st.integers(1, 40))
def test_truncated_prompt_always_fits_and_keeps_first_and_last_line(lines, limit) -> None:
    prompt = "\n".join(lines)
    try:
        out, _ = check_or_truncate(
            prompt, max_context_tokens=limit + 2, max_tokens=2, count=len, truncate=True
        )
    except ContextTooLong:
        return
    assert len(out) <= limit
    assert out.split("\n")[0] == lines[0]
    if len(lines) > 1:
        assert out.split("\n")[-1] == lines[-1]
