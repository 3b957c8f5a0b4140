"""Routers running the scheduler in their own process (`inferx-router
--embedded-scheduler`, issue #14), on real etcd and real processes, with mutual TLS
between services (SIMULATED workers): two routers, each with its embedded scheduler, no
scheduler process.

* chains through both routers complete; one embedded scheduler owns the pool: its
  router's hops are in-process calls, the other router's reach it over gRPC (mutual
  TLS on the scheduler's own port);
* the owning router stopped with SIGTERM exits cleanly, its partition moves to the other
  router's scheduler, whose router then runs its hops in-process.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator

import pytest

from inferx import etcd
from inferx.devstack import LocalStack, read_models_file
from inferx.partitions import Owner
from inferx.v1 import router_pb2
from tests.conftest import EXAMPLES, make_stack, started
from tests.polling import poll_until

pytestmark = pytest.mark.integration

POOL = "tiny-llama"
CHAIN = "embedded_chain"
CHAIN_TEXT = f"""
agent_chain:
  name: {CHAIN}
  tier: standard
  inputs:
    query: {{description: the question}}
  slo: {{end_to_end_latency_p99: 60000ms, availability: 99%}}
  nodes:
    - id: draft
      type: model_inference
      model: qwen-7b
      timeout: 20000ms
      max_tokens: 8
      prompt: "Question: {{{{ inputs.query }}}}\\nDraft:"
    - id: answer
      type: model_inference
      model: qwen-7b
      timeout: 20000ms
      max_tokens: 8
      depends_on: [draft]
      prompt: "Question: {{{{ inputs.query }}}}\\nDraft: {{{{ nodes.draft.output }}}}\\nAnswer:"
"""
HOPS_PER_CHAIN = 2
IN_PROCESS = re.compile(
    r'^inferx_in_process_calls_total\{method="/inferx.v1.Scheduler/SubmitHop"\} (\S+)$', re.M
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    def start(stack: LocalStack) -> None:
        stack.start_core(replicas=2)
        stack.load_models(read_models_file(EXAMPLES / "models.yaml"))
        for _ in range(2):
            stack.start_worker(POOL, "sim", ["--sim-speed", "20"])

        async def put() -> None:
            async with stack.client() as client:
                await client.put_chain(CHAIN_TEXT)

        asyncio.run(put())

    tmp = tmp_path_factory.mktemp("embedded")
    with started(make_stack(tmp, insecure=False, lease_ttl_s=3, embedded_scheduler=True), start) as stack:
        yield stack


async def run_chains(stack: LocalStack, router: str, count: int) -> list[router_pb2.ChainFinished]:
    async def one(i: int) -> router_pb2.ChainFinished:
        async with stack.client(address=stack.services[router].address, timeout_s=60) as client:
            async for event in client.run_chain(CHAIN, {"query": f"{router} question {i}"}):
                if event.HasField("chain_finished"):
                    return event.chain_finished
        raise AssertionError("the run ended without ChainFinished")

    return list(await asyncio.gather(*(one(i) for i in range(count))))


async def schedulers(stack: LocalStack) -> dict[str, dict]:
    """The schedulers registered in etcd, by address: their ServiceInfo."""
    async with stack.etcd_client() as client:
        found = await client.get_prefix(f"{etcd.SERVICES}scheduler/".encode())
    return {info["address"]: info for info in (json.loads(item.value) for item in found)}


def assert_all_ok(finished: list[router_pb2.ChainFinished]) -> None:
    failed = [f"{f.run_id}: {f.status} {f.error}" for f in finished if f.status != "ok"]
    assert not failed, failed
    assert all(len(f.hops) == HOPS_PER_CHAIN for f in finished)


async def test_the_owning_router_runs_its_hops_in_process_the_other_over_grpc(stack: LocalStack) -> None:
    assert not [name for name in stack.services if name.startswith("scheduler")]  # no scheduler process
    found = await schedulers(stack)
    assert len(found) == 2  # one per router, each on a port of its own
    router_addresses = {stack.services[name].address for name in ("router", "router-1")}
    assert not set(found) & router_addresses
    the_owner = await owner(stack)
    assert the_owner is not None and the_owner.address in found
    # which router it lives in: the one sharing its metrics endpoint
    by_metrics = {info["metricsAddress"]: address for address, info in found.items()}
    assert len(by_metrics) == 2
    before = {address: in_process_calls(metrics) for metrics, address in by_metrics.items()}

    chains = 6
    for router in ("router", "router-1"):
        assert_all_ok(await run_chains(stack, router, chains))

    after = {address: in_process_calls(metrics) for metrics, address in by_metrics.items()}
    grew = {address: after[address] - before[address] for address in found}
    # One router's hops ran in its own process; the other's went to that scheduler over
    # gRPC (had they run in its own embedded scheduler, that one would own the pool too).
    assert grew[the_owner.address] == chains * HOPS_PER_CHAIN, grew
    others = [address for address in found if address != the_owner.address]
    assert [grew[address] for address in others] == [0.0], grew


async def test_a_stopped_owner_hands_its_pool_to_the_other_router_s_scheduler(stack: LocalStack) -> None:
    found = await schedulers(stack)
    the_owner = await owner(stack)
    assert the_owner is not None
    owner_metrics = found[the_owner.address]["metricsAddress"]
    routers = {name: stack.services[name] for name in ("router", "router-1")}
    owning = next(name for name, proc in routers.items() if owner_metrics.endswith(f":{metrics_port(proc)}"))
    remaining = next(name for name in routers if name != owning)
    routers[owning].signal(signal.SIGTERM)
    assert routers[owning].wait(60) == 0, routers[owning].log_tail()

    async def moved() -> bool:
        now = await owner(stack)
        return now is not None and now.address != the_owner.address

    await poll_until(moved, timeout_s=30, what="the pool's partition to move")
    new_owner = await owner(stack)
    assert new_owner is not None
    new_metrics = (await schedulers(stack))[new_owner.address]["metricsAddress"]
    before = in_process_calls(new_metrics)
    assert_all_ok(await run_chains(stack, remaining, 4))
    assert in_process_calls(new_metrics) - before == 4 * HOPS_PER_CHAIN


def metrics_port(proc) -> str:
    """The port the router's log says its metrics are served on."""
    found = re.search(r"metrics http://[^:]+:(\d+)/metrics", proc.log_path.read_text(errors="replace"))
    assert found, proc.log_tail()
    return found.group(1)


async def owner(stack: LocalStack) -> Owner | None:
    async with stack.etcd_client() as client:
        found = await client.get(etcd.partition_key("scheduler", POOL).encode())
    return Owner.decode(found.value) if found is not None else None


def in_process_calls(metrics_address: str) -> float:
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    found = IN_PROCESS.search(text)
    return float(found.group(1)) if found else 0.0


def test_a_router_whose_scheduler_cannot_listen_says_so_and_exits() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [
                sys.executable, "-m", "inferx_router", "--insecure", "--etcd", "127.0.0.1:1", "--port", "0",
                "--metrics-port", "0", "--embedded-scheduler", "--scheduler-port", str(port),
            ],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if line.startswith("inferx-router: error:")]
    assert len(errors) == 1, done.stderr
    said = "inferx-router: error: the embedded scheduler: cannot listen on 127.0.0.1:"
    assert errors[0].startswith(f"{said}{port}"), errors
    assert "Traceback" not in done.stderr
