"""A/B tests of chain configs: arm choice, significance, the guard rail (inferx.ab)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from inferx.ab import (
    AbTest,
    RunOutcome,
    arm_figures,
    check_test,
    choose_arm,
    guard,
    parse_test,
    parse_version,
    two_proportion_z,
)
from inferx.errors import InvalidArgument


def test_arm_choice_is_sticky_and_close_to_the_split() -> None:
    assert all(choose_arm("session-1", 10, "t") == choose_arm("session-1", 10, "t") for _ in range(3))
    arms = [choose_arm(f"s{i}", 10, "t") for i in range(10_000)]
    assert 0.08 < arms.count("b") / len(arms) < 0.12
    assert {choose_arm(f"s{i}", 0, "t") for i in range(500)} == {"a"}
    assert {choose_arm(f"s{i}", 100, "t") for i in range(500)} == {"b"}


@given(st.text(max_size=40), st.floats(0, 100), st.floats(0, 100), st.text(max_size=8))
def test_raising_the_split_only_moves_keys_from_a_to_b(key: str, low: float, high: float, salt: str) -> None:
    low, high = min(low, high), max(low, high)
    if choose_arm(key, low, salt) == "b":
        assert choose_arm(key, high, salt) == "b"


def test_bad_tests_are_named() -> None:
    with pytest.raises(InvalidArgument, match="split: must be a percentage from 0 to 100"):
        check_test(1, 2, 150)
    with pytest.raises(InvalidArgument, match="split"):
        check_test(1, 2, -1)
    with pytest.raises(InvalidArgument, match="both arms are version 3"):
        check_test(3, 3, 10)
    with pytest.raises(InvalidArgument, match="a: must be a version number"):
        check_test(0, 3, 10)
    with pytest.raises(InvalidArgument, match="margin"):
        check_test(1, 2, 10, margin=0)
    with pytest.raises(InvalidArgument, match="min_runs"):
        check_test(1, 2, 10, min_runs=0)
    test = AbTest(3, 4, 10.0, 123, "alice", 0.2, 5)
    assert parse_test(test.to_json()) == test
    assert parse_version("v3") == 3 and parse_version("12") == 12
    for bad in ("x", "v0", "", "v-1"):
        with pytest.raises(InvalidArgument, match="expected a version"):
            parse_version(bad)


def test_significance_says_when_there_are_too_few_runs() -> None:
    few = two_proportion_z(5, 10, 9, 10)
    assert not few.enough and "too few runs to tell" in few.note
    all_met = two_proportion_z(100, 100, 100, 100)
    assert not all_met.enough and "too few runs" in all_met.note
    clear = two_proportion_z(50, 100, 90, 100)
    assert clear.enough and clear.p_value < 0.001 and clear.z > 0 and "b attains" in clear.note
    same = two_proportion_z(80, 100, 81, 100)
    assert same.enough and same.p_value > 0.5 and "no significant difference" in same.note


def test_z_matches_the_textbook_value() -> None:
    # p1 = 0.5 (n 100), p2 = 0.6 (n 100): pooled 0.55, se = sqrt(.55*.45*.02) = 0.07036, z = 1.421
    result = two_proportion_z(50, 100, 60, 100)
    assert result.z == pytest.approx(1.4213, abs=1e-3)
    assert result.p_value == pytest.approx(0.1552, abs=1e-3)


@given(st.integers(20, 500), st.integers(20, 500), st.data())
def test_p_value_is_a_probability_and_symmetric(runs_a: int, runs_b: int, data: st.DataObject) -> None:
    met_a = data.draw(st.integers(0, runs_a))
    met_b = data.draw(st.integers(0, runs_b))
    forward = two_proportion_z(met_a, runs_a, met_b, runs_b)
    backward = two_proportion_z(met_b, runs_b, met_a, runs_a)
    assert 0 <= forward.p_value <= 1
    assert forward.p_value == pytest.approx(backward.p_value)
    assert forward.z == pytest.approx(-backward.z)


def outcomes(n: int, met: int, errors: int = 0) -> list[RunOutcome]:
    return [RunOutcome(100.0 + i, i < met, i >= errors, 10, 0.01) for i in range(n)]


def test_guard_stops_the_arm_that_falls_below_by_more_than_the_margin() -> None:
    a = arm_figures("a", 3, outcomes(40, 38))
    b = arm_figures("b", 4, outcomes(40, 20))
    verdict = guard(a, b, margin=0.1, min_runs=30)
    assert (
        verdict is not None and (verdict.stop, verdict.keep) == ("b", "a") and "attainment" in verdict.reason
    )
    assert guard(a, b, margin=0.6, min_runs=30) is None
    assert guard(a, b, margin=0.1, min_runs=41) is None  # not enough runs yet
    erring = arm_figures("a", 3, outcomes(40, 40, errors=10))
    verdict = guard(erring, arm_figures("b", 4, outcomes(40, 40)), margin=0.1, min_runs=30)
    assert verdict is not None and verdict.stop == "a" and "error rate" in verdict.reason


def test_arm_figures() -> None:
    figures = arm_figures("b", 4, outcomes(10, 7, errors=2))
    assert (figures.runs, figures.slo_met, figures.errors, figures.tokens) == (10, 7, 2, 100)
    assert figures.attainment == 0.7 and figures.error_rate == 0.2
    assert figures.cost == pytest.approx(0.1) and figures.p50_ms == pytest.approx(104.5)
    assert arm_figures("a", 1, []).runs == 0
