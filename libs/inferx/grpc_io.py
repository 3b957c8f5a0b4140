"""gRPC's I/O layer for InferX's processes, chosen before grpc loads.

Recent grpc cores run each connection's reads and writes on the threads of their
EventEngine; grpc.aio then learns of each finished operation through its own poller
thread, so every message crosses threads twice before the event loop sees it. With the
EventEngine client and listener experiments off, grpc's polling I/O does the reads and
writes on that poller thread itself: one crossing fewer each way, on every hop's messages
(issues #14 and #16, 2-core box, one run each way: the embedded scheduler's 4-hop chain
1,315 -> 1,516 hops/s; a minimal Python front over a worker stream 0.63 -> 0.39 ms added
per call; docs/benchmarks.md).

grpc reads `GRPC_EXPERIMENTS` once, when its extension module loads, so this runs before
anything imports grpc: each service package and the CLI package call it first thing. An
operator's own `GRPC_EXPERIMENTS` wins (set it empty for grpc's defaults). A grpc that no
longer knows these experiments logs "Unknown experiment" once and runs as it would.
"""

from __future__ import annotations

import os

POLLED_IO = "-event_engine_client,-event_engine_listener"


def use_polled_io() -> None:
    os.environ.setdefault("GRPC_EXPERIMENTS", POLLED_IO)
