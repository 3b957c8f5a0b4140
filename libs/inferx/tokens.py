"""Token estimates for admission and KV reservations, before the engine has tokenized.

The worker reports the exact counts afterwards; this only has to err on the large
side so reservations are not too small. Byte-level BPE on English averages about
4 characters per token; small vocabularies produce more tokens, so we assume 3.
"""

import math

CHARS_PER_TOKEN = 3.0
# A hop that sets no `max_tokens` may generate this many (the chain schema's default).
DEFAULT_MAX_TOKENS = 64


def estimate_tokens(text: str) -> int:
    return max(1, math.ceil(len(text) / CHARS_PER_TOKEN))


def kv_tokens(prompt_tokens: int, max_tokens: int) -> int:
    """KV a hop may pin while it runs: its whole prompt plus what it may generate."""
    return prompt_tokens + (max_tokens or DEFAULT_MAX_TOKENS)
