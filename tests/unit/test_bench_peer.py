"""`inferx bench --peer vllm-router` (pure parts): what each front is told per call (no
oracle input), the agent programs' message sizes, the rate ladder, vllm-router's
program-scheduling configuration from the engine profile, and the CLI's checks."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import socket
import threading
import time
from typing import Any

import httpx
import pytest

from inferx.bench import agent_http, peer
from inferx.bench.agent_http import Conversation, Front, HttpAgentReplay, identity
from inferx.cli import bench_args
from inferx.cli.peer import check_args
from inferx.errors import InvalidArgument
from inferx.httpserve import listen_socket
from inferx.openai_compat.render import render_chat
from inferx.openai_compat.schema import ChatMessage
from inferx.sim.profile import EngineProfile
from inferx.sim.trace import TraceConfig, generate, workload


def chains(kind: str = "bfcl", n: int = 3):
    return generate(TraceConfig(seed=5, duration_s=60, rate_per_s=1.0, mix={kind: 1.0})).chains[:n]


def rendered(messages: list[dict[str, Any]]) -> str:
    return render_chat([ChatMessage.model_validate(m) for m in messages])


@pytest.mark.parametrize("kind", ["bfcl", "chat", "swe"])
def test_prompts_have_the_trace_tokens_and_extend_the_previous_prompt(kind: str) -> None:
    chain = chains(kind, 1)[0]
    conversation = Conversation(chain)
    previous = ""
    for k, hop in enumerate(chain.hops):
        messages = conversation.next_call(k)
        prompt = rendered(messages)
        assert len(prompt) % 4 == 0  # whole sim tokens: the completion starts at a token boundary
        assert (
            len(prompt) // 4 == chain.prompt_tokens(k)
            or k == 0
            and len(prompt) // 4 >= chain.prompt_tokens(k)
        )
        assert prompt.startswith(previous)  # the prefix cache sees the previous prompt + completion
        assert f"<|sim-eos {hop.output_tokens}|>" in messages[-1]["content"]
        completion = "abcd" * hop.output_tokens
        conversation.completion(k, completion)
        previous = prompt + completion
    roles = {m["role"] for m in messages}
    assert ("tool" in roles) == (kind != "chat" and len(chain.hops) > 1)


def test_fronts_are_told_only_what_a_client_knows() -> None:
    chain = chains("swe", 1)[0]
    k = 3
    secret = {str(chain.hops[k].output_tokens), str(len(chain.hops) - k - 1)}
    headers, body = identity("inferx", chain, k, 12.5)
    assert headers == {
        "X-InferX-Program": chain.chain_id,
        "X-InferX-Tier": chain.tier,
        "X-InferX-Deadline-Ms": "12500",
    }
    assert body == {}  # no Program-End: a client does not know a call is its last
    headers, body = identity("agentic", chain, k, 12.5)
    context = body["vllm_xargs"]["agentic_context"]
    assert headers == {} and set(context) == {
        "program_id",
        "session_id",
        "step_id",
        "priority",
        "deadline_seconds",
    }
    assert "expected_output_length" not in context and "kv_retention_ttl_seconds" not in context
    assert identity("session", chain, k, 12.5) == ({"X-Session-ID": chain.chain_id}, {})
    assert identity("none", chain, k, 12.5) == ({}, {})
    # past its deadline a chain sends none
    assert "X-InferX-Deadline-Ms" not in identity("inferx", chain, k, -1.0)[0]
    assert "deadline_seconds" not in identity("agentic", chain, k, None)[1]["vllm_xargs"]["agentic_context"]
    for kind in ("inferx", "agentic", "session"):
        headers, body = identity(kind, chain, k, None)
        assert not secret & set(headers.values()) - {chain.chain_id}
        assert str(chain.hops[k].output_tokens) not in json.dumps(body).replace(chain.chain_id, "")


def research_chain():
    trace = generate(workload("research", 1).model_copy(update={"duration_s": 60}))
    return next(c for c in trace.chains if not c.is_sequence and len(c.roots()) == 1)


def test_a_dag_program_extends_each_call_it_waits_for() -> None:
    """A research program: each branch extends the plan's prompt + completion, the join
    carries every branch it waits for, and every call has the trace's prompt tokens."""
    chain = research_chain()
    conversation = Conversation(chain)
    prompts: dict[int, str] = {}
    for k in range(len(chain.hops)):  # index order is a valid issue order
        prompt = rendered(conversation.next_call(k))
        assert len(prompt) % 4 == 0 and len(prompt) // 4 >= chain.prompt_tokens(k)
        assert len(prompt) // 4 == chain.prompt_tokens(k) or k == 0
        completion = f"<{k}>" + "abcd" * chain.hops[k].output_tokens
        deps = chain.deps(k)
        if deps:  # the prefix cache sees the first call it waits for, prompt + completion
            assert prompt.startswith(prompts[deps[0]])
        for j in deps:
            assert f"<{j}>" in prompt  # the completions of what it waits for
        for j in set(range(k)) - set(chain.ancestors(k)):
            assert f"<{j}>" not in prompt  # not a sibling's
        conversation.completion(k, completion)
        prompts[k] = prompt + completion
    join = len(chain.hops) - 1
    assert len(chain.deps(join)) >= 2


def test_a_dag_programs_branches_are_in_flight_together() -> None:
    """The replay sends a DAG's branches at once and the join after all of them (and
    their delays): checked against a front that answers after a short wait."""
    chain = research_chain().model_copy(update={"arrival_s": 0.0})
    trace = generate(workload("research", 1).model_copy(update={"duration_s": 60}))
    trace = trace.model_copy(update={"chains": [chain]})
    in_flight, most = 0, 0
    sent: list[tuple[str, float]] = []

    async def answer(request: httpx.Request) -> httpx.Response:
        nonlocal in_flight, most
        body = json.loads(request.content)
        last = body["messages"][-1]["content"]
        sent.append((last.split("call ", 1)[1].split("]", 1)[0], asyncio.get_running_loop().time()))
        in_flight += 1
        most = max(most, in_flight)
        await asyncio.sleep(0.05)
        in_flight -= 1
        chunk = {"choices": [{"index": 0, "delta": {"content": "ok"}}]}
        usage = {"choices": [], "usage": {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 4}}}
        text = f"data: {json.dumps(chunk)}\n\ndata: {json.dumps(usage)}\n\ndata: [DONE]\n\n"
        return httpx.Response(200, content=text.encode(), headers={"content-type": "text/event-stream"})

    replay = HttpAgentReplay(
        Front("fake", "http://fake", "inferx"), trace, EngineProfile(), speed=1000.0, model="m"
    )
    original = agent_http.http_client
    agent_http.http_client = lambda timeout_s: httpx.AsyncClient(transport=httpx.MockTransport(answer))
    try:
        records = asyncio.run(replay.run(30.0, lambda done: None))
    finally:
        agent_http.http_client = original
    assert [r.status for r in records] == ["ok"]
    assert len(sent) == len(chain.hops)
    branches = [k for k in range(len(chain.hops)) if chain.deps(k) == [0]]
    assert most >= len(branches) >= 2  # the branches were in flight together
    order = [int(k) for k, _ in sent]
    join = len(chain.hops) - 1
    assert order[0] == 0 and order[-1] == join
    assert records[0].prompt_tokens == 10 * len(chain.hops) and records[0].cached_tokens == 4 * len(
        chain.hops
    )


def probe(meets: bool, index: int, rate: float) -> peer.Probe:
    return peer.Probe(
        "f", rate, index, meets, 10, 5, 1.0 if meets else 0.5, None, 1.0, 1.0, 0.1, 0.2, 0.5, {}, 10, 1.0
    )


def walk(passes_below: float, start: int, max_probes: int = 6) -> peer.FrontCapacity:
    calls: list[int] = []

    def evaluate(index: int) -> peer.Probe:
        calls.append(index)
        rate = 0.5 * 1.5**index
        return probe(rate <= passes_below, index, rate)

    result = peer.walk_ladder("f", evaluate, start, max_probes)
    assert len(calls) <= max_probes
    return result


def test_ladder_walks_up_to_the_first_miss_and_down_to_the_first_pass() -> None:
    up = walk(passes_below=1.0, start=0)  # rates 0.5, 0.75, 1.125
    assert [p.ladder_index for p in up.probes] == [0, 1, 2]
    assert up.rate_per_s == pytest.approx(0.75) and up.failing_rate_per_s == pytest.approx(1.125)
    assert not up.at_least
    down = walk(passes_below=0.34, start=1)  # rates 0.75, 0.5, 0.333
    assert [p.ladder_index for p in down.probes] == [1, 0, -1]
    assert down.rate_per_s == pytest.approx(0.5 / 1.5) and down.failing_rate_per_s == pytest.approx(0.5)
    bounded = walk(passes_below=100, start=0, max_probes=3)
    assert bounded.at_least and bounded.rate_per_s == pytest.approx(0.5 * 1.5**2)
    nothing = walk(passes_below=0.0, start=0, max_probes=2)
    assert nothing.rate_per_s == 0 and nothing.failing_rate_per_s == pytest.approx(0.5 / 1.5)


def test_inferx_starts_at_the_best_peer_capacity() -> None:
    seen: list[tuple[str, int]] = []
    capacity = {"vllm-router consistent_hash": 1, "vllm-router program": 2, "inferx": 4}

    def run_probe(front: str, rate: float, index: int) -> peer.Probe:
        seen.append((front, index))
        return probe(index <= capacity[front], index, rate)

    options = peer.LadderOptions(start_rate=0.5, step=1.25, max_probes=4)
    results = peer.capacity_ladder(["consistent_hash", "program"], run_probe, options, lambda r: None)
    assert [i for f, i in seen if f == "inferx"] == [2, 3, 4, 5]
    comparison = peer.compare(
        results,
        [
            {"path": "direct", "added_p50_ms": None},
            {"path": "vllm-router consistent_hash", "added_p50_ms": 0.4},
            {"path": "vllm-router program", "added_p50_ms": 0.6},
            {"path": "inferx", "added_p50_ms": 0.8},
        ],
    )
    assert comparison["best_peer"] == "vllm-router program"
    assert comparison["capacity_ratio"] == pytest.approx(1.25**2) and comparison["capacity_target_met"]
    assert not comparison["inferx_capacity_is_lower_bound"]
    assert comparison["added_latency_gap_p50_ms"] == pytest.approx(0.4)
    assert comparison["added_latency_target_met"]


def test_program_scheduling_config_follows_the_engine_profile_and_speed() -> None:
    profile = EngineProfile()
    one, four = peer.program_scheduling_config(profile, 1.0), peer.program_scheduling_config(profile, 4.0)
    assert one["token_capacity_per_target"] == profile.kv_capacity_tokens
    assert one["max_active_programs_per_target"] == profile.max_num_seqs
    # 1k tokens prefilled alone: 1000 / 15k tokens/s + attention over 500k pairs at 2.6 ms per 1e6
    prefill = one["prefill_cost_model"]
    assert prefill["linear_seconds_per_1k_tokens"] + prefill["quadratic_seconds_per_1k_tokens_squared"] == (
        pytest.approx(profile.step_ms(0, 1000, 0, 1000 * 500) / 1000)
    )
    decode = one["decode_throughput_model"]
    for batch, context in ((1, 0), (32, 100_000)):
        step = decode["fixed_step_seconds"] + decode["batch_step_seconds_per_request"] * batch
        step += decode["context_step_seconds_per_token"] * context
        assert step == pytest.approx(profile.step_ms(batch, 0, context) / 1000)
    assert four["max_acting_ttl_seconds"] == pytest.approx(one["max_acting_ttl_seconds"] / 4)
    assert four["decode_throughput_model"]["fixed_step_seconds"] == pytest.approx(
        decode["fixed_step_seconds"] / 4
    )


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    bench_args.register(sub)
    args = parser.parse_args(["bench", *argv])
    bench_args._defaults(args)
    return args


def test_cli_checks() -> None:
    check_args(parse("--peer", "vllm-router"))
    for argv, message in (
        (("--overhead",), "drop --overhead"),
        (("--probe-chains", "0"), "--probe-chains"),
        (("--rate-step", "1"), "--rate-step"),
        (("--trace", "x.jsonl", "--seeds", "2"), "--seeds"),
    ):
        with pytest.raises(InvalidArgument, match=message):
            check_args(parse("--peer", "vllm-router", *argv))
    with pytest.raises(InvalidArgument, match="unknown vllm-router mode"):
        peer.check_modes(["consistent_hash", "magic"])
    assert math.isclose(parse("--peer", "vllm-router").rate_step ** 2, 1.5)


def test_http_listeners_send_small_writes_at_once() -> None:
    """TCP_NODELAY on the listener (inherited by accepted connections): without it a
    kept-alive call waits ~40 ms for the client's delayed ACK."""
    sock = listen_socket("127.0.0.1", 0)
    try:
        client = socket.create_connection(sock.getsockname())
        accepted, _ = sock.accept()
        assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        accepted.close()
        client.close()
    finally:
        sock.close()


def test_report_renders_every_table() -> None:
    from rich.console import Console

    from inferx.cli import peer as cli_peer

    def front(name: str, rates: list[tuple[float, bool]]) -> peer.FrontCapacity:
        probes = [probe(meets, i, rate) for i, (rate, meets) in enumerate(rates)]
        for p in probes:
            p.front = name
        passing = [p.rate_per_s for p in probes if p.meets]
        failing = [p.rate_per_s for p in probes if not p.meets]
        return peer.FrontCapacity(name, max(passing, default=0.0), min(failing, default=None), probes)

    fronts = [
        front("vllm-router consistent_hash", [(0.5, True), (0.6, False)]),
        front("inferx", [(0.5, True), (0.6, True)]),
    ]
    overhead = [
        {
            "path": "direct",
            "calls": 3,
            "p50_ms": 1.0,
            "p99_ms": 2.0,
            "added_p50_ms": None,
            "added_p99_ms": None,
            "errors": 0,
        },
        {
            "path": "vllm-router consistent_hash",
            "calls": 3,
            "p50_ms": 1.4,
            "p99_ms": 2.5,
            "added_p50_ms": 0.4,
            "added_p99_ms": 0.5,
            "errors": 0,
        },
        {
            "path": "inferx",
            "calls": 3,
            "p50_ms": 6.0,
            "p99_ms": 9.0,
            "added_p50_ms": 5.0,
            "added_p99_ms": 7.0,
            "errors": 1,
        },
    ]
    seed: dict[str, Any] = {"trace_seed": 1, "fronts": fronts, "comparison": peer.compare(fronts, overhead)}
    console = Console(record=True, width=200)
    console.print(cli_peer.overhead_table(overhead))
    console.print(cli_peer.capacity_table(seed))
    same = cli_peer.same_rate_table(seed)
    assert same is not None
    console.print(same)
    for line in [
        *cli_peer.probes_lines(seed),
        *cli_peer.verdict_lines(seed["comparison"], peer.median_summary([seed])),
    ]:
        console.print(line)
    text = console.export_text()
    assert ">= 0.600" in text and "vr consistent_hash" in text
    assert "1.20x (a lower bound" in text and "+4.60 ms" in text and "not met" in text


def test_no_ratio_when_the_best_peer_never_missed() -> None:
    def run_probe(front: str, rate: float, index: int) -> peer.Probe:
        return probe(True, index, rate)  # everyone meets the SLO at every rate

    options = peer.LadderOptions(start_rate=0.5, max_probes=2)
    results = peer.capacity_ladder(["consistent_hash"], run_probe, options, lambda r: None)
    comparison = peer.compare(results, [])
    assert comparison["capacity_ratio"] is None and comparison["capacity_target_met"] is None
    assert "every rate it tried" in comparison["capacity_ratio_undefined_because"]


def test_inferx_diagnostics_differ_from_the_benchmark_only_as_named() -> None:
    chain = chains("bfcl", 1)[0]
    last = len(chain.hops) - 1
    for k in range(len(chain.hops)):
        plain = identity("inferx", chain, k, 5.0)[0]
        assert "X-InferX-Program-End" not in plain
        ended = identity("inferx-end-marks", chain, k, 5.0)[0]
        assert ended == ({**plain, "X-InferX-Program-End": "true"} if k == last else plain)
        no_deadline = identity("inferx-no-deadline", chain, k, 5.0)[0]
        assert no_deadline == {h: v for h, v in plain.items() if h != "X-InferX-Deadline-Ms"}


def test_two_ladder_steps_meet_the_target_despite_floating_point():
    # sqrt(1.5) ** 2 == 1.4999999999999998: two steps up the ladder are the 1.5x target.
    step = peer.DEFAULT_RATE_STEP
    assert step**2 < 1.5
    assert peer.meets_ratio(0.735 * step**2 / 0.735, peer.CAPACITY_TARGET)
    assert not peer.meets_ratio(step, peer.CAPACITY_TARGET)
    assert not peer.meets_ratio(1.49, peer.CAPACITY_TARGET)


def mix_trace():
    return generate(TraceConfig(seed=7, duration_s=300, rate_per_s=1.0, mix={"chat": 0.6, "bfcl": 0.4}))


def test_a_steady_probe_spans_the_same_window_at_every_rate_and_counts_only_the_window() -> None:
    """The live ladder probes in steady state, as the simulator does (issue #42): the
    old probe (the first N chains at the rate) let a front absorb one short burst and
    call that its capacity."""
    from inferx.sim.steady import steady_window

    base = mix_trace()
    window = steady_window(base, 600.0)
    ladder = peer.LadderOptions(start_rate=0.5, window=window)
    spans = []
    for rate in (0.5, 1.0, 2.0):
        trace, measured = peer.probe_trace(base, rate, ladder)
        arrivals = [c.arrival_s for c in trace.chains]
        spans.append(max(arrivals))
        assert window.span_s - 2 / rate <= max(arrivals) < window.span_s
        # the chains that count arrived in the measured window, and all of those count
        assert measured == {c.chain_id for c in trace.chains if window.measured(c.arrival_s)}
        assert len(measured) == pytest.approx(rate * window.window_s, rel=0.25)
        assert len(trace.chains) > len(measured)  # warm-up and drain replayed, not counted
    assert max(spans) - min(spans) < 5.0  # same span whatever the rate: not a burst
    burst, counted = peer.probe_trace(base, 2.0, peer.LadderOptions(start_rate=0.5, probe_chains=30))
    assert len(burst.chains) == 30 and counted == {c.chain_id for c in burst.chains}
    assert "BURST" in peer.LadderOptions(start_rate=0.5, probe_chains=30).describe(4.0)
    assert "steady state" in ladder.describe(4.0) and "NOT steady" not in ladder.describe(4.0)
    short = peer.LadderOptions(start_rate=0.5, window=steady_window(base, 100.0))
    assert "NOT steady state" in short.describe(4.0)  # 100 s is 4 median SLOs


def test_a_probe_counts_only_its_measured_chains() -> None:
    from inferx.sim.records import ChainRecord

    def record(chain_id: str, latency_s: float | None) -> ChainRecord:
        return ChainRecord(
            chain_id,
            "chat",
            "realtime",
            0.0,
            10.0,
            1.0,
            status="ok" if latency_s else "running",
            latency_s=latency_s,
        )

    # warm-up chains that missed their SLO (or never finished) do not fail the probe
    records = [record("w1", 50.0), record("w2", None), *(record(f"m{i}", 5.0) for i in range(20))]
    measured = frozenset(f"m{i}" for i in range(20))
    counted = peer.summarize_probe("f", 1.0, 0, records, peer_stats(), 1.0, measured)
    assert counted.meets and counted.chains == 20 and counted.replayed == 22
    everything = peer.summarize_probe("f", 1.0, 0, records, peer_stats(), 1.0)
    assert not everything.meets and everything.chains == 22
    # ... but a measured chain that missed does
    records[2] = record("m0", 50.0)
    assert not peer.summarize_probe("f", 1.0, 0, records, peer_stats(), 1.0, measured).meets


def test_a_probe_reports_the_realtime_tiers_own_tail() -> None:
    from inferx.sim.records import ChainRecord

    def record(chain_id: str, tier: str, latency_s: float, ttft_s: float) -> ChainRecord:
        return ChainRecord(
            chain_id, "chat", tier, 0.0, 100.0, 1.0, status="ok", latency_s=latency_s, ttft_s=[ttft_s]
        )

    records = [record(f"r{i}", "realtime", 2.0, 0.1) for i in range(10)]
    records += [record(f"b{i}", "batch", 60.0, 30.0) for i in range(10)]
    probe = peer.summarize_probe("f", 1.0, 0, records, peer_stats(), 1.0)
    assert probe.ttft_p99_s == 30.0 and probe.p99_latency_s == 60.0  # all tiers: batch's tail
    assert probe.realtime_ttft_p99_s == 0.1 and probe.realtime_p99_latency_s == 2.0
    no_realtime = peer.summarize_probe("f", 1.0, 0, records[10:], peer_stats(), 1.0)
    assert no_realtime.realtime_ttft_p99_s is None and no_realtime.realtime_p99_latency_s is None


def test_each_probe_reports_the_boxs_load_and_says_when_the_cpus_were_saturated() -> None:
    from inferx.cli import peer as cli_peer

    readings: list[float | None] = [3.0, 5.0, None, 4.0]
    all_read = threading.Event()

    def read() -> float | None:
        if not readings:
            all_read.set()
            return None
        return readings.pop(0)

    with peer.LoadSampler(interval_s=0.001, read=read) as load:
        assert all_read.wait(10)
    assert load.mean == 4.0  # the OS's missing readings are skipped, not counted as 0
    assert peer.LoadSampler(read=lambda: None).mean is None
    assert peer.load_note(3.9, cpus=2) == "load 3.9 on 2 CPUs: saturated, figures read low"
    assert peer.load_note(1.3, cpus=2) == "load 1.3 on 2 CPUs"

    quiet, busy = probe(True, 0, 0.5), probe(False, 1, 0.6)
    busy.load_avg = 2 * (os.cpu_count() or 1) + 1
    fronts = [peer.FrontCapacity("inferx", 0.5, 0.6, [quiet, busy])]
    (line,) = cli_peer.probes_lines({"fronts": fronts})
    assert "saturated" in line and line.count("load") == 1  # only the probe that was measured


def test_a_probe_reports_what_the_fronts_own_processes_cost_in_cpu() -> None:
    """`FrontCpu` counts the CPU the given processes and their descendants use from its
    start (a child that burns ~0.3 s of CPU after it is read first), ignores a pid that
    is gone, and the probe reports it per call; the report's probe line says it."""
    import subprocess
    import sys

    from inferx.cli import peer as cli_peer

    burn = (
        "import sys, time\nsys.stdin.readline()\nt = time.process_time()\n"
        "while time.process_time() - t < 0.3: pass\nsys.stdin.readline()"
    )
    # The burner runs as the child of a launcher (as vllm-router's Python launcher could
    # run its Rust router): the launcher's pid is the one given.
    burner = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {burn!r}])"],
        stdin=subprocess.PIPE,
        text=True,
    )
    try:
        missing = subprocess.Popen([sys.executable, "-c", "pass"])
        missing.wait()
        cpu = peer.FrontCpu([burner.pid, missing.pid])
        idle = cpu.used_s()
        assert burner.stdin is not None
        burner.stdin.write("go\n")
        burner.stdin.flush()
        deadline = time.monotonic() + 30
        while cpu.used_s() < 0.25 and time.monotonic() < deadline:
            time.sleep(0.05)
        used = cpu.used_s()
    finally:
        burner.kill()
        burner.wait()
    assert idle < 0.1  # what it used before `FrontCpu` started is not counted
    assert 0.25 <= used < 5.0

    from inferx.sim.records import ChainRecord

    stats = peer_stats()
    stats.calls = 400
    records = [
        ChainRecord(f"c{i}", "chat", "standard", 0.0, 10.0, 1.0, status="ok", latency_s=1.0)
        for i in range(10)
    ]
    probed = peer.summarize_probe("f", 1.0, 0, records, stats, 1.0, front_cpu_s=0.8)
    assert probed.front_cpu_s == 0.8 and probed.front_cpu_ms_per_call == pytest.approx(2.0)
    no_calls = peer.summarize_probe("f", 1.0, 0, records, peer_stats(), 1.0, front_cpu_s=0.8)
    assert no_calls.front_cpu_ms_per_call is None  # no calls: no figure per call
    (line,) = cli_peer.probes_lines({"fronts": [peer.FrontCapacity("inferx", 1.0, None, [probed])]})
    assert "front CPU 2.0 ms/call" in line


def peer_stats():
    from inferx.bench.agent_http import ReplayStats

    return ReplayStats()


def test_cli_probes_in_steady_state_unless_a_burst_is_asked_for() -> None:
    args = parse("--peer", "vllm-router")
    check_args(args)
    assert args.probe_chains is None  # steady state by default
    args = parse("--peer", "vllm-router", "--burst", "12")
    check_args(args)
    assert args.probe_chains == 12  # --burst: the simulator's name for the same burst
    for argv, message in (
        (("--probe-chains", "5", "--window-s", "600"), "give one of them"),
        (("--probe-chains", "5", "--burst", "6"), "same burst"),
    ):
        with pytest.raises(InvalidArgument, match=message):
            check_args(parse("--peer", "vllm-router", *argv))


def test_a_diagnostic_probe_keeps_its_variant_in_the_report() -> None:
    """The variant's label is in square brackets, which rich would take for a tag."""
    from rich.console import Console

    from inferx.cli import peer as cli_peer

    diagnostic = probe(False, 0, 0.9)
    diagnostic.front = "inferx [inferx-end-marks]"
    console = Console(record=True, width=200)
    console.print(cli_peer.diagnostic_line(diagnostic))
    assert "diagnostic inferx [inferx-end-marks] at 0.900/s: misses the SLO" in console.export_text()
