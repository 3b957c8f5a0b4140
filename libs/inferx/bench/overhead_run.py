"""`inferx bench --overhead` (I/O): start a local stack (the one bootstrap,
`inferx.devstack.LocalStack`) with one SIMULATED sim worker at a very high
--sim-speed, then measure the direct worker call, a 1-hop and an N-hop chain through
the router, one after the other in one run. See `inferx.bench.overhead` for what is
derived from the samples.

Both paths are called with plain gRPC stubs on plain channels (no client
interceptors), so the difference between them is the serving path, not the client.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from inferx.bench.overhead import (
    DIRECT,
    MODEL,
    PROMPT,
    PathSamples,
    chain_name,
    chain_yaml,
    path_name,
)
from inferx.bench.runner import ProgressFactory
from inferx.devstack import LocalStack, StackPorts
from inferx.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

CALL_TIMEOUT_S = 30.0
READY_TIMEOUT_S = 60.0


@dataclass
class OverheadOptions:
    hops: int = 4
    count: int = 300  # sequential calls measured per path
    warmup: int = 30  # sequential calls before them, not measured
    concurrency: int = 16  # closed-loop callers
    load_calls: int = 1000  # closed-loop calls per path
    speed: float = 10_000.0  # the sim worker's --sim-speed
    policy: str | None = None  # the scheduler's --policy (default: its own)
    python: str = sys.executable  # what runs the services (a profiler wrapper, say)
    embedded_scheduler: bool = False  # the router runs the scheduler in its process
    insecure: bool = False  # the stack runs plaintext (`inferx up --insecure`), no tokens
    outside: bool = False  # also measure from a plain outside client (inferx.bench.outside)
    outside_duration_s: float = 8.0  # its closed loop per path, in seconds


class CallFailed(Exception):
    """One call that did not end as it should; the message says how."""


def start_overhead_stack(state_dir: Path, options: OverheadOptions) -> LocalStack:
    """etcd, router, scheduler, memory-pool, cache and one sim worker, all serving,
    the model mapped and the 1-hop and N-hop chains stored."""
    policy_flags = ["--policy", options.policy] if options.policy else []
    stack = LocalStack(
        state_dir,
        StackPorts.free(),
        lease_ttl_s=10,
        fresh_etcd=True,
        python=options.python,
        embedded_scheduler=options.embedded_scheduler,
        scheduler_flags=policy_flags,
        insecure=options.insecure,
    )
    try:
        stack.start_etcd()
        if policy_flags and not options.embedded_scheduler:
            stack.start_service("scheduler", policy_flags)
        stack.start_core()
        stack.load_models({MODEL: MODEL})
        stack.start_worker(MODEL, "sim", ["--sim-speed", str(options.speed)])
        stack.wait_workers(READY_TIMEOUT_S)  # SERVING, and routed: no call meets "no live worker"
        files = []
        for hops in sorted({1, options.hops}):
            path = state_dir / f"{chain_name(hops)}.yaml"
            path.write_text(chain_yaml(hops))
            files.append(path)
        stack.put_chains(files, message="inferx bench --overhead")
        return stack
    except BaseException:
        stack.stop()
        raise


Call = Callable[[], Awaitable[None]]


def direct_call(stub: worker_pb2_grpc.ModelWorkerStub) -> Call:
    request = worker_pb2.GenerateRequest(
        context=common_pb2.HopContext(run_id="overhead", hop_id="direct"),
        prompt=PROMPT,
        sampling=common_pb2.SamplingOptions(max_tokens=1),
    )

    async def call() -> None:
        last = None
        async for chunk in stub.Generate(request, timeout=CALL_TIMEOUT_S):
            last = chunk
        if last is None or not last.finished:
            raise CallFailed("Generate ended without its finished chunk")

    return call


def chain_call(
    stub: router_pb2_grpc.RouterStub,
    hops: int,
    metadata: tuple[tuple[str, str], ...] | None = None,
    final_only: bool = False,
    batched: bool = False,
) -> Call:
    request = router_pb2.RunChainRequest(chain=chain_name(hops), final_only=final_only, batch_events=batched)

    async def call() -> None:
        finished = None
        async for message in stub.RunChain(request, timeout=CALL_TIMEOUT_S, metadata=metadata):
            for event in (message, *message.following):
                if event.HasField("chain_finished"):
                    finished = event.chain_finished
        if finished is None:
            raise CallFailed("RunChain ended without chain_finished")
        if finished.status != "ok":
            raise CallFailed(f"chain {finished.status}: {finished.error}")
        if len(finished.hops) != hops:
            raise CallFailed(f"chain reported {len(finished.hops)} hops, expected {hops}")

    return call


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"


async def _until_ready(call: Call, what: str) -> None:
    """The router may not have seen the worker yet (etcd watch): retry until one call
    succeeds, then measure."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        try:
            await call()
            return
        except (grpc.aio.AioRpcError, CallFailed) as exc:
            if time.monotonic() > deadline:
                raise CallFailed(
                    f"{what} still failing after {READY_TIMEOUT_S:.0f}s: {_describe(exc)}"
                ) from None
            await asyncio.sleep(0.2)


async def measure_path(
    samples: PathSamples, call: Call, options: OverheadOptions, progress: ProgressFactory
) -> PathSamples:
    """Sequential latency (warm-up, then `count` timed calls), then closed-loop
    throughput (`concurrency` callers sharing `load_calls` calls)."""
    await _until_ready(call, samples.name)

    async def attempt() -> bool:
        try:
            await call()
            return True
        except (grpc.aio.AioRpcError, CallFailed) as exc:
            if not samples.first_error:
                samples.first_error = _describe(exc)
            return False

    clock = time.perf_counter
    with progress(f"{samples.name}: sequential", options.warmup + options.count) as advance:
        for i in range(options.warmup + options.count):
            started = clock()
            ok = await attempt()
            elapsed_ms = (clock() - started) * 1000
            if not ok:
                samples.errors += 1
            elif i >= options.warmup:
                samples.latencies_ms.append(elapsed_ms)
            advance(i + 1)

    samples.concurrency = options.concurrency
    issued = 0
    with progress(f"{samples.name}: x{options.concurrency} closed loop", options.load_calls) as advance:

        async def caller() -> None:
            nonlocal issued
            while issued < options.load_calls:
                issued += 1
                if await attempt():
                    samples.load_calls += 1
                else:
                    samples.load_errors += 1
                advance(samples.load_calls + samples.load_errors)

        started = clock()
        await asyncio.gather(*(caller() for _ in range(options.concurrency)))
        samples.load_wall_s = clock() - started
    return samples


async def measure(
    stack: LocalStack,
    options: OverheadOptions,
    progress: ProgressFactory,
    on_path: Callable[[PathSamples], None] = lambda p: None,
) -> list[PathSamples]:
    """direct, 1-hop, N-hop, N-hop batched, N-hop final, in that order; `on_path` gets each
    as soon as it is done."""
    channel_options = [("grpc.max_receive_message_length", 64 << 20)]
    done: list[PathSamples] = []
    # The stack's own certificate for both (the worker requires one; the router's public
    # port verifies none but serves TLS), and its admin token for the router.
    async with (
        stack.transport.aio_channel(stack.workers[0].address, options=channel_options) as worker,
        stack.transport.aio_channel(stack.router_address, options=channel_options) as router,
    ):
        worker_stub = worker_pb2_grpc.ModelWorkerStub(worker)
        router_stub = router_pb2_grpc.RouterStub(router)
        metadata = (("authorization", f"Bearer {stack.admin_token}"),) if stack.admin_token else None
        plan: list[tuple[PathSamples, Call]] = [(PathSamples(DIRECT, 1), direct_call(worker_stub))]
        for hops in sorted({1, options.hops}):
            plan.append((PathSamples(path_name(hops), hops), chain_call(router_stub, hops, metadata)))
        batched = PathSamples(path_name(options.hops, batched=True), options.hops, batched=True)
        plan.append((batched, chain_call(router_stub, options.hops, metadata, batched=True)))
        final = PathSamples(path_name(options.hops, final_only=True), options.hops, final_only=True)
        plan.append((final, chain_call(router_stub, options.hops, metadata, final_only=True)))
        for samples, call in plan:
            done.append(await measure_path(samples, call, options, progress))
            on_path(samples)
    return done


async def measure_outside(stack: LocalStack, options: OverheadOptions) -> list[PathSamples]:
    """The direct call, the 1-hop and the N-hop chain (events batched) from a plain
    grpc.aio client in a process of its own (`inferx.bench.outside`): `count` sequential
    calls each, then `concurrency` callers for `outside_duration_s` seconds."""
    argv = [options.python, "-m", "inferx.bench.outside", "--router", stack.router_address]
    argv += ["--worker", stack.workers[0].address, "--hops", *map(str, sorted({1, options.hops}))]
    argv += ["--count", str(options.count), "--warmup", str(options.warmup)]
    argv += ["--concurrency", str(options.concurrency), "--duration", str(options.outside_duration_s)]
    if stack.tls is not None:
        assert stack.tls.cert is not None and stack.tls.key is not None
        argv += [
            "--tls-ca",
            str(stack.tls.ca),
            "--tls-cert",
            str(stack.tls.cert),
            "--tls-key",
            str(stack.tls.key),
        ]
    env = dict(os.environ)
    if stack.admin_token:
        env["INFERX_OUTSIDE_TOKEN"] = stack.admin_token  # not on a command line others can read
    process = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env
    )
    try:
        out, err = await process.communicate()
    except BaseException:
        if process.returncode is None:
            process.kill()
            await process.wait()
        raise
    if process.returncode != 0:
        raise CallFailed(f"the outside client failed: {err.decode(errors='replace').strip()[-2000:]}")
    return [PathSamples(**path) for path in json.loads(out)["paths"]]
