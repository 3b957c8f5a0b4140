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


def test_overhead_outside_client_reports_hops_per_s_and_added_ms_per_hop(tmp_path: Path) -> None:
    """`--outside` (issue #45): a plain grpc.aio client in its own process (no SDK),
    batch_events, on a plaintext stack: direct, 1-hop and 4-hop, each with hops/s from
    its closed loop and the added ms per hop against its own direct call."""
    argv = [sys.executable, "-m", "inferx.cli.main", "bench", "--overhead", "--outside", "--insecure"]
    argv += ["--count", "8", "--warmup", "2", "--concurrency", "4", "--load-calls", "8"]
    argv += ["--outside-duration", "1", "--timeout", "240", "--state-dir", str(tmp_path / "stack"), "--json"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["context"]["options"]["insecure"] is True
    outside = [p for p in report["summary"]["paths"] if p["client"] == "outside"]
    assert [(p["name"], p["hops"]) for p in outside] == [
        ("direct", 1),
        ("1-hop batched", 1),
        ("4-hop batched", 4),
    ]
    for path in outside:
        assert path["errors"] == 0 and path["samples"] == 8 and path["concurrency"] == 4, path
        assert path["hops_per_s"] > 0 and path["hops_per_s"] == pytest.approx(
            path["calls_per_s"] * path["hops"]
        )
    direct = outside[0]
    for chain in outside[1:]:
        assert chain["batched"] is True
        added = chain["p50_ms"] / chain["hops"] - direct["p50_ms"]
        assert chain["added_per_hop_p50_ms"] == pytest.approx(added)
