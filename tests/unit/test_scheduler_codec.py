"""The scheduler's service-edge codec: HopRequest protobufs to HopView values."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from inferx.scheduling.chain_aware import ChainAwarePolicy
from inferx.scheduling.views import HopView, Tier
from inferx.tokens import DEFAULT_MAX_TOKENS, estimate_tokens
from inferx.v1 import common_pb2, scheduler_pb2
from inferx_scheduler import codec
from inferx_scheduler.codec import hop_view, monotonic_deadline, next_hop_views

NOW_MONO = 500.0
NOW_UNIX = 1_700_000_000.0
PROMPT = "Summarise the following report in three sentences. " * 5


@pytest.fixture
def clocks(monkeypatch) -> None:
    """The codec's clocks fixed: monotonic 500 s, unix 1.7e9 s."""
    monkeypatch.setattr(codec, "time", SimpleNamespace(monotonic=lambda: NOW_MONO, time=lambda: NOW_UNIX))


def request(prompt: str = PROMPT, max_tokens: int = 0, next_hops=(), **context) -> scheduler_pb2.HopRequest:
    return scheduler_pb2.HopRequest(
        context=common_pb2.HopContext(next_hops=list(next_hops), **context),
        model="m",
        prompt=prompt,
        sampling=common_pb2.SamplingOptions(max_tokens=max_tokens),
    )


def test_hop_view_maps_every_context_field(clocks) -> None:
    """Each HopContext field lands in its HopView field, converted where units differ."""
    req = request(
        max_tokens=32,
        run_id="r1",
        hop_id="h2",
        session_id="s3",
        tier=common_pb2.TIER_REALTIME,
        priority=1,
        chain_deadline_unix_ms=1_700_000_002_500,
        hop_index=4,
        remaining_hops=3,
        remaining_critical_path_ms=2_500.0,
        last_worker_id="w7",
        prefix_id="3f2a",
        prefix_tokens=40,
    )
    assert hop_view("pool-a", req) == HopView(
        pool="pool-a",
        run_id="r1",
        hop_id="h2",
        session_id="s3",
        tier=Tier.REALTIME,
        node_priority=1,
        prompt_tokens=estimate_tokens(PROMPT),
        max_tokens=32,
        deadline=502.5,
        hop_index=4,
        remaining_critical_path_s=2.5,
        remaining_hops=3,
        last_worker_id="w7",
        prefix_id="3f2a",
        prefix_tokens=40,
    )


def test_a_prefix_length_without_its_id_is_none() -> None:
    """Tokens of a prefix nobody named mean nothing to a policy: dropped, not trusted."""
    view = hop_view("p", request(prefix_tokens=40))
    assert (view.prefix_id, view.prefix_tokens) == ("", 0)


@pytest.mark.parametrize(
    ("wire", "expected"),
    [(0, Tier.UNSPECIFIED), (1, Tier.REALTIME), (2, Tier.STANDARD), (3, Tier.BATCH), (9, Tier.UNSPECIFIED)],
)
def test_tier_enum_and_unknown_tier_is_unspecified(wire: int, expected: Tier) -> None:
    """Known tiers map to the Tier enum; a value this build does not know is UNSPECIFIED."""
    view = hop_view("p", request(tier=wire))
    assert view.tier is expected


def test_remaining_hops_present_zero_versus_absent() -> None:
    """An explicit remaining_hops of 0 (last hop) stays 0; an unset one is None (unknown)."""
    assert hop_view("p", request(remaining_hops=0)).remaining_hops == 0
    assert hop_view("p", request()).remaining_hops is None


def test_kv_retention_hint_present_zero_versus_absent_and_a_bad_one_is_none() -> None:
    """The client's hint: 0 is one (let go at once); unset is none; a value no client
    could have sent (negative, not finite) is no hint rather than a failed hop."""
    assert hop_view("p", request(kv_retention_s=30.0)).kv_retention_s == 30.0
    assert hop_view("p", request(kv_retention_s=0.0)).kv_retention_s == 0.0
    assert hop_view("p", request()).kv_retention_s is None
    for bad in (-1.0, float("nan"), float("inf")):
        assert hop_view("p", request(kv_retention_s=bad)).kv_retention_s is None


def test_max_tokens_defaults_when_zero() -> None:
    """max_tokens 0 (unset) becomes DEFAULT_MAX_TOKENS; a set value is kept."""
    assert DEFAULT_MAX_TOKENS not in (0, 7)  # so the two cases below differ
    assert hop_view("p", request(max_tokens=0)).max_tokens == DEFAULT_MAX_TOKENS
    assert hop_view("p", request(max_tokens=7)).max_tokens == 7


@pytest.mark.parametrize("prompt", ["", "hi", "x" * 401, PROMPT])
def test_prompt_tokens_is_the_shared_estimate(prompt: str) -> None:
    """prompt_tokens is inferx.tokens.estimate_tokens of the prompt text."""
    assert hop_view("p", request(prompt=prompt)).prompt_tokens == estimate_tokens(prompt)


def test_no_deadline_is_none(clocks) -> None:
    """chain_deadline_unix_ms 0 means no deadline, not 'now minus the epoch'."""
    assert hop_view("p", request()).deadline is None


def test_monotonic_deadline_with_injected_clocks() -> None:
    """The unix deadline keeps its distance from now on the monotonic clock, past or future."""
    assert monotonic_deadline(1_700_000_002_500, now_mono=NOW_MONO, now_unix=NOW_UNIX) == 502.5
    assert monotonic_deadline(1_699_999_999_000, now_mono=NOW_MONO, now_unix=NOW_UNIX) == 499.0
    assert monotonic_deadline(0, now_mono=NOW_MONO, now_unix=NOW_UNIX) is None


def test_monotonic_deadline_reads_the_clocks_when_not_given(clocks) -> None:
    """Without injected values the module's clocks are used."""
    assert monotonic_deadline(1_700_000_010_000) == 510.0


def test_next_hop_views_skip_models_without_a_pool() -> None:
    """Next hops become views in their model's pool; unserved or model-less ones are left out."""
    asked: list[str] = []

    def pool_of(model: str) -> str | None:
        asked.append(model)
        return {"big": "pool-big", "small": "pool-small"}.get(model)

    req = request(
        run_id="r1",
        session_id="s1",
        tier=common_pb2.TIER_BATCH,
        hop_index=2,
        next_hops=[
            common_pb2.NextHop(
                hop_id="n1", model="big", prompt_tokens=900, max_tokens=128, last_worker_id="w2"
            ),
            common_pb2.NextHop(hop_id="n2", model="nobody-serves-this", prompt_tokens=5, max_tokens=5),
            common_pb2.NextHop(hop_id="n3", model="", prompt_tokens=5, max_tokens=5),
            common_pb2.NextHop(hop_id="n4", model="small", prompt_tokens=40, max_tokens=0),
        ],
    )
    hop = hop_view("pool-cur", req)
    views = next_hop_views(hop, req, pool_of)
    assert asked == ["big", "nobody-serves-this", "small"]
    assert views == [
        HopView(
            "pool-big",
            "r1",
            "n1",
            "s1",
            Tier.BATCH,
            prompt_tokens=900,
            max_tokens=128,
            hop_index=3,
            last_worker_id="w2",
        ),
        HopView(
            "pool-small",
            "r1",
            "n4",
            "s1",
            Tier.BATCH,
            prompt_tokens=40,
            max_tokens=DEFAULT_MAX_TOKENS,
            hop_index=3,
        ),
    ]
    assert [(v.deadline, v.remaining_hops, v.node_priority) for v in views] == [(None, None, 2)] * 2


def test_next_hop_views_empty_without_next_hops() -> None:
    """A hop that announces no successors has no look-ahead views."""
    req = request(run_id="r1")
    assert next_hop_views(hop_view("p", req), req, lambda model: "p") == []


def test_program_kind_is_the_chain_name_and_tier() -> None:
    """What the policy learns gaps per: the chain config (or the OpenAI front's program
    name) and its tier; unknown without a chain name."""
    view = hop_view("p", request(chain_name="support", tier=common_pb2.TIER_REALTIME))
    assert view.program == "support/realtime"
    assert hop_view("p", request(chain_name="support")).program == "support/standard"
    assert hop_view("p", request()).program == ""


def test_gaps_are_learned_per_program_before_the_prefix_it_shares() -> None:
    """Two chain configs may start with one system prompt yet wait on tools of their own:
    the program names what gaps are learned per, the shared prefix only when there is none."""
    kind = ChainAwarePolicy._program_kind
    assert (
        kind(hop_view("p", request(chain_name="support", prefix_id="ab12", prefix_tokens=40)))
        == "support/standard"
    )
    assert kind(hop_view("p", request(prefix_id="ab12", prefix_tokens=40))) == "ab12"
    assert kind(hop_view("p", request())) == "p"
