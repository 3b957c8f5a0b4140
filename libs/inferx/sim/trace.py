"""Agent-chain workloads as JSONL: a `meta` line, then one line per chain.

A chain is a sequence of model calls replayed closed-loop: call k+1 is issued when
call k has finished and its tool delay (or the user's think time) has passed. Call
k's prompt is the shared prefix (system prompt / tool definitions), every earlier
call's input and output, then its own new input; so contexts grow along the chain
and a worker that kept the chain's prefix prefills only the new tokens.

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
Tiers are chosen per kind (`TraceConfig.tiers`): one tier, or a weighted mix, so a
realtime coding session exists beside a batch one.
Tool delays are lognormal; arrivals Poisson, or bursty with gamma inter-arrival
times (shape = `burstiness`, as vLLM's benchmark `--burstiness`: < 1 is burstier).
Each chain's SLO = its delays + `slo_factors[tier]` x its model time alone on an
idle engine with a warm prefix (EngineProfile.alone_hop_s).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from inferx.errors import InvalidArgument
from inferx.sim.profile import EngineProfile

Kind = Literal["bfcl", "swe", "chat", "coding"]
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


# The output cap agents of each kind typically send when a trace does not say.
DEFAULT_MAX_TOKENS_BY_KIND = {"bfcl": 512, "chat": 1024, "swe": 2048, "coding": 4096}
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

    def max_tokens(self, k: int) -> int:
        """Call k's output cap: what a policy may know of its output length."""
        return self.hops[k].max_tokens or default_max_tokens(self.kind)

    def prompt_tokens(self, k: int) -> int:
        before = sum(h.new_tokens + h.output_tokens for h in self.hops[:k])
        return self.shared_tokens + before + self.hops[k].new_tokens

    def delays_s(self) -> float:
        return sum(h.delay_after_s for h in self.hops[:-1])

    def model_alone_s(self, profile: EngineProfile) -> float:
        """Model time alone, prefix warm: each call prefills only its new tokens."""
        return sum(
            profile.alone_hop_s(h.new_tokens, self.prompt_tokens(k), h.output_tokens)
            for k, h in enumerate(self.hops)
        )


class TraceConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    seed: int = 4
    duration_s: float = Field(600.0, gt=0)
    rate_per_s: float = Field(0.5, gt=0, description="chain arrivals per second")
    burstiness: float = Field(1.0, gt=0, description="gamma shape; 1 = Poisson")
    mix: dict[str, float] = Field(default_factory=lambda: {"chat": 0.45, "bfcl": 0.4, "swe": 0.15})
    # Per kind: a tier, or a weighted mix of tiers (chosen per chain).
    tiers: dict[str, TierName | dict[TierName, float]] = Field(
        default_factory=lambda: {
            "chat": "realtime",
            "bfcl": "standard",
            "swe": "batch",
            "coding": {"realtime": 0.2, "standard": 0.5, "batch": 0.3},
        }
    )
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
            # Contexts stop near 110k tokens (agents truncate old tool output there).
            room = 110_000 - context - out
            new, out = (max(20, min(new, room)), out) if room > 20 else (20, 40)
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
            hops.append(TraceHop(new_tokens=new, output_tokens=out, delay_after_s=round(delay, 4)))
            context += new + out
    return "coding-system", shared, hops


_KINDS = {"bfcl": _bfcl, "swe": _swe, "chat": _chat, "coding": _coding}


def _tier(rng: random.Random, choice: str | dict[str, float] | None) -> TierName:
    if choice is None:
        return "standard"
    if isinstance(choice, str):
        return choice  # type: ignore[return-value]
    names, weights = zip(*sorted(choice.items()), strict=True)
    return rng.choices(names, weights)[0]  # type: ignore[return-value]


# Named workloads (`inferx sim --workload NAME`): the trace config each starts from; the
# arrival rate only sets where a capacity search starts.
WORKLOADS: dict[str, TraceConfig] = {
    "mix": TraceConfig(duration_s=600.0, rate_per_s=1.0),
    "coding": TraceConfig(duration_s=4000.0, rate_per_s=0.03, mix={"coding": 1.0}),
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
        slo = draft.delays_s() + config.slo_factors.get(tier, 4.0) * draft.model_alone_s(profile)
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
        chains = [TraceChain.model_validate_json(line) for line in lines[1:]]
    except (ValueError, ValidationError) as exc:
        raise InvalidArgument(f"{path}: not a trace file ({str(exc).splitlines()[0]})") from None
    return Trace(meta=meta, chains=chains)
