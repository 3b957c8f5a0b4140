"""Fault injection with real etcd and services as processes. Each scenario runs a batch
of at least 20 concurrent chains and asserts every chain either completes or ends with
an explicit error status (none hangs, none vanishes), plus the specific outcome."""

from __future__ import annotations

import asyncio
import collections
import json
import signal
import time
from pathlib import Path

import grpc
import pytest

from inferx import etcd
from inferx.client import InferxClient
from inferx.devstack import LocalStack, ManagedProcess
from inferx.etcd import make_client
from inferx.idempotency import IdempotencyRecords
from inferx.v1 import tool_pb2, tool_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.conftest import running_sim_stack
from tests.integration.faults import ToolServer, describe, run_batch
from tests.polling import poll_until

pytestmark = pytest.mark.integration

BATCH = 20


@pytest.fixture
def stack(tmp_path: Path):
    """A fresh stack per scenario (they break things): etcd, services, 2 sim workers."""
    with running_sim_stack(tmp_path, sim_speed=2) as stack:
        yield stack


def queries(n: int = BATCH) -> list[dict[str, str]]:
    return [{"query": f"Where is my order number {i}?"} for i in range(n)]


async def running_hops(worker: ManagedProcess) -> int:
    async with grpc.aio.insecure_channel(worker.address) as channel:
        load = await worker_pb2_grpc.ModelWorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
    return load.running + load.waiting


async def when_busy(worker: ManagedProcess, sig: int) -> None:
    """Send `sig` once the worker has hops in flight, so the fault hits work under way
    (a fixed delay could hit an idle worker and test nothing)."""

    async def busy() -> bool:
        return await running_hops(worker) > 0

    await poll_until(busy, timeout_s=30, interval_s=0.02, what=f"{worker.name} to run hops")
    worker.signal(sig)


async def worker_id_of(stack: LocalStack, worker: ManagedProcess) -> str:
    async with InferxClient(stack.router_address) as client:
        status = await client.status()
    return next(w.worker_id for w in status.workers if w.address == worker.address)


async def test_sigterm_of_a_worker_fails_no_hop(stack: LocalStack) -> None:
    killer = asyncio.create_task(when_busy(stack.workers[0], signal.SIGTERM))
    outcomes = await run_batch(stack, "customer_service_agent", queries(40), stagger_s=0.02)
    await killer
    assert all(o.ok for o in outcomes), describe(outcomes)
    assert stack.workers[0].wait(30) == 0  # drained and exited cleanly
    workers_used = {h.worker_id for o in outcomes for h in o.finished.hops if h.worker_id}
    assert len(workers_used) == 2  # both served until the drain


async def test_chains_go_on_while_etcd_is_down_and_registrations_come_back(stack: LocalStack) -> None:
    async with make_client(stack.etcd_endpoint) as client:
        before = {kv.key for kv in await client.get_prefix(etcd.SERVICES.encode())}
    assert len(before) == 6  # router, scheduler, memory-pool, cache, 2 workers
    assert stack.etcd is not None
    stack.etcd.stop()
    down_at = time.monotonic()
    try:
        # Down for twice every lease TTL (3 s here), a batch of chains every 2 s: services
        # keep what they hold (a duration, not a synchronisation).
        batches = 0
        while batches < 3 or time.monotonic() - down_at < 2 * stack.lease_ttl_s:
            outcomes = await run_batch(stack, "customer_service_agent", queries())
            assert all(o.ok for o in outcomes), describe(outcomes)
            batches += 1
            await asyncio.sleep(2)
    finally:
        stack.fresh_etcd = False
        stack.start_etcd()

    async def restored() -> bool:
        async with make_client(stack.etcd_endpoint) as client:
            try:
                now = {kv.key for kv in await client.get_prefix(etcd.SERVICES.encode())}
            except etcd.ETCD_DOWN_ERRORS:
                return False
            # The very same registrations: every process keeps its instance id, and
            # re-puts its own key under a new lease.
            return now == before

    await poll_until(restored, timeout_s=30, interval_s=0.5, what="the registrations to come back")
    outcomes = await run_batch(stack, "customer_service_agent", queries())
    assert all(o.ok for o in outcomes), describe(outcomes)
    for proc in [*stack.services.values(), *stack.workers]:
        assert proc.alive(), f"{proc.name} died during the etcd outage"


async def test_cache_killed_chains_finish_uncached(stack: LocalStack) -> None:
    stack.services["cache"].signal(signal.SIGKILL)
    stack.services["cache"].wait(5)
    outcomes = await run_batch(stack, "customer_service_agent", queries())
    assert all(o.ok for o in outcomes), describe(outcomes)
    for o in outcomes:
        tool = next(h for h in o.finished.hops if h.node_id == "knowledge_retrieval")
        assert tool.cache_unavailable and not tool.cache_hit


SLOW_TOOL_CHAIN = """
agent_chain:
  name: slow_tool_chain
  slo: {end_to_end_latency_p99: 2s}
  inputs: [q]
  nodes:
    - id: lookup
      type: tool_call
      tool: slow_lookup
      timeout: 300ms
      retries: 1
      fallback_output: "no live data; answer from general knowledge"
      arguments: {q: "{{ inputs.q }}"}
    - id: answer
      type: model_inference
      model: qwen-7b
      timeout: 1s
      max_tokens: 4
      depends_on: [lookup]
      prompt: "Context: {{ nodes.lookup.output }} Question: {{ inputs.q }}"
"""


class SlowTool(tool_pb2_grpc.ToolServiceServicer):
    def __init__(self) -> None:
        self.calls = 0

    async def Invoke(self, request, context):
        self.calls += 1
        await asyncio.sleep(5)  # far beyond the node's timeout
        return tool_pb2.ToolResponse(result_json='"late"')


async def test_tool_that_times_out_takes_the_fallback_within_the_slo(sim_stack: LocalStack) -> None:
    async with ToolServer(sim_stack, "slow_lookup", SlowTool()):
        async with InferxClient(sim_stack.router_address) as client:
            await client.put_chain(SLOW_TOOL_CHAIN)
        outcomes = await run_batch(sim_stack, "slow_tool_chain", [{"q": f"q{i}"} for i in range(BATCH)])
    assert all(o.ok for o in outcomes), describe(outcomes)
    for o in outcomes:
        lookup = o.finished.hops[0]
        assert lookup.degradation == "static_fallback" and lookup.degradation_reason == "timeout"
        assert lookup.output.startswith("no live data")
        assert o.finished.hops[1].status == "ok"
        assert o.finished.slo_met, o.finished.latency_ms


PAY_CHAIN = """
agent_chain:
  name: pay_chain
  slo: {end_to_end_latency_p99: 5s}
  inputs: [amount]
  nodes:
    - id: charge
      type: tool_call
      tool: payments
      idempotent: false
      timeout: 2s
      arguments: {amount: "{{ inputs.amount }}"}
"""


class FlakyPayments(tool_pb2_grpc.ToolServiceServicer):
    """Charges, then loses the first reply for every 4th amount: the classic
    double-charge trap. (Losing every reply would, rightly, open the circuit breaker.)"""

    def __init__(self, records: IdempotencyRecords) -> None:
        self.records = records
        self.charges: collections.Counter[str] = collections.Counter()
        self.replies_lost: set[str] = set()
        self.lost_amounts: set[str] = set()

    async def Invoke(self, request, context):
        key = request.idempotency_key

        async def charge() -> dict:
            self.charges[key] += 1
            return {"charged": json.loads(request.arguments_json)["amount"]}

        result = await self.records.run_once("payments", key, charge)
        amount = json.loads(request.arguments_json)["amount"]
        if int(amount) % 4 == 0 and key not in self.replies_lost:
            self.replies_lost.add(key)
            self.lost_amounts.add(amount)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset after charging")
        return tool_pb2.ToolResponse(result_json=json.dumps(result))


async def run_payments(stack: LocalStack, *, idempotency_keys: bool):
    """BATCH pay_chain runs against FlakyPayments registered with or without key support."""
    records = IdempotencyRecords(stack.services["cache"].address, stack.transport)
    payments = FlakyPayments(records)
    amounts = [{"amount": str(i)} for i in range(BATCH)]
    try:
        async with ToolServer(stack, "payments", payments, idempotency_keys=idempotency_keys):
            async with InferxClient(stack.router_address) as client:
                await client.put_chain(PAY_CHAIN)
            outcomes = await run_batch(stack, "pay_chain", amounts, stagger_s=0.03)
    finally:
        await records.close()
    return payments, amounts, outcomes


async def test_non_idempotent_tool_failing_after_its_side_effect_acts_once(sim_stack: LocalStack) -> None:
    payments, amounts, outcomes = await run_payments(sim_stack, idempotency_keys=True)
    assert all(o.ok for o in outcomes), describe(outcomes)
    assert len(payments.charges) == BATCH
    assert set(payments.charges.values()) == {1}  # every run charged exactly once
    assert len(payments.lost_amounts) == BATCH // 4
    for inputs, o in zip(amounts, outcomes, strict=True):
        lost = inputs["amount"] in payments.lost_amounts
        assert o.finished.hops[0].retries == (1 if lost else 0)
        assert json.loads(o.finished.hops[0].output) == {"charged": inputs["amount"]}


async def test_non_idempotent_tool_without_key_support_is_not_retried(sim_stack: LocalStack) -> None:
    payments, amounts, outcomes = await run_payments(sim_stack, idempotency_keys=False)
    assert set(payments.charges.values()) == {1}
    for inputs, o in zip(amounts, outcomes, strict=True):
        lost = inputs["amount"] in payments.lost_amounts
        assert o.finished.status == ("error" if lost else "ok")
        assert o.finished.hops[0].retries == 0


LONG_HOP_CHAIN = """
agent_chain:
  name: long_hop_chain
  slo: {end_to_end_latency_p99: 10s}
  inputs: [q]
  nodes:
    - {id: ramble, type: model_inference, model: qwen-7b, timeout: 300ms, max_tokens: 2000,
       prompt: "Talk at length about {{ inputs.q }}"}
"""


async def test_abandoned_hop_stops_using_the_engine(sim_stack: LocalStack) -> None:
    """The node timeout travels as the gRPC deadline to the worker, whose engine request
    is aborted: nothing keeps generating for a caller that has gone."""
    async with InferxClient(sim_stack.router_address) as client:
        await client.put_chain(LONG_HOP_CHAIN)
    outcomes = await run_batch(sim_stack, "long_hop_chain", [{"q": str(i)} for i in range(BATCH)])
    assert all(o.finished.status in ("timeout", "error") for o in outcomes), describe(outcomes)
    assert all(o.finished.hops[0].status == "timeout" for o in outcomes), describe(outcomes)

    async def engines_idle() -> bool:
        return all([await running_hops(worker) == 0 for worker in sim_stack.workers])

    # Left alone, 2000 tokens take the sim engine seconds more (2 ms a token at speed
    # 5); idle within 1 s means the requests were aborted, not run to the end.
    await poll_until(engines_idle, timeout_s=1.0, interval_s=0.05, what="the engines to drop abandoned hops")


async def test_kill_9_of_a_worker_mid_run_chains_finish_on_the_other(stack: LocalStack) -> None:
    victim, survivor = stack.workers
    victim_id, survivor_id = await worker_id_of(stack, victim), await worker_id_of(stack, survivor)
    killer = asyncio.create_task(when_busy(victim, signal.SIGKILL))
    outcomes = await run_batch(stack, "customer_service_agent", queries(40), stagger_s=0.02)
    await killer
    assert all(o.ok for o in outcomes), describe(outcomes)
    # A hop re-dispatched after its worker died mid-reply has the survivor's reply alone,
    # not the dead worker's first words joined to it: the sim engine's tokens are 4
    # characters each.
    replies = [h for o in outcomes for h in o.finished.hops if h.node_type == "model_inference"]
    assert replies and all(len(h.output) == 4 * h.usage.completion_tokens for h in replies), [
        (h.node_id, h.worker_id, len(h.output), h.usage.completion_tokens)
        for h in replies
        if len(h.output) != 4 * h.usage.completion_tokens
    ]
    survivor_hops = [h.worker_id for o in outcomes[-10:] for h in o.finished.hops if h.worker_id]
    assert set(survivor_hops) == {survivor_id}  # the late runs all went to the surviving worker
    async with InferxClient(stack.router_address) as client:
        status = await client.status()
    # Killed with hops in flight, their transport failure opened its breaker (the hops
    # were re-dispatched); a half-open probe to it can only fail again.
    assert status.circuit_breakers[f"worker:{victim_id}"] in ("open", "half_open"), status.circuit_breakers

    async def victim_unregistered() -> bool:
        async with InferxClient(stack.router_address) as client:
            return victim_id not in {w.worker_id for w in (await client.status()).workers}

    # ... and it leaves the worker list when its etcd lease ends.
    await poll_until(victim_unregistered, timeout_s=stack.lease_ttl_s + 5, what="the dead worker to leave")


@pytest.fixture
def long_lease_stack(tmp_path: Path):
    """Leases of a minute: only health checks can take a silent worker out quickly."""
    with running_sim_stack(tmp_path, sim_speed=2, lease_ttl_s=60) as stack:
        try:
            yield stack
        finally:
            for worker in stack.workers:
                worker.signal(signal.SIGCONT)


async def test_worker_that_stops_answering_leaves_scheduling_before_its_lease_expires(
    long_lease_stack: LocalStack,
) -> None:
    stack = long_lease_stack
    frozen = stack.workers[0]
    frozen_id = await worker_id_of(stack, frozen)
    frozen.signal(signal.SIGSTOP)  # alive and registered, but answering nothing

    async def taken_out() -> bool:  # after three failed health checks, one per second
        async with InferxClient(stack.router_address) as client:
            status = await client.status()
        return status.circuit_breakers.get(f"worker:{frozen_id}") == "open"

    await poll_until(taken_out, timeout_s=15, interval_s=0.2, what="the frozen worker's breaker to open")
    outcomes = await run_batch(stack, "customer_service_agent", queries())
    assert all(o.ok for o in outcomes), describe(outcomes)
    async with InferxClient(stack.router_address) as client:
        status = await client.status()
    assert len(status.workers) == 2  # still registered in etcd ...
    assert status.circuit_breakers[f"worker:{frozen_id}"] in ("open", "half_open")
    used = {h.worker_id for o in outcomes for h in o.finished.hops if h.worker_id}
    assert frozen_id not in used  # ... but no hop went to it


PATIENT_CHAIN = """
agent_chain:
  name: patient_answer
  tier: standard
  inputs:
    query: {description: "the customer's message"}
  slo: {end_to_end_latency_p99: 120000ms}
  nodes:
    - id: answer
      type: model_inference
      model: qwen-7b
      timeout: 60000ms
      max_tokens: 48
      prompt: "Answer: {{ inputs.query }}"
"""


async def test_hops_running_on_a_worker_that_freezes_are_re_dispatched_without_waiting_for_keepalive(
    long_lease_stack: LocalStack,
) -> None:
    stack = long_lease_stack
    # Node timeouts far longer than the example chain's 500 ms, so a hop stuck on the
    # frozen worker waits for whatever gives it up first.
    chain = stack.state_dir / "patient.yaml"
    chain.write_text(PATIENT_CHAIN)
    await asyncio.to_thread(stack.put_chains, [chain])  # (it runs its own event loop)
    frozen = stack.workers[0]
    freezer = asyncio.create_task(when_busy(frozen, signal.SIGSTOP))  # hops in flight on it
    started = asyncio.get_running_loop().time()
    outcomes = await run_batch(stack, "patient_answer", queries(30), stagger_s=0.02)
    took_s = asyncio.get_running_loop().time() - started
    await freezer
    assert all(o.ok for o in outcomes), describe(outcomes)
    # Given up after 5 silent health checks (~5 s) and re-dispatched; the connection's
    # keepalive alone would have taken 40 s (a 30 s ping, 10 s for its answer).
    assert took_s < 30, f"the batch took {took_s:.1f}s: the frozen worker's hops waited for keepalive"
    replies = [h for o in outcomes for h in o.finished.hops if h.node_type == "model_inference"]
    assert all(len(h.output) == 4 * h.usage.completion_tokens for h in replies)  # no void text joined


async def test_memory_pool_down_chains_continue_conservatively(stack: LocalStack) -> None:
    stack.services["memory-pool"].signal(signal.SIGKILL)
    stack.services["memory-pool"].wait(5)
    outcomes = await run_batch(stack, "customer_service_agent", queries())
    assert all(o.ok for o in outcomes), describe(outcomes)
    async with InferxClient(stack.router_address) as client:
        status = await client.status()
    assert any("half concurrency" in p for p in status.problems), status.problems
