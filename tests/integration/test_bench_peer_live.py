"""`inferx bench --peer vllm-router` end to end on a tiny trace: vllm-router (its
consistent_hash and program-scheduling modes) and InferX's HTTP front, each in front
of sim workers serving HTTP, the same agent programs through both, JSON out. No
timing is asserted: only the shape of the report, that every call succeeded, and that
the programs' prefixes were cache hits behind every front.

Skipped only where vllm-router cannot run on this machine (`make setup` installs it
with the test extra)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from inferx.bench.peer import find_vllm_router
from inferx.errors import FailedPrecondition
from inferx.sim.trace import TraceConfig, generate, write_trace

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def vllm_router() -> str:
    try:
        return find_vllm_router().path
    except FailedPrecondition as exc:
        pytest.skip(f"vllm-router cannot run on this machine: {exc.message}")


def test_peer_bench_runs_both_fronts_on_a_tiny_trace(vllm_router: str, tmp_path: Path) -> None:
    trace = tmp_path / "tiny.jsonl"
    write_trace(generate(TraceConfig(seed=3, duration_s=30, rate_per_s=0.5, mix={"bfcl": 1.0})), trace)
    results = tmp_path / "peer.json"
    argv = [sys.executable, "-m", "inferx.cli.main", "bench", "--peer", "vllm-router", "--trace", str(trace)]
    argv += ["--peer-modes", "consistent_hash", "program", "--probe-chains", "3", "--max-probes", "1"]
    argv += ["--rate", "0.5", "--speed", "10", "--count", "8", "--warmup", "2", "--timeout", "240"]
    argv += ["--state-dir", str(tmp_path / "state"), "--results", str(results), "--json"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["kind"] == "peer" and report["context"]["peer"]["name"] == "vllm-router"

    fronts = ["vllm-router consistent_hash", "vllm-router program", "inferx"]
    overhead = {row["path"]: row for row in report["overhead"]}
    assert list(overhead) == ["direct", *fronts]
    for row in overhead.values():
        assert row["errors"] == 0, row
        assert row["calls"] == 8 and 0 < row["p50_ms"] <= row["p99_ms"]
    assert overhead["direct"]["added_p50_ms"] is None
    assert overhead["inferx"]["added_p50_ms"] == pytest.approx(
        overhead["inferx"]["p50_ms"] - overhead["direct"]["p50_ms"]
    )

    (seed,) = report["seeds"]
    assert [f["front"] for f in seed["fronts"]] == fronts
    for front in seed["fronts"]:
        (probe,) = front["probes"]
        assert probe["chains"] == 3 and probe["rate_per_s"] == pytest.approx(0.5)
        assert probe["errors"] == {}, (front["front"], probe["errors"])
        assert probe["p99_latency_s"] is not None  # every chain finished (in SLO or not: no timing here)
        assert probe["cached_ratio"] > 0.3  # each program's calls found its prefix on their worker
        assert probe["ttft_p50_s"] is not None
        # the front's own processes (InferX's services, or the vllm-router process) ran
        assert probe["front_cpu_s"] > 0 and probe["front_cpu_ms_per_call"] > 0, probe
    comparison = seed["comparison"]
    assert set(comparison) >= {"capacity_ratio", "added_latency_gap_p50_ms", "best_peer"}
    saved = json.loads(results.read_text())
    assert saved["complete"] is True and saved["kind"] == "peer" and saved["seeds"]


def test_peer_bench_probes_in_steady_state_by_default(vllm_router: str, tmp_path: Path) -> None:
    """Without --probe-chains a probe replays the trace over warm-up, measured window and
    drain, and counts only the chains arriving in the window (issue #42)."""
    trace = tmp_path / "chat.jsonl"
    write_trace(generate(TraceConfig(seed=4, duration_s=40, rate_per_s=0.5, mix={"chat": 1.0})), trace)
    results = tmp_path / "peer.json"
    argv = [sys.executable, "-m", "inferx.cli.main", "bench", "--peer", "vllm-router", "--trace", str(trace)]
    argv += ["--peer-modes", "consistent_hash", "--window-s", "30", "--max-probes", "1", "--rate", "0.2"]
    argv += ["--speed", "20", "--count", "4", "--warmup", "1", "--timeout", "240"]
    argv += ["--state-dir", str(tmp_path / "state"), "--results", str(results), "--json"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    ladder = report["context"]["ladder"]
    assert ladder["steady"] and ladder["window"]["window_s"] == 30
    assert "NOT steady state" in ladder["probes"]  # 30 s is ~1 median chat SLO: labelled
    (seed,) = report["seeds"]
    assert [f["front"] for f in seed["fronts"]] == ["vllm-router consistent_hash", "inferx"]
    for front in seed["fronts"]:
        (probe,) = front["probes"]
        assert probe["errors"] == {}, (front["front"], probe["errors"])
        # warm-up and drain replayed, not counted: ~0.2/s x 30 s counted
        assert 1 <= probe["chains"] <= 15 < probe["replayed"], probe
