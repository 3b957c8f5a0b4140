"""`inferx bench --overhead --outside`: the same comparison from a plain outside client
(issue #45), in a process of its own.

What a team calling InferX from its own code would write: a `grpc.aio` channel, the
generated `inferx.v1.Router` stub (no SDK, no interceptors, none of the bench's code on
the call path), `RunChainRequest.batch_events = true`, one channel shared by every
caller. Per path: `count` sequential calls (after `warmup`), then a closed loop of
`concurrency` callers for `duration_s` seconds (each starts its next call when its last
one ended; calls still in flight at the end are finished and not counted). The worker's
`Generate` is called the same way, the reference each hop is compared with.

Run as `python -m inferx.bench.outside --router ADDR --worker ADDR ...`: it prints one
JSON object, {"paths": [PathSamples...]}, on stdout. Only grpc, the generated stubs and
the standard library are imported on its path (`inferx.bench.overhead` holds no I/O).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from pathlib import Path

import grpc

from inferx.bench.overhead import DIRECT, MODEL, PROMPT, PathSamples, chain_name, path_name
from inferx.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

OUTSIDE = "outside"  # PathSamples.client of these paths
CALL_TIMEOUT_S = 30.0
READY_TIMEOUT_S = 60.0

Call = Callable[[], Awaitable[None]]


class CallFailed(Exception):
    pass


def _channel(address: str, ca: bytes | None, cert: bytes | None, key: bytes | None) -> grpc.aio.Channel:
    if ca is None:
        return grpc.aio.insecure_channel(address)
    credentials = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
    return grpc.aio.secure_channel(address, credentials)


def _direct(stub: worker_pb2_grpc.ModelWorkerStub) -> Call:
    request = worker_pb2.GenerateRequest(
        context=common_pb2.HopContext(run_id="outside", hop_id="direct"),
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


def _chain(stub: router_pb2_grpc.RouterStub, chain: str, hops: int, metadata) -> Call:
    request = router_pb2.RunChainRequest(chain=chain, batch_events=True)

    async def call() -> None:
        finished = None
        async for message in stub.RunChain(request, timeout=CALL_TIMEOUT_S, metadata=metadata):
            for event in (message, *message.following):
                if event.HasField("chain_finished"):
                    finished = event.chain_finished
        if finished is None:
            raise CallFailed("RunChain ended without chain_finished")
        if finished.status != "ok" or len(finished.hops) != hops:
            raise CallFailed(f"chain {finished.status} with {len(finished.hops)} hops: {finished.error}")

    return call


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"


async def measure_path(
    samples: PathSamples, call: Call, *, count: int, warmup: int, concurrency: int, duration_s: float
) -> PathSamples:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:  # the router may not have seen the worker yet
        try:
            await call()
            break
        except (grpc.aio.AioRpcError, CallFailed) as exc:
            if time.monotonic() > deadline:
                raise CallFailed(f"{samples.name} still failing: {_describe(exc)}") from None
            await asyncio.sleep(0.2)

    async def attempt() -> bool:
        try:
            await call()
            return True
        except (grpc.aio.AioRpcError, CallFailed) as exc:
            samples.first_error = samples.first_error or _describe(exc)
            return False

    clock = time.perf_counter
    for i in range(warmup + count):
        started = clock()
        ok = await attempt()
        if not ok:
            samples.errors += 1
        elif i >= warmup:
            samples.latencies_ms.append((clock() - started) * 1000)

    samples.concurrency = concurrency
    started = clock()
    end = started + duration_s

    async def caller() -> None:
        while clock() < end:
            ok = await attempt()
            if clock() > end:
                return  # finished after the window: not counted
            if ok:
                samples.load_calls += 1
            else:
                samples.load_errors += 1

    await asyncio.gather(*(caller() for _ in range(concurrency)))
    samples.load_wall_s = duration_s
    return samples


async def run(args: argparse.Namespace) -> list[PathSamples]:
    read = lambda p: Path(p).read_bytes() if p else None  # noqa: E731
    ca, cert, key = read(args.tls_ca), read(args.tls_cert), read(args.tls_key)
    token = args.token or os.environ.get("INFERX_OUTSIDE_TOKEN", "")
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    options = dict(
        count=args.count, warmup=args.warmup, concurrency=args.concurrency, duration_s=args.duration
    )
    done = []
    async with (
        _channel(args.router, ca, None, None) as router,
        _channel(args.worker, ca, cert, key) as worker,
    ):
        plan: list[tuple[PathSamples, Call]] = []
        if not args.no_direct:
            plan.append(
                (PathSamples(DIRECT, 1, client=OUTSIDE), _direct(worker_pb2_grpc.ModelWorkerStub(worker)))
            )
        stub = router_pb2_grpc.RouterStub(router)
        for hops in args.hops:
            samples = PathSamples(path_name(hops, batched=True), hops, batched=True, client=OUTSIDE)
            plan.append((samples, _chain(stub, args.chain_prefix + chain_name(hops), hops, metadata)))
        for samples, call in plan:
            done.append(await measure_path(samples, call, **options))
    return done


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m inferx.bench.outside", description="a plain outside client of the router"
    )
    parser.add_argument("--router", required=True, metavar="HOST:PORT")
    parser.add_argument("--worker", required=True, metavar="HOST:PORT", help="the worker called directly")
    parser.add_argument(
        "--hops", type=int, nargs="*", default=[1, 4], help="chain lengths (1 4; none: direct only)"
    )
    parser.add_argument("--chain-prefix", default="", help="chain names: PREFIX + overhead_N_hop")
    parser.add_argument("--count", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--duration", type=float, default=8.0, help="closed-loop seconds per path (8)")
    parser.add_argument("--no-direct", action="store_true", help="skip the worker's Generate")
    parser.add_argument("--tls-ca", help="TLS: the stack's CA (the router and the worker)")
    parser.add_argument("--tls-cert", help="the worker's mutual TLS: a certificate of the stack's CA")
    parser.add_argument("--tls-key")
    parser.add_argument("--token", help="the router's API token (env INFERX_OUTSIDE_TOKEN)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        paths = asyncio.run(run(args))
    except CallFailed as exc:
        print(f"outside client: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({"model": MODEL, "paths": [asdict(p) for p in paths]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
