"""Agent-chain workloads as JSONL: a `meta` line, then one line per chain.

A chain is a set of model calls replayed closed-loop. By default a sequence: call k+1
is issued when call k has finished and its tool delay (or the user's think time) has
passed. A call may instead name the earlier calls it waits for (`depends_on`), which
makes the chain a DAG (a fan-out of parallel branches joined by a later call): a call
is issued when every call it depends on has finished and each one's delay has passed
(`ready_at`). Call k's prompt is the shared prefix (system prompt / tool definitions),
the input and output of every call it transitively depends on (in index order), then
its own new input; so contexts grow along the chain and a worker that kept the chain's
prefix prefills only the new tokens.

Kinds (`generate`):
  * bfcl  -- BFCL-style function calling: ~11 calls, ~700-token first prompt
             (tool specs + query), short JSON outputs, fast tool calls.
  * swe   -- SWE-style coding agent: 15-30 calls, tool outputs (files, test logs)
             grow the context to 16-32k tokens, tools take seconds.
  * chat  -- a few conversational turns separated by the user's think time.
  * coding -- a long-context coding agent shaped on the GitHub Copilot coding-agent
             dataset (Azure public dataset, 2026): about 4 user turns x 8 LLM calls,
             contexts growing from ~20k to ~110k tokens (about 68k per call on average),
             about 530 completion tokens per call, heavy-tailed tool delays (test runs
             of minutes) and the user's think time between turns.
  * research -- a deep-research agent with parallel fan-out: a planning call, 2-6
             search/browse branches (1-3 calls each, web tool delays between them)
             that run concurrently, then a report-writing call that depends on every
             branch (it reads all their findings: large context, 1-3k output tokens).
Tiers are chosen per kind (`TraceConfig.tiers`): one tier, or a weighted mix, so a
realtime coding session exists beside a batch one.
Tool delays are lognormal; arrivals Poisson, or bursty with gamma inter-arrival
times (shape = `burstiness`, as vLLM's benchmark `--burstiness`: < 1 is burstier).
Each chain's SLO = its delays + `slo_factors[tier]` x its model time alone on an
idle engine with a warm prefix (EngineProfile.alone_hop_s), both taken along the
chain's critical path (for a sequence: every call and every delay).
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from inferx.errors import InvalidArgument
from inferx.sim.profile import EngineProfile

Kind = Literal["bfcl", "swe", "chat", "coding", "research"]
TierName = Literal["realtime", "standard", "batch"]


class TraceHop(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    new_tokens: int = Field(gt=0)
    output_tokens: int = Field(gt=0)
    delay_after_s: float = Field(0.0, ge=0)  # tool delay / think time before the next call
    # The request's `max_tokens` cap, what a scheduler knows of the output before it is
    # generated (`output_tokens` is what the replay generates: never shown to a policy).
    # None: the workload's default cap for its kind (`default_max_tokens`).
    max_tokens: int | None = Field(None, gt=0)
    # Indices of the earlier calls of the chain this call waits for (a DAG); None: the
    # previous call (a sequence), so traces without the field keep their meaning. Left
    # out of the JSON when None, so sequential traces are written as before.
    depends_on: list[int] | None = Field(None, exclude_if=lambda v: v is None)


# The output cap agents of each kind typically send when a trace does not say.
DEFAULT_MAX_TOKENS_BY_KIND = {"bfcl": 512, "chat": 1024, "swe": 2048, "coding": 4096, "research": 4096}
DEFAULT_MAX_TOKENS = 2048


def default_max_tokens(kind: str) -> int:
    return DEFAULT_MAX_TOKENS_BY_KIND.get(kind, DEFAULT_MAX_TOKENS)


class TraceChain(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    chain_id: str
    kind: str
    tier: TierName
    arrival_s: float = Field(ge=0)
    slo_s: float = Field(gt=0)
    shared_prefix: str  # id of the prefix shared with other chains of its kind
    shared_tokens: int = Field(ge=0)
    hops: list[TraceHop] = Field(min_length=1)

    @model_validator(mode="after")
    def _check_dependencies(self) -> TraceChain:
        for k, hop in enumerate(self.hops):
            if hop.depends_on is None:
                continue
            bad = [j for j in hop.depends_on if not 0 <= j < k]
            if bad:
                raise ValueError(
                    f"chain {self.chain_id} hop {k}: depends_on {hop.depends_on} must name earlier "
                    f"calls of the chain (indices 0..{k - 1}); got {bad}"
                )
            if len(set(hop.depends_on)) != len(hop.depends_on):
                raise ValueError(f"chain {self.chain_id} hop {k}: depends_on {hop.depends_on} repeats a call")
        return self

    def max_tokens(self, k: int) -> int:
        """Call k's output cap: what a policy may know of its output length."""
        return self.hops[k].max_tokens or default_max_tokens(self.kind)

    # ----- structure (declared in the trace, so a live router knows it too) -----------

    @property
    def is_sequence(self) -> bool:
        """Every call waits for the previous one only (no `depends_on` other than that)."""
        return all(h.depends_on is None or h.depends_on == [k - 1] for k, h in enumerate(self.hops) if k)

    def deps(self, k: int) -> list[int]:
        """The calls call k waits for: `depends_on`, or the previous call."""
        declared = self.hops[k].depends_on
        if declared is not None:
            return sorted(declared)
        return [k - 1] if k > 0 else []

    def dependents(self, j: int) -> list[int]:
        """The calls that wait for call j, in index order."""
        return [k for k in range(j + 1, len(self.hops)) if j in self.deps(k)]

    def roots(self) -> list[int]:
        """The calls issued at the chain's arrival (no dependencies)."""
        return [k for k in range(len(self.hops)) if not self.deps(k)]

    def ancestors(self, k: int) -> list[int]:
        """Every call call k transitively depends on, in index order: whose input and
        output its prompt carries."""
        seen: set[int] = set()
        todo = list(self.deps(k))
        while todo:
            j = todo.pop()
            if j not in seen:
                seen.add(j)
                todo.extend(self.deps(j))
        return sorted(seen)

    def ancestor_table(self) -> list[list[int]]:
        """`ancestors(k)` for every call at once, in one pass (a call's dependencies
        come before it): for callers that need many of them."""
        table: list[list[int]] = []
        for k in range(len(self.hops)):
            seen: set[int] = set()
            for j in self.deps(k):
                seen.add(j)
                seen.update(table[j])
            table.append(sorted(seen))
        return table

    def prompt_tokens(self, k: int) -> int:
        before = sum(self.hops[j].new_tokens + self.hops[j].output_tokens for j in self.ancestors(k))
        return self.shared_tokens + before + self.hops[k].new_tokens

    def critical_path(self, profile: EngineProfile | None = None) -> list[int]:
        """The chain's longest path alone with unbounded parallelism: the calls (in
        order) that maximize model time alone (warm prefix) plus the delays between
        them. For a sequence: every call."""
        if self.is_sequence:
            return list(range(len(self.hops)))
        profile = profile or EngineProfile()
        best: list[float] = []
        via: list[int | None] = []
        for k, hop in enumerate(self.hops):
            model = profile.alone_hop_s(hop.new_tokens, self.prompt_tokens(k), hop.output_tokens)
            start, parent = 0.0, None
            for j in self.deps(k):
                at = best[j] + self.hops[j].delay_after_s
                if parent is None or at > start:
                    start, parent = at, j
            best.append(start + model)
            via.append(parent)
        node: int | None = max(range(len(best)), key=lambda k: (best[k], -k))
        path = []
        while node is not None:
            path.append(node)
            node = via[node]
        return path[::-1]

    def delays_s(self, profile: EngineProfile | None = None) -> float:
        """Tool and think time on the critical path (no scheduler can save it)."""
        path = self.critical_path(profile)
        return sum(self.hops[k].delay_after_s for k in path[:-1])

    def model_alone_s(self, profile: EngineProfile) -> float:
        """Model time alone on the critical path, prefix warm: each call prefills only
        its new tokens."""
        return sum(
            profile.alone_hop_s(self.hops[k].new_tokens, self.prompt_tokens(k), self.hops[k].output_tokens)
            for k in self.critical_path(profile)
        )


def ready_at(
    chain: TraceChain, k: int, finished_at: Mapping[int, float], arrival: float, speed: float = 1.0
) -> float | None:
    """When call k is issued: once every call it depends on has finished (`finished_at`,
    by call index) and each one's delay has passed (delays divided by `speed`, for a
    replay that runs faster than real time); `arrival` for a call without dependencies;
    None while a dependency is unfinished. The one rule the simulator and the live
    replay share."""
    deps = chain.deps(k)
    if any(j not in finished_at for j in deps):
        return None
    return max((finished_at[j] + chain.hops[j].delay_after_s / speed for j in deps), default=arrival)


class ChainProgress:
    """A chain's calls as a replay issues and finishes them: which become ready when a
    call finishes, and what a router knows when it issues one (`hop_index`: calls
    finished so far; `remaining_hops`: calls not yet issued after this one)."""

    def __init__(self, chain: TraceChain) -> None:
        self.chain = chain
        self.finished_at: dict[int, float] = {}
        self.issued: set[int] = set()

    @property
    def done(self) -> bool:
        return len(self.finished_at) == len(self.chain.hops)

    def issue(self, k: int) -> tuple[int, int]:
        """Call k is issued: its (hop_index, remaining_hops)."""
        self.issued.add(k)
        return len(self.finished_at), len(self.chain.hops) - len(self.issued)

    def finish(self, k: int, at: float, speed: float = 1.0) -> list[tuple[int, float]]:
        """Call k finished at `at`: the calls that this makes ready and when, in index order."""
        self.finished_at[k] = at
        ready = []
        for d in self.chain.dependents(k):
            when = ready_at(self.chain, d, self.finished_at, self.chain.arrival_s, speed)
            if when is not None and d not in self.issued:
                ready.append((d, when))
        return ready


TierChoice = TierName | dict[TierName, float]
_DEFAULT_TIERS: dict[str, TierChoice] = {
    "chat": "realtime",
    "bfcl": "standard",
    "swe": "batch",
    "coding": {"realtime": 0.2, "standard": 0.5, "batch": 0.3},
    "research": {"realtime": 0.2, "standard": 0.5, "batch": 0.3},
}


class TraceConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    seed: int = 4
    duration_s: float = Field(600.0, gt=0)
    rate_per_s: float = Field(0.5, gt=0, description="chain arrivals per second")
    burstiness: float = Field(1.0, gt=0, description="gamma shape; 1 = Poisson")
    mix: dict[str, float] = Field(default_factory=lambda: {"chat": 0.45, "bfcl": 0.4, "swe": 0.15})
    # Per kind: a tier, or a weighted mix of tiers (chosen per chain).
    tiers: dict[str, TierChoice] = Field(default_factory=lambda: dict(_DEFAULT_TIERS))
    slo_factors: dict[str, float] = Field(
        default_factory=lambda: {"realtime": 3.0, "standard": 4.0, "batch": 6.0}
    )


class TraceMeta(BaseModel):
    model_config = ConfigDict(extra="allow")

    kind: Literal["meta"] = "meta"
    generator: str = "inferx.sim.trace v1"
    config: TraceConfig
    chains: int
    profile: str


class Trace(BaseModel):
    meta: TraceMeta
    chains: list[TraceChain]

    @property
    def window_s(self) -> float:
        """The arrival window: goodput is chains meeting their SLO per second of it."""
        return max(self.meta.config.duration_s, max((c.arrival_s for c in self.chains), default=0))

    def at_rate(self, rate_per_s: float) -> Trace:
        """The same chains with arrival times stretched or squeezed to `rate_per_s`."""
        factor = self.meta.config.rate_per_s / rate_per_s
        config = self.meta.config.model_copy(
            update={"rate_per_s": rate_per_s, "duration_s": self.meta.config.duration_s * factor}
        )
        chains = [c.model_copy(update={"arrival_s": c.arrival_s * factor}) for c in self.chains]
        return Trace(meta=self.meta.model_copy(update={"config": config}), chains=chains)

    def head(self, duration_s: float) -> Trace:
        """Only the chains that arrive in the first `duration_s` seconds."""
        chains = [c for c in self.chains if c.arrival_s < duration_s]
        config = self.meta.config.model_copy(
            update={"duration_s": min(duration_s, self.meta.config.duration_s)}
        )
        meta = self.meta.model_copy(update={"config": config, "chains": len(chains)})
        return Trace(meta=meta, chains=chains)


def _lognormal(rng: random.Random, median: float, sigma: float, lo: float, hi: float) -> float:
    return min(hi, max(lo, rng.lognormvariate(0.0, sigma) * median))


def _bfcl(rng: random.Random) -> tuple[str, int, list[TraceHop]]:
    suite = rng.randrange(8)  # a handful of tool suites: their specs are shared prefixes
    hops = []
    n = rng.randint(8, 14)
    for k in range(n):
        new = rng.randint(60, 160) if k == 0 else int(_lognormal(rng, 120, 0.6, 20, 800))
        out = int(_lognormal(rng, 40, 0.5, 8, 200))
        delay = _lognormal(rng, 0.25, 0.8, 0.02, 5.0) if k < n - 1 else 0.0
        hops.append(TraceHop(new_tokens=new, output_tokens=out, delay_after_s=round(delay, 4)))
    return f"bfcl-tools-{suite}", 600, hops


def _swe(rng: random.Random) -> tuple[str, int, list[TraceHop]]:
    n = rng.randint(15, 30)
    shared, issue = 2500, rng.randint(800, 2000)
    outs = [int(_lognormal(rng, 150, 0.5, 30, 600)) for _ in range(n)]
    target = rng.uniform(16_000, 32_000)
    growth = max(target - shared - issue - sum(outs), 200 * (n - 1))
    weights = [rng.lognormvariate(0.0, 0.8) for _ in range(n - 1)]
    scale = growth / sum(weights)
    hops = []
    for k in range(n):
        new = issue if k == 0 else max(20, int(weights[k - 1] * scale))
        delay = _lognormal(rng, 2.0, 1.0, 0.05, 60.0) if k < n - 1 else 0.0
        hops.append(TraceHop(new_tokens=new, output_tokens=outs[k], delay_after_s=round(delay, 4)))
    return "swe-system", shared, hops


def _chat(rng: random.Random) -> tuple[str, int, list[TraceHop]]:
    n = rng.randint(2, 5)
    hops = []
    for k in range(n):
        new = int(_lognormal(rng, 80, 0.7, 5, 1000))
        out = int(_lognormal(rng, 180, 0.5, 20, 600))
        think = _lognormal(rng, 5.0, 0.6, 0.5, 60.0) if k < n - 1 else 0.0
        hops.append(TraceHop(new_tokens=new, output_tokens=out, delay_after_s=round(think, 4)))
    return "chat-system", 400, hops


def _coding(rng: random.Random) -> tuple[str, int, list[TraceHop]]:
    """User turns of agent calls. Within a turn each call adds tool output (file reads,
    diffs, test logs: heavy-tailed sizes) and waits on the tool before the next call;
    between turns the user thinks. The first call brings the repository context."""
    shared = 8_000  # system prompt + tool definitions + repository instructions
    turns = max(1, min(8, int(round(rng.gauss(4, 1.2)))))
    hops: list[TraceHop] = []
    context = shared
    full = False  # the context reached the cap: no more calls
    for turn in range(turns):
        calls = max(2, min(16, int(round(rng.gauss(8, 2.5)))))
        for call in range(calls):
            if not hops:
                new = rng.randint(10_000, 18_000)  # the task + repository map + first files
            elif call == 0:
                new = int(_lognormal(rng, 300, 0.8, 30, 4_000))  # the user's next message
            else:
                new = int(_lognormal(rng, 1_500, 1.0, 80, 20_000))  # tool output
            out = int(_lognormal(rng, 510, 0.6, 40, 3_000))
            # Contexts stop at 110k tokens: a call that would pass it cuts its tool output
            # to fit; once nothing fits the session is over. (Calls past it once crept on
            # by 60 tokens each, to prompts longer than the 7B profile's whole KV pool.)
            room = 110_000 - context - out
            full = full or room <= 20
            new = max(20, min(new, room))
            last_of_turn = call == calls - 1
            if last_of_turn:
                delay = _lognormal(rng, 30.0, 0.9, 3.0, 600.0) if turn < turns - 1 else 0.0
            else:
                # Most tools (read, search, edit) take about a second; about one call in
                # twelve runs the tests or a build, which takes minutes.
                test_run = rng.random() < 0.08
                delay = (
                    _lognormal(rng, 90.0, 0.8, 5.0, 900.0)
                    if test_run
                    else _lognormal(rng, 1.5, 1.0, 0.05, 60.0)
                )
            if full:
                continue  # the random draws go on, so the chains after this one stay as they were
            hops.append(TraceHop(new_tokens=new, output_tokens=out, delay_after_s=round(delay, 4)))
            context += new + out
    if hops[-1].delay_after_s:
        hops[-1] = hops[-1].model_copy(update={"delay_after_s": 0.0})
    return "coding-system", shared, hops


def _research(rng: random.Random) -> tuple[str, int, list[TraceHop]]:
    """A deep-research agent: plan, parallel search/browse branches, one report.

    Call 0 plans (the user's question in, sub-questions out). Each of 2-6 branches
    depends on the plan and runs 1-3 calls: the first turns its sub-question into a
    search, later ones read what the web tools returned (search results, then a
    page: thousands of tokens each) with the tool's delay between calls; a branch's
    last call writes its findings. The last call writes the report: it depends on
    every branch's last call, so its prompt carries every branch (tens of thousands of
    tokens) and it generates 1-3k tokens."""
    shared = 3_000  # system prompt + web search / browse tool definitions
    question = int(_lognormal(rng, 150, 0.6, 20, 2_000))
    plan_out = int(_lognormal(rng, 350, 0.5, 80, 1_500))
    dispatch = round(rng.uniform(0.05, 0.5), 4)  # the orchestrator starting the branches
    hops = [TraceHop(new_tokens=question, output_tokens=plan_out, delay_after_s=dispatch)]
    branch_ends = []
    for _ in range(rng.randint(2, 6)):
        calls = rng.randint(1, 3)
        for call in range(calls):
            if call == 0:
                new = int(_lognormal(rng, 120, 0.5, 20, 600))  # the branch's sub-question
            elif call == 1:
                new = int(_lognormal(rng, 2_500, 0.6, 300, 12_000))  # search results
            else:
                new = int(_lognormal(rng, 4_000, 0.7, 500, 16_000))  # a browsed page
            last = call == calls - 1
            # A search query or a browse action; the branch's last call writes its findings.
            if last:
                out = int(_lognormal(rng, 450, 0.5, 80, 1_500))
            else:
                out = int(_lognormal(rng, 90, 0.5, 15, 400))
            if last:
                delay = rng.uniform(0.0, 0.3)  # handing the findings back to the orchestrator
            elif call == 0:
                delay = _lognormal(rng, 1.5, 0.6, 0.2, 20.0)  # a web search
            else:
                delay = _lognormal(rng, 4.0, 0.8, 0.3, 60.0)  # fetching and extracting a page
            depends = [0] if call == 0 else [len(hops) - 1]
            hops.append(
                TraceHop(new_tokens=new, output_tokens=out, delay_after_s=round(delay, 4), depends_on=depends)
            )
        branch_ends.append(len(hops) - 1)
    report = int(_lognormal(rng, 250, 0.5, 50, 1_500))  # the report instructions
    out = int(_lognormal(rng, 1_800, 0.3, 1_000, 3_000))
    hops.append(TraceHop(new_tokens=report, output_tokens=out, depends_on=branch_ends))
    return "research-system", shared, hops


_KINDS = {"bfcl": _bfcl, "swe": _swe, "chat": _chat, "coding": _coding, "research": _research}


def _tier(rng: random.Random, choice: TierChoice | None) -> TierName:
    if choice is None:
        return "standard"
    if isinstance(choice, str):
        return choice
    names, weights = zip(*sorted(choice.items()), strict=True)
    return rng.choices(names, weights)[0]


# Named workloads (`inferx sim --workload NAME`): the trace config each starts from; the
# arrival rate only sets where a capacity search starts.
WORKLOADS: dict[str, TraceConfig] = {
    "mix": TraceConfig(duration_s=600.0, rate_per_s=1.0),
    "coding": TraceConfig(duration_s=4000.0, rate_per_s=0.03, mix={"coding": 1.0}),
    "research": TraceConfig(duration_s=1200.0, rate_per_s=0.25, mix={"research": 1.0}),
}


def workload(name: str, seed: int) -> TraceConfig:
    if name not in WORKLOADS:
        raise InvalidArgument(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    return WORKLOADS[name].model_copy(update={"seed": seed})


def generate(config: TraceConfig, profile: EngineProfile | None = None) -> Trace:
    profile = profile or EngineProfile()
    unknown = sorted(set(config.mix) - set(_KINDS))
    if unknown:
        raise InvalidArgument(f"unknown chain kind(s) {unknown}; known: {sorted(_KINDS)}")
    rng = random.Random(config.seed)
    kinds, weights = zip(*sorted(config.mix.items()), strict=True)
    chains: list[TraceChain] = []
    t = 0.0
    shape = config.burstiness
    while True:
        t += rng.gammavariate(shape, 1.0 / (config.rate_per_s * shape))
        if t >= config.duration_s:
            break
        kind = rng.choices(kinds, weights)[0]
        prefix, shared, hops = _KINDS[kind](rng)
        tier = _tier(rng, config.tiers.get(kind))
        draft = TraceChain(
            chain_id=f"c{len(chains):05d}",
            kind=kind,
            tier=tier,
            arrival_s=round(t, 4),
            slo_s=1.0,
            shared_prefix=prefix,
            shared_tokens=shared,
            hops=hops,
        )
        slo = draft.delays_s(profile) + config.slo_factors.get(tier, 4.0) * draft.model_alone_s(profile)
        chains.append(draft.model_copy(update={"slo_s": round(slo, 3)}))
    meta = TraceMeta(config=config, chains=len(chains), profile=profile.name)
    return Trace(meta=meta, chains=chains)


def write_trace(trace: Trace, path: str | Path) -> None:
    lines = [trace.meta.model_dump_json()] + [c.model_dump_json() for c in trace.chains]
    Path(path).write_text("\n".join(lines) + "\n")


def read_trace(path: str | Path) -> Trace:
    path = Path(path)
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
    except OSError as exc:
        raise InvalidArgument(f"{path}: {exc.strerror or exc}") from None
    try:
        first = json.loads(lines[0]) if lines else {}
        if first.get("kind") != "meta":
            raise InvalidArgument(f"{path}: the first line must be the trace's meta line")
        meta = TraceMeta.model_validate(first)
    except (ValueError, ValidationError) as exc:
        raise InvalidArgument(f"{path}: not a trace file ({_first_error(exc)})") from None
    chains = []
    for number, line in enumerate(lines[1:], start=2):
        try:
            chains.append(TraceChain.model_validate_json(line))
        except (ValueError, ValidationError) as exc:
            raise InvalidArgument(f"{path}: line {number}: not a trace chain ({_first_error(exc)})") from None
    return Trace(meta=meta, chains=chains)


def _first_error(exc: Exception) -> str:
    if isinstance(exc, ValidationError) and exc.errors():
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        message = str(error["msg"]).removeprefix("Value error, ")
        return f"{where}: {message}" if where else message
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
