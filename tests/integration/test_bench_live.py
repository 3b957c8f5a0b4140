"""The live benchmarks, kept short: the trace replay through the scheduler with sim
workers, and the seed-agent scenario with sim workers (the vLLM run is a benchmark,
not a test). No timing is asserted: only what the replay must get exactly right."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from inferx.bench import seed_run
from inferx.bench.live import POOL, LiveOptions, run_live_sim
from inferx.sim.profile import EngineProfile
from inferx.sim.trace import TraceConfig, generate, write_trace

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def _no_progress(label: str, total: int):
    yield lambda done: None


def test_trace_replay_sends_every_call_with_the_traces_token_counts(tmp_path: Path) -> None:
    profile = EngineProfile()
    config = TraceConfig(seed=3, duration_s=6.0, rate_per_s=1.0, mix={"bfcl": 1.0})
    trace = generate(config, profile)
    assert 2 <= len(trace.chains) <= 12
    # (told the engine, the scheduler learns it only when asked: as `--option learn_engine=true`)
    options = LiveOptions(
        workers=2, speed=20.0, timeout_s=120.0, state_dir=tmp_path, scheduler_flags=("--learn-engine",)
    )
    runs, errors = asyncio.run(run_live_sim(trace, ["chain-aware"], profile, options, _no_progress))
    (run,) = runs
    assert errors == {"chain-aware": {}}
    # What the scheduler priced the engine with, read off its /metrics, on the workload's
    # clock (its workers ran x20: 20x the prefill rate on the wall clock).
    assert run.engine is not None and list(run.engine) == [POOL]
    assert 0.5 < run.engine[POOL]["prefill_tokens_per_s"] / profile.prefill_tokens_per_s < 2
    assert 0 <= run.engine[POOL]["kv_read_s_per_token"] < 1e-6
    for chain, record in zip(trace.chains, run.chains, strict=True):
        assert record.status == "ok", (chain.chain_id, record.status)
        # Every prompt is exactly the trace's size: shared prefix + history + new input.
        assert record.prompt_tokens == sum(chain.prompt_tokens(k) for k in range(len(chain.hops)))
        assert len(record.ttft_s) == len(chain.hops)
        # Calls k >= 1 find the chain's own earlier calls in the cache, not only the
        # system prompt it shares with other chains: the shared prefix alone could give
        # at most shared_tokens per call, so more than that proves the chain's own
        # history was reused.
        shared_at_most = chain.shared_tokens * len(chain.hops)
        assert record.cached_tokens > shared_at_most, (chain.chain_id, record.cached_tokens, shared_at_most)


def test_seed_agent_scenario_on_sim_workers(tmp_path: Path) -> None:
    options = seed_run.SeedOptions(
        engine="sim", workers=2, chains=4, rate_per_s=4.0, tool_median_s=0.01, sim_speed=20.0, timeout_s=120
    )
    summaries = asyncio.run(
        seed_run.run_seed(
            options,
            ["reference", "on"],
            tmp_path,
            ROOT / "examples" / "knowledge_base.jsonl",
            _no_progress,
            print,
        )
    )
    reference, on = summaries
    assert reference.completed == on.completed == 4, (reference.errors, on.errors)
    # reference: the engine's prefix caching stays on (every chain shares the system
    # prompt, so it hits), only InferX's tool cache is off.
    assert reference.prefix_hit_rate > 0 and reference.tool_cache_hit_rate == 0
    # on: the previous step's prompt is (almost) always found, and repeated queries hit.
    assert on.reusable_hit_rate > 0.9
    assert on.tool_cache_hit_rate > 0
    # what the scheduler priced the engines with, read off its /metrics at the end:
    # chain-aware exports its figures (its prior, or what it learned); round-robin none
    assert on.engine and all(f["prefill_tokens_per_s"] > 0 for f in on.engine.values()), on.engine
    assert reference.engine is None


def test_bench_replays_a_trace_against_a_running_stack(tmp_path: Path) -> None:
    """`inferx bench --router`: the scheduler and model come from the router's status;
    one run with the stack's policy, every chain completed, JSON on stdout."""
    import json
    import subprocess
    import sys

    from tests.conftest import running_sim_stack

    trace_file = tmp_path / "trace.jsonl"
    config = TraceConfig(seed=5, duration_s=4.0, rate_per_s=1.0, mix={"bfcl": 1.0})
    write_trace(generate(config, EngineProfile()), trace_file)
    with running_sim_stack(tmp_path / "stack", workers=2, sim_speed=20) as stack:
        argv = [sys.executable, "-m", "inferx.cli.main", "bench", "--router", stack.router_address]
        results = tmp_path / "results.json"
        argv += ["--trace", str(trace_file), "--rate", "1", "--speed", "20", "--timeout", "120"]
        argv += ["--results", str(results), "--json"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        (summary,) = report["summaries"]
        assert summary["policy"] == "chain-aware" and summary["workers"] == 2
        assert summary["overall"]["completed"] == summary["overall"]["chains"] >= 2
        # Preemptions of a stack it did not start are not measured: null, never 0.
        assert summary["overall"]["preemptions"] is None
        saved = json.loads(results.read_text())
        assert saved["complete"] is True and saved["summaries"] == report["summaries"]
        assert len(saved["runs"][0]["chains"]) == summary["overall"]["chains"]
        # Two policies cannot be compared on one running scheduler: a clear refusal.
        argv[-1:] = ["--compare", "baseline", "chain-aware"]
        refused = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert refused.returncode != 0 and "one policy" in refused.stderr
        assert "Traceback" not in refused.stderr


@pytest.mark.parametrize("stopping", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_terminated_benchmark_stops_its_stack(tmp_path: Path, stopping: signal.Signals) -> None:
    """SIGTERM (a supervisor, `timeout`, a CI job's end) or SIGHUP (the terminal or ssh
    session went away) stops `inferx bench` as Ctrl-C does: it exits, and no process of
    the local stack it started is left running -- a second signal during the clean-up
    (`timeout` passing its own on, a supervisor repeating itself) does not break into it."""
    trace_path = tmp_path / "trace.jsonl"
    write_trace(generate(TraceConfig(seed=3, duration_s=60.0, rate_per_s=1.0, mix={"bfcl": 1.0})), trace_path)
    state = tmp_path / "state"
    command = [
        sys.executable,
        "-m",
        "inferx.cli.main",
        "bench",
        "--engine",
        "sim",
        "--trace",
        str(trace_path),
    ]
    command += [
        "--compare",
        "round-robin",
        "--rate",
        "1",
        "--speed",
        "1",
        "--workers",
        "1",
        "--state-dir",
        str(state),
    ]
    bench = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while not list(state.glob("*/logs/worker-0.log")):  # the stack is up and replaying
            assert bench.poll() is None, bench.stderr.read() if bench.stderr else ""
            assert time.monotonic() < deadline, "the stack did not start"
            time.sleep(0.2)
        time.sleep(2)
        assert _processes_of(state), "no stack process found to stop"
        bench.send_signal(stopping)
        for _ in range(30):  # while the clean-up runs: stopping the stack's processes takes seconds
            time.sleep(0.1)
            if bench.poll() is None:
                bench.send_signal(stopping)
        assert bench.wait(timeout=60) == 130  # interrupted, as by Ctrl-C
    finally:
        if bench.poll() is None:
            bench.kill()
    deadline = time.monotonic() + 15
    while _processes_of(state) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_of(state) == []


def _processes_of(state: Path) -> list[str]:
    """Command lines of live processes that name the state directory (etcd, services)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
            status = (cmdline.parent / "stat").read_text().split()[2]
        except OSError:
            continue
        if str(state) in args and status != "Z":  # a zombie has exited already
            found.append(args)
    return found
