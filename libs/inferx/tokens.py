"""Token estimates for admission and KV reservations, before the engine has tokenized.

The worker reports the exact counts afterwards; this only has to err on the large
side so reservations are not too small. Byte-level BPE on English averages about
4 characters per token; small vocabularies produce more tokens, so we assume 3.
"""

import hashlib
import math

CHARS_PER_TOKEN = 3.0
# A chain node's `max_tokens` when its config sets none (the chain schema's default), and
# what the scheduler reserves KV for when a call sets none (an OpenAI-style call without
# `max_tokens` generates until the model stops or its context is full; the engine caps it,
# and reserving the whole context for every such call would starve admission).
DEFAULT_MAX_TOKENS = 64


def estimate_tokens(text: str) -> int:
    return max(1, math.ceil(len(text) / CHARS_PER_TOKEN))


def kv_tokens(prompt_tokens: int, max_tokens: int) -> int:
    """KV a hop may pin while it runs: its whole prompt plus what it may generate."""
    return prompt_tokens + (max_tokens or DEFAULT_MAX_TOKENS)


# vLLM's default KV block: an engine caches whole blocks only, so a shared head shorter
# than one is never a prefix-cache hit and is not worth naming.
MIN_SHARED_PREFIX_TOKENS = 16


def shared_prefix(head: str) -> tuple[str, int]:
    """(id, token estimate) of a prompt's shared head -- text other runs and programs
    send first too (a template's static text, a chat's tool specs and system messages):
    equal text, equal id, so policies can tell which chains share a cached prefix. ("", 0)
    when the head is shorter than one KV block."""
    tokens = estimate_tokens(head) if head else 0
    if tokens < MIN_SHARED_PREFIX_TOKENS:
        return "", 0
    return hashlib.blake2b(head.encode(), digest_size=8).hexdigest(), tokens
