"""Shared fixtures: a real etcd and real service processes on free ports.

Integration and e2e tests start the same LocalStack that `make run` uses, with a
temporary state directory and a short lease TTL, and tear it down by process group.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from inferx import devstack
from inferx.devstack import LocalStack, ManagedProcess, StackError, StackPorts, read_models_file

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TEST_LEASE_TTL_S = 3
#: the etcd lease TTL of the stacks on a real vLLM engine, which test no lease expiry: its
#: engine keeps the CPUs busy, and a worker or service starved past a 3 s TTL on a loaded
#: 2-core machine drops out of routing mid-test ("no live worker serves model ...")
E2E_LEASE_TTL_S = 10
#: how long a test waits for the workers of its stack to be routed (`wait_workers_routed`)
WORKERS_ROUTED_TIMEOUT_S = 60.0
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


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (`make test` runs `-n 2`), each worker process picks the ports
    of its stacks from its own slice of free_port's range: two workers choosing at the
    same moment could otherwise both take a port neither service has bound yet."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # gw0, gw1, ...
    if worker.startswith("gw"):
        devstack.port_slice = (int(worker[2:]), int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
        # ... and so do the stacks its tests' CLI processes start
        os.environ[devstack.PORT_SLICE_ENV] = "{}/{}".format(*devstack.port_slice)


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


#: stacks started with `started(..., guard=True)` and still running: before every test,
#: `workers_routed_before_each_test` waits until their workers are routed
GUARDED_STACKS: list[LocalStack] = []


def wait_workers_routed(
    stack: LocalStack,
    timeout_s: float = WORKERS_ROUTED_TIMEOUT_S,
    workers: Sequence[ManagedProcess] | None = None,
    routers: Sequence[str] | None = None,
) -> None:
    """Wait (at most `timeout_s`) until each of `workers` (default: every worker process of
    the stack still running) is SERVING and routed: seen by each router at `routers`
    (default: every router process of the stack still running), by the scheduler that
    owns its pool and by the memory-pool (`LocalStack.wait_workers`). A worker's
    own SERVING is not enough: its etcd registration reaches the others' watches a
    moment later -- much later on a loaded machine, where a starved worker can also lose
    its lease and register again -- and a hop sent meanwhile fails with "no live worker
    serves model ...". On a timeout the test fails naming what is still missing, with
    every process's log."""
    try:
        stack.wait_workers(timeout_s, workers, routers)
    except StackError as exc:
        dump_logs(stack)
        pytest.fail(f"{exc}", pytrace=False)


@pytest.fixture(autouse=True)
def workers_routed_before_each_test() -> None:
    """Every test on a guarded stack (a module's shared one) starts with its workers
    routed: an earlier test's load may have cost a worker its lease a moment ago."""
    for stack in list(GUARDED_STACKS):
        wait_workers_routed(stack)


@contextlib.contextmanager
def started(
    stack: LocalStack, start: Callable[[LocalStack], None], *, guard: bool = False
) -> Iterator[LocalStack]:
    """`start(stack)`, printing the logs when it fails; the stack is stopped at the end.
    Then it waits until the stack's workers are routed (`wait_workers_routed`).
    `guard`: every test while it runs first waits for its workers to be routed (a stack
    shared by a module's tests, none of which leaves a worker, a scheduler or the router
    stopped or frozen for the next)."""
    try:
        start(stack)
        stack.wait_workers(WORKERS_ROUTED_TIMEOUT_S)
    except BaseException:
        dump_logs(stack)
        stack.stop()
        raise
    if guard:
        GUARDED_STACKS.append(stack)
    try:
        yield stack
    finally:
        if guard:
            GUARDED_STACKS.remove(stack)
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
    guard: bool = True,
) -> Iterator[LocalStack]:
    """etcd + all services + `workers` sim workers (with `worker_args` added to their
    flags) routed, example models and chains loaded; the logs are printed when start-up
    fails, and everything is stopped at the end. `guard`: as `started`'s."""

    def start(stack: LocalStack) -> None:
        stack.start_core()
        stack.load_models(read_models_file(EXAMPLES / "models.yaml"))
        for _ in range(workers):
            stack.start_worker("tiny-llama", "sim", ["--sim-speed", str(sim_speed), *worker_args])
        stack.put_chains(sorted((EXAMPLES / "chains").glob("*.yaml")))

    stack = make_stack(tmp, lease_ttl_s=lease_ttl_s, insecure=insecure, tls_server_name=tls_server_name)
    with started(stack, start, guard=guard):
        yield stack


@pytest.fixture
def etcd_only(tmp_path: Path) -> Iterator[LocalStack]:
    """A real etcd and nothing else, for one test."""
    stack = make_stack(tmp_path)
    stack.start_etcd()
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def sim_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """Shared by a module's tests: etcd, all services, two sim workers."""
    with running_sim_stack(tmp_path_factory.mktemp("stack")) as stack:
        yield stack
