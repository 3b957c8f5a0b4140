"""Protobuf <-> the scheduler's plain values, at the service edge only.

Everything behind the servicer (dispatcher, policy, look-ahead) works on `HopView`
values built here once per hop: the prompt's token estimate (in the pool's engine
tokens, `inferx.tokens.TokenRatio`), the default `max_tokens`, the tier enum and the
monotonic deadline are worked out in this one place, so the policy and the KV
reservation can never disagree about a hop's size.
"""

from __future__ import annotations

import math
import time

from inferx.scheduling.views import TIER_NAMES, HopView, Tier
from inferx.tokens import DEFAULT_MAX_TOKENS, TokenRatio
from inferx.v1 import scheduler_pb2


def monotonic_deadline(unix_ms: int, *, now_mono: float | None = None, now_unix: float | None = None):
    """A unix-time deadline (as it travels between processes) on this process's
    monotonic clock (what queues and timers use); None when not set."""
    if not unix_ms:
        return None
    now_mono = time.monotonic() if now_mono is None else now_mono
    now_unix = time.time() if now_unix is None else now_unix
    return now_mono + unix_ms / 1000 - now_unix


def hop_view(pool: str, request: scheduler_pb2.HopRequest, tokens: TokenRatio | None = None) -> HopView:
    """What the policy sees of a submitted hop; token counts by the pool's learned ratio
    (`tokens`; None: the prior, `estimate_tokens`)."""
    tokens = tokens or TokenRatio()
    ctx = request.context
    tier = _tier(ctx.tier)
    return HopView(
        pool=pool,
        run_id=ctx.run_id,
        hop_id=ctx.hop_id,
        session_id=ctx.session_id,
        tier=tier,
        node_priority=ctx.priority,
        prompt_tokens=tokens.estimate(request.prompt),
        max_tokens=request.sampling.max_tokens or DEFAULT_MAX_TOKENS,  # 0: not set (an estimate)
        deadline=monotonic_deadline(ctx.chain_deadline_unix_ms),
        hop_index=ctx.hop_index,
        remaining_critical_path_s=ctx.remaining_critical_path_ms / 1000,
        remaining_hops=ctx.remaining_hops if ctx.HasField("remaining_hops") else None,
        # Per chain config and tier, as the simulator learns (one config, one tier).
        program=f"{ctx.chain_name}/{TIER_NAMES.get(tier, 'standard')}" if ctx.chain_name else "",
        last_worker_id=ctx.last_worker_id,
        kv_retention_s=_retention_s(ctx),
        prefix_id=ctx.prefix_id,
        prefix_tokens=tokens.rescale(ctx.prefix_tokens) if ctx.prefix_id else 0,  # the router's estimate
    )


def _retention_s(ctx) -> float | None:
    """The client's KV retention hint; None when unset, or not a number of seconds at
    least 0 (a bad hint is no hint: the policy prices the hold itself)."""
    if not ctx.HasField("kv_retention_s"):
        return None
    value = ctx.kv_retention_s
    return value if math.isfinite(value) and value >= 0 else None


def next_hop_views(
    hop: HopView, request: scheduler_pb2.HopRequest, pool_of, tokens_of=lambda pool: TokenRatio()
) -> list[HopView]:
    """The chain's next model hops (as the router announced them) as views in their
    pools; `pool_of(model)` names a model's pool, or None when nobody serves it;
    `tokens_of(pool)` its learned `TokenRatio` (default: the prior)."""
    views = []
    for nxt in request.context.next_hops:
        pool = pool_of(nxt.model) if nxt.model else None
        if pool is None:
            continue
        views.append(
            HopView(
                pool=pool,
                run_id=hop.run_id,
                hop_id=nxt.hop_id,
                session_id=hop.session_id,
                tier=hop.tier,
                prompt_tokens=tokens_of(pool).rescale(int(nxt.prompt_tokens)),
                max_tokens=nxt.max_tokens or DEFAULT_MAX_TOKENS,
                hop_index=hop.hop_index + 1,
                last_worker_id=nxt.last_worker_id,
            )
        )
    return views


def _tier(value: int) -> Tier:
    try:
        return Tier(value)
    except ValueError:  # a newer client's tier: treat it as unspecified (standard)
        return Tier.UNSPECIFIED
