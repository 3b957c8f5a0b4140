"""The shared percentile: both methods, the edge cases the module docstring promises,
and properties that must hold for any input."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from inferx.stats import METHODS, percentile

INF = math.inf
finite = st.floats(allow_nan=False, allow_infinity=False, min_value=-1e12, max_value=1e12)
any_number = st.floats(allow_nan=False)  # infinities included
pcts = st.floats(min_value=0, max_value=100)


# ----- examples ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "pct", "expected"),
    [
        ([3, 1, 2], 50, 2),
        ([1, 2, 3, 4], 50, 2),  # the lower middle: rank ceil(0.5 * 4) = 2
        ([1, 2, 3, 4], 51, 3),
        ([7], 99, 7),
        (list(range(1, 101)), 99, 99),
        (list(range(1, 101)), 0, 1),  # rank at least 1
        (list(range(1, 101)), 100, 100),
    ],
)
def test_nearest_rank_examples(values, pct, expected) -> None:
    assert percentile(values, pct, method="nearest-rank") == expected


@pytest.mark.parametrize(
    ("values", "pct", "expected"),
    [
        ([1, 2, 3, 4], 50, 2.5),
        ([7], 99, 7),
        (list(range(1, 101)), 99, 99.01),
        ([10, 20], 0, 10),
        ([10, 20], 100, 20),
        ([-1e308, 1e308], 50, 0.0),  # b - a would overflow to inf
    ],
)
def test_linear_examples(values, pct, expected) -> None:
    assert percentile(values, pct, method="linear") == pytest.approx(expected)


# ----- edge cases ----------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_empty_input_is_nan(method) -> None:
    assert math.isnan(percentile([], 50, method=method))


def test_p99_is_a_miss_only_when_more_than_one_percent_missed() -> None:
    # Benchmarks count a shed chain as infinite latency: 1 miss in 100 keeps P99 finite
    # with nearest-rank, 2 misses make it infinite.
    one = [1.0] * 99 + [INF]
    two = [1.0] * 98 + [INF, INF]
    assert percentile(one, 99, method="nearest-rank") == 1.0
    assert percentile(two, 99, method="nearest-rank") == INF
    # Linear interpolation towards an infinite neighbour is that infinity, not NaN.
    assert percentile(one, 99, method="linear") == INF


@pytest.mark.parametrize("method", METHODS)
def test_all_infinite_is_infinite_not_nan(method) -> None:
    assert percentile([INF, INF, INF], 50, method=method) == INF
    assert percentile([-INF, -INF], 30, method=method) == -INF


def test_linear_between_minus_and_plus_infinity_is_undefined() -> None:
    assert math.isnan(percentile([-INF, INF], 50, method="linear"))
    assert percentile([-INF, INF], 0, method="linear") == -INF
    assert percentile([-INF, 5.0], 50, method="linear") == -INF


@pytest.mark.parametrize("method", METHODS)
def test_nan_values_are_rejected(method) -> None:
    with pytest.raises(ValueError, match="NaN"):
        percentile([1.0, math.nan], 50, method=method)


@pytest.mark.parametrize("pct", [-1, 100.5, 1e9, math.nan])
def test_pct_outside_0_to_100_is_rejected(pct) -> None:
    with pytest.raises(ValueError, match="0 to 100"):
        percentile([1.0], pct, method="linear")


def test_method_is_required_and_checked() -> None:
    with pytest.raises(TypeError):
        percentile([1.0], 50)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="nearest-rank, linear"):
        percentile([1.0], 50, method="midpoint")  # type: ignore[arg-type]


def test_accepts_any_iterable_and_does_not_reorder_the_callers_list() -> None:
    values = [3.0, 1.0, 2.0]
    assert percentile(iter(values), 100, method="nearest-rank") == 3.0
    assert percentile(values, 0, method="linear") == 1.0
    assert values == [3.0, 1.0, 2.0]


# ----- properties ----------------------------------------------------------------------


@given(st.lists(any_number, min_size=1), pcts)
def test_nearest_rank_is_one_of_the_values(values, pct) -> None:
    assert percentile(values, pct, method="nearest-rank") in values


@given(st.lists(finite, min_size=1), pcts)
def test_nearest_rank_has_pct_of_the_values_at_or_below_it(values, pct) -> None:
    p = percentile(values, pct, method="nearest-rank")
    at_or_below = sum(1 for v in values if v <= p)
    below = sum(1 for v in values if v < p)
    assert at_or_below >= pct / 100 * len(values) - 1e-9
    # ... and it is the smallest such value.
    assert below < max(1, math.ceil(pct / 100 * len(values)))


@given(st.lists(finite, min_size=1), pcts)
def test_linear_matches_numpy(values, pct) -> None:
    expected = float(np.percentile(np.array(values), pct))
    assert percentile(values, pct, method="linear") == pytest.approx(expected, rel=1e-9, abs=1e-6)


@given(st.lists(any_number, min_size=1), pcts, st.sampled_from(METHODS))
def test_result_lies_between_min_and_max(values, pct, method) -> None:
    p = percentile(values, pct, method=method)
    if math.isnan(p):  # only linear between -inf and +inf
        assert method == "linear" and -INF in values and INF in values
    else:
        assert min(values) <= p <= max(values)


@given(st.lists(finite, min_size=1), pcts, pcts, st.sampled_from(METHODS))
def test_monotone_in_pct(values, a, b, method) -> None:
    lo, hi = sorted((a, b))
    assert percentile(values, lo, method=method) <= percentile(values, hi, method=method)


@given(st.lists(any_number, min_size=1), pcts, st.sampled_from(METHODS), st.randoms())
def test_order_of_the_input_does_not_matter(values, pct, method, rnd) -> None:
    shuffled = list(values)
    rnd.shuffle(shuffled)
    a, b = percentile(values, pct, method=method), percentile(shuffled, pct, method=method)
    assert a == b or (math.isnan(a) and math.isnan(b))
