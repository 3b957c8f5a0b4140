"""Live replay of a trace: a LocalStack per policy (etcd, memory-pool, the scheduler with
`--policy NAME`, N `sim` workers running the simulator's EngineModel), the trace's
chains driven closed-loop through the scheduler's SubmitHop.

How a chain is replayed (the same rules as the virtual-time simulator):
  * call k is submitted when every call it depends on (by default call k-1; a DAG
    chain's `depends_on`) has finished and each one's tool delay / think time has
    passed (`inferx.sim.trace.ready_at`, via `ChainProgress`): a DAG's parallel
    branches are in flight together, one asyncio task per call;
  * call k's prompt is the chain's shared prefix text, the input and *actual
    completion* of every call it transitively depends on (in index order), then call
    k's new input, so a worker that kept the chain's blocks prefills only the new
    tokens (the sim engine counts 4 characters per token and every piece of text here
    is a whole number of tokens);
  * HopContext is filled as the router fills it: run id, tier, the chain deadline
    (arrival + SLO), hop index (calls of the chain finished so far), remaining hops
    (calls not yet issued after this one) and the learned remaining critical path;
  * time is compressed by `speed`: the workers run `speed` times faster than real
    time and arrivals and tool delays are divided by it; every figure is multiplied
    back, so results are in trace seconds, comparable with the simulator's.

The scheduler's own time constants (starvation bound 10 s, tier promotion 120 s,
affinity patience, chain TTL) are compressed too: it runs with `--time-scale speed`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from inferx.bench.replay import replay_chains, run_calls
from inferx.devstack import LocalStack, StackPorts, free_port, wait_serving
from inferx.errors import InvalidArgument
from inferx.scheduling.views import TIER_BY_NAME
from inferx.sim.estimates import RemainingPath
from inferx.sim.profile import EngineProfile
from inferx.sim.records import ChainRecord, ReplayResult
from inferx.sim.trace import ChainProgress, Trace, TraceChain
from inferx.tls import Transport
from inferx.tokens import shared_prefix
from inferx.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from inferx.wire import tier_to_proto

if TYPE_CHECKING:
    from inferx.client import InferxClient

POOL = "sim"
CHARS_PER_TOKEN = 4
_FILLER = (
    "the agent reads the file and runs the tests then calls the search tool with the "
    "query and writes the patch for the failing function before it checks the log "
)
_PREEMPTIONS = re.compile(r"sim engine stats: preemptions=(\d+)")


def piece(tag: str, tokens: int) -> str:
    """Exactly `tokens` sim-engine tokens of text that starts with `tag`."""
    width = tokens * CHARS_PER_TOKEN
    head = f"[{tag}] "
    body = head + _FILLER * (1 + width // len(_FILLER))
    return body[:width]


def shared_head(chain: TraceChain) -> str:
    """The system prompt every chain of its kind starts with ("" when none)."""
    return _system_prompt(chain.shared_prefix, chain.shared_tokens)


def _system_prompt(name: str, tokens: int) -> str:
    return piece(f"system {name}", tokens) if tokens else ""


@functools.lru_cache(maxsize=256)  # a trace's few kinds, named once each rather than per call
def _named_prefix(name: str, tokens: int) -> tuple[str, int]:
    """The shared prefix as the router names a template's static head."""
    return shared_prefix(_system_prompt(name, tokens))


def build_prompt(chain: TraceChain, k: int, outputs: Sequence[str] | Mapping[int, str]) -> str:
    """Call k's prompt: shared prefix, the inputs and completions (`outputs[j]`) of the
    calls it depends on, transitively and in index order, then its new input."""
    parts = [shared_head(chain)] if chain.shared_tokens else []
    for j in chain.ancestors(k):
        parts.append(piece(f"{chain.chain_id} call {j}", chain.hops[j].new_tokens))
        parts.append(outputs[j])
    parts.append(piece(f"{chain.chain_id} call {k}", chain.hops[k].new_tokens))
    return "".join(parts)


def hop_request(
    chain: TraceChain,
    k: int,
    prompt: str,
    deadline_unix_s: float,
    remaining_s: float,
    speed: float,
    model: str = POOL,
    hop_index: int | None = None,
    remaining_hops: int | None = None,
) -> scheduler_pb2.HopRequest:
    """`hop_index` (calls finished before this one) and `remaining_hops` (calls not yet
    issued after it) default to a sequence's: k and the calls after k."""
    prefix_id, prefix_tokens = _named_prefix(chain.shared_prefix, chain.shared_tokens)
    return scheduler_pb2.HopRequest(
        context=common_pb2.HopContext(
            run_id=chain.chain_id,
            hop_id=str(k),
            chain_name=f"trace-{chain.kind}",
            tier=tier_to_proto(TIER_BY_NAME[chain.tier]),
            chain_deadline_unix_ms=int(deadline_unix_s * 1000),
            hop_index=k if hop_index is None else hop_index,
            remaining_hops=len(chain.hops) - 1 - k if remaining_hops is None else remaining_hops,
            remaining_critical_path_ms=remaining_s / speed * 1000,
            # The prompt's shared head named as the router names a template's static head.
            prefix_id=prefix_id,
            prefix_tokens=prefix_tokens,
        ),
        model=model,
        prompt=prompt,
        # The scheduler sees the cap; the output length the trace prescribes reaches the
        # engine only, as the model's EOS would.
        sampling=common_pb2.SamplingOptions(
            max_tokens=chain.max_tokens(k), stop_after_tokens=chain.hops[k].output_tokens
        ),
    )


@dataclass
class LiveOptions:
    workers: int = 4
    speed: float = 4.0
    timeout_s: float = 900.0
    state_dir: Path | None = None  # default: a temporary directory per run
    scheduler_flags: tuple[str, ...] = ()  # policy options as the scheduler's flags (scheduler_flags)


class TraceReplayer:
    """Replays chains against one scheduler; pure bookkeeping in ChainRecord."""

    def __init__(
        self,
        scheduler: str,
        trace: Trace,
        profile: EngineProfile,
        speed: float,
        model: str = POOL,
        *,
        transport: Transport,
    ) -> None:
        self.scheduler, self.trace, self.profile, self.speed = scheduler, trace, profile, speed
        self.transport = transport  # the scheduler accepts mutual TLS only, unless --insecure
        self._learned = RemainingPath()  # as the simulator: learned from finished calls, not read ahead
        self.model = model
        self.errors: dict[str, int] = {}

    async def run(self, timeout_s: float, progress: Callable[[int], None]) -> list[ChainRecord]:
        options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
        async with self.transport.aio_channel(self.scheduler, options=options) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)

            async def run_chain(chain: TraceChain, record: ChainRecord, start: float) -> None:
                await self._chain(stub, chain, record, start)

            records, unfinished = await replay_chains(
                self.trace, self.profile, self.speed, timeout_s, progress, run_chain
            )
        if unfinished:
            self.errors["timeout"] = self.errors.get("timeout", 0) + unfinished
        return records

    async def _chain(self, stub, chain: TraceChain, record: ChainRecord, start: float) -> None:
        """One chain: each call is a task, started when `ChainProgress` says it is ready
        (its dependencies finished, their delays passed); the chain ends when all did,
        or at the first call that fails (the others are cancelled)."""
        loop = asyncio.get_running_loop()
        speed = self.speed
        arrival = start + chain.arrival_s / speed
        await asyncio.sleep(max(0.0, arrival - loop.time()))
        deadline_unix_s = time.time() + chain.slo_s / speed
        progress = ChainProgress(chain)
        outputs: dict[int, str] = {}
        gaps_seen: set[int] = set()
        structure = None if chain.is_sequence else [chain.deps(j) for j in range(len(chain.hops))]

        async def call(k: int, ready_at: float) -> tuple[str | None, float]:
            """Call k issued at `ready_at` (loop time): (None, when it finished), or the
            chain's failure status."""
            await asyncio.sleep(max(0.0, ready_at - loop.time()))
            ready = loop.time()
            for j in chain.deps(k):
                if j not in gaps_seen:  # j's first dependent issued: the gap after j
                    gaps_seen.add(j)
                    self._learned.gap_observed(chain.kind, j, (ready - progress.finished_at[j]) * speed)
            hop_index, remaining_hops = progress.issue(k)
            prompt = build_prompt(chain, k, outputs)
            remaining = self._learned.remaining_s(chain.kind, k, len(chain.hops), structure)
            request = hop_request(
                chain, k, prompt, deadline_unix_s, remaining, speed, self.model, hop_index, remaining_hops
            )
            first: float | None = None
            finished = None
            text: list[str] = []
            try:
                async for event in stub.SubmitHop(request):
                    text.append(event.text)  # each piece once: TOKENS, then FINISHED's tail
                    if event.kind == scheduler_pb2.HopEvent.KIND_TOKENS and first is None:
                        first = loop.time()
                    elif event.kind == scheduler_pb2.HopEvent.KIND_FINISHED:
                        finished = event
            except grpc.aio.AioRpcError as exc:
                key = exc.code().name
                self.errors[key] = self.errors.get(key, 0) + 1
                return "shed" if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else "failed", loop.time()
            if finished is None:
                self.errors["no FINISHED"] = self.errors.get("no FINISHED", 0) + 1
                return "failed", loop.time()
            record.ttft_s.append(((first or loop.time()) - ready) * speed)
            record.prompt_tokens += finished.usage.prompt_tokens
            record.cached_tokens += finished.usage.cached_prompt_tokens
            outputs[k] = "".join(text)
            finished_at = loop.time()
            self._learned.call_finished(chain.kind, k, (finished_at - ready) * speed)
            return None, finished_at

        failure, ended = await run_calls(progress, arrival, speed, call)
        record.finish(failure or "ok", (ended - start) * speed)


def scheduler_flags(options: Mapping[str, object]) -> tuple[str, ...]:
    """`--option KEY=VALUE` policy options as the live scheduler's flags; InvalidArgument
    for one it has no flag for (the simulator takes more: never dropped in silence)."""
    from inferx_scheduler.config import POLICY_OPTIONS  # the service's own flags

    flags: list[str] = []
    for key, value in options.items():
        if key not in POLICY_OPTIONS:
            takes = ", ".join(POLICY_OPTIONS)
            raise InvalidArgument(f"--option {key}: the live scheduler has no flag for it (takes: {takes})")
        flag = key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            flags += [f"--{flag}", str(value)]
    return tuple(flags)


def start_sim_stack(state_dir: Path, policy: str, profile: EngineProfile, options: LiveOptions) -> LocalStack:
    """etcd, memory-pool, scheduler(--policy), N sim workers; returns once all serve
    and the scheduler sees every worker."""
    stack = LocalStack(state_dir, StackPorts.free(), lease_ttl_s=10, fresh_etcd=True)
    try:
        stack.start_etcd()
        profile_path = state_dir / "profile.json"  # the workers' engine, and what the scheduler knows of it
        profile_path.write_text(json.dumps(profile.model_dump()))
        scheduler = [
            "--policy",
            policy,
            "--time-scale",
            str(options.speed),
            "--engine-profile",
            str(profile_path),
            *options.scheduler_flags,
        ]
        wait_serving(stack.start_service("memory-pool"), 60)
        # on a port we know: what it priced the engine with is read off it at the end
        wait_serving(stack.start_service("scheduler", scheduler, metrics_port=free_port()), 60)
        stack.load_models({POOL: POOL})
        extra = [
            "--sim-speed",
            str(options.speed),
            "--sim-profile",
            str(profile_path),
            "--max-num-seqs",
            str(profile.max_num_seqs),
        ]
        for _ in range(options.workers):
            stack.start_worker(POOL, "sim", extra)
        for worker in stack.workers:
            wait_serving(worker, 60)
        asyncio.run(_wait_workers_seen(stack.services["scheduler"].address, options.workers, stack.transport))
        return stack
    except BaseException:
        stack.stop()
        raise


async def _wait_workers_seen(
    scheduler: str, workers: int, transport: Transport, timeout_s: float = 30.0
) -> None:
    async with transport.aio_channel(scheduler) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            status = await stub.GetSchedulerStatus(scheduler_pb2.SchedulerStatusRequest())
            seen = sum(len(p.workers) for p in status.pools if p.pool == POOL)
            if seen >= workers:
                return
            await asyncio.sleep(0.2)
    raise TimeoutError(f"the scheduler did not see {workers} workers within {timeout_s:.0f}s")


def preemptions_from_logs(stack: LocalStack) -> int | None:
    """The workers' preemptions, from the count each logs at shutdown; None unless every
    worker logged it (a worker killed before logging would make the sum too small)."""
    total = 0
    for worker in stack.workers:
        try:
            text = worker.log_path.read_text(errors="replace")
        except OSError:
            return None
        counts = _PREEMPTIONS.findall(text)
        if not counts:
            return None
        total += sum(int(m) for m in counts)
    return total


# The scheduler's gauges of what it prices each pool's engine with (inferx_scheduler.metrics).
ENGINE_GAUGES = {
    "inferx_scheduler_engine_prefill_tokens_per_second": "prefill_tokens_per_s",
    "inferx_scheduler_engine_kv_read_seconds_per_token": "kv_read_s_per_token",
}


def engine_from_metrics(page: str) -> dict[str, dict[str, float]] | None:
    """Per pool, the engine figures a scheduler's /metrics page shows (None: none)."""
    from prometheus_client.parser import text_string_to_metric_families

    figures: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            key = ENGINE_GAUGES.get(sample.name)
            if key is not None and "pool" in sample.labels:
                figures.setdefault(sample.labels["pool"], {})[key] = sample.value
    return {pool: f for pool, f in figures.items() if len(f) == len(ENGINE_GAUGES)} or None


def scheduler_engine(stack: LocalStack, speed: float = 1.0) -> dict[str, dict[str, float]] | None:
    """What the stack's scheduler priced its engines with at the end of a run, on the
    workload's clock (its workers ran `speed` times faster; None if it exported nothing
    or its page could not be read: not measured, not made up)."""
    import urllib.error
    import urllib.request

    scheduler = stack.services.get("scheduler")
    if scheduler is None or not scheduler.metrics_port:
        return None
    try:
        url = f"http://127.0.0.1:{scheduler.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as reply:
            figures = engine_from_metrics(reply.read().decode())
    except (OSError, urllib.error.URLError, ValueError):
        return None
    return {
        pool: {
            "prefill_tokens_per_s": f["prefill_tokens_per_s"] / speed,
            "kv_read_s_per_token": f["kv_read_s_per_token"] * speed,
        }
        for pool, f in (figures or {}).items()
    } or None


@dataclass(frozen=True)
class RunningStack:
    """What `inferx bench --router` learns from a running stack's router."""

    scheduler: str
    policy: str
    workers: int
    model: str
    transport: Transport  # to call its scheduler with


async def find_running_stack(router: InferxClient, model: str | None, transport: Transport) -> RunningStack:
    """The scheduler, its policy and the model to replay with, from the router's status;
    `transport` is what the replay calls the scheduler with."""
    from inferx.errors import InvalidArgument, Unavailable

    async with router as client:
        status = await client.status()
    router_address = router.address
    schedulers = [s.address for s in status.services if s.kind == "scheduler"]
    if not schedulers:
        raise Unavailable(f"the stack behind {router_address} has no scheduler registered")
    pools = sorted({w.pool for w in status.workers})
    if not pools:
        raise Unavailable(f"the stack behind {router_address} has no model worker registered")
    if model is None:
        if len(pools) > 1:
            raise InvalidArgument(
                f"the stack serves several pools ({', '.join(pools)}): choose one with --model"
            )
        model = pools[0]
    workers = sum(1 for w in status.workers if w.pool == model) or len(status.workers)
    return RunningStack(schedulers[0], status.scheduler_policy or "unknown", workers, model, transport)


async def run_against(
    stack: RunningStack, trace: Trace, profile: EngineProfile, speed: float, timeout_s: float, progress
) -> tuple[ReplayResult, dict[str, int]]:
    """Replay the trace once against a running stack (whatever policy it runs)."""
    replayer = TraceReplayer(stack.scheduler, trace, profile, speed, stack.model, transport=stack.transport)
    started = time.perf_counter()
    with progress(f"{stack.policy} at {stack.scheduler}", len(trace.chains)) as advance:
        records = await replayer.run(timeout_s, advance)
    wall = time.perf_counter() - started
    run = ReplayResult(
        policy=stack.policy,
        source=f"running stack (x{speed:g})",
        window_s=trace.window_s,
        workers=stack.workers,
        chains=records,
        # Not measured: the workers of a stack we did not start log their count to
        # files we cannot read, and the scheduler does not report it.
        preemptions=None,
        makespan_s=wall * speed,
        wall_s=wall,
    )
    return run, replayer.errors


async def run_live_sim(
    trace: Trace,
    policies: list[str],
    profile: EngineProfile,
    options: LiveOptions,
    progress,
    on_note: Callable[[str], None] = lambda s: None,
    on_run: Callable[[ReplayResult, dict[str, int]], None] = lambda run, errors: None,
) -> tuple[list[ReplayResult], dict[str, dict[str, int]]]:
    """One fresh stack per policy, the same trace on each. Returns the runs and, per
    policy, the count of errors by gRPC code (shed hops are RESOURCE_EXHAUSTED).
    `on_run` gets each policy's run as soon as it ends (to save it before the next)."""
    runs, errors = [], {}
    for policy in policies:
        with tempfile.TemporaryDirectory(prefix=f"inferx-bench-{policy}-") as tmp:
            state = options.state_dir / policy if options.state_dir else Path(tmp)
            state.mkdir(parents=True, exist_ok=True)
            on_note(f"starting a stack: scheduler --policy {policy}, {options.workers} sim workers")
            stack = await asyncio.to_thread(start_sim_stack, state, policy, profile, options)
            try:
                replayer = TraceReplayer(
                    stack.services["scheduler"].address,
                    trace,
                    profile,
                    options.speed,
                    transport=stack.transport,
                )
                started = time.perf_counter()
                with progress(f"live {policy} (x{options.speed:g})", len(trace.chains)) as advance:
                    records = await replayer.run(options.timeout_s, advance)
                wall = time.perf_counter() - started
                engine = await asyncio.to_thread(scheduler_engine, stack, options.speed)
            finally:
                await asyncio.to_thread(stack.stop)
            runs.append(
                ReplayResult(
                    policy=policy,
                    source=f"live (sim workers, x{options.speed:g})",
                    window_s=trace.window_s,
                    workers=options.workers,
                    chains=records,
                    preemptions=preemptions_from_logs(stack),
                    makespan_s=wall * options.speed,
                    wall_s=wall,
                    engine=engine,
                )
            )
            errors[policy] = replayer.errors
            on_run(runs[-1], replayer.errors)
    return runs, errors
