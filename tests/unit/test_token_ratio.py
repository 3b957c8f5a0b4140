"""The scheduler sizes prompts in its pool's engine tokens, learned from what the
workers count (`inferx.tokens.TokenRatio`): an estimate off by a constant factor read
as uncached prefill on every hop of a chain whose context its worker still held."""

from __future__ import annotations

import asyncio
import math

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import REGISTRY

from inferx import hopstream
from inferx.scheduling.chain_aware import ChainAwarePolicy
from inferx.scheduling.views import HopView
from inferx.tokens import CHARS_PER_TOKEN, TokenRatio, estimate_tokens
from inferx.v1 import common_pb2, scheduler_pb2, worker_pb2
from inferx_scheduler.codec import hop_view, next_hop_views
from inferx_scheduler.dispatcher import HopDispatcher
from tests.local_scheduler import local_scheduler

ENGINE_CHARS_PER_TOKEN = 4  # the engine below cuts 4 characters per token; the prior assumes 3


def test_the_prior_is_the_shared_estimate_until_enough_hops_were_counted() -> None:
    ratio = TokenRatio(min_samples=3)
    for _ in range(2):
        ratio.observe(400, 100)
    assert not ratio.learned
    assert ratio.estimate("x" * 400) == estimate_tokens("x" * 400) == 134
    assert ratio.rescale(134) == 134
    ratio.observe(400, 100)
    assert ratio.learned
    assert ratio.estimate("x" * 400) == 100
    assert ratio.rescale(estimate_tokens("x" * 400)) == math.ceil(134 * CHARS_PER_TOKEN / 4)


def test_the_ratio_is_of_the_sums_over_the_latest_window() -> None:
    ratio = TokenRatio(window=4, min_samples=1)
    for chars, tokens in [(100, 50)] * 4:  # 2 characters per token (a small vocabulary)
        ratio.observe(chars, tokens)
    assert ratio.tokens_per_char == 0.5
    for chars, tokens in [(1000, 250)] * 4:  # the window forgets the old hops entirely
        ratio.observe(chars, tokens)
    assert ratio.tokens_per_char == 0.25
    ratio.observe(1000, 250)
    ratio.observe(200, 100)  # sums, not a mean of ratios: long prompts weigh more
    assert ratio.tokens_per_char == (250 * 3 + 100) / (1000 * 3 + 200)


def test_hops_without_counts_teach_nothing() -> None:
    ratio = TokenRatio(min_samples=1)
    ratio.observe(0, 10)
    ratio.observe(10, 0)
    assert not ratio.learned


@given(
    cpt=st.floats(min_value=1.0, max_value=8.0),
    chars=st.integers(min_value=1, max_value=200_000),
)
def test_a_learned_estimate_is_within_a_token_of_the_engines_count(cpt: float, chars: int) -> None:
    ratio = TokenRatio(min_samples=1)
    ratio.observe(1_000_000, round(1_000_000 / cpt))
    engine = chars / cpt
    # Within a token, plus what rounding the observed count to whole tokens (half a token
    # of 1e6 / cpt) makes the learned ratio off by, relatively (CI: cpt 5.84, 38,277 chars).
    assert abs(ratio.estimate("y" * chars) - engine) <= 1 + engine * (0.5 * cpt / 1_000_000 + 1e-9)


def test_the_codec_sizes_a_hop_by_its_pools_ratio() -> None:
    """The hop's prompt, its shared prefix (the router's estimate) and announced next
    hops (the router's estimate too) all in the pool's engine tokens."""
    ratio = TokenRatio(min_samples=1)
    ratio.observe(4000, 1000)
    prompt = "z" * 4000
    request = scheduler_pb2.HopRequest(
        model="m",
        prompt=prompt,
        context=common_pb2.HopContext(
            run_id="r",
            hop_id="h",
            prefix_id="p1",
            prefix_tokens=estimate_tokens("z" * 1200),
            next_hops=[
                common_pb2.NextHop(hop_id="n", model="m", prompt_tokens=estimate_tokens(prompt + "z" * 8))
            ],
        ),
    )
    view = hop_view("m", request, ratio)
    assert (view.prompt_tokens, view.prefix_tokens) == (1000, 300)
    assert hop_view("m", request).prompt_tokens == estimate_tokens(prompt)  # no ratio: the prior
    (ahead,) = next_hop_views(view, request, lambda model: "m", lambda pool: ratio)
    assert ahead.prompt_tokens == 1002


# ----- the live scheduler learns it ----------------------------------------------------

WORKER = common_pb2.WorkerInfo(
    worker_id="w1", pool="m", address="w1:1", max_concurrency=4, kv_capacity_tokens=1_000_000
)


async def counting_engine(request: worker_pb2.GenerateRequest, context):
    """Counts the prompt at ENGINE_CHARS_PER_TOKEN characters per token; one output token."""
    yield worker_pb2.GenerateChunk(
        text="ok",
        finished=True,
        finish_reason="stop",
        usage=common_pb2.TokenUsage(
            prompt_tokens=math.ceil(len(request.prompt) / ENGINE_CHARS_PER_TOKEN), completion_tokens=1
        ),
        worker_id="w1",
        engine_ms=5.0,
        ttft_ms=1.0,
    )


def scheduler() -> tuple[hopstream.LocalPeer, HopDispatcher, list[HopView]]:
    peer, dispatcher = local_scheduler(WORKER, counting_engine)
    seen: list[HopView] = []
    submit = dispatcher.submit

    def recording_submit(view: HopView):
        seen.append(view)
        return submit(view)

    dispatcher.submit = recording_submit  # type: ignore[method-assign]
    return peer, dispatcher, seen


async def run_hop(
    peer: hopstream.LocalPeer, run_id: str, hop_id: str, prompt: str, hop_index: int = 0
) -> None:
    request = scheduler_pb2.HopRequest(
        model="m",
        prompt=prompt,
        context=common_pb2.HopContext(run_id=run_id, hop_id=hop_id, hop_index=hop_index),
    )
    [event async for event in peer.call(request, timeout=5.0)]
    await asyncio.sleep(0)  # the hop's end booked


async def test_a_chains_next_hop_is_priced_by_what_it_adds_not_by_the_estimates_error() -> None:
    peer, dispatcher, seen = scheduler()
    for i in range(TokenRatio().min_samples):  # other programs' hops teach the ratio
        await run_hop(peer, f"warm-{i}", "0", "w" * 4000)
    assert REGISTRY.get_sample_value("inferx_scheduler_prompt_chars_per_token", {"pool": "m"}) == 4.0
    context = "c" * 40_000  # 10,000 engine tokens, cached on w1 after the first hop
    await run_hop(peer, "agent", "0", context)
    await run_hop(peer, "agent", "1", context + "n" * 400, hop_index=1)  # 100 new tokens
    first, second = seen[-2:]
    assert first.prompt_tokens == 10_000 and second.prompt_tokens == 10_100
    policy = dispatcher.queue.policy
    assert isinstance(policy, ChainAwarePolicy)
    # The prior (3 characters per token) would have priced a third of the context again:
    # 13,467 estimated - 10,001 counted = 3,466 tokens, a heavy prefill; it is 99.
    assert policy.bucket(second) == 0
