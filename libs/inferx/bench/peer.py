"""`inferx bench --peer vllm-router`: InferX's OpenAI-compatible front against
vllm-router, both in front of identical SIMULATED sim workers, in one run.

Two measurements:

1. **Added latency per call** (`measure_overhead`): one sim worker at a very high
   `--sim-speed` (engine time ~0) serves, over HTTP, direct calls, calls through each
   vllm-router mode (one vllm-router process per mode, all in front of that worker) and
   calls through InferX (router `--http-port` -> scheduler -> the same worker over
   gRPC). Sequential non-streamed one-token chat calls, the paths interleaved call by
   call so that background load hits them alike; "added" = a path's p50/p99 minus the
   direct call's.

2. **Capacity at SLO** (`capacity_ladder`): the same agent programs
   (`inferx.bench.agent_http`) at arrival rates on a geometric ladder
   (`start x step^i`, default step sqrt(1.5), so two steps are the issue's 1.5x
   target), each probe on a fresh environment: etcd + N sim workers serving HTTP +
   the front under test (a vllm-router process in one mode, or InferX's router,
   scheduler, memory-pool and cache, the router with `--http-port`). A probe meets
   the SLO when >= 99% of realtime and >= 95% of all chains finish within their SLO
   (`inferx.sim.capacity`, the simulator's criterion). Each vllm-router mode walks the
   ladder up from the start rate (down if that fails) until it fails (passes); InferX
   starts at the best mode's capacity, so both are measured at the same rate there.
   The walk is bounded by `max_probes` per front: a front that still met the SLO at
   its last probe has a capacity of *at least* that rate.

vllm-router modes: `consistent_hash` (X-Session-ID = the program id), `program`
(its program scheduling, `--enable-program-scheduling`, identity in
`vllm_xargs.agentic_context`, `consistent_hash` as the fallback policy), and the other
policies by name (`cache_aware`, `power_of_two`, `round_robin`, `sticky_least_loaded`,
`random`). Program scheduling gets the deployment's numbers as an operator would set
them: the workers' KV capacity (`token_capacity_per_target`), their `max_num_seqs`
(`max_active_programs_per_target`), the prefill/decode cost models fitted from the sim
engine's own profile, and its time constants divided by the replay's `speed` (as
InferX's scheduler runs with `--time-scale speed`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import httpx
import psutil

from inferx.bench.agent_http import DIAGNOSTICS, Front, HttpAgentReplay, Identity, http_client, identity
from inferx.bench.runner import ProgressFactory
from inferx.devstack import LocalStack, ManagedProcess, StackError, StackPorts, free_port, wait_serving
from inferx.errors import FailedPrecondition, InvalidArgument
from inferx.sim.capacity import OVERALL_TARGET, REALTIME_TARGET, attainment, meets_slo
from inferx.sim.profile import EngineProfile
from inferx.sim.records import ChainRecord
from inferx.sim.steady import SteadyWindow, burst_trace, steady_trace
from inferx.sim.trace import Trace, TraceChain, TraceHop
from inferx.stats import percentile

PEER = "vllm-router"
INSTALL_HINT = (
    "install it with `pip install vllm-router` (0.1.17 is what docs/benchmarks.md measured; "
    "`make setup` installs it with the project's test extra)"
)
MODEL = "sim"  # the sim workers' pool and model name on every path
INFERX = "inferx"
DIRECT = "direct"
CAPACITY_TARGET = 1.5  # issue #16: InferX's capacity at SLO over the best vllm-router mode
DEFAULT_RATE_STEP = math.sqrt(CAPACITY_TARGET)
READY_TIMEOUT_S = 90.0


@dataclass(frozen=True)
class PeerMode:
    policy: str
    program_scheduling: bool
    identity: Identity


PEER_MODES: dict[str, PeerMode] = {
    "consistent_hash": PeerMode("consistent_hash", False, "session"),
    "program": PeerMode("consistent_hash", True, "agentic"),
    "cache_aware": PeerMode("cache_aware", False, "session"),
    "sticky_least_loaded": PeerMode("sticky_least_loaded", False, "session"),
    "power_of_two": PeerMode("power_of_two", False, "session"),
    "round_robin": PeerMode("round_robin", False, "none"),
    "random": PeerMode("random", False, "none"),
}
DEFAULT_MODES = ("consistent_hash", "program")


def front_name(mode: str) -> str:
    return INFERX if mode == INFERX else f"{PEER} {mode}"


def check_modes(modes: list[str]) -> list[str]:
    unknown = [m for m in modes if m not in PEER_MODES]
    if unknown:
        raise InvalidArgument(f"unknown vllm-router mode(s) {unknown}; choose from {', '.join(PEER_MODES)}")
    if len(set(modes)) != len(modes):
        raise InvalidArgument("--peer-modes repeats a mode")
    return modes


@dataclass(frozen=True)
class PeerBinary:
    path: str
    version: str


def find_vllm_router() -> PeerBinary:
    """The vllm-router launcher (a Python entry point over a Rust extension), checked
    to start on this machine; FailedPrecondition says how to install it."""
    beside = Path(sys.executable).parent / PEER
    path = str(beside) if beside.exists() else shutil.which(PEER)
    if path is None:
        raise FailedPrecondition(f"{PEER} is not installed: {INSTALL_HINT}")
    try:
        check = subprocess.run([path, "--help"], capture_output=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise FailedPrecondition(f"{path} cannot run on this machine ({exc}); {INSTALL_HINT}") from None
    if check.returncode != 0 or b"--worker-urls" not in check.stdout:
        tail = (check.stderr or check.stdout).decode(errors="replace").strip().splitlines()[-3:]
        raise FailedPrecondition(f"{path} --help failed ({' / '.join(tail)}); {INSTALL_HINT}")
    try:
        version = metadata.version(PEER)
    except metadata.PackageNotFoundError:
        version = "unknown"
    return PeerBinary(path, version)


def program_scheduling_config(profile: EngineProfile, speed: float) -> dict[str, Any]:
    """vllm-router's program scheduling, configured for the sim workers: capacity and
    cost models from the engine profile (wall seconds: engine seconds / speed), time
    constants (its documented defaults) divided by `speed`."""
    s = speed
    # prefill alone: T tokens cost T / tps + attention over T^2/2 pairs (EngineProfile.step_ms)
    linear = 1000 / profile.prefill_tokens_per_s  # seconds per 1k tokens
    quadratic = profile.prefill_attention_ms * 0.5  # ms per (1k tokens)^2 = s per 1k^2 / 1000 * 1000
    per_request = profile.decode_step_ms * profile.batch_slowdown / 31 / 1000
    return {
        "program_scheduling_enable_key": "vllm_xargs.agentic_context",
        "global_queue": True,
        "token_capacity_per_target": profile.kv_capacity_tokens,
        "max_active_programs_per_target": profile.max_num_seqs,
        "metrics_interval_seconds": max(0.05, 1.0 / s),
        "queue_timeout_seconds": 600.0 / s,
        "force_resume_timeout_seconds": 300.0 / s,
        "paused_retention_ttl_seconds": 1800.0 / s,
        "max_acting_ttl_seconds": 10.0 / s,
        "shared_prefix_freshness_warmup_seconds": 100.0 / s,
        "prefill_cost_model": {
            "intercept_seconds": profile.decode_step_ms / 1000 / s,
            "linear_seconds_per_1k_tokens": linear / s,
            "quadratic_seconds_per_1k_tokens_squared": quadratic / 1000 / s,
            "decode_throughput_alpha": 0.15,
        },
        "decode_throughput_model": {
            "fixed_step_seconds": (profile.decode_step_ms / 1000 - per_request) / s,
            "batch_step_seconds_per_request": per_request / s,
            "context_step_seconds_per_token": profile.kv_read_ms_per_1k_tokens / 1e6 / s,
        },
    }


# ----- environments ---------------------------------------------------------------------


@dataclass
class Environment:
    """etcd + sim workers serving HTTP, and the front under test."""

    stack: LocalStack
    worker_urls: list[str]
    fronts: dict[str, str] = field(default_factory=dict)  # front name -> base URL
    routers: list[ManagedProcess] = field(default_factory=list)

    def stop(self) -> None:
        for proc in self.routers:
            proc.stop()
        self.stack.stop()

    def front_pids(self) -> list[int]:
        """The processes of the front under test: InferX's services (router, scheduler,
        memory-pool, cache) or the vllm-router processes -- not the sim workers, etcd or
        the load generator, which both fronts share."""
        return [proc.pid for proc in (*self.stack.services.values(), *self.routers) if proc.alive()]


@dataclass(frozen=True)
class EnvSpec:
    workers: int
    speed: float
    profile: EngineProfile
    inferx: bool  # start InferX's services (router --http-port, scheduler, memory-pool, cache)
    time_scale: float = 1.0  # InferX's scheduler --time-scale (the replay's speed)
    modes: tuple[str, ...] = ()  # a vllm-router process per mode, in front of the workers
    binary: str = PEER
    python: str = sys.executable
    embedded_scheduler: bool = False  # InferX's router runs the scheduler in its process


def start_environment(state_dir: Path, spec: EnvSpec) -> Environment:
    # Plaintext and no tokens (--insecure), as the vllm-router side runs: the comparison is
    # of scheduling and of each front's own cost, not of TLS.
    state_dir.mkdir(parents=True, exist_ok=True)
    profile_path = state_dir / "profile.json"  # the workers' engine, and what InferX's scheduler knows of it
    profile_path.write_text(json.dumps(spec.profile.model_dump()))
    scheduler_flags = ["--time-scale", str(spec.time_scale), "--engine-profile", str(profile_path)]
    stack = LocalStack(
        state_dir,
        StackPorts.free(),
        lease_ttl_s=10,
        fresh_etcd=True,
        python=spec.python,
        insecure=True,
        embedded_scheduler=spec.embedded_scheduler,
        scheduler_flags=scheduler_flags,
    )
    env = Environment(stack, [])
    try:
        stack.start_etcd()
        if spec.inferx:
            for kind, extra in (
                ("memory-pool", []),
                ("scheduler", scheduler_flags),
                ("cache", []),
                ("router", []),
            ):
                if kind == "scheduler" and spec.embedded_scheduler:
                    continue  # the router runs it
                stack.start_service(kind, extra)
            for proc in stack.services.values():
                wait_serving(proc, READY_TIMEOUT_S)
            stack.load_models({MODEL: MODEL})
        ports = [free_port() for _ in range(spec.workers)]
        for port in ports:
            stack.start_worker(
                MODEL,
                "sim",
                [
                    "--sim-speed",
                    str(spec.speed),
                    "--sim-profile",
                    str(profile_path),
                    "--max-num-seqs",
                    str(spec.profile.max_num_seqs),
                    "--openai-http-port",
                    str(port),
                    # No model directory, so no chat template: both paths (vllm-router ->
                    # worker HTTP, InferX -> worker gRPC) render chats with InferX's
                    # generic rendering, which the client sizes its messages by.
                    "--model-path",
                    MODEL,
                ],
            )
        for worker in stack.workers:
            wait_serving(worker, READY_TIMEOUT_S)
        env.worker_urls = [f"http://127.0.0.1:{port}" for port in ports]
        if spec.inferx:
            # SERVING is not routed yet: the router's front would answer 503 "no live
            # worker" until its, the scheduler's and the memory-pool's watches see them.
            stack.wait_workers(READY_TIMEOUT_S)
            base = f"http://127.0.0.1:{stack.ports.router_http}"
            _wait_http(f"{base}/v1/models", lambda r: MODEL in r.text, stack.services["router"])
            env.fronts[INFERX] = base
        for mode in spec.modes:
            env.fronts[front_name(mode)] = _start_vllm_router(env, state_dir, mode, spec)
        return env
    except BaseException:
        env.stop()
        raise


def _start_vllm_router(env: Environment, state_dir: Path, mode: str, spec: EnvSpec) -> str:
    peer = PEER_MODES[mode]
    port = free_port()
    argv = [
        spec.binary,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        *env.worker_urls,
        "--policy",
        peer.policy,
        "--prometheus-port",
        str(free_port()),
        "--log-level",
        "warning",
    ]
    if peer.program_scheduling:
        config = program_scheduling_config(spec.profile, spec.speed)
        argv += [
            "--enable-program-scheduling",
            "--program-scheduling-config-json",
            json.dumps(config, separators=(",", ":")),
        ]
    proc = ManagedProcess(f"vllm-router-{mode}", argv, state_dir / "logs" / f"vllm-router-{mode}.log")
    proc.start()
    env.routers.append(proc)
    base = f"http://127.0.0.1:{port}"
    _wait_http(f"{base}/health", lambda r: r.status_code == 200, proc)
    return base


def _wait_http(url: str, ok: Callable[[httpx.Response], bool], proc: ManagedProcess) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if not proc.alive():
                raise StackError(f"{proc.name} exited during start-up; its log ends with:\n{proc.log_tail()}")
            try:
                if ok(client.get(url)):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
    raise StackError(
        f"{url} not ready after {READY_TIMEOUT_S:.0f}s; {proc.name}'s log ends with:\n{proc.log_tail()}"
    )


# ----- 1. added latency per call ---------------------------------------------------------


@dataclass
class PathLatency:
    name: str
    latencies_ms: list[float] = field(default_factory=list)
    errors: int = 0
    first_error: str = ""

    @property
    def p50_ms(self) -> float:
        return percentile(self.latencies_ms, 50, method="nearest-rank")

    @property
    def p99_ms(self) -> float:
        return percentile(self.latencies_ms, 99, method="nearest-rank")


async def measure_overhead(
    fronts: dict[str, tuple[str, Identity]], count: int, warmup: int, progress: ProgressFactory
) -> list[PathLatency]:
    """`fronts`: name -> (base URL, identity). Sequential one-token calls, the paths
    interleaved call by call, in a new random order each round (no path always after
    the same one)."""
    paths = {name: PathLatency(name) for name in fronts}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
    program = TraceChain(
        chain_id="overhead",
        kind="bfcl",
        tier="standard",
        arrival_s=0,
        slo_s=60,
        shared_prefix="none",
        shared_tokens=0,
        hops=[TraceHop(new_tokens=1, output_tokens=1)],
    )
    async with http_client(30.0) as client:
        with progress("added latency (sequential calls)", (warmup + count) * len(fronts)) as advance:
            done = 0
            order, names = random.Random(0), list(fronts)
            for i in range(warmup + count):
                order.shuffle(names)
                for name in names:
                    base, kind = fronts[name]
                    headers, extra = identity(kind, program, i, 60.0)
                    started = time.perf_counter()
                    try:
                        reply = await client.post(
                            f"{base}/v1/chat/completions", json={**body, **extra}, headers=headers
                        )
                        failed = (
                            ""
                            if reply.status_code == 200
                            else f"http {reply.status_code}: {reply.text[:200]}"
                        )
                    except httpx.HTTPError as exc:
                        failed = f"{type(exc).__name__}: {exc}"
                    elapsed_ms = (time.perf_counter() - started) * 1000
                    if failed:
                        paths[name].errors += 1
                        paths[name].first_error = paths[name].first_error or failed
                    elif i >= warmup:
                        paths[name].latencies_ms.append(elapsed_ms)
                    done += 1
                    advance(done)
    return list(paths.values())


def overhead_summary(paths: list[PathLatency]) -> list[dict[str, Any]]:
    direct = next((p for p in paths if p.name == DIRECT), None)
    rows = []
    for p in paths:
        rows.append(
            {
                "path": p.name,
                "calls": len(p.latencies_ms),
                "p50_ms": p.p50_ms,
                "p99_ms": p.p99_ms,
                "added_p50_ms": None if direct is None or p is direct else p.p50_ms - direct.p50_ms,
                "added_p99_ms": None if direct is None or p is direct else p.p99_ms - direct.p99_ms,
                "errors": p.errors,
                "first_error": p.first_error,
            }
        )
    return rows


# ----- 2. capacity at SLO ------------------------------------------------------------------


def probe_trace(base: Trace, rate: float, ladder: LadderOptions) -> tuple[Trace, frozenset[str]]:
    """What one probe replays at `rate`, and the ids of the chains it counts: in steady
    state (`ladder.window`) `base`'s chains repeated over warm-up, measured window and
    drain, only those arriving in the window counted (`inferx.sim.steady`, as the
    simulator's capacity search); else a burst of the first `ladder.probe_chains`."""
    if ladder.window is None:
        return burst_trace(base, rate, ladder.probe_chains)
    return steady_trace(base, rate, ladder.window)


@dataclass
class Probe:
    front: str
    rate_per_s: float
    ladder_index: int
    meets: bool
    chains: int
    realtime_chains: int
    overall: float
    realtime: float | None
    p99_latency_s: float | None  # trace seconds; None (inf) when > 1% did not finish
    p50_latency_s: float | None
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    cached_ratio: float | None
    errors: dict[str, int]
    calls: int
    wall_s: float
    replayed: int = 0  # chains replayed, warm-up and drain included (`chains`: those counted)
    # The realtime tier's own tail: a front may keep other tiers' prefills waiting (within
    # their SLO) to keep realtime calls fast, which the all-tier figures above hide.
    realtime_p99_latency_s: float | None = None
    realtime_ttft_p99_s: float | None = None
    # The box's mean 1-minute load average over the probe (None where the OS has none):
    # over its CPU count, the fronts, the sim workers and the load generator fought for
    # the CPUs, and the probe's figures read low.
    load_avg: float | None = None
    # CPU time (user + system) of the front's own processes over the probe, and per call
    # made (`FrontCpu`): what the front costs to run, beside what it serves.
    front_cpu_s: float | None = None
    front_cpu_ms_per_call: float | None = None


def _one_minute_load() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:  # not every platform keeps one
        return None


class LoadSampler:
    """The box's load average, read every `interval_s` on a thread while a probe runs.
    Live probes share the box's CPUs among the front's services, the sim workers (which
    must keep x`speed` real time) and the load generator; a probe that saturated them is
    reported as such rather than read as the front's capacity."""

    def __init__(self, interval_s: float = 10.0, read: Callable[[], float | None] = _one_minute_load) -> None:
        self._interval_s = interval_s
        self._read = read
        self._samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="load-sampler", daemon=True)

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            value = self._read()
            if value is not None:
                self._samples.append(value)
            if self._stop.wait(self._interval_s):
                return

    @property
    def mean(self) -> float | None:
        return sum(self._samples) / len(self._samples) if self._samples else None


class FrontCpu:
    """CPU seconds (user + system, their children's included) that a set of processes
    use from now on: the front's services over a probe (`Environment.front_pids`). A
    process gone before `used_s` counts what it had used when last read."""

    def __init__(self, pids: list[int]) -> None:
        self._processes: list[psutil.Process] = []
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                self._processes.append(psutil.Process(pid))
        self._last: dict[int, float] = {}  # pid -> its latest reading
        self._start = self._total()

    @staticmethod
    def _read(process: psutil.Process) -> float | None:
        """The process's CPU time, its reaped children's and its live descendants'
        (a launcher may run the front in a child, as vLLM runs its engine core)."""
        try:
            t = process.cpu_times()
            descendants = process.children(recursive=True)
        except psutil.Error:
            return None
        total = t.user + t.system + t.children_user + t.children_system
        for child in descendants:
            with contextlib.suppress(psutil.Error):
                c = child.cpu_times()
                total += c.user + c.system
        return total

    def _total(self) -> float:
        for process in self._processes:
            value = self._read(process)
            if value is not None:
                self._last[process.pid] = value
        return sum(self._last.values())

    def used_s(self) -> float:
        return self._total() - self._start


def load_note(load_avg: float, cpus: int | None = None) -> str:
    """`load 3.9 on 2 CPUs: saturated, figures read low` / `load 1.2 on 2 CPUs`."""
    cpus = cpus or os.cpu_count() or 1
    saturated = ": saturated, figures read low" if load_avg > cpus else ""
    return f"load {load_avg:.1f} on {cpus} CPUs{saturated}"


def probe_notes(probe: Probe) -> list[str]:
    """What a probe's lines say besides its attainment: the front's own CPU per call and
    the box's load while it ran (each where measured)."""
    notes = []
    if probe.front_cpu_ms_per_call is not None:
        notes.append(f"front CPU {probe.front_cpu_ms_per_call:.1f} ms/call")
    if probe.load_avg is not None:
        notes.append(load_note(probe.load_avg))
    return notes


def summarize_probe(
    front: str,
    rate: float,
    index: int,
    records: list[ChainRecord],
    stats,
    wall_s: float,
    measured: frozenset[str] | None = None,
    load_avg: float | None = None,
    front_cpu_s: float | None = None,
) -> Probe:
    """The probe's figures over the chains it counts (`measured`; None: all of them)."""
    replayed = len(records)
    if measured is not None:
        records = [r for r in records if r.chain_id in measured]
    result = attainment(records)
    realtime = [r for r in records if r.tier == "realtime"]
    prompt = sum(r.prompt_tokens for r in records)
    cached = sum(r.cached_tokens for r in records)

    def latencies(chains: list[ChainRecord]) -> list[float]:
        return [math.inf if r.latency_s is None else r.latency_s for r in chains]

    def ttfts(chains: list[ChainRecord]) -> list[float]:
        return [t for r in chains for t in r.ttft_s]

    def pct(values: list[float], q: float) -> float | None:
        """Nearest-rank percentile; None when there is none or it is inf (unfinished)."""
        if not values:
            return None
        value = percentile(values, q, method="nearest-rank")
        return value if math.isfinite(value) else None

    return Probe(
        front=front,
        rate_per_s=rate,
        ladder_index=index,
        meets=meets_slo(result),
        chains=result.chains,
        realtime_chains=result.realtime_chains,
        overall=result.overall,
        realtime=result.realtime,
        p99_latency_s=pct(latencies(records), 99),
        p50_latency_s=pct(latencies(records), 50),
        ttft_p50_s=pct(ttfts(records), 50),
        ttft_p99_s=pct(ttfts(records), 99),
        cached_ratio=cached / prompt if prompt else None,
        errors=dict(stats.errors),
        calls=stats.calls,
        wall_s=wall_s,
        replayed=replayed,
        realtime_p99_latency_s=pct(latencies(realtime), 99),
        realtime_ttft_p99_s=pct(ttfts(realtime), 99),
        load_avg=load_avg,
        front_cpu_s=front_cpu_s,
        front_cpu_ms_per_call=1000 * front_cpu_s / stats.calls
        if front_cpu_s is not None and stats.calls
        else None,
    )


@dataclass
class FrontCapacity:
    front: str
    rate_per_s: float  # highest ladder rate that met the SLO below the first failing one (0: none)
    failing_rate_per_s: float | None  # None: met the SLO at every rate probed
    probes: list[Probe]

    @property
    def at_least(self) -> bool:
        """Met the SLO at its highest probe: the capacity is a lower bound."""
        return self.failing_rate_per_s is None and self.rate_per_s > 0


@dataclass
class LadderOptions:
    start_rate: float
    step: float = DEFAULT_RATE_STEP
    max_probes: int = 4
    # Steady state (the default of `inferx bench --peer`): every probe's arrivals span
    # this window whatever its rate. None: a burst of `probe_chains` chains instead.
    window: SteadyWindow | None = None
    probe_chains: int = 40
    timeout_s: float = 900.0  # wall seconds a probe may run after its last arrival

    @property
    def steady(self) -> bool:
        return self.window is not None

    def describe(self, speed: float) -> str:
        """What each probe replays, for the progress notes and the report."""
        if self.window is None:
            return (
                f"a BURST of {self.probe_chains} chains per probe (how each front absorbs one burst, "
                "not a sustained rate)"
            )
        w = self.window
        return (
            f"steady state: per probe {w.warmup_s:.0f} s warm-up + {w.window_s:.0f} s measured "
            f"({w.window_slos:.1f} median chain SLOs) + {w.drain_s:.0f} s drain of arrivals, "
            f"~{w.span_s / speed / 60:.0f} min wall at x{speed:g}"
            + ("" if w.steady else "; NOT steady state: the window is under 20 median SLOs")
        )


def walk_ladder(
    front: str, evaluate: Callable[[int], Probe], start_index: int, max_probes: int
) -> FrontCapacity:
    """Up from `start_index` while the SLO is met (down while it is not), at most
    `max_probes` probes. Pure over `evaluate(index)`."""
    probes: list[Probe] = []
    index = start_index
    first = evaluate(index)
    probes.append(first)
    direction = 1 if first.meets else -1
    while len(probes) < max_probes:
        index += direction
        probe = evaluate(index)
        probes.append(probe)
        if probe.meets != first.meets:
            break
    passing = [p for p in probes if p.meets]
    failing = [p for p in probes if not p.meets]
    if direction == 1:
        capacity = max((p.rate_per_s for p in passing), default=0.0)
        fail = min((p.rate_per_s for p in failing), default=None)
    else:
        capacity = max((p.rate_per_s for p in passing), default=0.0)
        fail = min((p.rate_per_s for p in failing if p.rate_per_s > capacity), default=None)
    return FrontCapacity(front, capacity, fail, probes)


ProbeRunner = Callable[[str, float, int], Probe]


def capacity_ladder(
    modes: list[str],
    run_probe: ProbeRunner,
    options: LadderOptions,
    on_front: Callable[[FrontCapacity], None],
) -> list[FrontCapacity]:
    """Each vllm-router mode from the start rate, then InferX from the best mode's
    capacity (the start rate if none met the SLO). `run_probe(front, rate, index)`."""

    def rate(index: int) -> float:
        return options.start_rate * options.step**index

    results: list[FrontCapacity] = []

    def evaluator(name: str) -> Callable[[int], Probe]:
        return lambda index: run_probe(name, rate(index), index)

    for mode in modes:
        result = walk_ladder(front_name(mode), evaluator(front_name(mode)), 0, options.max_probes)
        results.append(result)
        on_front(result)
    best = max(results, key=lambda r: r.rate_per_s, default=None)
    start = 0
    if best is not None and best.rate_per_s > 0:
        start = next(p.ladder_index for p in best.probes if p.rate_per_s == best.rate_per_s)
    inferx = walk_ladder(INFERX, evaluator(INFERX), start, options.max_probes)
    results.append(inferx)
    on_front(inferx)
    return results


def meets_ratio(ratio: float, target: float) -> bool:
    """`ratio >= target` for ratios of ladder rates: two steps of sqrt(1.5) make
    1.4999999999999998 in floating point, which is the 1.5x the ladder was built for."""
    return ratio >= target * (1 - 1e-9)


def compare(results: list[FrontCapacity], overhead: list[dict[str, Any]]) -> dict[str, Any]:
    """InferX against the best vllm-router mode: capacity ratio (a lower bound when
    InferX met the SLO at every rate it tried), added latency difference."""
    inferx = next(r for r in results if r.front == INFERX)
    peers = [r for r in results if r.front != INFERX]
    best = max(peers, key=lambda r: r.rate_per_s, default=None)
    ratio, why = None, ""
    if best is None or best.rate_per_s <= 0:
        why = "no vllm-router mode met the SLO at the lowest rate probed (lower --rate)"
    elif best.at_least:
        why = f"{best.front} met the SLO at every rate it tried (raise --rate or --max-probes)"
    else:
        ratio = inferx.rate_per_s / best.rate_per_s
    added = {row["path"]: row for row in overhead}
    peer_added = [
        row for name, row in added.items() if name.startswith(PEER) and row["added_p50_ms"] is not None
    ]
    best_latency = min(peer_added, key=lambda row: row["added_p50_ms"], default=None)
    gap = None
    if INFERX in added and best_latency is not None and added[INFERX]["added_p50_ms"] is not None:
        gap = added[INFERX]["added_p50_ms"] - best_latency["added_p50_ms"]
    return {
        "best_peer": best.front if best else None,
        "best_peer_capacity_per_s": best.rate_per_s if best else None,
        "inferx_capacity_per_s": inferx.rate_per_s,
        "inferx_capacity_is_lower_bound": inferx.at_least,
        "capacity_ratio": ratio,
        "capacity_ratio_undefined_because": why or None,
        "capacity_target": CAPACITY_TARGET,
        "capacity_target_met": None if ratio is None else meets_ratio(ratio, CAPACITY_TARGET),
        "added_latency_gap_p50_ms": gap,
        "added_latency_peer": best_latency["path"] if best_latency else None,
        "added_latency_target_ms": 0.5,
        "added_latency_target_met": None if gap is None else gap <= 0.5,
    }


# ----- the whole benchmark -----------------------------------------------------------------


@dataclass
class PeerOptions:
    workers: int
    speed: float
    modes: list[str]
    ladder: LadderOptions
    count: int  # sequential calls per path (added latency)
    warmup: int
    overhead_speed: float = 10_000.0
    state_dir: Path | None = None
    # After the ladder, InferX once more at the best mode's capacity with each of
    # agent_http.DIAGNOSTICS (an end mark on each program's last call: an oracle; no
    # deadline header): what each costs InferX. Reported apart, never in the ratio.
    diagnostics: bool = False
    embedded_scheduler: bool = False  # InferX's router runs the scheduler in its process


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"


async def run_peer_bench(
    traces: list[Trace],
    profile: EngineProfile,
    options: PeerOptions,
    binary: PeerBinary,
    progress_calls: ProgressFactory,
    progress_chains: ProgressFactory,
    note: Callable[[str], None],
    keep: Callable[[str, Any], None],
) -> dict[str, Any]:
    """Both measurements; `keep(key, value)` gets every result as soon as it exists."""
    with tempfile.TemporaryDirectory(prefix="inferx-peer-") as tmp:
        root = options.state_dir or Path(tmp)
        note(
            f"added latency: InferX and {PEER} ({', '.join(options.modes)}) in front of one sim worker "
            f"(x{options.overhead_speed:g}: engine time ~0) ..."
        )
        spec = EnvSpec(
            1,
            options.overhead_speed,
            profile,
            inferx=True,
            modes=tuple(options.modes),
            binary=binary.path,
            embedded_scheduler=options.embedded_scheduler,
        )
        env = await asyncio.to_thread(start_environment, root / "overhead", spec)
        try:
            fronts: dict[str, tuple[str, Identity]] = {DIRECT: (env.worker_urls[0], "none")}
            for mode in options.modes:
                fronts[front_name(mode)] = (env.fronts[front_name(mode)], PEER_MODES[mode].identity)
            fronts[INFERX] = (env.fronts[INFERX], "inferx")
            paths = await measure_overhead(fronts, options.count, options.warmup, progress_calls)
        finally:
            await asyncio.to_thread(env.stop)
        overhead = overhead_summary(paths)
        keep("overhead", overhead)

        seeds: list[dict[str, Any]] = []
        raw: list[dict[str, Any]] = []  # every probe with its chains, saved as it ends

        def saver(seed: int) -> Callable[[Probe, list[ChainRecord]], None]:
            def save(probe: Probe, records: list[ChainRecord]) -> None:
                raw.append({"trace_seed": seed, "probe": probe, "chains": records})
                keep("probes", raw)

            return save

        for trace in traces:
            seed = trace.meta.config.seed
            results, diagnostics = await _capacity_for_trace(
                trace,
                profile,
                options,
                binary,
                root / f"seed-{seed}",
                progress_chains,
                note,
                saver(seed),
            )
            seeds.append(
                {
                    "trace_seed": seed,
                    "fronts": results,
                    "comparison": compare(results, overhead),
                    "diagnostics": diagnostics,
                }
            )
            keep("seeds", seeds)
    return {"overhead": overhead, "seeds": seeds, "summary": median_summary(seeds)}


async def _capacity_for_trace(
    trace: Trace,
    profile: EngineProfile,
    options: PeerOptions,
    binary: PeerBinary,
    root: Path,
    progress: ProgressFactory,
    note: Callable[[str], None],
    on_probe: Callable[[Probe, list[ChainRecord]], None],
) -> tuple[list[FrontCapacity], list[Probe]]:
    """The fronts' capacities, and the diagnostic probes (`options.diagnostics`)."""
    ladder = options.ladder
    loop = asyncio.get_running_loop()
    counter = iter(range(1_000_000))

    def run_probe(front: str, rate: float, index: int, diagnostic: Identity | None = None) -> Probe:
        mode = None if front == INFERX else front.removeprefix(f"{PEER} ")
        spec = EnvSpec(
            options.workers,
            options.speed,
            profile,
            inferx=mode is None,
            time_scale=options.speed,
            modes=() if mode is None else (mode,),
            binary=binary.path,
            embedded_scheduler=options.embedded_scheduler,
        )
        state = root / f"probe-{next(counter)}"
        probe_chains, measured = probe_trace(trace, rate, ladder)
        # the timeout runs from the probe's last arrival (a steady probe's arrivals alone
        # take its whole span)
        last_arrival_s = max((c.arrival_s for c in probe_chains.chains), default=0.0)
        timeout_s = ladder.timeout_s + last_arrival_s / options.speed
        env = start_environment(state, spec)
        try:
            kind: Identity = "inferx" if mode is None else PEER_MODES[mode].identity
            label = front if diagnostic is None else f"{front} [{diagnostic}]"
            replay = HttpAgentReplay(
                Front(label, env.fronts[front], diagnostic or kind),
                probe_chains,
                profile,
                options.speed,
                MODEL,
            )
            started = time.perf_counter()
            title = f"{label} at {rate:.3f} chains/s (x{options.speed:g})"
            cpu = FrontCpu(env.front_pids())
            with LoadSampler() as load, progress(title, len(probe_chains.chains)) as advance:
                records = asyncio.run_coroutine_threadsafe(replay.run(timeout_s, advance), loop).result()
            wall = time.perf_counter() - started
            front_cpu_s = cpu.used_s()
        finally:
            env.stop()
        probe = summarize_probe(
            label, rate, index, records, replay.stats, wall, measured, load.mean, front_cpu_s
        )
        on_probe(probe, records)
        verdict = "meets the SLO" if probe.meets else "misses the SLO"
        realtime = "-" if probe.realtime is None else f"{probe.realtime:.0%}"
        note(
            f"  {label} at {rate:.3f}/s: {verdict} (all {probe.overall:.0%}, realtime {realtime}, "
            f"P99 {_s(probe.p99_latency_s)}, {', '.join([f'{wall:.0f} s wall', *probe_notes(probe)])})"
        )
        return probe

    def ladder_walk() -> tuple[list[FrontCapacity], list[Probe]]:
        results = capacity_ladder(options.modes, run_probe, ladder, lambda r: None)
        diagnostics = []
        best = max((r for r in results if r.front != INFERX), key=lambda r: r.rate_per_s, default=None)
        if options.diagnostics and best is not None and best.rate_per_s > 0:
            at = next(p for p in best.probes if p.rate_per_s == best.rate_per_s)
            for variant in DIAGNOSTICS:
                diagnostics.append(run_probe(INFERX, at.rate_per_s, at.ladder_index, variant))
        return results, diagnostics

    note(
        f"capacity at SLO (trace seed {trace.meta.config.seed}): {ladder.describe(options.speed)}; "
        f"rates {ladder.start_rate:.3f} x {ladder.step:.3f}^i, at most {ladder.max_probes} probes per front"
    )
    return await asyncio.to_thread(ladder_walk)


def _s(value: float | None) -> str:
    return "miss" if value is None else f"{value:.1f} s"


def median_summary(seeds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per front, the median capacity over seeds; the median ratio."""
    fronts: dict[str, list[float]] = {}
    for seed in seeds:
        for result in seed["fronts"]:
            fronts.setdefault(result.front, []).append(result.rate_per_s)
    ratios = [
        s["comparison"]["capacity_ratio"] for s in seeds if s["comparison"]["capacity_ratio"] is not None
    ]
    return {
        "capacity_median_per_s": {name: _median(values) for name, values in fronts.items()},
        "capacity_ratio_median": _median(ratios) if ratios else None,
        "seeds": len(seeds),
        "seeds_with_a_ratio": len(ratios),
        "realtime_target": REALTIME_TARGET,
        "overall_target": OVERALL_TARGET,
    }


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
