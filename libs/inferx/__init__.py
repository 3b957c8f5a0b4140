"""InferX: schedules whole AI-agent chains over inference engines."""

import os

__version__ = "0.1.0"

# gRPC's fork handlers (pthread_atfork) can deadlock a fork while gRPC is shutting down a
# closed channel's resources in its own thread: a test process starting its next stack hung
# inside subprocess.Popen that way. InferX starts processes by fork + exec and never uses
# gRPC in a forked child, so it needs no fork support; set before anything imports grpc.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

# Where the CLI and the SDK find the router unless told (here: the parser needs it
# without importing the gRPC client).
DEFAULT_ROUTER = "127.0.0.1:50051"

# The largest value the protos' uint32 fields (token counts, versions, ...) hold.
MAX_UINT32 = 2**32 - 1
