"""Issue #15 figures on a live local stack (real etcd and processes, SIMULATED workers):
2 routers, 2 memory-pools, 3 caches, 3 sim workers, one model pool.

  1. affinity: worker switches per 3-hop chain with one scheduler, then with two
     (partitioned: the routers send the pool's hops to its owner), and -- with
     --compare-unpartitioned -- with two schedulers started --no-partitions (the
     round-robin split main had before);
  2. failover: kill -9 of the owning scheduler while 40 chains run: how long until the
     partition's key names another scheduler (polled every 20 ms on one etcd
     connection), and whether every chain completed.

    python benchmarks/partitions.py --seeds 3 [--lease-ttl-s 2] [--compare-unpartitioned]

Prints one line per seed and the medians; --json for the raw figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from inferx import etcd
from inferx.client import InferxClient
from inferx.devstack import LocalStack, StackPorts, read_models_file, wait_serving
from inferx.partitions import Owner

ROOT = Path(__file__).resolve().parents[1]
POOL = "tiny-llama"
CHAIN = "partition_chain"
NODE = """    - id: {id}
      type: model_inference
      model: qwen-7b
      timeout: 20000ms
      max_tokens: 12
{deps}      prompt: "Question: {{{{ inputs.query }}}}\\nStep {id}: {{{{ {ref} }}}}\\nNext:"
"""
CHAIN_TEXT = (
    f"agent_chain:\n  name: {CHAIN}\n  tier: standard\n  inputs:\n    query: {{description: q}}\n"
    "  slo: {end_to_end_latency_p99: 60000ms, availability: 99%}\n  nodes:\n"
    + NODE.format(id="draft", deps="", ref="inputs.query")
    + NODE.format(id="critique", deps="      depends_on: [draft]\n", ref="nodes.draft.output")
    + NODE.format(id="answer", deps="      depends_on: [critique]\n", ref="nodes.critique.output")
)


async def run_one(address: str, query: str):
    async with InferxClient(address, timeout_s=90) as client:
        async for event in client.run_chain(CHAIN, {"query": query}):
            if event.HasField("chain_finished"):
                return event.chain_finished
    raise RuntimeError("no ChainFinished")


async def run_many(addresses: list[str], count: int, tag: str, parallel: int) -> list:
    gate = asyncio.Semaphore(parallel)

    async def one(i: int):
        async with gate:
            return await run_one(addresses[i % len(addresses)], f"{tag} {i}: where is order {i}?")

    return list(await asyncio.gather(*(one(i) for i in range(count))))


def switches_per_chain(finished: list) -> float:
    total = 0
    for run in finished:
        workers = [hop.worker_id for hop in run.hops if hop.worker_id]
        total += sum(1 for a, b in zip(workers, workers[1:], strict=False) if a != b)
    return total / len(finished)


def ok(finished: list) -> int:
    return sum(1 for run in finished if run.status == "ok")


async def owner(client) -> Owner | None:
    found = await client.get(etcd.partition_key("scheduler", POOL).encode())
    return Owner.decode(found.value) if found is not None else None


def one_seed(seed: int, lease_ttl_s: int, chains: int, unpartitioned: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        stack = LocalStack(
            Path(tmp), StackPorts.free(), lease_ttl_s=lease_ttl_s, fresh_etcd=True, insecure=True,
            knowledge_base=ROOT / "examples" / "knowledge_base.jsonl",
        )  # fmt: skip
        try:
            sched_flags = ["--no-partitions"] if unpartitioned else []
            stack.start_etcd()
            for kind in ("router", "memory-pool", "cache"):
                stack.start_service(kind)
            stack.start_service("scheduler", sched_flags)
            extra = [stack.start_service("router", replica=1), stack.start_service("memory-pool", replica=1)]
            extra += [stack.start_service("cache", replica=r) for r in (1, 2)]
            stack.load_models(read_models_file(ROOT / "examples" / "models.yaml"))
            for _ in range(3):
                stack.start_worker(POOL, "sim", ["--sim-speed", "5"])
            for proc in [*stack.services.values(), *stack.workers]:
                wait_serving(proc, 60)
            return asyncio.run(measure(stack, seed, chains, sched_flags))
        finally:
            stack.stop()


async def measure(stack: LocalStack, seed: int, chains: int, sched_flags: list[str]) -> dict:
    routers = [stack.services["router"].address, stack.services["router-1"].address]
    async with InferxClient(routers[0]) as client:
        await client.put_chain(CHAIN_TEXT)
    one = await run_many(routers, chains, f"s{seed} one", parallel=6)
    second = stack.start_service("scheduler", sched_flags, replica=1)
    await asyncio.to_thread(wait_serving, second, 60)
    two = await run_many(routers, chains, f"s{seed} two", parallel=6)
    result = {
        "seed": seed,
        "switches_one_scheduler": switches_per_chain(one),
        "switches_two_schedulers": switches_per_chain(two),
        "ok_one": ok(one),
        "ok_two": ok(two),
    }
    if sched_flags:  # unpartitioned: no owner to kill
        return result
    async with stack.etcd_client() as client:
        first = await owner(client)
        assert first is not None
        doomed = next(p for p in stack.services.values() if p.address == first.address)
        runs = asyncio.ensure_future(run_many(routers, 40, f"s{seed} kill", parallel=40))
        await asyncio.sleep(0.4)
        doomed.signal(signal.SIGKILL)
        killed = time.monotonic()
        moved = None
        while time.monotonic() - killed < 30:
            now = await owner(client)
            if now is not None and now.address != first.address:
                moved = time.monotonic() - killed
                break
            await asyncio.sleep(0.02)
    finished = await runs
    result.update({"moved_s": moved, "ok_after_kill": ok(finished), "chains_at_kill": len(finished)})
    return result


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--chains", type=int, default=40, help="chains per phase (one, then two schedulers)")
    parser.add_argument("--lease-ttl-s", type=int, default=2)
    parser.add_argument("--compare-unpartitioned", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    modes = [False, True] if args.compare_unpartitioned else [False]
    results = {}
    for unpartitioned in modes:
        name = "unpartitioned" if unpartitioned else "partitioned"
        rows = [one_seed(seed, args.lease_ttl_s, args.chains, unpartitioned) for seed in range(args.seeds)]
        results[name] = rows
        if not args.json:
            for row in rows:
                print(name, json.dumps(row))
            for key in ("switches_one_scheduler", "switches_two_schedulers", "moved_s"):
                values = [r[key] for r in rows if r.get(key) is not None]
                if values:
                    print(f"{name} median {key}: {statistics.median(values):.3f} over {len(values)} seeds")
    if args.json:
        json.dump(results, sys.stdout, indent=2)
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
