"""Token estimates for admission and KV reservations, before the engine has tokenized.

The worker reports the exact counts afterwards. Before any has (and wherever no
engine's count comes back, as in the router's cost figures) the estimate errs on the
large side so reservations are not too small: byte-level BPE on English averages about
4 characters per token; small vocabularies produce more tokens, so we assume 3. The
scheduler replaces that prior with each pool's own ratio once learned (`TokenRatio`).
"""

import hashlib
import math
from collections import deque
from dataclasses import dataclass, field

CHARS_PER_TOKEN = 3.0
# A chain node's `max_tokens` when its config sets none (the chain schema's default), and
# what the scheduler reserves KV for when a call sets none (an OpenAI-style call without
# `max_tokens` generates until the model stops or its context is full; the engine caps it,
# and reserving the whole context for every such call would starve admission).
DEFAULT_MAX_TOKENS = 64


def estimate_tokens(text: str) -> int:
    return max(1, math.ceil(len(text) / CHARS_PER_TOKEN))


@dataclass
class TokenRatio:
    """Engine tokens per prompt character in one pool, learned from the exact counts its
    workers report for finished hops (the ratio of the sums over the latest `window`);
    `1 / CHARS_PER_TOKEN` until `min_samples` were seen.

    The scheduler prices a hop before any engine has tokenized it, but compares that
    estimate with what workers counted: the context a chain left cached on a worker is
    the worker's prompt + output tokens. An estimate off by a constant factor then reads
    as uncached prefill on every hop (at 3 characters per token against an engine
    cutting 4, a quarter of each prompt), which makes long-context hops look heavy and
    every worker look fuller than it is. So the estimate is the engine's own ratio, not
    a cautious one: a reservation's margin is the hop's `max_tokens`, which the output
    rarely fills."""

    window: int = 256
    min_samples: int = 8
    _samples: deque[tuple[int, int]] = field(default_factory=deque, repr=False)
    _chars: int = field(default=0, repr=False)
    _tokens: int = field(default=0, repr=False)

    @property
    def learned(self) -> bool:
        return len(self._samples) >= self.min_samples and self._chars > 0

    @property
    def tokens_per_char(self) -> float:
        return self._tokens / self._chars if self.learned else 1 / CHARS_PER_TOKEN

    def estimate(self, text: str) -> int:
        """The prompt's tokens as this pool's engines would count them."""
        if not self.learned:
            return estimate_tokens(text)
        return max(1, math.ceil(len(text) * self.tokens_per_char))

    def rescale(self, estimate: int) -> int:
        """An `estimate_tokens` figure made elsewhere (the router's), in this pool's tokens."""
        if estimate <= 0 or not self.learned:
            return estimate
        return max(1, math.ceil(estimate * CHARS_PER_TOKEN * self.tokens_per_char))

    def observe(self, chars: int, tokens: int) -> None:
        """A finished hop: its prompt had `chars` characters, its engine counted `tokens`."""
        if chars <= 0 or tokens <= 0:
            return  # nothing counted (an engine that reports no usage)
        self._samples.append((chars, tokens))
        self._chars += chars
        self._tokens += tokens
        if len(self._samples) > self.window:
            old_chars, old_tokens = self._samples.popleft()
            self._chars -= old_chars
            self._tokens -= old_tokens


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
