"""Shared fixtures: a real etcd and real service processes on free ports.

Integration and e2e tests start the same LocalStack that `make run` uses, with a
temporary state directory and a short lease TTL, and tear it down by process group.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from inferx.devstack import LocalStack, StackPorts, read_models_file, wait_serving

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TEST_LEASE_TTL_S = 3
# `make test-integration` / `make test-e2e` select by marker: a test in these
# directories without its marker would silently run in neither.
DIRECTORY_MARKERS = {"integration": "integration", "e2e": "e2e"}


def load_benchmark_script(name: str) -> types.ModuleType:
    """A script of benchmarks/ (not a package) as a module, for its tests."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    unmarked = []
    for item in items:
        parts = item.path.relative_to(ROOT).parts
        if len(parts) > 2 and parts[0] == "tests" and parts[1] in DIRECTORY_MARKERS:
            if item.get_closest_marker(DIRECTORY_MARKERS[parts[1]]) is None:
                unmarked.append(item.nodeid)
    if unmarked:
        raise pytest.UsageError(
            "tests without the marker of their directory (add pytestmark = pytest.mark.<marker>): "
            + ", ".join(unmarked)
        )


def make_stack(
    tmp: Path,
    *,
    lease_ttl_s: int = TEST_LEASE_TTL_S,
    insecure: bool = True,
    tls_server_name: str | None = None,
    embedded_scheduler: bool = False,
    scheduler_flags: tuple[str, ...] = (),
) -> LocalStack:
    """A stack on free ports. Plaintext (`insecure=True`) unless asked: the tests of
    scheduling, configs and faults call services directly; tests/integration/test_secure_stack.py
    runs the secure stack `inferx up` runs by default. `tls_server_name`: its certificate
    names only that name, which every process verifies its peers against (LocalStack)."""
    return LocalStack(
        tmp,
        StackPorts.free(),
        lease_ttl_s=lease_ttl_s,
        fresh_etcd=True,
        python=sys.executable,
        knowledge_base=EXAMPLES / "knowledge_base.jsonl",
        insecure=insecure,
        tls_server_name=tls_server_name,
        embedded_scheduler=embedded_scheduler,
        scheduler_flags=scheduler_flags,
    )


def dump_logs(stack: LocalStack) -> None:
    for proc in [stack.etcd, *stack.services.values(), *stack.workers]:
        if proc is not None:
            print(f"----- {proc.name} -----\n{proc.log_tail(40)}")


@contextlib.contextmanager
def started(stack: LocalStack, start: Callable[[LocalStack], None]) -> Iterator[LocalStack]:
    """`start(stack)`, printing the logs when it fails; the stack is stopped at the end."""
    try:
        start(stack)
    except BaseException:
        dump_logs(stack)
        stack.stop()
        raise
    try:
        yield stack
    finally:
        stack.stop()


@contextlib.contextmanager
def running_sim_stack(
    tmp: Path,
    *,
    workers: int = 2,
    sim_speed: float = 5,
    lease_ttl_s: int = TEST_LEASE_TTL_S,
    insecure: bool = True,
    tls_server_name: str | None = None,
    worker_args: Sequence[str] = (),
) -> Iterator[LocalStack]:
    """etcd + all services + `workers` sim workers (with `worker_args` added to their
    flags), example models and chains loaded; the logs are printed when start-up fails,
    and everything is stopped at the end."""

    def start(stack: LocalStack) -> None:
        stack.start_core()
        stack.load_models(read_models_file(EXAMPLES / "models.yaml"))
        for _ in range(workers):
            stack.start_worker("tiny-llama", "sim", ["--sim-speed", str(sim_speed), *worker_args])
        for worker in stack.workers:
            wait_serving(worker, 60)
        stack.put_chains(sorted((EXAMPLES / "chains").glob("*.yaml")))

    stack = make_stack(tmp, lease_ttl_s=lease_ttl_s, insecure=insecure, tls_server_name=tls_server_name)
    with started(stack, start):
        yield stack


@pytest.fixture(scope="module")
def sim_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """Shared by a module's tests: etcd, all services, two sim workers."""
    with running_sim_stack(tmp_path_factory.mktemp("stack")) as stack:
        yield stack
