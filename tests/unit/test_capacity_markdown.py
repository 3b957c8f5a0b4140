"""benchmarks/capacity_markdown.py: the headline table from `inferx sim --capacity`
results, seeds merged across files (as `make bench` writes them), and the peers
`make bench` keeps for the later seeds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import load_benchmark_script

PROFILE = {"name": "llama-3-8b/a100-80gb (Vidur profile)"}


def _write(path: Path, seeds: list[int], rates: dict[str, list[float]], *, raw: bool, bound=None) -> str:
    runs = {name: [{"rate_per_s": r} for r in values] for name, values in rates.items()}
    data = {
        "context": {
            "mode": "steady",
            "trace": "mix",
            "profile": PROFILE,
            "workers": 4,
            "trace_seeds": seeds,
            "window": [{"window_s": 1800.0} for _ in seeds],
        },
        # a --results file holds a list per policy; --json's output a dict with per_seed
        "capacity": runs if raw else {name: {"per_seed": r} for name, r in runs.items()},
        "bound": bound,
    }
    if raw:
        data["complete"] = True
    path.write_text(json.dumps(data))
    return str(path)


def test_seeds_merge_across_files_and_the_strongest_peer_is_measured_on_every_seed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = load_benchmark_script("capacity_markdown")
    first = _write(
        tmp_path / "seed1.json",
        [1],
        {"session-affinity": [1.0], "program-las": [2.0], "tier-pools": [1.9], "chain-aware": [3.0]},
        raw=True,
        bound={"per_seed": [{"seed": 1, "bound_per_s": 4.0, "at_least": False}]},
    )
    assert script.top_peers(2, [first]) == ["program-las", "tier-pools"]
    rest = _write(
        tmp_path / "seeds.json",
        [2, 3],
        {"program-las": [2.2, 1.8], "tier-pools": [2.5, 2.4], "chain-aware": [3.3, 2.7]},
        raw=False,
    )
    script.main([first, rest])
    row = capsys.readouterr().out.strip().splitlines()[-1]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:3] == ["mix", "llama-3-8b/a100-80gb", "1800"]
    assert cells[3] == "3 (2.7-3.3)"  # three significant digits: coding rates are ~0.002
    assert cells[4] == "tier-pools 2.4 (1.9-2.5)"  # median over 3 seeds beats program-las'
    assert cells[5].startswith("**1.25x**") and "seeds 1,2,3" in cells[5]
    assert cells[6] == "4 (1 seeds)" and cells[7] == "75% / 60%"
    assert "session-affinity 1 (1 seed)" in cells[8]


def test_unfinished_and_burst_results_are_refused(tmp_path: Path) -> None:
    script = load_benchmark_script("capacity_markdown")
    path = Path(_write(tmp_path / "r.json", [1], {"chain-aware": [1.0]}, raw=True))
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "complete": False}))
    with pytest.raises(SystemExit, match="unfinished"):
        script.main([str(path)])
    data["context"]["mode"] = "burst"
    path.write_text(json.dumps(data))
    with pytest.raises(SystemExit, match="not a steady-state"):
        script.main([str(path)])
    with pytest.raises(SystemExit, match="usage"):
        script.main(["--top-peers", "two", str(path)])
