"""Priced KV retention across a chain's tool calls: keep its context or let it go?

When a chain's hop ends and the chain goes off to a tool (or its user thinks), its
context sits in the worker's prefix cache. Keeping it there (holding the room: no other
work is admitted over it) saves re-prefilling it when the chain comes back; letting
it go frees the room for others. Which is cheaper depends on how long the gap will be,
which nobody knows in advance -- so it is learned online from the gaps already seen
(`GapModel`), never read from a trace.

The price (`hold_seconds`): both costs in GPU-seconds.
  * re-prefilling `tokens` costs `tokens / prefill_tokens_per_s`;
  * holding them for `t` seconds costs `tokens * t / kv_capacity_tokens`: a worker's
    whole KV pays for the whole GPU, so when memory is what limits the worker (the only
    time a hold matters: without contention nothing waits for the held room) a token
    of KV for a second is worth 1/capacity of a GPU-second.
Holding for `T` and releasing if the chain has not come back by then costs, expected
over the learned gaps g: `tokens * E[min(g, T)] / capacity + P(T < g < inf) * reprefill`.
A program that never came back (g = inf: it ended, and nobody said so -- an OpenAI-front
agent rarely does) is learned too (`GapModel.observe_end`): holding for it is pure
waste and it costs no re-prefill. Without these the model learns only from the programs
that returned, and holds every program's last context as if it would.
`hold_seconds` picks the `T` (0, or one of the observed gaps) that minimises it. With
no gaps seen yet it holds for the break-even time `capacity / prefill_tokens_per_s`
(rent-or-buy: never worse than twice the best choice made knowing the gap). Tokens
cancel out of the comparison, so a small-KV engine (MHA, long contexts) holds for
less time than a large-KV one, and a program whose tool calls are short keeps its KV
while one waiting minutes on a test run lets it go.

With a KV offload tier on the worker (host memory the engine evicts prefix blocks to,
`reload_tokens_per_s` given), a context let go is not lost: it comes back over PCIe at
`tokens / reload_tokens_per_s` (the chain waits for the copy; compute does not), so
letting go costs the smaller of that and the re-prefill. Loading back is several times
faster than prefilling, so the break-even hold shrinks by as much: with offload the
scheduler holds for less and lends the room to others sooner. `offload_fits` says
whether a context may count on the tier.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Sequence


class GapModel:
    """Recent gaps (seconds between a chain's hop ending and its next hop arriving),
    per program kind (e.g. the shared prefix the chain's prompts start with); `inf` for
    a chain that never came back.

    The scheduler prices a hold on every hop's finish, so the sorted gaps are kept
    sorted as they come and go (not sorted again per price), and a price is remembered
    until the kind's gaps change (`price`): the same answer as `hold_seconds` over
    `samples`, without redoing it."""

    def __init__(self, window: int = 256) -> None:
        self.window = window
        self._gaps: dict[str, deque[float]] = {}
        self._sorted: dict[str, list[float]] = {}
        self._prices: dict[str, tuple[tuple[float, ...], float]] = {}  # kind -> (inputs, hold)

    def observe(self, kind: str, seconds: float) -> None:
        if seconds < 0:
            return
        self._add(kind, seconds)

    def observe_end(self, kind: str) -> None:
        """A chain of `kind` was forgotten idle, never having come back: a gap of inf."""
        self._add(kind, math.inf)

    def _add(self, kind: str, seconds: float) -> None:
        gaps = self._gaps.get(kind)
        if gaps is None:
            gaps = self._gaps[kind] = deque(maxlen=self.window)
            self._sorted[kind] = []
        ordered = self._sorted[kind]
        if len(gaps) == gaps.maxlen:  # the oldest leaves the window
            del ordered[bisect.bisect_left(ordered, gaps[0])]
        gaps.append(seconds)
        bisect.insort(ordered, seconds)
        self._prices.pop(kind, None)

    def samples(self, kind: str) -> list[float]:
        """The kind's recent gaps, sorted (empty when none were seen; ends last, as inf)."""
        return list(self._sorted.get(kind, ()))

    def price(
        self,
        kind: str,
        *,
        kv_capacity_tokens: int,
        prefill_tokens_per_s: float,
        max_hold_s: float,
        reload_tokens_per_s: float = 0.0,
    ) -> float:
        """`hold_seconds` over the kind's gaps, remembered until they change."""
        inputs = (kv_capacity_tokens, prefill_tokens_per_s, max_hold_s, reload_tokens_per_s)
        known = self._prices.get(kind)
        if known is not None and known[0] == inputs:
            return known[1]
        hold = hold_seconds(
            self._sorted.get(kind, ()),
            kv_capacity_tokens=kv_capacity_tokens,
            prefill_tokens_per_s=prefill_tokens_per_s,
            max_hold_s=max_hold_s,
            reload_tokens_per_s=reload_tokens_per_s,
        )
        if kind in self._gaps:  # a kind never seen is not remembered (no bound on kinds asked)
            self._prices[kind] = (inputs, hold)
        return hold


def hold_seconds(
    gaps: Sequence[float],
    *,
    kv_capacity_tokens: int,
    prefill_tokens_per_s: float,
    max_hold_s: float,
    reload_tokens_per_s: float = 0.0,
) -> float:
    """How long to hold a chain's context after its hop (see the module docstring).
    `gaps`: the learned gaps, sorted ascending (inf: never came back). Independent of
    the context's size. `reload_tokens_per_s`: how fast a context let go comes back from
    the worker's KV offload tier (0: there is none, a context let go is re-prefilled)."""
    if kv_capacity_tokens <= 0:
        return max_hold_s  # unknown memory: nothing to price it by
    # Letting go costs the cheaper way back, per token.
    prefill_tokens_per_s = max(prefill_tokens_per_s, reload_tokens_per_s)
    # Per token: holding 1 s costs 1/capacity GPU-s; re-prefilling costs 1/rate GPU-s.
    break_even_s = kv_capacity_tokens / prefill_tokens_per_s
    if not gaps:
        return min(break_even_s, max_hold_s)
    n = len(gaps)
    returning = bisect.bisect_left(gaps, math.inf)  # sorted: the ended ones (inf) are last
    # The holds to choose from: 0, or an observed gap within the bound (never an end's inf).
    within = min(bisect.bisect_right(gaps, max_hold_s), returning)
    # In units of 1/(n * capacity) GPU-seconds per token, holding for T = gaps[i] costs
    #   sum(gaps[:i+1]) + gaps[i] * (n - i - 1)   (n * E[min(g, T)]: token-seconds held)
    #   + (returning - i - 1) * break_even_s       (the re-prefills of those back after T).
    # Less (returning - 1) * break_even_s for every T, that is break_even_s for T = 0, and
    # from one candidate to the next it grows by (gaps[i] - gaps[i-1]) * (n - i) less one
    # break_even_s: a few operations per gap (the scheduler prices on every hop's finish).
    best_t = previous = 0.0
    best = cost = break_even_s
    still_away = n  # gaps not yet ended at the previous candidate: n - i
    for t in gaps[:within]:
        cost += (t - previous) * still_away - break_even_s
        still_away -= 1
        previous = t
        if cost < best:
            best_t, best = t, cost
    return best_t


def offload_fits(context_tokens: int, host_kv_capacity_tokens: int, share: float) -> bool:
    """Whether a context let go may count on the worker's offload tier to keep it: the
    tier is LRU and shared by every context the worker evicts, so only one that takes
    at most `share` of it is likely to still be there when its chain comes back."""
    return host_kv_capacity_tokens > 0 and context_tokens <= host_kv_capacity_tokens * share


# What became of a client's retention hint (`client_hold`): the hold is the hint as
# given, cut to the longest hold, zero (let go at once), or the priced hold (mode
# "cap" with a price below the hint; mode "off").
HINT_HELD, HINT_CAPPED, HINT_RELEASED, HINT_PRICED = "held", "capped", "released", "priced"
HINT_ENDED = "ended"  # the hop was its program's last: nothing is held, whatever the hint


def client_hold(priced_s: float, hint_s: float | None, *, mode: str, max_hold_s: float) -> tuple[float, str]:
    """How long to hold a chain's context after its hop when its client gave a KV
    retention hint (`hint_s`: seconds to keep it; agentic_context's kv_retention_ttl),
    and what became of the hint ("" when none was given: the priced hold stands).

    `mode` "override" (the default) takes the hint for this gap, in place of the price:
    the client knows what it is about to do (a 30 s test run, a user typing, the end of
    its work) while the price only knows the gaps of the program's kind so far. "cap"
    lets a hint only shorten the priced hold (an operator who does not trust clients
    with KV). "off" ignores hints. In every mode a hint of 0 lets go at once (outside
    "off"), and no hold exceeds `max_hold_s`: a client cannot keep room longer than the
    operator allows any chain."""
    if hint_s is None or mode == "off":
        return priced_s, "" if hint_s is None else HINT_PRICED
    if hint_s <= 0:
        return 0.0, HINT_RELEASED
    if mode == "cap" and priced_s < hint_s:
        return priced_s, HINT_PRICED if priced_s > 0 else HINT_RELEASED
    if hint_s > max_hold_s:
        return max_hold_s, HINT_CAPPED
    return hint_s, HINT_HELD
