"""A/B tests of chain configs on live traffic (pure code): the test as stored in etcd,
which arm a run takes, each arm's figures, the significance of their difference in SLO
attainment, and the guard rail that stops a failing arm.

  * Arm choice is a hash of the session id (else the run id) salted with the test's
    start: a session keeps its arm for the whole test, whichever router it reaches.
  * Significance: a two-proportion z-test on SLO attainment (met / runs); with fewer
    than `MIN_RUNS_FOR_TEST` runs in an arm, or fewer than 5 met or 5 missed runs
    expected in either, the note says there are too few runs to tell.
  * Guard: once both arms have `min_runs`, an arm whose error rate is above the other's
    by more than `margin`, or whose attainment is below the other's by more than
    `margin`, is stopped (the other arm is kept).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from inferx.errors import InvalidArgument
from inferx.stats import percentile

ARMS = ("a", "b")
MIN_RUNS_FOR_TEST = 20
DEFAULT_MARGIN = 0.1
DEFAULT_MIN_RUNS = 30


@dataclass(frozen=True)
class AbTest:
    a: int  # versions
    b: int
    split_pct: float  # share of runs to b, 0-100
    started_unix_ms: int = 0
    started_by: str = ""
    margin: float = DEFAULT_MARGIN  # guard: how far below the other an arm may fall
    min_runs: int = DEFAULT_MIN_RUNS  # guard: runs per arm before it judges

    def version(self, arm: str) -> int:
        return self.a if arm == "a" else self.b

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def check_test(
    a: Any, b: Any, split_pct: Any, *, margin: Any = DEFAULT_MARGIN, min_runs: Any = DEFAULT_MIN_RUNS
) -> None:
    """InvalidArgument naming the first field that is wrong."""
    for name, version in (("a", a), ("b", b)):
        if isinstance(version, bool) or not isinstance(version, int) or version <= 0:
            raise InvalidArgument(f"{name}: must be a version number >= 1, got {version!r}")
    if a == b:
        raise InvalidArgument(f"a, b: both arms are version {a}; give two different versions")
    if (
        isinstance(split_pct, bool)
        or not isinstance(split_pct, (int, float))
        or not math.isfinite(split_pct)
        or not 0 <= split_pct <= 100
    ):
        raise InvalidArgument(f"split: must be a percentage from 0 to 100 (runs to b), got {split_pct!r}")
    if (
        isinstance(margin, bool)
        or not isinstance(margin, (int, float))
        or not math.isfinite(margin)
        or not 0 < margin <= 1
    ):
        raise InvalidArgument(f"margin: must be a fraction in (0, 1], got {margin!r}")
    if isinstance(min_runs, bool) or not isinstance(min_runs, int) or min_runs < 1:
        raise InvalidArgument(f"min_runs: must be a whole number >= 1, got {min_runs!r}")


def parse_test(raw: bytes | str | Mapping[str, Any]) -> AbTest:
    document = json.loads(raw) if isinstance(raw, (bytes, str)) else dict(raw)
    test = AbTest(
        a=document["a"],
        b=document["b"],
        split_pct=document["split_pct"],
        started_unix_ms=int(document.get("started_unix_ms", 0)),
        started_by=str(document.get("started_by", "")),
        margin=document.get("margin", DEFAULT_MARGIN),
        min_runs=document.get("min_runs", DEFAULT_MIN_RUNS),
    )
    check_test(test.a, test.b, test.split_pct, margin=test.margin, min_runs=test.min_runs)
    return test


def choose_arm(key: str, split_pct: float, salt: str = "") -> str:
    """'b' for `split_pct` percent of keys, 'a' for the rest; the same key always gets
    the same arm (for one salt)."""
    digest = hashlib.sha256(f"{salt}\x00{key}".encode()).digest()
    bucket = int.from_bytes(digest[:8], "big") / 2**64 * 100  # uniform in [0, 100)
    return "b" if bucket < split_pct else "a"


@dataclass(frozen=True)
class RunOutcome:
    """What an arm's statistics need of one run."""

    latency_ms: float
    slo_met: bool
    ok: bool
    tokens: int
    cost: float


@dataclass(frozen=True)
class ArmFigures:
    arm: str
    version: int
    runs: int
    slo_met: int
    errors: int
    p50_ms: float
    p99_ms: float
    tokens: int
    cost: float

    @property
    def attainment(self) -> float:
        return self.slo_met / self.runs if self.runs else 0.0

    @property
    def error_rate(self) -> float:
        return self.errors / self.runs if self.runs else 0.0


def arm_figures(arm: str, version: int, runs: Iterable[RunOutcome]) -> ArmFigures:
    runs = list(runs)
    latencies = [r.latency_ms for r in runs]
    return ArmFigures(
        arm=arm,
        version=version,
        runs=len(runs),
        slo_met=sum(1 for r in runs if r.slo_met),
        errors=sum(1 for r in runs if not r.ok),
        p50_ms=percentile(latencies, 50, method="linear") if latencies else 0.0,
        p99_ms=percentile(latencies, 99, method="linear") if latencies else 0.0,
        tokens=sum(r.tokens for r in runs),
        cost=sum(r.cost for r in runs),
    )


@dataclass(frozen=True)
class Significance:
    z: float
    p_value: float
    enough: bool  # enough runs for the test to say anything
    note: str


def two_proportion_z(
    met_a: int, runs_a: int, met_b: int, runs_b: int, *, alpha: float = 0.05
) -> Significance:
    """Two-sided two-proportion z-test of attainment (met / runs) between the arms."""
    if runs_a < MIN_RUNS_FOR_TEST or runs_b < MIN_RUNS_FOR_TEST:
        return Significance(
            0.0,
            1.0,
            False,
            f"too few runs to tell (need {MIN_RUNS_FOR_TEST} per arm; a has {runs_a}, b {runs_b})",
        )
    pooled = (met_a + met_b) / (runs_a + runs_b)
    smallest = min(runs_a, runs_b)
    if smallest * pooled < 5 or smallest * (1 - pooled) < 5:
        return Significance(
            0.0,
            1.0,
            False,
            "too few runs to tell: fewer than 5 met or 5 missed SLOs expected in an arm",
        )
    p_a, p_b = met_a / runs_a, met_b / runs_b
    se = math.sqrt(pooled * (1 - pooled) * (1 / runs_a + 1 / runs_b))
    z = (p_b - p_a) / se
    p_value = math.erfc(abs(z) / math.sqrt(2))
    if p_value < alpha:
        better = "b" if p_b > p_a else "a"
        note = f"{better} attains its SLO more often (p = {p_value:.3g} < {alpha:g})"
    else:
        note = f"no significant difference in SLO attainment (p = {p_value:.3g})"
    return Significance(z, p_value, True, note)


@dataclass(frozen=True)
class GuardVerdict:
    stop: str  # the arm to stop
    keep: str
    reason: str


def guard(a: ArmFigures, b: ArmFigures, *, margin: float, min_runs: int) -> GuardVerdict | None:
    """The arm to stop, when both have `min_runs` and one falls more than `margin` below
    the other in error rate or SLO attainment (errors first); None otherwise."""
    if a.runs < min_runs or b.runs < min_runs:
        return None
    for worse, better in ((a, b), (b, a)):
        if worse.error_rate - better.error_rate > margin:
            return GuardVerdict(
                worse.arm,
                better.arm,
                f"error rate {worse.error_rate:.1%} vs {better.error_rate:.1%} (margin {margin:.0%})",
            )
    for worse, better in ((a, b), (b, a)):
        if better.attainment - worse.attainment > margin:
            return GuardVerdict(
                worse.arm,
                better.arm,
                f"SLO attainment {worse.attainment:.1%} vs {better.attainment:.1%} (margin {margin:.0%})",
            )
    return None


def parse_version(text: str) -> int:
    """'v3' or '3' -> 3; InvalidArgument otherwise."""
    digits = text[1:] if text[:1] in ("v", "V") else text
    if not digits.isdigit() or int(digits) < 1:
        raise InvalidArgument(f"{text!r}: expected a version like v3 or 3")
    return int(digits)
