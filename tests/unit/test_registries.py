"""Policies and engines are found by name in one registry each."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from inferx.scheduling import registry
from inferx.scheduling.chain_aware import ChainAwarePolicy
from inferx.scheduling.policy import RoundRobinPolicy
from inferx.sim.cluster import sim_policy
from inferx.sim.profile import EngineProfile, load_profile
from inferx_scheduler.config import SchedulerSettings
from inferx_worker.config import WorkerSettings
from inferx_worker.engines.registry import engine_info, engine_names


def test_policies_are_registered_with_aliases() -> None:
    names = registry.policy_names()
    assert names[:2] == ("round-robin", "chain-aware")
    assert "baseline" in registry.accepted_names() and "baseline" not in names
    assert isinstance(registry.make_policy("baseline"), RoundRobinPolicy)
    assert registry.canonical_name("baseline") == "round-robin"


def test_options_reach_only_the_policies_that_take_them() -> None:
    aware = registry.make_policy("chain-aware", reuse_window_hops=7, kv_warm_s=3.0)
    assert isinstance(aware, ChainAwarePolicy)
    assert aware.config.reuse_window_hops == 7 and aware.config.kv_warm_s == 3.0
    # The scheduler passes its chain-aware flags whatever the policy: others ignore them.
    assert isinstance(registry.make_policy("round-robin", reuse_window_hops=7), RoundRobinPolicy)
    scaled = registry.make_policy("chain-aware", time_scale=10.0, kv_warm_s=30.0)
    assert isinstance(scaled, ChainAwarePolicy) and scaled.config.kv_warm_s == pytest.approx(3.0)


def test_unknown_policy_names_the_choices() -> None:
    with pytest.raises(ValueError, match="unknown policy 'fastest'; choose one of round-robin, chain-aware"):
        registry.make_policy("fastest")
    with pytest.raises(ValueError, match="time scale"):
        registry.make_policy("chain-aware", time_scale=0)


def test_a_name_cannot_be_registered_twice() -> None:
    registry.policy_names()  # built-ins loaded
    with pytest.raises(ValueError, match="registered twice"):
        registry.register_policy("baseline", summary="x")(lambda time_scale=1.0: RoundRobinPolicy())


def test_scheduler_flag_accepts_registered_policies_only() -> None:
    assert SchedulerSettings(policy="baseline").policy == "round-robin"
    with pytest.raises(ValidationError, match="unknown policy 'nope'"):
        SchedulerSettings(policy="nope")


def test_scheduler_flags_reach_the_policy() -> None:
    settings = SchedulerSettings(
        reuse_window_hops=2,
        kv_retention="priced",
        max_hold_s=42.0,
        kv_warm_s=7.0,
        overload_control=True,
        strict_holds=True,
        offload_retention=False,
        client_retention="cap",
    )
    policy = registry.make_policy("chain-aware", time_scale=2.0, **settings.policy_options())
    assert isinstance(policy, ChainAwarePolicy)
    config = policy.config
    assert (config.reuse_window_hops, config.kv_retention, config.overload_control) == (2, "priced", True)
    assert (config.max_hold_s, config.kv_warm_s) == (21.0, 3.5)  # time constants scaled
    assert config.strict_holds and not config.offload_retention
    assert config.client_retention == "cap"
    with pytest.raises(ValidationError, match="client_retention"):
        SchedulerSettings(client_retention="always")
    assert config.clock_scale == 2.0  # rates workers report follow the replay's clock
    # A peer ignores the chain-aware options.
    assert registry.make_policy("session-affinity", **settings.policy_options()).name == "session-affinity"


def test_the_engines_calibration_reaches_the_policy_live_and_in_the_simulator(tmp_path) -> None:
    """`inferx-scheduler --engine-profile` and `inferx sim --profile` tell chain-aware
    the same figures of the engine (its prefill rate, a decode step's cost per context
    token and without any); an explicit option wins; without a profile, Llama-3-8B's."""
    profile_file = tmp_path / "seven.yaml"
    profile_file.write_text(
        "name: seven\nprefill_tokens_per_s: 16000\nkv_read_ms_per_1k_tokens: 0.33\ndecode_step_ms: 8.4\n"
    )
    live = registry.make_policy(
        "chain-aware", **SchedulerSettings(engine_profile=str(profile_file)).policy_options()
    )
    assert isinstance(live, ChainAwarePolicy)
    assert live.config.prefill_tokens_per_s == 16000 and live.config.kv_read_s_per_token == pytest.approx(
        0.33e-6
    )
    assert live.config.decode_step_s == pytest.approx(0.0084)
    default = registry.make_policy("chain-aware", **SchedulerSettings().policy_options())
    assert isinstance(default, ChainAwarePolicy)
    assert default.config.kv_read_s_per_token == EngineProfile().policy_options()["kv_read_s_per_token"]
    assert default.config.prefill_tokens_per_s == EngineProfile().prefill_tokens_per_s
    assert default.config.decode_step_s == EngineProfile().decode_step_ms / 1e3
    simulated = sim_policy("chain-aware", load_profile(profile_file))
    assert isinstance(simulated, ChainAwarePolicy) and simulated.config == live.config
    told = sim_policy("chain-aware", load_profile(profile_file), {"kv_read_s_per_token": 1e-7})
    assert isinstance(told, ChainAwarePolicy) and told.config.kv_read_s_per_token == 1e-7
    assert sim_policy("session-affinity", load_profile(profile_file)).name == "session-affinity"
    with pytest.raises(ValidationError, match="missing.yaml"):
        SchedulerSettings(engine_profile=str(tmp_path / "missing.yaml"))
    (tmp_path / "bad.yaml").write_text("prefill_tokens_per_s: -1\n")
    with pytest.raises(ValidationError, match="prefill_tokens_per_s"):
        SchedulerSettings(engine_profile=str(tmp_path / "bad.yaml"))


def test_engines_are_registered() -> None:
    assert engine_names() == ("vllm", "openai", "sim")
    assert engine_info("sim").simulated and not engine_info("vllm").simulated
    assert not engine_info("openai").standalone
    assert WorkerSettings(model="m", engine="sim").engine == "sim"
    with pytest.raises(ValidationError, match="unknown engine 'tgi'; choose one of vllm, openai, sim"):
        WorkerSettings(model="m", engine="tgi")
