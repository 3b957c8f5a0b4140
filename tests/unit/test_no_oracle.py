"""Replays give a policy only what a live system would know: the request's max_tokens cap
(not the output length), and a remaining path learned from finished calls (not the
trace's future tool delays or outputs)."""

from __future__ import annotations

import pytest

from inferx.scheduling.registry import make_policy
from inferx.scheduling.views import HopView
from inferx.sim.cluster import ClusterSim
from inferx.sim.estimates import RemainingPath
from inferx.sim.profile import EngineProfile
from inferx.sim.trace import TraceConfig, TraceHop, default_max_tokens, generate


def views_seen(trace) -> list[HopView]:
    seen: list[HopView] = []
    policy = make_policy("chain-aware")
    original = policy.on_dispatch

    def spy(queued, worker_id, now):
        seen.append(queued.view)
        original(queued, worker_id, now)

    policy.on_dispatch = spy  # type: ignore[method-assign]
    ClusterSim(trace, policy, EngineProfile(), workers=2).run()
    return seen


def test_policies_see_the_cap_not_the_output_length() -> None:
    trace = generate(TraceConfig(seed=3, duration_s=20, rate_per_s=1.0))
    capped = trace.chains[0].model_copy(
        update={"hops": [h.model_copy(update={"max_tokens": 777}) for h in trace.chains[0].hops]}
    )
    trace = trace.model_copy(update={"chains": [capped, *trace.chains[1:]]})
    by_id = {c.chain_id: c for c in trace.chains}
    seen = views_seen(trace)
    assert len(seen) == sum(len(c.hops) for c in trace.chains)
    for view in seen:
        chain = by_id[view.run_id]
        expected = 777 if chain is capped else default_max_tokens(chain.kind)
        assert view.max_tokens == expected != chain.hops[view.hop_index].output_tokens


def test_future_delays_and_outputs_do_not_reach_the_policy() -> None:
    """Change the last chain's future (its later calls' outputs and tool delays): every
    view the policy saw up to that chain's first call is the same."""
    trace = generate(TraceConfig(seed=5, duration_s=30, rate_per_s=1.0))
    last = trace.chains[-1]
    changed_hops = [last.hops[0]] + [
        TraceHop(
            new_tokens=h.new_tokens, output_tokens=h.output_tokens * 3, delay_after_s=h.delay_after_s * 7 + 1
        )
        for h in last.hops[1:]
    ]
    changed = trace.model_copy(
        update={"chains": [*trace.chains[:-1], last.model_copy(update={"hops": changed_hops})]}
    )

    def until_first_call_of_last(views: list[HopView]) -> list[HopView]:
        index = next(i for i, v in enumerate(views) if v.run_id == last.chain_id)
        return views[: index + 1]

    before, after = views_seen(trace), views_seen(changed)
    assert until_first_call_of_last(before) == until_first_call_of_last(after)
    first = until_first_call_of_last(after)[-1]
    assert first.remaining_hops == len(last.hops) - 1  # the declared structure is known


def test_remaining_path_is_learned_per_kind_and_call() -> None:
    path = RemainingPath(alpha=0.5)
    assert path.remaining_s("swe", 0, 3) == 0.0  # nothing finished yet: unknown
    path.call_finished("swe", 0, 2.0)
    path.gap_observed("swe", 0, 10.0)
    path.call_finished("swe", 1, 4.0)
    # call 0 + gap 0 + call 1 + gap 1 (unseen: the kind's mean gap) + call 2 (unseen: mean call)
    mean_call = 2.0 + 0.5 * (4.0 - 2.0)
    assert path.remaining_s("swe", 0, 3) == pytest.approx(2.0 + 10.0 + 4.0 + 10.0 + mean_call)
    assert path.remaining_s("swe", 2, 3) == pytest.approx(mean_call)  # the last call: no gap after
    assert path.remaining_s("chat", 0, 3) == 0.0  # another kind learns on its own
