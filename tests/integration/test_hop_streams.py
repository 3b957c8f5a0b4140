"""Hops on long-lived multiplexed streams (issue #14, `inferx.hopstream`) with real
processes: chains run through `Scheduler.Hops` and `ModelWorker.GenerateStream`, and a
scheduler killed with hops in flight gives the same outcome with streams as with one
call per hop (`--no-hop-streams`): its hops fail UNAVAILABLE and the router retries them
on the other scheduler."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from inferx.client import InferxClient
from inferx.devstack import LocalStack, ManagedProcess, read_models_file, wait_serving
from inferx.v1 import scheduler_pb2, scheduler_pb2_grpc
from tests.conftest import EXAMPLES, make_stack, started
from tests.integration.faults import describe, run_batch
from tests.integration.test_observability import metrics_addresses, scrape, total
from tests.polling import poll_until

pytestmark = pytest.mark.integration

HOPS = "/inferx.v1.Scheduler/Hops"
GENERATE_STREAM = "/inferx.v1.ModelWorker/GenerateStream"

# Two model hops in a row, each retried on failure (model nodes are not by default).
RETRIED_CHAIN = """
agent_chain:
  name: retried_hops
  retry_budget: 20
  slo: {end_to_end_latency_p99: 30000ms, availability: 99%}
  nodes:
    - id: first
      type: model_inference
      model: tiny-llama
      timeout: 10000ms
      retries: 10
      max_tokens: 60
      prompt: "Say something about {{ inputs.q }}"
    - id: second
      type: model_inference
      model: tiny-llama
      timeout: 10000ms
      retries: 10
      max_tokens: 20
      depends_on: [first]
      prompt: "Summarise: {{ nodes.first.output }}"
"""


@contextlib.contextmanager
def two_scheduler_stack(tmp: Path, streams: bool) -> Iterator[LocalStack]:
    """etcd, every service with two schedulers, two sim workers; the router and the
    schedulers with or without hop streams."""
    flags = [] if streams else ["--no-hop-streams"]

    def start(stack: LocalStack) -> None:
        stack.start_etcd()
        stack.start_service("router", flags)
        stack.start_service("scheduler", flags)
        stack.start_service("scheduler", flags, replica=1)
        stack.start_core()
        wait_serving(stack.services["scheduler-1"], 60)
        stack.load_models(read_models_file(EXAMPLES / "models.yaml"))
        for _ in range(2):
            stack.start_worker("tiny-llama", "sim", ["--sim-speed", "2"])

    with started(make_stack(tmp), start) as stack:
        yield stack


async def stream_calls(stack: LocalStack, kind: str, method: str) -> tuple[float, float]:
    """(streams opened, calls on them) to every `kind` service, from their /metrics."""
    opened = calls = 0.0
    for address in (await metrics_addresses(stack))[kind]:
        samples = await asyncio.to_thread(scrape, address)
        opened += total(samples, "inferx_hop_streams_opened_total", method=method)
        calls += total(samples, "inferx_hop_stream_calls_total", method=method)
    return opened, calls


def model_hops(outcomes) -> int:
    return sum(1 for o in outcomes for hop in o.finished.hops if hop.model)


async def test_chains_run_on_one_stream_per_peer(sim_stack: LocalStack) -> None:
    before_hops = await stream_calls(sim_stack, "scheduler", HOPS)
    before_generate = await stream_calls(sim_stack, "worker", GENERATE_STREAM)
    outcomes = await run_batch(
        sim_stack, "customer_service_agent", [{"query": f"order {i}?"} for i in range(24)]
    )
    assert all(o.ok for o in outcomes), describe(outcomes)
    hops = model_hops(outcomes)
    assert hops >= 48
    opened, calls = await stream_calls(sim_stack, "scheduler", HOPS)
    # Every hop went to the scheduler on the router's stream, and 24 concurrent chains
    # shared it (a stream per hop would have opened dozens).
    assert calls - before_hops[1] == hops
    assert opened <= 2
    opened, calls = await stream_calls(sim_stack, "worker", GENERATE_STREAM)
    assert calls - before_generate[1] == hops  # and to the workers on the scheduler's
    assert opened <= 2 * 2  # one per worker, twice at most


async def scheduler_running(proc: ManagedProcess) -> int:
    async with grpc.aio.insecure_channel(proc.address) as channel:
        status = await scheduler_pb2_grpc.SchedulerStub(channel).GetSchedulerStatus(
            scheduler_pb2.SchedulerStatusRequest(), timeout=5
        )
    return sum(pool.running for pool in status.pools)


@pytest.fixture(params=[True, False], ids=["streams", "calls"])
def two_schedulers(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[LocalStack, bool]]:
    with two_scheduler_stack(tmp_path, request.param) as stack:
        yield stack, request.param


async def test_scheduler_killed_mid_hop_its_hops_are_retried_on_the_other(
    two_schedulers: tuple[LocalStack, bool],
) -> None:
    stack, streams = two_schedulers
    async with InferxClient(stack.router_address) as client:
        await client.put_chain(RETRIED_CHAIN)
    schedulers = [stack.services["scheduler"], stack.services["scheduler-1"]]
    killed: list[ManagedProcess] = []

    async def kill_when_busy() -> None:
        # The pool's hops go to the scheduler that owns it (issue #15's partitions): kill
        # whichever one is running them.
        async def busy() -> bool:
            for proc in schedulers:
                if await scheduler_running(proc) > 0:
                    killed.append(proc)
                    return True
            return False

        await poll_until(busy, timeout_s=30, interval_s=0.01, what="a scheduler to run hops")
        killed[0].signal(signal.SIGKILL)

    killer = asyncio.create_task(kill_when_busy())
    outcomes = await run_batch(stack, "retried_hops", [{"q": str(i)} for i in range(30)], stagger_s=0.02)
    await killer
    # The hops in flight on the killed scheduler failed UNAVAILABLE (the stream broke,
    # or the call did) and were sent again: re-submitted by the router to the pool's
    # next owner, or retried by the chain. Every chain finished.
    assert all(o.ok for o in outcomes), describe(outcomes)
    retried = sum(hop.retries for o in outcomes for hop in o.finished.hops)
    (router_metrics,) = (await metrics_addresses(stack))["router"]
    resent = total(await asyncio.to_thread(scrape, router_metrics), "inferx_router_hop_resends_total")
    assert retried + resent >= 1, describe(outcomes)
    (survivor,) = [proc for proc in schedulers if proc is not killed[0]]
    async with InferxClient(stack.router_address) as client:
        status = await client.status()
    (metrics,) = [s.metrics_address for s in status.services if s.address == survivor.address]
    samples = await asyncio.to_thread(scrape, metrics)
    calls = total(samples, "inferx_hop_stream_calls_total", method=HOPS)
    if streams:
        assert calls > 0  # the survivor served hops on a stream
    else:
        assert calls == 0  # one SubmitHop call per hop, as before
