"""Options of `inferx-scheduler` (flags or INFERX_* environment variables)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from inferx.errors import InvalidArgument
from inferx.settings import ServiceSettings
from inferx.sim.profile import EngineProfile, load_profile


def _engine_profile(path: str) -> EngineProfile:
    """The calibration file, or a ValueError naming what is wrong with it (a flag error)."""
    try:
        return load_profile(path)
    except InvalidArgument as exc:
        raise ValueError(f"--engine-profile {exc}") from None


# The policy options a flag of the same name (dashes for underscores) sets.
POLICY_OPTIONS = (
    "reuse_window_hops",
    "kv_retention",
    "max_hold_s",
    "client_retention",
    "strict_holds",
    "offload_retention",
    "kv_warm_s",
    "overload_control",
    "exact_prefix",
    "worker_hints",
    "learn_engine",
)


class SchedulerSettings(ServiceSettings):
    _engine: EngineProfile | None = PrivateAttr(None)  # --engine-profile, read
    max_queued_per_pool: int = Field(1024, gt=0, description="bound of each pool's hop queue")
    reserve_kv: bool = Field(
        True, description="reserve KV capacity per hop (from the leased budget, or in the memory-pool)"
    )
    kv_budget: bool = Field(
        True,
        description="reserve each hop's KV from a budget per worker leased from the memory-pool, with "
        "no call per hop (renewed, grown and returned in the background; hops beyond it reserve at the "
        "memory-pool); off: one Reserve and one Release call per hop (needs --reserve-kv)",
    )
    kv_budget_sync_s: float = Field(
        0.5,
        gt=0,
        le=60,
        description="how often the budget is renewed and what is reserved from it reported to the "
        "memory-pool (also as soon as it runs low)",
    )
    kv_budget_ttl_s: float = Field(
        0.0,
        ge=0,
        description="the budget's lease asked for: not renewed by then (this scheduler died or cannot "
        "reach the memory-pool), the memory-pool takes it back; 0 = the memory-pool's --budget-ttl-s",
    )
    max_kv_wait_s: float = Field(
        120.0,
        gt=0,
        description="a hop the memory-pool has no KV room for waits this long at most (less when "
        "its deadline is nearer), then fails with RESOURCE_EXHAUSTED",
    )
    lookahead: bool = Field(
        True,
        description="chain-aware: when a chain's next hop needs another pool or a much longer "
        "context, reserve KV for it on its worker while the current hop runs (needs --reserve-kv)",
    )
    lookahead_lease_s: float = Field(
        30.0, gt=0, description="a look-ahead reservation not used by then is dropped"
    )
    lookahead_growth: float = Field(
        2.0,
        gt=1,
        description="a next hop in the same pool gets a look-ahead when its context is this many "
        "times the current hop's",
    )
    reuse_window_hops: int = Field(
        4,
        ge=0,
        description="chain-aware: a chain keeps its worker (where its prefix is cached) for this many "
        "hops, then is placed by load again; 0 = for as long as the worker has room",
    )
    kv_retention: Literal["priced", "fixed"] = Field(
        "priced",
        description="chain-aware: between its hops (tool calls) a chain's context is held on its worker "
        "(no hop is admitted over it) for as long as that is expected to cost less than re-prefilling it, "
        "learned from the gaps seen so far (priced), or for --kv-warm-s (fixed)",
    )
    max_hold_s: float = Field(
        600.0,
        gt=0,
        description="chain-aware: the longest hold, priced or asked for by a client (kv_retention_ttl)",
    )
    client_retention: Literal["override", "cap", "off"] = Field(
        "override",
        description="chain-aware: a client's KV retention hint (agentic_context.kv_retention_ttl, "
        "X-InferX-KV-Retention-S, CallModel's kv_retention_s) holds its program's context that long "
        "instead of the priced hold (override), only shortens it (cap), or is ignored (off); 0 lets "
        "go at once; never beyond --max-hold-s",
    )
    strict_holds: bool = Field(
        False,
        description="chain-aware: no hop runs over room held for another chain, on any worker (off: a "
        "hold only keeps other chains from being placed there; strict measured worse on long contexts)",
    )
    offload_retention: bool = Field(
        True,
        description="chain-aware, priced retention: on a worker with a KV offload tier (inferx-worker "
        "--kv-offload-gib), letting a context go costs the load back from host memory, not a re-prefill, "
        "so contexts are held for less (off: the tier is ignored)",
    )
    overload_control: bool = Field(
        False,
        description="chain-aware: protect tiers under overload -- while realtime (standard) hops run "
        "stretched, new standard and batch (batch) chains wait to start, as many running as an adaptive "
        "window allows, and past it are refused with RESOURCE_EXHAUSTED and a retry hint",
    )
    kv_events: bool = Field(
        True,
        description="subscribe to each worker's KV events (ModelWorker.KvEvents) and keep an index of "
        "which worker holds which prefix blocks (used by policies given --exact-prefix)",
    )
    exact_prefix: bool = Field(
        False,
        description="chain-aware and prefix-aware: place hops by where their prompt's blocks are cached, "
        "read from the workers' KV events, instead of where the chain last ran (needs --kv-events)",
    )
    worker_hints: bool = Field(
        True,
        description="chain-aware: a chain this instance has no record of (it took the pool over from "
        "a scheduler that died, or restarted) goes back to the worker the router says served its "
        "latest hop in the pool, while that worker is alive there (off: placed as a new chain)",
    )
    learn_engine: bool = Field(
        True,
        description="chain-aware: learn each pool's engine figures (prefill rate, decode cost per "
        "token of KV in flight) from the times its workers report for finished hops, starting from "
        "Llama-3-8B's (or --engine-profile's); off: price with those as given. Default: on without "
        "--engine-profile, off with it (a calibration is taken as given unless --learn-engine)",
    )
    kv_warm_s: float = Field(
        30.0,
        gt=0,
        description="chain-aware, fixed retention: between its hops (tool calls) a chain's context is held "
        "on its worker this long, so other chains are not placed over it",
    )
    engine_profile: str = Field(
        "",
        description="chain-aware: the workers' engine calibration, a YAML or JSON file with the keys of "
        "`inferx sim --profile` (e.g. benchmarks/llama2-7b-mha-a100.yaml): its prefill rate and the "
        "decode cost per context token price moving a chain to another worker and where a realtime hop "
        "waits least (--learn-engine starts from them); empty: Llama-3-8B on an A100-80GB",
    )
    time_scale: float = Field(
        1.0,
        gt=0,
        description="the policy's time constants are divided by this (benchmarks that replay "
        "a workload N times faster than real time pass N)",
    )
    max_redispatch: int = Field(
        2, ge=0, le=10, description="times a hop goes to another worker after its worker failed"
    )
    health_check_interval_s: float = Field(1.0, gt=0, description="how often each worker is health-checked")
    partitions: bool = Field(
        True,
        description="own model pools under etcd leases (one owner per pool; the routers send a pool's "
        "hops to its owner, another instance takes over within the lease TTL when it dies); off: serve "
        "every hop sent here, as one scheduler alone did before",
    )
    pools: str = Field(
        "",
        description="comma-separated model pools this instance campaigns for and may serve; empty: "
        "every pool seen in etcd (workers and model mappings)",
    )
    policy: str = Field(
        "chain-aware",
        description="a registered scheduling policy: chain-aware (tiers, chain progress, affinity, "
        "admission), round-robin (alias baseline), or a peer policy (`inferx sim --help` lists them)",
    )

    def wanted_pools(self) -> frozenset[str] | None:
        """--pools as a set; None: every pool."""
        pools = frozenset(p.strip() for p in self.pools.split(",") if p.strip())
        return pools or None

    def policy_options(self) -> dict[str, Any]:
        """The policy's options set by flags (a policy ignores those it does not take),
        with the engine's calibration (--engine-profile) when given."""
        engine = self._engine.policy_options() if self._engine is not None else {}
        return engine | {name: getattr(self, name) for name in POLICY_OPTIONS}

    @model_validator(mode="after")
    def _read_profile(self) -> SchedulerSettings:
        # Read once, at start: a file that is missing or not a profile fails the start, named.
        self._engine = _engine_profile(self.engine_profile) if self.engine_profile else None
        if self._engine is not None and "learn_engine" not in self.model_fields_set:
            self.learn_engine = False  # told the engine: its calibration is taken as given
        return self

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        from inferx.scheduling.registry import canonical_name

        return canonical_name(value)  # ValueError names the registered policies
