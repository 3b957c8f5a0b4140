"""The engine profiles shipped in benchmarks/ (`inferx sim --profile`) load, and each is
a different engine: a typo'd key or a copy left unedited would silently re-run another
profile's figures under a new name."""

from __future__ import annotations

from pathlib import Path

import pytest

from inferx.sim.profile import EngineProfile, load_profile

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
PROFILES = sorted(BENCHMARKS.glob("*.yaml"))


def test_the_profiles_are_found() -> None:
    assert {p.name for p in PROFILES} >= {"llama2-7b-mha-a100.yaml", "llama3-8b-h100.yaml"}


@pytest.mark.parametrize("path", PROFILES, ids=lambda p: p.name)
def test_a_shipped_profile_loads(path: Path) -> None:
    profile = load_profile(path)  # InvalidArgument names the bad key
    assert profile.name and profile.name != EngineProfile().name


def test_each_shipped_profile_is_its_own_engine() -> None:
    profiles = [load_profile(p) for p in PROFILES]
    names = [p.name for p in profiles]
    assert len(set(names)) == len(names)
    engines = {repr(p.model_dump(exclude={"name"})) for p in [*profiles, EngineProfile()]}
    assert len(engines) == len(profiles) + 1
