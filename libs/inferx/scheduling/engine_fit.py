"""The engine's speed, learned from the hops it finishes.

Chain-aware prices engine time with two figures of the engine behind a pool: its
prefill rate (what moving a context to another worker, or re-prefilling one let go,
costs) and what a decode step pays per context token in its batch (what a realtime
hop loses next to long contexts). An operator may tell them (`inferx-scheduler
--engine-profile`); otherwise they were fixed at Llama-3-8B on an A100, whatever the
engine. `EngineFit` learns them from what every worker reports on a hop's last chunk
-- its time to first token, the prompt tokens it computed (not found cached), its
output tokens and its engine time -- so a pool on another GPU or model is priced by
its own speed; what it was told (or the default) is the prior until enough is seen.

Both are read off the *fastest* hops seen, not the mean: a hop's time to first token
is its prefill plus whatever it waited for in the engine (other prefills ahead of it,
the decode steps its chunks ride in), and a decode step's time grows with the prefill
chunks that share it. Those only ever add. So the prefill rate is the best rate
(prefilled tokens over time to first token) that hops of one size reach reliably (a
high quantile per size bucket; the best bucket, usually the largest, where fixed
per-step costs weigh least), which a hop can only fall short of; and the decode cost
per token of KV is the slope of the lower envelope of step time over KV in flight (a
low quantile per KV bucket, a straight line through them), fixed per-step costs in
its intercept. Attention makes a long context's prefill slower per token than a short
one's; the rate learned includes that, as far as the hops seen had long contexts.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class EngineSample:
    """What one finished hop says of its engine's speed (the worker's last chunk)."""

    prefill_tokens: int  # prompt tokens the engine computed (not served from its prefix cache)
    ttft_s: float  # engine time to the first token
    output_tokens: int
    decode_s: float  # engine time after the first token
    kv_in_flight: int = 0  # KV of the hops running on its worker meanwhile (the queue's count)


def _buckets(points: Sequence[tuple[float, float]], min_bucket: int) -> list[list[tuple[float, float]]]:
    """`points` by x in powers-of-two buckets, those with at least `min_bucket` points."""
    buckets: dict[int, list[tuple[float, float]]] = {}
    for x, y in points:
        if x > 0:
            buckets.setdefault(math.frexp(x)[1], []).append((x, y))
    return [members for members in buckets.values() if len(members) >= min_bucket]


def best_rate(
    points: Sequence[tuple[float, float]], quantile: float = 0.9, min_bucket: int = 8
) -> float | None:
    """The highest rate x / y that points of one x bucket reach at their `quantile`
    (powers-of-two buckets with at least `min_bucket` points); None without such a
    bucket or where y is never positive."""
    best: float | None = None
    for members in _buckets(points, min_bucket):
        rates = sorted(x / y for x, y in members if y > 0)
        if rates:
            rate = rates[int(quantile * (len(rates) - 1))]
            best = rate if best is None else max(best, rate)
    return best


def envelope_slope(
    points: Sequence[tuple[float, float]], quantile: float = 0.1, min_bucket: int = 8, rounds: int = 3
) -> float | None:
    """The slope of y over x along the low envelope of `points`: x in powers-of-two
    buckets, each bucket with at least `min_bucket` points giving one corner, the
    least-squares slope through the corners (weighted by their buckets' points). A
    bucket's corner is its point at the `quantile` of y less the slope found so far (a
    bucket spans 2x in x: ranked by y alone, its corner would sit at its low end
    whatever the slope); `rounds` refits.
    None with fewer than two such buckets (too little spread in x to tell a slope)."""
    buckets = _buckets(points, min_bucket)
    if len(buckets) < 2:
        return None
    weights = [len(members) for members in buckets]  # a corner of more points is surer
    total = sum(weights)
    slope = 0.0
    for _ in range(rounds):
        corners = []
        for members in buckets:
            members.sort(key=lambda point: point[1] - slope * point[0])
            corners.append(members[int(quantile * (len(members) - 1))])
        mean_x = sum(w * x for w, (x, _) in zip(weights, corners, strict=True)) / total
        mean_y = sum(w * y for w, (_, y) in zip(weights, corners, strict=True)) / total
        spread = sum(w * (x - mean_x) ** 2 for w, (x, _) in zip(weights, corners, strict=True))
        if spread <= 0:
            return None
        slope = (
            sum(w * (x - mean_x) * (y - mean_y) for w, (x, y) in zip(weights, corners, strict=True)) / spread
        )
    return slope


class EngineFit:
    """One pool's engine figures: the prior until the hops seen say otherwise.

    `prefill_tokens_per_s` = the best rate of prefilled tokens over time to first
    token (`best_rate`; hops that prefilled at least `min_prefill_tokens`: below that
    a first token is mostly one decode step). `kv_read_s_per_token` = the slope of a
    decode step's time (a hop's decode time over its output tokens) over the KV in
    flight on its worker (`envelope_slope`), at least 0. Each is refitted every
    `refit_every` samples over the last `window`; a fit that cannot tell (too few hops
    of a size, too little spread) keeps the last."""

    def __init__(
        self,
        prefill_tokens_per_s: float,
        kv_read_s_per_token: float,
        *,
        window: int = 512,
        refit_every: int = 32,
        min_prefill_tokens: int = 1024,
        min_output_tokens: int = 8,
    ) -> None:
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.kv_read_s_per_token = kv_read_s_per_token
        self.refit_every = refit_every
        self.min_prefill_tokens = min_prefill_tokens
        self.min_output_tokens = min_output_tokens
        self.samples = 0  # hops observed that said something
        self.fits = 0  # refits so far (the figures may have changed with each)
        self.learned = {"prefill": False, "kv_read": False}  # whether each figure is fitted, not the prior
        self._prefills: deque[tuple[float, float]] = deque(maxlen=window)  # (tokens, ttft_s)
        self._steps: deque[tuple[float, float]] = deque(maxlen=window)  # (kv in flight, s per token)
        self._since_fit = 0

    def figures(self) -> dict[str, float]:
        return {
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "kv_read_s_per_token": self.kv_read_s_per_token,
        }

    def observe(self, sample: EngineSample) -> None:
        used = False
        if sample.prefill_tokens >= self.min_prefill_tokens and sample.ttft_s > 0:
            self._prefills.append((float(sample.prefill_tokens), sample.ttft_s))
            used = True
        decode_tokens = sample.output_tokens - 1  # the first came with the prefill
        if decode_tokens >= self.min_output_tokens - 1 and sample.decode_s > 0 and sample.kv_in_flight > 0:
            self._steps.append((float(sample.kv_in_flight), sample.decode_s / decode_tokens))
            used = True
        if not used:
            return
        self.samples += 1
        self._since_fit += 1
        if self._since_fit >= self.refit_every:
            self._since_fit = 0
            self._refit()

    def _refit(self) -> None:
        self.fits += 1
        rate = best_rate(self._prefills)
        if rate is not None and rate > 0:
            self.prefill_tokens_per_s = rate
            self.learned["prefill"] = True
        kv_read = envelope_slope(self._steps)
        if kv_read is not None:
            self.kv_read_s_per_token = max(kv_read, 0.0)
            self.learned["kv_read"] = True


@runtime_checkable
class LearnsEngine(Protocol):
    """A policy that learns its pools' engine figures (the scheduler exports them)."""

    def engine_fit(self, pool: str) -> EngineFit | None: ...
