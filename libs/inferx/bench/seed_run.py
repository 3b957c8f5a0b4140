"""The `seed-agent` scenario on a live stack (I/O): start a LocalStack per
configuration, serve the knowledge tool, drive Poisson arrivals of the chain through
the router, and measure.

Configurations:
  on  = scheduler --policy chain-aware (chain affinity), vLLM prefix caching,
        router tool cache;
  reference = scheduler --policy round-robin (FCFS), vLLM as deployed by default
        (automatic prefix caching ON), router --no-tool-cache: what serving the chain
        without InferX's scheduling and tool cache gives. The comparison's reference;
  no-affinity = as `on` but scheduler --policy round-robin (an ablation: the prefix
        cache and tool cache without chain affinity).

`off` is accepted as an old name of `reference`. `off` used to turn vLLM's prefix
caching off too: a weakened reference (vLLM has it on by default), so ratios against
it overstated the gain; those figures are marked superseded in docs/benchmarks.md.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel

from inferx.bench import seed_agent as sa
from inferx.bench.live import scheduler_engine
from inferx.bench.metrics import ratio_or_none
from inferx.devstack import LocalStack, StackPorts, free_port, wait_serving
from inferx.errors import InferxError
from inferx.stats import percentile
from inferx.toolserver import ToolServer
from inferx.v1 import tool_pb2, tool_pb2_grpc

REFERENCE = "reference"
CANDIDATE = "on"

CONFIGS: dict[str, dict[str, list[str]]] = {
    "on": {"scheduler": ["--policy", "chain-aware"], "router": [], "worker": []},
    # The peer to beat: round-robin in front of stock vLLM. The worker gets no flag, so
    # vLLM's automatic prefix caching stays on as it is by default; only InferX's own
    # tool cache is off.
    REFERENCE: {"scheduler": ["--policy", "round-robin"], "router": ["--no-tool-cache"], "worker": []},
    # Ablation: everything on but chain affinity (round-robin spreads a chain's steps).
    "no-affinity": {"scheduler": ["--policy", "round-robin"], "router": [], "worker": []},
    # The KV-pressure scenario (benchmarks/kv_pressure.py): the same workers (a small KV
    # cache, SeedOptions.kv_cache_tokens) and router (no tool cache: every tool call is
    # a real gap, during which other chains may evict the context); only the scheduler
    # differs. The peer: sticky sessions, as vllm-router and llm-d route, and as
    # they are deployed: no KV reservations in front of the engine (InferX's ledger
    # counts prompt + max_tokens per hop and makes a hop wait for that room, where vLLM
    # alone would admit it and queue or preempt by what is really used; with it the
    # peer lost chains whose sticky worker stayed "full" past their step timeout).
    "kv-session-affinity": {
        "scheduler": ["--policy", "session-affinity", "--no-reserve-kv"],
        "router": ["--no-tool-cache"],
        "worker": [],
    },
    # Chain-aware with priced retention (holds keep other chains off the room)...
    "kv-chain-aware": {"scheduler": ["--policy", "chain-aware"], "router": ["--no-tool-cache"], "worker": []},
    # ... and with strict holds (no hop runs over a held context, so vLLM never evicts it).
    "kv-chain-aware-strict": {
        "scheduler": ["--policy", "chain-aware", "--strict-holds"],
        "router": ["--no-tool-cache"],
        "worker": [],
    },
    # An ablation: every context held 10 s after its hop (fixed, not priced), strictly --
    # what protecting the KV through tool calls buys and costs when it is not priced.
    "kv-chain-aware-hold": {
        "scheduler": [
            *("--policy", "chain-aware", "--kv-retention", "fixed"),
            *("--kv-warm-s", "10", "--strict-holds"),
        ],
        "router": ["--no-tool-cache"],
        "worker": [],
    },
}

# Old configuration names still accepted, and what to tell whoever uses them.
RENAMED: dict[str, tuple[str, str]] = {
    "off": (
        REFERENCE,
        "'off' now runs 'reference': round-robin with vLLM's prefix caching ON (vLLM's "
        "default). The old 'off' also disabled prefix caching, a weakened reference; "
        "its ratios are superseded (docs/benchmarks.md)",
    ),
}


def resolve_configs(names: list[str]) -> tuple[list[str], list[str]]:
    """Configuration names with old names replaced, and a note per replaced name.
    ValueError names the choices for an unknown one or a configuration named twice."""
    resolved, notes = [], []
    for name in names:
        if name in RENAMED:
            new, note = RENAMED[name]
            resolved.append(new)
            notes.append(note)
        elif name in CONFIGS:
            resolved.append(name)
        else:
            raise ValueError(
                f"seed-agent configuration {name!r}: choose from {', '.join(CONFIGS)} "
                f"(old name: {', '.join(RENAMED)})"
            )
    if len(set(resolved)) < len(resolved):
        raise ValueError(f"--compare names a configuration twice: {' '.join(names)}")
    return resolved, notes


@dataclass
class SeedOptions:
    engine: str = "vllm"
    workers: int = 2
    chains: int = 60
    rate_per_s: float = 0.5
    max_tokens: int = 16
    tool_median_s: float = 0.3
    tool_sigma: float = 0.6
    model_path: str = ".inferx/models/tiny-llama"
    sim_speed: float = 1.0
    timeout_s: float = 900.0
    seed: int = 7
    kv_cache_tokens: int | None = None  # cap each worker's KV cache (KV pressure); None: the engine's


class KnowledgeTool(tool_pb2_grpc.ToolServiceServicer):
    """`kb_search`: deterministic documents for a query after a lognormal delay (a
    vector store over the network). The n-th call of a query gets the same delay in
    every configuration (drawn from a hash of the query and n)."""

    def __init__(self, documents: list[str], median_s: float, sigma: float) -> None:
        self.documents, self.median_s, self.sigma = documents, median_s, sigma
        self.calls: dict[str, int] = {}

    async def Invoke(self, request: tool_pb2.ToolRequest, context) -> tool_pb2.ToolResponse:
        query = json.loads(request.arguments_json or "{}").get("query", "")
        nth = self.calls[query] = self.calls.get(query, 0) + 1
        digest = hashlib.sha256(f"{query}|{nth}".encode()).digest()
        z = _normal(digest)
        await asyncio.sleep(min(10.0, self.median_s * math.exp(self.sigma * z)))
        first = int.from_bytes(hashlib.sha256(query.encode()).digest()[:4], "big")
        picked = [self.documents[(first + i) % len(self.documents)] for i in range(2)]
        return tool_pb2.ToolResponse(result_json=json.dumps(" ".join(picked)))


def _normal(digest: bytes) -> float:
    """A standard normal deviate from 8 bytes (Box-Muller)."""
    u1 = (int.from_bytes(digest[:4], "big") + 1) / (2**32 + 1)
    u2 = int.from_bytes(digest[4:8], "big") / 2**32
    return math.sqrt(-2 * math.log(u1)) * math.cos(2 * math.pi * u2)


async def serve_tool(stack: LocalStack, servicer: KnowledgeTool):
    """Start the ToolService (TLS unless the stack is insecure) and register it in the
    stack's etcd under a lease."""
    server = ToolServer(
        servicer, sa.TOOL, security=stack.security(), etcd_endpoint=stack.etcd_endpoint, instance_id="bench"
    )
    await server.start()
    if not await server.wait_registered(10):
        await server.stop()
        raise InferxError("could not register the kb_search tool in etcd")
    return server.stop


def start_stack(state_dir: Path, config: str, options: SeedOptions, knowledge: Path) -> LocalStack:
    flags = CONFIGS[config]
    stack = LocalStack(
        state_dir, StackPorts.free(), lease_ttl_s=10, fresh_etcd=True, knowledge_base=knowledge
    )
    try:
        stack.start_etcd()
        procs = [
            stack.start_service("router", flags["router"]),
            # its own /metrics port: what it priced the engines with is read there at the end
            stack.start_service("scheduler", flags["scheduler"], metrics_port=free_port()),
            stack.start_service("memory-pool"),
            stack.start_service("cache"),
        ]
        for proc in procs:
            wait_serving(proc, 60)
        stack.load_models({sa.MODEL: sa.MODEL})
        if options.engine == "vllm":
            extra = ["--model-path", options.model_path, "--max-model-len", "4096", *flags["worker"]]
            if options.kv_cache_tokens:
                extra += ["--kv-cache-tokens", str(options.kv_cache_tokens)]
        else:
            extra = ["--sim-speed", str(options.sim_speed), *flags["worker"]]
            if options.kv_cache_tokens:
                extra += ["--sim-kv-capacity-tokens", str(options.kv_cache_tokens)]
        for _ in range(options.workers):
            stack.start_worker(sa.MODEL, options.engine, extra)
        # SERVING, and seen by the router, the scheduler and the memory-pool: a chain
        # run before then fails "no live worker serves model ...".
        stack.wait_workers(600)
        return stack
    except BaseException:
        stack.stop()
        raise


@dataclass
class RunOutcome:
    status: str = "running"
    latency_s: float = math.inf
    prompt_tokens: list[int] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)
    workers: list[str] = field(default_factory=list)
    outputs: dict[str, str] = field(default_factory=dict)
    tool_hits: int = 0
    tool_calls: int = 0
    error: str = ""


class SeedSummary(BaseModel):
    config: str
    chains: int
    completed: int
    latency_p50_s: float
    latency_p90_s: float
    latency_p99_s: float
    reusable_hit_rate: float  # cached / tokens shared with the previous step's prompt
    prefix_hit_rate: float  # cached / all prompt tokens (the first step included)
    tool_cache_hit_rate: float
    worker_switches: float  # per chain: steps that ran on another worker than the previous step
    wall_s: float
    errors: list[str]
    # Steps 2..8: tokens shared with the previous step's prompt, and how many of them the
    # engine prefilled again (not found in its prefix cache: evicted, or on another worker).
    reusable_tokens: int = 0
    reprefilled_tokens: int = 0
    # Per pool, the engine figures the scheduler priced time with at the end of the run
    # (learned from finished hops unless it was told a profile; its /metrics gauges);
    # None: it exported none (a policy that prices nothing) or the page was not read.
    engine: dict[str, dict[str, float]] | None = None


async def drive(
    stack: LocalStack, plan: list[sa.Arrival], timeout_s: float, progress: Callable[[int], None]
) -> list[RunOutcome]:
    outcomes = [RunOutcome() for _ in plan]
    done = 0
    async with stack.client() as client:
        loop = asyncio.get_running_loop()
        start = loop.time()

        async def one(arrival: sa.Arrival, out: RunOutcome) -> None:
            nonlocal done
            await asyncio.sleep(max(0.0, start + arrival.at_s - loop.time()))
            began = loop.time()
            try:
                async for event in client.run_chain(sa.CHAIN_NAME, arrival.inputs):
                    kind = event.WhichOneof("event")
                    if kind == "node_finished":
                        node = event.node_finished
                        out.outputs[node.node_id] = node.output
                        if node.node_type == "model_inference":
                            out.prompt_tokens.append(node.usage.prompt_tokens)
                            out.cached_tokens.append(node.usage.cached_prompt_tokens)
                            out.workers.append(node.worker_id)
                        elif node.node_type == "tool_call":
                            out.tool_calls += 1
                            out.tool_hits += int(node.cache_hit)
                    elif kind == "chain_finished":
                        out.status = event.chain_finished.status
                        out.error = event.chain_finished.error
                if out.status == "ok":
                    out.latency_s = loop.time() - began
            except InferxError as exc:
                out.status, out.error = "error", f"{exc.code.name}: {exc.message}"
            finally:
                done += 1
                progress(done)

        tasks = [asyncio.create_task(one(a, o)) for a, o in zip(plan, outcomes, strict=True)]
        _, pending = await asyncio.wait(tasks, timeout=timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return outcomes


def summarize(
    config: str,
    plan: list[sa.Arrival],
    outcomes: list[RunOutcome],
    tokenize,
    wall_s: float,
    engine: dict[str, dict[str, float]] | None = None,
):
    latencies = [o.latency_s if o.status == "ok" else math.inf for o in outcomes]
    hops: list[sa.HopReuse] = []
    cached_all = prompt_all = switches = 0
    for arrival, out in zip(plan, outcomes, strict=True):
        if out.status != "ok" or len(out.prompt_tokens) != sa.STEPS:
            continue
        ids = [tokenize(p) for p in sa.rendered_prompts(arrival.inputs, out.outputs)]
        for k, reusable in enumerate(sa.reusable_tokens(ids)):
            if k:
                hops.append(sa.HopReuse(reusable, out.cached_tokens[k]))
        cached_all += sum(out.cached_tokens)
        prompt_all += sum(out.prompt_tokens)
        switches += sum(1 for a, b in zip(out.workers, out.workers[1:], strict=False) if a != b)
    ok = [o for o in outcomes if o.status == "ok"]
    tool_calls = sum(o.tool_calls for o in outcomes)
    errors = sorted({o.error for o in outcomes if o.status != "ok" and o.error})[:5]
    return SeedSummary(
        config=config,
        chains=len(outcomes),
        completed=len(ok),
        # Nearest-rank, as the other benchmarks: a failed chain (inf) is a miss, and
        # the P99 is one only when more than 1% of the chains missed.
        latency_p50_s=percentile(latencies, 50, method="nearest-rank"),
        latency_p90_s=percentile(latencies, 90, method="nearest-rank"),
        latency_p99_s=percentile(latencies, 99, method="nearest-rank"),
        reusable_hit_rate=sa.reuse_hit_rate(hops),
        prefix_hit_rate=cached_all / prompt_all if prompt_all else math.nan,
        tool_cache_hit_rate=sum(o.tool_hits for o in outcomes) / tool_calls if tool_calls else math.nan,
        worker_switches=switches / len(ok) if ok else math.nan,
        wall_s=wall_s,
        errors=errors,
        reusable_tokens=sum(h.reusable for h in hops),
        reprefilled_tokens=sum(h.reusable - min(h.cached, h.reusable) for h in hops),
        engine=engine,
    )


def load_documents(path: Path) -> list[str]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [f"{r.get('title', '')}: {r.get('text', '')}" for r in rows]


def make_tokenizer(options: SeedOptions):
    """The model's own tokenizer for vLLM (what its prefix cache sees); 4 characters a
    token for the sim engine."""
    if options.engine == "vllm":
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(Path(options.model_path) / "tokenizer.json"))
        return lambda text: tok.encode(text).ids
    return lambda text: [hash(text[i : i + 4]) for i in range(0, len(text), 4)]


async def run_seed(
    options: SeedOptions,
    configs: list[str],
    state_root: Path,
    knowledge: Path,
    progress,
    note: Callable[[str], None],
    on_config: Callable[[SeedSummary, list[RunOutcome]], None] = lambda summary, outcomes: None,
) -> list[SeedSummary]:
    """Each configuration in turn on a fresh stack. `on_config` gets each one's summary
    and raw outcomes as soon as it ends (to save them before the next one starts)."""
    plan = sa.arrivals(options.chains, options.rate_per_s, options.seed)
    tokenize = make_tokenizer(options)
    summaries = []
    for config in configs:
        state = state_root / config
        state.mkdir(parents=True, exist_ok=True)
        note(f"starting a stack for '{config}': {options.workers} {options.engine} workers ...")
        stack = await asyncio.to_thread(start_stack, state, config, options, knowledge)
        tool = KnowledgeTool(load_documents(knowledge), options.tool_median_s, options.tool_sigma)
        try:
            close_tool = await serve_tool(stack, tool)
            try:
                async with stack.client() as client:
                    await client.put_chain(sa.chain_yaml(max_tokens=options.max_tokens), message="bench")
                await asyncio.sleep(1.0)  # the router's etcd watch sees the tool
                started = time.perf_counter()
                with progress(f"seed-agent '{config}'", len(plan)) as advance:
                    outcomes = await drive(stack, plan, options.timeout_s, advance)
                wall = time.perf_counter() - started
                engine = await asyncio.to_thread(scheduler_engine, stack)
            finally:
                await close_tool()
        finally:
            await asyncio.to_thread(stack.stop)
        summaries.append(summarize(config, plan, outcomes, tokenize, wall, engine))
        on_config(summaries[-1], outcomes)
    return summaries


class SeedComparison(BaseModel):
    """`on` against the reference: the P99 ratio, or None with the reason."""

    reference: str
    candidate: str
    p99_ratio: float | None
    note: str | None
    target_met: bool | None  # P99 ratio <= 0.5; None: undefined


def compare_seed(
    summaries: list[SeedSummary], reference: str = REFERENCE, candidate: str = CANDIDATE
) -> SeedComparison | None:
    """None unless both configurations ran. A reference that did not complete every
    chain may have no P99 (a miss): then the ratio is undefined, never 0 or "met"."""
    by = {s.config: s for s in summaries}
    if reference not in by or candidate not in by:
        return None
    ref, cand = by[reference], by[candidate]
    ratio = ratio_or_none(cand.latency_p99_s, ref.latency_p99_s)
    note = None
    if ratio is None:
        missed = ref.chains - ref.completed
        note = (
            f"{reference} did not complete {missed} of {ref.chains} chains; P99 undefined"
            if missed
            else f"{reference}'s P99 is {ref.latency_p99_s:g} s; no ratio against it"
        )
    return SeedComparison(
        reference=reference,
        candidate=candidate,
        p99_ratio=ratio,
        note=note,
        target_met=None if ratio is None else ratio <= 0.5,
    )
