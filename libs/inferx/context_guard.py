"""The context-length guard (pure): a prompt that would not fit a node's
`max_context_tokens` (prompt + completion) is either rejected with a clear message or
truncated: whole middle lines go first, oldest first, so the system prompt at the top
and the newest turns at the bottom survive. A worker never sees a prompt that would
run it out of memory."""

from __future__ import annotations

from collections.abc import Callable


class ContextTooLong(Exception):
    pass


def prompt_budget(max_context_tokens: int, max_tokens: int) -> int:
    return max_context_tokens - max_tokens


def check_or_truncate(
    prompt: str,
    *,
    max_context_tokens: int,
    max_tokens: int,
    count: Callable[[str], int],
    truncate: bool,
) -> tuple[str, int]:
    """(prompt to run, lines dropped). Raises ContextTooLong when it cannot fit."""
    budget = prompt_budget(max_context_tokens, max_tokens)
    if budget <= 0:
        raise ContextTooLong(
            f"max_tokens {max_tokens} leaves no room for a prompt "
            f"within max_context_tokens {max_context_tokens}"
        )
    tokens = count(prompt)
    if tokens <= budget:
        return prompt, 0
    if not truncate:
        raise ContextTooLong(
            f"prompt has {tokens} tokens; with max_tokens {max_tokens} it exceeds "
            f"max_context_tokens {max_context_tokens} (set context_overflow: truncate to cut it)"
        )
    lines = prompt.split("\n")
    head, middle, tail = lines[:1], lines[1:-1], lines[-1:] if len(lines) > 1 else []
    dropped = 0
    while middle:
        middle.pop(0)
        dropped += 1
        candidate = "\n".join(head + middle + tail)
        if count(candidate) <= budget:
            return candidate, dropped
    candidate = "\n".join(head + tail)
    if count(candidate) <= budget:
        return candidate, dropped
    raise ContextTooLong(
        f"even without its middle lines the prompt has {count(candidate)} tokens, more than the "
        f"{budget} that max_context_tokens {max_context_tokens} leaves with max_tokens {max_tokens}"
    )
