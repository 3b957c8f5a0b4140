"""InferX: schedules whole AI-agent chains over inference engines."""

__version__ = "0.1.0"

# Where the CLI and the SDK find the router unless told (here: the parser needs it
# without importing the gRPC client).
DEFAULT_ROUTER = "127.0.0.1:50051"

# The largest value the protos' uint32 fields (token counts, versions, ...) hold.
MAX_UINT32 = 2**32 - 1
