"""The engine registry: a new engine is one module with one `@register_engine` factory.

`inferx-worker --engine`, `inferx up --engine` and the docs list what is registered
here. Built-in engines live in the modules of `BUILTIN_MODULES`, imported on first
use; each module is cheap to import (heavy libraries such as vLLM load in `start()`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

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


_ENGINES: dict[str, EngineInfo] = {}
_loaded = False


def register_engine(
    name: str, *, summary: str, simulated: bool = False, standalone: bool = True
) -> Callable[[EngineFactory], EngineFactory]:
    def decorate(factory: EngineFactory) -> EngineFactory:
        if name in _ENGINES:
            raise ValueError(f"engine {name!r} is registered twice")
        _ENGINES[name] = EngineInfo(name, factory, summary, simulated, standalone)
        return factory

    return decorate


def _load_builtins() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for module in BUILTIN_MODULES:
            importlib.import_module(module)


def engine_names() -> tuple[str, ...]:
    """Built-ins in `BUILTIN_MODULES` order (whatever was imported first), then others."""
    _load_builtins()

    def position(name: str) -> int:
        module = _ENGINES[name].factory.__module__
        return BUILTIN_MODULES.index(module) if module in BUILTIN_MODULES else len(BUILTIN_MODULES)

    return tuple(sorted(_ENGINES, key=position))


def engine_info(name: str) -> EngineInfo:
    _load_builtins()
    if name not in _ENGINES:
        raise ValueError(f"unknown engine {name!r}; choose one of {', '.join(engine_names())}")
    return _ENGINES[name]


def make_engine(settings: Any) -> Engine:
    return engine_info(settings.engine).factory(settings)
