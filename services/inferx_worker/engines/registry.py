"""The engine registry: a new engine is one module with one `@register_engine` factory.

`inferx-worker --engine`, `inferx up --engine` and the docs list what is registered
here. Built-in engines live in the modules of `BUILTIN_MODULES`, imported on first
use; each module is cheap to import (heavy libraries such as vLLM load in `start()`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from inferx.plugins import PluginTable

if TYPE_CHECKING:
    from inferx_worker.engines.base import Engine

BUILTIN_MODULES: tuple[str, ...] = (
    "inferx_worker.engines.vllm_engine",
    "inferx_worker.engines.openai_engine",
    "inferx_worker.engines.sim_engine",
)

# factory(settings: inferx_worker.config.WorkerSettings) -> Engine. The settings type is
# not imported: the settings validate `--engine` against this registry.
EngineFactory = Callable[[Any], "Engine"]


@dataclass(frozen=True)
class EngineInfo:
    name: str
    factory: EngineFactory
    summary: str
    simulated: bool = False  # a latency model, never a stand-in for a real engine
    standalone: bool = True  # runs without an outside server (what `inferx up` can start)


_ENGINES: PluginTable[EngineInfo] = PluginTable("engine", BUILTIN_MODULES)


def register_engine(
    name: str, *, summary: str, simulated: bool = False, standalone: bool = True
) -> Callable[[EngineFactory], EngineFactory]:
    def decorate(factory: EngineFactory) -> EngineFactory:
        _ENGINES.add(name, EngineInfo(name, factory, summary, simulated, standalone), factory.__module__)
        return factory

    return decorate


def engine_names() -> tuple[str, ...]:
    """Built-ins in `BUILTIN_MODULES` order (whatever was imported first), then others."""
    return _ENGINES.names()


def engine_info(name: str) -> EngineInfo:
    return _ENGINES.get(name)


def make_engine(settings: Any) -> Engine:
    return engine_info(settings.engine).factory(settings)
