"""Interleaved A/B of the hop path (`inferx bench --overhead`'s measurement) between two
checkouts: two stacks side by side, each running the services of one checkout, calls
alternated between them so both see the same background load (on a shared box absolute
figures move by 20%+ from run to run; the difference between A and B does not).

    python benchmarks/overhead_ab.py --a /path/to/main --b . [--hops 4] [--count 300] \\
        [--warmup 30] [--concurrency 16] [--load-calls 1000] [--rounds 4] [--insecure] \\
        [--embedded a|b] [--final-only a|b] [--batch-events a|b] [--json FILE]

`--final-only b`: side B's chain calls ask for their result alone
(`RunChainRequest.final_only`), e.g. `--a . --b . --final-only b` measures what the
node events cost on one checkout; `--batch-events b`: side B's chain calls ask for the
events that are ready together in one message (`RunChainRequest.batch_events`).

`--embedded b`: side B's router runs the scheduler in its own process
(`inferx-router --embedded-scheduler`), e.g. `--a . --b . --embedded b` compares the
two deployments of one checkout.

Each side's services run as `python -m inferx_<service>` with PYTHONPATH set to that
checkout's `libs` and `services` (generated stubs included: run `make proto` in both
first); the client (this process) is the current checkout. Both stacks are what
`inferx bench --overhead` starts: etcd, router, scheduler, memory-pool, cache and one
SIMULATED sim worker at a very high --sim-speed, mutual TLS between services unless
--insecure.

Measured, per path (direct Generate, 1-hop chain, N-hop chain):
  * sequential latency: `warmup` + `count` calls per side, A and B alternating call by
    call (who goes first alternates too); p50/p90/p99 (nearest rank);
  * closed loop: `concurrency` callers, `load-calls` calls per side split into `rounds`
    blocks alternating A and B; calls/s over the blocks' summed wall time;
  * during the N-hop closed loop: CPU (utime + stime from /proc) per hop of every
    process of each stack, and the memory-pool calls per hop (GetUsage's `calls` where
    the memory-pool has it; else Reserve calls from its metrics, x2 for the Releases).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from inferx.bench.overhead import DIRECT, MODEL, chain_name, chain_yaml, path_name
from inferx.bench.overhead_run import READY_TIMEOUT_S, Call, chain_call, direct_call
from inferx.devstack import LocalStack, StackPorts, wait_serving
from inferx.stats import percentile
from inferx.v1 import memory_pool_pb2, memory_pool_pb2_grpc, router_pb2_grpc, worker_pb2_grpc

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class PathResult:
    latencies_ms: list[float] = field(default_factory=list)
    errors: int = 0
    load_calls: int = 0
    load_errors: int = 0
    load_wall_s: float = 0.0


@dataclass
class SideResult:
    name: str
    root: str
    paths: dict[str, PathResult] = field(default_factory=dict)
    cpu_ms_per_hop: dict[str, float] = field(default_factory=dict)
    pool_calls_per_hop: float = math.nan
    pool_calls_how: str = ""
    pool_calls_by_method: dict[str, float] = field(default_factory=dict)  # per hop


def wrapper(root: Path, state: Path, name: str) -> str:
    """An executable that runs Python with `root`'s code first on the path."""
    path = state / f"python-{name}"
    libs, services = (root / "libs").resolve(), (root / "services").resolve()
    path.write_text(f'#!/bin/sh\nPYTHONPATH={libs}:{services} exec {sys.executable} "$@"\n')
    path.chmod(0o755)
    return str(path)


def start_stack(
    state: Path, python: str, hops: int, speed: float, insecure: bool, embedded: bool = False
) -> LocalStack:
    stack = LocalStack(
        state,
        StackPorts.free(),
        lease_ttl_s=10,
        fresh_etcd=True,
        python=python,
        insecure=insecure,
        embedded_scheduler=embedded,
    )
    try:
        stack.start_etcd()
        stack.start_core()
        stack.load_models({MODEL: MODEL})
        stack.start_worker(MODEL, "sim", ["--sim-speed", str(speed)])
        wait_serving(stack.workers[0], READY_TIMEOUT_S)
        files = []
        for n in sorted({1, hops}):
            path = state / f"{chain_name(n)}.yaml"
            path.write_text(chain_yaml(n))
            files.append(path)
        stack.put_chains(files, message="overhead A/B")
        return stack
    except BaseException:
        stack.stop()
        raise


def cpu_ticks(stack: LocalStack) -> dict[str, int]:
    ticks = {}
    for name, proc in [*stack.services.items(), *((f"worker-{i}", w) for i, w in enumerate(stack.workers))]:
        try:
            fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            ticks[name] = int(fields[11]) + int(fields[12])  # utime, stime
        except (OSError, IndexError, ValueError):
            ticks[name] = 0
    return ticks


HOP_METHODS = ("Reserve", "Release", "SyncBudget")


async def pool_calls(stack: LocalStack) -> tuple[dict[str, float], str]:
    """Reserve, Release and SyncBudget calls answered so far, and how they were counted."""
    address = stack.services["memory-pool"].address
    async with stack.transport.aio_channel(address) as channel:
        usage = await memory_pool_pb2_grpc.MemoryPoolStub(channel).GetUsage(
            memory_pool_pb2.GetUsageRequest(), timeout=5
        )
    if usage.calls:
        return {m: float(usage.calls.get(m, 0)) for m in HOP_METHODS}, "counted"
    async with stack.client() as client:  # where its /metrics is: as `inferx status` says
        status = await client.status()
    metrics = next(s.metrics_address for s in status.services if s.kind == "memory-pool")
    body = await asyncio.to_thread(
        lambda: urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5).read().decode()
    )
    reserves = sum(
        float(line.rsplit(" ", 1)[1])
        for line in body.splitlines()
        if line.startswith("inferx_memory_reservations_total{")
    )
    return {"Reserve": reserves, "Release": reserves}, "Reserve from metrics, as many Releases"


async def until_ready(call: Call) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        try:
            await call()
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def timed(call: Call, result: PathResult, keep: bool) -> None:
    started = time.perf_counter()
    try:
        await call()
    except Exception:
        result.errors += 1
        return
    if keep:
        result.latencies_ms.append((time.perf_counter() - started) * 1000)


async def closed_loop(call: Call, result: PathResult, calls: int, concurrency: int) -> None:
    issued = 0

    async def caller() -> None:
        nonlocal issued
        while issued < calls:
            issued += 1
            try:
                await call()
                result.load_calls += 1
            except Exception:
                result.load_errors += 1

    started = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    result.load_wall_s += time.perf_counter() - started


async def measure(stacks: list[LocalStack], sides: list[SideResult], args: argparse.Namespace) -> None:
    options = [("grpc.max_receive_message_length", 64 << 20)]
    channels = []
    calls: list[dict[str, tuple[int, Call]]] = []
    try:
        for side, stack in zip(sides, stacks, strict=True):
            final_only = side.name.lower() in args.final_only
            batched = side.name.lower() in args.batch_events
            worker = stack.transport.aio_channel(stack.workers[0].address, options=options)
            router = stack.transport.aio_channel(stack.router_address, options=options)
            channels += [worker, router]
            metadata = (("authorization", f"Bearer {stack.admin_token}"),) if stack.admin_token else None
            plan = {DIRECT: (1, direct_call(worker_pb2_grpc.ModelWorkerStub(worker)))}
            for n in sorted({1, args.hops}):
                stub = router_pb2_grpc.RouterStub(router)
                chain = chain_call(stub, n, metadata, final_only=final_only, batched=batched)
                plan[path_name(n)] = (n, chain)
            calls.append(plan)
        for plan in calls:
            for _, call in plan.values():
                await until_ready(call)
        names = list(calls[0])
        for side in sides:
            side.paths = {name: PathResult() for name in names}
        # Sequential: every path, A and B alternating call by call.
        # A new random order of every (path, side) each round: no call always follows the
        # same one (a fixed alternation favours whichever side repeats a path back to back).
        shuffled = random.Random(0)
        pairs = [(name, k) for name in names for k in (0, 1)]
        for i in range(args.warmup + args.count):
            shuffled.shuffle(pairs)
            for name, k in pairs:
                await timed(calls[k][name][1], sides[k].paths[name], keep=i >= args.warmup)
            if i % 50 == 0:
                print(f"sequential {i}/{args.warmup + args.count}", file=sys.stderr)
        # Closed loop: blocks alternating A and B; CPU and pool calls on the longest chain.
        per_block = max(1, args.load_calls // args.rounds)
        longest = path_name(args.hops)
        for name in names:
            hops = calls[0][name][0]
            before_cpu = [cpu_ticks(s) for s in stacks] if name == longest else None
            before_calls = [await pool_calls(s) for s in stacks] if name == longest else None
            for r in range(args.rounds):
                for k in [0, 1] if r % 2 == 0 else [1, 0]:
                    await closed_loop(calls[k][name][1], sides[k].paths[name], per_block, args.concurrency)
            print(f"closed loop {name} done", file=sys.stderr)
            if before_cpu is not None and before_calls is not None:
                for k, stack in enumerate(stacks):
                    done_hops = sides[k].paths[name].load_calls * hops
                    after = cpu_ticks(stack)
                    sides[k].cpu_ms_per_hop = {
                        proc: (after[proc] - before_cpu[k].get(proc, 0)) * 1000 / CLOCK_TICKS / done_hops
                        for proc in after
                    }
                    count, how = await pool_calls(stack)
                    sides[k].pool_calls_by_method = {
                        m: (count.get(m, 0) - before_calls[k][0].get(m, 0)) / done_hops for m in HOP_METHODS
                    }
                    sides[k].pool_calls_per_hop = sum(sides[k].pool_calls_by_method.values())
                    sides[k].pool_calls_how = how
    finally:
        for channel in channels:
            await channel.close()


def pct(values: list[float], p: float) -> float:
    return percentile(values, p, method="nearest-rank") if values else math.nan


def report(sides: list[SideResult], args: argparse.Namespace) -> str:
    a, b = sides
    lines = [
        f"A = {a.root}, B = {b.root}; {'plaintext' if args.insecure else 'mutual TLS'}; "
        f"n={args.count} sequential per path and side (after {args.warmup} warm-up), "
        f"closed loop x{args.concurrency}, {args.load_calls} calls per path and side in {args.rounds} blocks",
        "",
        "| path | A p50 / p90 / p99 ms | B p50 / p90 / p99 ms | A added/hop p50 | B added/hop p50 "
        "| A hops/s | B hops/s |",
        "|---|---|---|---|---|---|---|",
    ]
    direct = {side.name: pct(side.paths[DIRECT].latencies_ms, 50) for side in sides}
    for name in a.paths:
        hops = 1 if name == DIRECT else int(name.split("-")[0])
        cells = []
        for side in sides:
            lat = side.paths[name].latencies_ms
            cells.append(f"{pct(lat, 50):.2f} / {pct(lat, 90):.2f} / {pct(lat, 99):.2f}")
        added = [
            "-"
            if name == DIRECT
            else f"{pct(side.paths[name].latencies_ms, 50) / hops - direct[side.name]:.2f}"
            for side in sides
        ]
        rates = []
        for side in sides:
            p = side.paths[name]
            rates.append(f"{p.load_calls * hops / p.load_wall_s:,.0f}" if p.load_wall_s else "-")
        lines.append(
            f"| {name} | {cells[0]} | {cells[1]} | {added[0]} | {added[1]} | {rates[0]} | {rates[1]} |"
        )
    one, longest = path_name(1), path_name(args.hops)
    if args.hops > 1:
        for side in sides:
            marginal = (pct(side.paths[longest].latencies_ms, 50) - pct(side.paths[one].latencies_ms, 50)) / (
                args.hops - 1
            )
            lines.append(f"\n{side.name}: one more hop {marginal:.2f} ms (p50)")
    lines += [
        "",
        f"CPU ms per hop, closed loop on the {longest} chain:",
        "",
        "| process | A | B |",
        "|---|---|---|",
    ]
    for proc in sorted(set(a.cpu_ms_per_hop) | set(b.cpu_ms_per_hop)):
        cpu_a, cpu_b = a.cpu_ms_per_hop.get(proc, math.nan), b.cpu_ms_per_hop.get(proc, math.nan)
        lines.append(f"| {proc} | {cpu_a:.2f} | {cpu_b:.2f} |")
    lines.append(f"| total | {sum(a.cpu_ms_per_hop.values()):.2f} | {sum(b.cpu_ms_per_hop.values()):.2f} |")
    for side in sides:
        methods = ", ".join(f"{m} {v:.3f}" for m, v in side.pool_calls_by_method.items())
        lines.append(
            f"\n{side.name}: memory-pool calls per hop {side.pool_calls_per_hop:.3f} ({methods}; "
            f"{side.pool_calls_how})"
        )
    errors = {s.name: sum(p.errors + p.load_errors for p in s.paths.values()) for s in sides}
    lines.append(f"errors: {errors}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--a", type=Path, required=True, help="checkout A (its libs/ and services/)")
    parser.add_argument("--b", type=Path, required=True, help="checkout B")
    parser.add_argument("--hops", type=int, default=4)
    parser.add_argument("--count", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--load-calls", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--speed", type=float, default=10_000.0)
    parser.add_argument("--insecure", action="store_true", help="plaintext stacks (default: mutual TLS)")
    parser.add_argument(
        "--embedded",
        choices=("a", "b"),
        action="append",
        default=[],
        help="that side's router runs the scheduler in its process (--embedded-scheduler); repeatable",
    )
    parser.add_argument(
        "--final-only",
        choices=["a", "b"],
        action="append",
        default=[],
        help="that side's chain calls ask for chain_finished alone (RunChainRequest.final_only)",
    )
    parser.add_argument(
        "--batch-events",
        choices=["a", "b"],
        action="append",
        default=[],
        help="that side's chain calls ask for their events batched (RunChainRequest.batch_events)",
    )
    parser.add_argument("--json", type=Path, help="write the raw samples here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="overhead-ab-") as tmp:
        state = Path(tmp)
        stacks: list[LocalStack] = []
        sides = [SideResult("A", str(args.a.resolve())), SideResult("B", str(args.b.resolve()))]
        try:
            for side, root in zip(sides, (args.a, args.b), strict=True):
                side_state = state / side.name
                side_state.mkdir()
                python = wrapper(root, state, side.name)
                embedded = side.name.lower() in args.embedded
                if embedded:
                    side.root += " (embedded scheduler)"
                if side.name.lower() in args.final_only:
                    side.root += " (final_only)"
                if side.name.lower() in args.batch_events:
                    side.root += " (batch_events)"
                stacks.append(start_stack(side_state, python, args.hops, args.speed, args.insecure, embedded))
            asyncio.run(measure(stacks, sides, args))
        finally:
            for stack in stacks:
                stack.stop()
    print(report(sides, args))
    if args.json:
        args.json.write_text(
            json.dumps(
                {"args": {k: str(v) for k, v in vars(args).items()}, "sides": [asdict(s) for s in sides]}
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
