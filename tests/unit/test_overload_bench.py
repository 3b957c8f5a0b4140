"""benchmarks/overload.py: past-capacity figures per policy (and per ablation) over seeds."""

from __future__ import annotations

import json

import pytest

from tests.conftest import load_benchmark_script


def load_script():
    return load_benchmark_script("overload")


def test_an_entry_names_a_policy_and_its_options() -> None:
    script = load_script()
    assert script.parse_entry("chain-aware") == ("chain-aware", {})
    assert script.parse_entry("chain-aware:overload_control=true,max_hold_s=5") == (
        "chain-aware",
        {"overload_control": True, "max_hold_s": 5},
    )
    with pytest.raises(SystemExit, match="key=value"):
        script.parse_entry("chain-aware:overload_control")


def test_it_reports_each_entry_per_seed(capsys: pytest.CaptureFixture[str]) -> None:
    script = load_script()
    script.main(
        [
            "--workload",
            "research",
            "--rate",
            "0.05",
            "--seeds",
            "2",
            "--window-s",
            "600",
            "--json",
            "--compare",
            "round-robin",
            "chain-aware:overload_control=true",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    figures = out["figures"]
    assert set(figures) == {"round-robin", "chain-aware:overload_control=true"}
    for rows in figures.values():
        assert len(rows) == 2
        for row in rows:
            assert 0.0 <= row["realtime"] <= 1.0 and 0.0 <= row["shed"] <= 1.0 and row["preemptions"] >= 0
            # far below capacity every measured chain finishes: as many per second of the
            # window as arrived in it (about the rate: Poisson, ~30 chains in 600 s)
            assert row["completed"] == 1.0
            # ... and the engines keep up: the work finishing in the window is the work
            # arriving in it (within a short window's edges)
            assert row["work_served"] == pytest.approx(1.0, abs=0.15)
            assert row["finished_per_s"] == pytest.approx(row["measured_chains"] / 600)
            assert 0.5 * 0.05 < row["finished_per_s"] < 2 * 0.05


def test_a_bad_option_is_a_clear_error() -> None:
    script = load_script()
    with pytest.raises(SystemExit, match="overload_control"):
        script.main(
            [
                "--workload",
                "research",
                "--rate",
                "0.05",
                "--seeds",
                "1",
                "--compare",
                "chain-aware:overload_control=maybe",
            ]
        )
