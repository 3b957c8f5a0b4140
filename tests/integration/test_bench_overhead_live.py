"""`inferx bench --overhead` end to end, kept short: it starts its own stack (etcd, the
services, one sim worker), measures the five paths and prints JSON. No timing is
asserted: only the shape of the report and that every call succeeded."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def test_overhead_measures_direct_1_hop_and_n_hop_with_every_call_ok(tmp_path: Path) -> None:
    results = tmp_path / "overhead.json"
    argv = [sys.executable, "-m", "inferx.cli.main", "bench", "--overhead", "--hops", "3"]
    argv += ["--count", "12", "--warmup", "3", "--concurrency", "4", "--load-calls", "16"]
    argv += ["--timeout", "240", "--state-dir", str(tmp_path / "stack"), "--results", str(results), "--json"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["kind"] == "overhead"
    summary = report["summary"]
    paths = summary["paths"]
    assert [(p["name"], p["hops"], p["batched"], p["final_only"]) for p in paths] == [
        ("direct", 1, False, False),
        ("1-hop", 1, False, False),
        ("3-hop", 3, False, False),
        ("3-hop batched", 3, True, False),
        ("3-hop final", 3, False, True),
    ]
    for path in paths:
        assert path["errors"] == 0, path
        assert path["samples"] == 12 and path["concurrency"] == 4
        assert 0 < path["p50_ms"] <= path["p99_ms"]
        assert path["calls_per_s"] > 0 and path["hops_per_s"] == pytest.approx(
            path["calls_per_s"] * path["hops"]
        )
    direct, one, three, _, _ = paths
    assert direct["added_per_hop_p50_ms"] is None  # the reference itself: no added cost (null in JSON)
    assert one["added_per_hop_p50_ms"] == pytest.approx(one["p50_ms"] - direct["p50_ms"])
    assert three["per_hop_p50_ms"] == pytest.approx(three["p50_ms"] / 3)
    assert math.isfinite(summary["marginal_hop_p50_ms"]) and summary["errors"] == 0
    # The raw samples reached the file, every closed-loop call counted.
    saved = json.loads(results.read_text())
    assert saved["complete"] is True and saved["kind"] == "overhead"
    assert [len(p["latencies_ms"]) for p in saved["paths"]] == [12] * 5
    assert [p["load_calls"] for p in saved["paths"]] == [16] * 5
