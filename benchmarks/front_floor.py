"""What an OpenAI front in Python costs at the least, next to InferX's and vllm-router's
(issue #16's added-latency target): one environment (etcd, InferX's services with the
router's `--http-port` and embedded scheduler, one SIMULATED sim worker at a very high
--sim-speed serving HTTP itself, vllm-router `consistent_hash` in front of it) plus a
*floor* front -- uvicorn (httptools, uvloop) reading the chat JSON and sending one
`GenerateRequest` to the worker on InferX's multiplexed `GenerateStream`
(`hopstream.StreamClient`), answering OpenAI-shaped JSON: no scheduling, no program
records, no metrics. Sequential one-token chat calls, the four paths in a new random
order each round; added = a path's p50 minus the direct call's.

    python benchmarks/front_floor.py [--count 600] [--warmup 50]

The floor is what any Python front that speaks gRPC to the workers pays here (HTTP in,
a stream message out and back, HTTP out); InferX's figure above it is its own work per
call (identity, program record, the scheduler's decision, KV accounting, metrics).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from http_front_ab import interleaved  # noqa: E402

from inferx.bench.peer import INFERX, EnvSpec, start_environment
from inferx.cli import argtypes
from inferx.devstack import free_port, port_in_use
from inferx.sim.profile import EngineProfile
from inferx.stats import percentile


def serve_floor(worker: str, port: int) -> None:
    """The floor front (run in a process of its own: `--serve-floor WORKER PORT`)."""
    import grpc
    import uvicorn

    from inferx import hopstream
    from inferx.v1 import worker_pb2, worker_pb2_grpc

    streams: list[hopstream.StreamClient] = []

    def client() -> hopstream.StreamClient:
        if not streams:  # made in the server's loop
            channel = grpc.aio.insecure_channel(worker)
            stub = worker_pb2_grpc.ModelWorkerStub(channel)
            streams.append(
                hopstream.StreamClient(stub.GenerateStream, hopstream.GENERATE, worker, lambda: channel)
            )
        return streams[0]

    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        request = json.loads(body)
        generate = worker_pb2.GenerateRequest(
            prompt="\n".join(m["content"] for m in request["messages"]),
            chat_json=json.dumps({"messages": request["messages"]}),
        )
        generate.sampling.max_tokens = request.get("max_tokens", 16)
        text, usage, reason = [], None, ""
        async for chunk in client().call(generate, 30.0):
            text.append(chunk.text)
            if chunk.finished:
                usage, reason = chunk.usage, chunk.finish_reason
        assert usage is not None
        reply = {
            "id": "floor",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": request["model"],
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "".join(text)},
                    "finish_reason": reason,
                }
            ],
            "usage": {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens},
        }
        out = json.dumps(reply).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(out)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": out})

    uvicorn.run(app, host="127.0.0.1", port=port, loop="uvloop", http="httptools", log_level="warning")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--count", type=argtypes.at_least_one, default=600, help="timed calls per path (600)")
    parser.add_argument("--warmup", type=argtypes.count, default=50, help="calls per path before those (50)")
    parser.add_argument("--serve-floor", nargs=2, metavar=("WORKER", "PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_floor:
        serve_floor(args.serve_floor[0], int(args.serve_floor[1]))
        return 0
    spec = EnvSpec(
        workers=1,
        speed=10_000.0,
        profile=EngineProfile(),
        inferx=True,
        embedded_scheduler=True,
        modes=("consistent_hash",),
    )
    env = start_environment(Path(tempfile.mkdtemp(prefix="front-floor-")), spec)
    floor = None
    try:
        port = free_port()
        floor = subprocess.Popen(
            [sys.executable, __file__, "--serve-floor", env.stack.workers[0].address, str(port)]
        )
        deadline = time.monotonic() + 30
        while not port_in_use(port):
            if floor.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the floor front did not start")
            time.sleep(0.1)
        paths = [
            ("direct", env.worker_urls[0], {}),
            ("floor (Python)", f"http://127.0.0.1:{port}", {}),
            ("InferX", env.fronts[INFERX], {"X-InferX-Program": "floor"}),
        ]
        paths += [
            (name, url, {"X-Session-ID": "floor"}) for name, url in env.fronts.items() if name != INFERX
        ]
        latencies = asyncio.run(interleaved(paths, args.count, args.warmup))
    finally:
        if floor is not None:
            floor.terminate()
            floor.wait(10)
        env.stop()
    direct = percentile(latencies["direct"], 50, method="nearest-rank")
    print(f"{'path':30s} {'p50':>7s} {'p90':>7s} {'added p50':>10s}  (ms, {args.count} calls each)")
    for name, samples in latencies.items():
        p50 = percentile(samples, 50, method="nearest-rank")
        p90 = percentile(samples, 90, method="nearest-rank")
        print(f"{name:30s} {p50:7.2f} {p90:7.2f} {p50 - direct:10.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
