"""Interleaved A/B of the OpenAI HTTP front's added latency per call (`inferx bench
--peer`'s measurement, without the peer) between two checkouts: two environments side
by side (etcd, InferX's services with the router's `--http-port`, one SIMULATED sim
worker at a very high --sim-speed serving HTTP itself), sequential one-token chat calls
round by round over A-direct, A-InferX, B-direct and B-InferX in a new random order each
round, so both sides see the same background load and no path is always next to the
same one. (A fixed alternation, reversed every other round, put each side's calls of
one path back to back every other round and favoured side B's front by ~0.3 ms in an
A/A run.)

    python benchmarks/http_front_ab.py --a /path/to/main --b . [--count 400] [--warmup 30] \\
        [--process-scheduler] [--long-chat]

--long-chat sends an agent's long call instead of a one-word chat: 61 messages (a system
prompt, 20 rounds of question, tool call and tool result) and 8 tool specs, 35 KB of
JSON, where the front's per-call cost grows with the body (reading, validating and
rendering it, the worker request). Besides latency, each side's router CPU per InferX
call is reported (the router process's CPU time over the run, from /proc, over its
calls): a steadier figure than latency on a shared box.

Each side's services run with PYTHONPATH set to that checkout's `libs` and `services`
(generated stubs included: run `make proto` in both first); the client (this process)
is the current checkout. Added = the InferX path's percentile minus the direct call's,
per side. With two stacks on the box the absolute figures are higher than one stack's:
read the difference between A and B.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from overhead_ab import wrapper  # noqa: E402

from inferx.bench.peer import INFERX, MODEL, Environment, EnvSpec, start_environment  # noqa: E402
from inferx.cli import argtypes  # noqa: E402
from inferx.sim.profile import EngineProfile  # noqa: E402
from inferx.stats import percentile  # noqa: E402


def pct(samples: list[float], q: float) -> float:
    return percentile(samples, q, method="nearest-rank")


CallPath = tuple[str, str, dict[str, str]]  # name, base URL, headers


def long_chat() -> dict[str, Any]:
    """An agent's long call (see --long-chat)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are an agent. " * 50}]
    for i in range(20):
        call = {"name": "search", "arguments": json.dumps({"query": "x" * 50})}
        messages += [
            {"role": "user", "content": "question line\n" * 40},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": f"c{i}", "type": "function", "function": call}],
            },
            {"role": "tool", "tool_call_id": f"c{i}", "content": "result data " * 60},
        ]
    parameters = {"type": "object", "properties": {"query": {"type": "string"}}}
    tools = [
        {
            "type": "function",
            "function": {"name": f"tool{i}", "description": "does things " * 10, "parameters": parameters},
        }
        for i in range(8)
    ]
    return {"model": MODEL, "messages": messages, "tools": tools, "max_tokens": 1}


def cpu_seconds(pid: int) -> float:
    """A process's CPU time so far (user + system), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(
    envs: dict[str, Environment], count: int, warmup: int, body: dict[str, Any] | None = None
) -> dict[str, list[float]]:
    paths: list[CallPath] = []
    for side, env in envs.items():
        paths.append((f"{side} direct", env.worker_urls[0], {}))
        paths.append((f"{side} InferX", env.fronts[INFERX], {"X-InferX-Program": f"ab-{side}"}))
    return await interleaved(paths, count, warmup, body)


async def interleaved(
    paths: list[CallPath], count: int, warmup: int, body: dict[str, Any] | None = None
) -> dict[str, list[float]]:
    """Sequential one-token chat calls (`body`, else a one-word chat), one per path per
    round in a new random order; the latencies (ms) after `warmup` rounds, by path name."""
    body = body or {"model": MODEL, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
    latencies: dict[str, list[float]] = {name: [] for name, _, _ in paths}
    order = random.Random(0)
    async with httpx.AsyncClient(timeout=30) as client:
        for i in range(warmup + count):
            order.shuffle(paths)  # no path always next to (and warmed by) the same one
            for name, base, headers in paths:
                started = time.perf_counter()
                reply = await client.post(f"{base}/v1/chat/completions", json=body, headers=headers)
                if reply.status_code != 200:
                    raise SystemExit(f"{name}: http {reply.status_code}: {reply.text[:200]}")
                if i >= warmup:
                    latencies[name].append((time.perf_counter() - started) * 1000)
    return latencies


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--a", type=Path, required=True, help="checkout A (its libs/ and services/)")
    parser.add_argument("--b", type=Path, required=True, help="checkout B")
    parser.add_argument("--count", type=argtypes.at_least_one, default=400, help="timed calls per path (400)")
    parser.add_argument("--warmup", type=argtypes.count, default=30, help="calls per path before those (30)")
    parser.add_argument(
        "--process-scheduler",
        action="store_true",
        help="a scheduler process per side (default: the router's embedded scheduler)",
    )
    parser.add_argument("--long-chat", action="store_true", help="an agent's 35 KB call (see above)")
    args = parser.parse_args()
    state = Path(tempfile.mkdtemp(prefix="http-front-ab-"))
    envs: dict[str, Environment] = {}
    try:
        for side, root in (("A", args.a), ("B", args.b)):
            spec = EnvSpec(
                workers=1,
                speed=10_000.0,
                profile=EngineProfile(),
                inferx=True,
                embedded_scheduler=not args.process_scheduler,
                python=wrapper(root, state, side),
            )
            envs[side] = start_environment(state / side, spec)
        routers = {side: env.stack.services["router"].pid for side, env in envs.items()}
        before = {side: cpu_seconds(pid) for side, pid in routers.items()}
        latencies = asyncio.run(
            measure(envs, args.count, args.warmup, long_chat() if args.long_chat else None)
        )
        cpu = {side: cpu_seconds(pid) - before[side] for side, pid in routers.items()}
    finally:
        for env in envs.values():
            env.stop()
    print(f"{'path':10s} {'p50':>7s} {'p90':>7s} {'p99':>7s}  (ms, {args.count} calls each)")
    for name, samples in latencies.items():
        print(f"{name:10s} {pct(samples, 50):7.2f} {pct(samples, 90):7.2f} {pct(samples, 99):7.2f}")
    for side in envs:
        direct, front = latencies[f"{side} direct"], latencies[f"{side} InferX"]
        print(
            f"{side}: InferX adds {pct(front, 50) - pct(direct, 50):.2f} ms p50, "
            f"{pct(front, 99) - pct(direct, 99):.2f} ms p99; router CPU "
            f"{cpu[side] / (args.count + args.warmup) * 1e6:.0f} us per call"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
