"""The scheduling-policy registry: a new policy is one module plus one `@register_policy`.

Every place that offers a choice of policy (`inferx-scheduler --policy`, `inferx sim`,
`inferx bench --compare`, the simulator) asks this registry, so a policy registered
here is usable everywhere at once. Built-in policies live in the modules listed in
`BUILTIN_MODULES`; they are imported on first use (not at import time), which keeps
this module free of import cycles with the policies that import it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from inferx.plugins import PluginTable

if TYPE_CHECKING:
    from inferx.scheduling.protocol import Policy

# Modules that register the built-in policies when imported.
BUILTIN_MODULES: tuple[str, ...] = (
    "inferx.scheduling.policy",
    "inferx.scheduling.chain_aware",
    "inferx.scheduling.peers.least_loaded",
    "inferx.scheduling.peers.session_affinity",
    "inferx.scheduling.peers.prefix_aware",
    "inferx.scheduling.peers.program_las",
    "inferx.scheduling.peers.tier_aware",
)

PolicyFactory = Callable[..., "Policy"]


@dataclass(frozen=True)
class PolicyInfo:
    name: str
    factory: PolicyFactory  # factory(time_scale=..., **options) -> Policy
    summary: str  # one line for --help and docs
    imitates: str = ""  # the deployed system this policy stands for, if any
    aliases: tuple[str, ...] = ()
    # Option names the factory accepts. Options meant for other policies (the scheduler's
    # chain-aware flags, say) are not passed to it.
    options: frozenset[str] = field(default_factory=frozenset)


_POLICIES: PluginTable[PolicyInfo] = PluginTable("policy", BUILTIN_MODULES)
_ALIASES: dict[str, str] = {}


def register_policy(
    name: str,
    *,
    summary: str,
    imitates: str = "",
    aliases: tuple[str, ...] = (),
    options: tuple[str, ...] = (),
) -> Callable[[PolicyFactory], PolicyFactory]:
    """Decorator for a factory `(time_scale: float = 1.0, **options) -> Policy`."""

    def decorate(factory: PolicyFactory) -> PolicyFactory:
        for alias in aliases:
            if alias in _POLICIES or alias in _ALIASES:
                raise ValueError(f"policy {alias!r} is registered twice")
        if name in _ALIASES:
            raise ValueError(f"policy {name!r} is registered twice")
        info = PolicyInfo(name, factory, summary, imitates, aliases, frozenset(options))
        _POLICIES.add(name, info, factory.__module__)
        for alias in aliases:
            _ALIASES[alias] = name
        return factory

    return decorate


def policy_names() -> tuple[str, ...]:
    """Canonical names: built-ins in `BUILTIN_MODULES` order, then others."""
    return _POLICIES.names()


def accepted_names() -> tuple[str, ...]:
    """Canonical names and aliases: what `--policy` accepts."""
    return policy_names() + tuple(_ALIASES)


def policy_info(name: str) -> PolicyInfo:
    """The registered policy called `name` (or an alias of it); ValueError names the choices."""
    _POLICIES.names()  # built-ins (and their aliases) registered
    return _POLICIES.get(_ALIASES.get(name, name))


def canonical_name(name: str) -> str:
    return policy_info(name).name


def make_policy(name: str, *, time_scale: float = 1.0, **options: object) -> Policy:
    """A fresh policy instance. `time_scale` > 1 when the workload runs that many times
    faster than real time; `options` not accepted by this policy are left out."""
    info = policy_info(name)
    if time_scale <= 0:
        raise ValueError("time scale must be positive")
    return info.factory(time_scale=time_scale, **_accepted(info, options))


def _accepted(info: PolicyInfo, options: Mapping[str, object]) -> dict[str, object]:
    return {key: value for key, value in options.items() if key in info.options}
