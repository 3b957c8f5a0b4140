"""The one `percentile` of the code base (benchmarks and the router's run statistics).

Semantics, for `percentile(values, pct, method=...)`:

* `pct` is in percent, 0..100 (as numpy's `percentile`); anything else is a ValueError,
  so a caller passing 0.99 for "P99" gets P0.99 only if it asks for exactly that.
* `method` is required, because the two users need different answers:
    - "nearest-rank": the smallest value with at least pct% of the values at or below
      it (rank ceil(pct/100 * n), at least 1). Always one of the values. Benchmarks use
      it: a shed chain counts as an infinite latency, and the P99 is then infinite
      exactly when more than 1% of the chains missed, never a blend of a miss and a
      finished chain.
    - "linear": linear interpolation between the closest ranks (numpy's default,
      position (n-1) * pct/100). The router's per-node statistics use it: samples are
      few and finite, and interpolation does not jump from one run to the next.
* Empty input: NaN ("no value"), whatever the method. A caller that must show a
  number (a protobuf field) decides itself what stands for "no samples".
* Infinite values are ordered like any number (+inf last, -inf first). Nearest-rank
  returns them when the rank lands on them. Linear interpolation towards an infinite
  neighbour gives that infinity (never NaN from inf - inf); between -inf and +inf it
  is NaN, the one case with no meaningful answer.
* NaN values are a ValueError: they have no place in an order, and sorting them
  silently would give an arbitrary answer.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal

Method = Literal["nearest-rank", "linear"]
METHODS: tuple[Method, ...] = ("nearest-rank", "linear")


def percentile(values: Iterable[float], pct: float, *, method: Method) -> float:
    """The `pct`-th percentile of `values` (see the module docstring for the semantics)."""
    if method not in METHODS:
        raise ValueError(f"percentile method {method!r}: choose one of {', '.join(METHODS)}")
    if not 0 <= pct <= 100 or math.isnan(pct):
        raise ValueError(f"percentile {pct!r}: expected a number from 0 to 100")
    ordered = sorted(float(v) for v in values)
    if any(math.isnan(v) for v in ordered):
        raise ValueError("percentile of values containing NaN")
    if not ordered:
        return math.nan
    if method == "nearest-rank":
        rank = max(1, math.ceil(pct / 100 * len(ordered)))
        return ordered[rank - 1]
    position = (len(ordered) - 1) * pct / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    fraction = position - low
    a, b = ordered[low], ordered[high]
    if fraction == 0 or a == b:
        return a
    if math.isinf(a) or math.isinf(b):
        # a <= b, so only (-inf, +inf) is undefined; otherwise the infinite end wins.
        if math.isinf(a) and math.isinf(b):
            return math.nan
        return a if math.isinf(a) else b
    # Weighted sum rather than a + (b - a) * f: b - a overflows for values of opposite
    # sign near the float limit. Rounding may step an ulp outside [a, b]; clamp it back.
    return min(max((1 - fraction) * a + fraction * b, a), b)


class RunningMean:
    """An exponentially weighted mean of the samples seen so far (the first sample is
    the mean), and how many there were."""

    __slots__ = ("alpha", "count", "value")

    def __init__(self, alpha: float) -> None:
        if not 0 < alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")
        self.alpha = alpha
        self.value = 0.0
        self.count = 0

    def add(self, sample: float) -> None:
        self.value = sample if self.count == 0 else self.value + self.alpha * (sample - self.value)
        self.count += 1
