"""A name -> entry table for things a module adds by registering itself (scheduling
policies, worker engines): built-in modules are imported on first lookup, names come
out in `builtin_modules` order whatever was imported first, and an unknown name is a
ValueError that lists the choices."""

from __future__ import annotations

import importlib
from typing import Generic, TypeVar

Entry = TypeVar("Entry")


class PluginTable(Generic[Entry]):
    def __init__(self, kind: str, builtin_modules: tuple[str, ...]) -> None:
        self.kind = kind  # "policy", "engine": for messages
        self.builtin_modules = builtin_modules
        self._entries: dict[str, tuple[Entry, str]] = {}  # name -> (entry, registering module)
        self._loaded = False

    def add(self, name: str, entry: Entry, module: str) -> None:
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        self._entries[name] = (entry, module)

    def __contains__(self, name: str) -> bool:
        """Registered so far (no import: registration itself asks)."""
        return name in self._entries

    def names(self) -> tuple[str, ...]:
        """Built-ins in `builtin_modules` order, then others in registration order."""
        self._load_builtins()
        modules = self.builtin_modules

        def position(name: str) -> int:
            module = self._entries[name][1]
            return modules.index(module) if module in modules else len(modules)

        return tuple(sorted(self._entries, key=position))  # stable within a module

    def get(self, name: str) -> Entry:
        self._load_builtins()
        if name not in self._entries:
            raise ValueError(f"unknown {self.kind} {name!r}; choose one of {', '.join(self.names())}")
        return self._entries[name][0]

    def _load_builtins(self) -> None:
        if not self._loaded:
            self._loaded = True
            for module in self.builtin_modules:
                importlib.import_module(module)
