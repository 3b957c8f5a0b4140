"""InferX's memory-pool service."""

from inferx.grpc_io import use_polled_io

use_polled_io()  # before anything loads grpc: it reads its I/O experiments at import
