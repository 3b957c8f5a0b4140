"""`devstack.wait_serving` (how `inferx up`, `inferx bench` and the tests wait for each
service they start) sees a server that starts listening after its first attempt, under
the gRPC I/O every `inferx` command runs with (`inferx.grpc_io`: grpc's polling I/O).

There, a synchronous channel whose first connection was refused only connects again
while some thread polls it, and a fail-fast health check that fails at once polls
nothing: `inferx bench --overhead` waited ~15 s per service for servers up in one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

LATE_SERVER = """
import time
from concurrent import futures
import grpc
from grpc_health.v1 import health, health_pb2_grpc
time.sleep(1.5)  # the client's first attempts are refused
server = grpc.server(futures.ThreadPoolExecutor(2))
health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
server.add_insecure_port("127.0.0.1:%d")
server.start()
server.wait_for_termination(60)
"""

CLIENT = """
import inferx.cli  # grpc's polling I/O, set before grpc loads, as every `inferx` command runs
import os, sys
from pathlib import Path
from inferx.devstack import ManagedProcess, free_port, wait_serving
assert "-event_engine_client" in os.environ["GRPC_EXPERIMENTS"]
port = free_port()
argv = [sys.executable, "-c", sys.argv[1] % port]
late = ManagedProcess("late", argv, Path(sys.argv[2]), address=f"127.0.0.1:{port}")
late.start()
try:
    print(f"serving after {wait_serving(late, 8.0):.1f}s")
finally:
    late.stop()
"""


def test_a_server_that_starts_late_is_seen_under_the_clis_grpc_io(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", CLIENT, LATE_SERVER, str(tmp_path / "late.log")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    # Before: "late not serving after 8s" (the channel stayed in its connect backoff).
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("serving after ")
