"""Every InferX process picks grpc's polling I/O before grpc loads (inferx.grpc_io):
grpc reads GRPC_EXPERIMENTS once, at import, so a process that loaded grpc first would
silently run on the default I/O layer (two thread crossings per message instead of one)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from inferx.grpc_io import POLLED_IO

# What GRPC_EXPERIMENTS says at the moment grpc is first imported, after importing the
# entry point's module the way its console script does (and then grpc, as a command
# that loads it lazily would).
PROBE = """
import importlib, os, sys
seen = []
class Probe:
    def find_spec(self, name, path=None, target=None):
        if name == "grpc" and not seen:
            seen.append(os.environ.get("GRPC_EXPERIMENTS", "<unset>"))
        return None
sys.meta_path.insert(0, Probe())
importlib.import_module(sys.argv[1])
import grpc
print(seen[0])
"""

ENTRY_POINTS = [
    "inferx_router.__main__",
    "inferx_scheduler.__main__",
    "inferx_memory_pool.__main__",
    "inferx_cache.__main__",
    "inferx_worker.__main__",
    "inferx.cli.main",
]


def grpc_experiments_at_import(module: str, environ: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, module], env=environ, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_each_entry_point_chooses_grpcs_io_before_grpc_loads(module: str) -> None:
    environ = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    assert grpc_experiments_at_import(module, environ) == POLLED_IO


def test_an_operators_own_grpc_experiments_win() -> None:
    for own in ("", "-event_engine_client"):
        environ = {**os.environ, "GRPC_EXPERIMENTS": own}
        assert grpc_experiments_at_import("inferx_router.__main__", environ) == own
