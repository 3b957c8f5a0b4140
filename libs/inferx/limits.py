"""The router's limits on what callers send, and the one wording of a refusal.

Each limit is a router setting (`inferx-router --help`, docs/limits.md). A request over
one is INVALID_ARGUMENT (HTTP 400, or 413 for the body): it is wrong by its size, so
sending it again never helps, unlike RESOURCE_EXHAUSTED (load: retry later). The
message names what was too big, by how much, and the flag that sets the limit:

    inputs: 3.2 MiB exceeds the router's limit of 1 MiB (--max-input-bytes)

The one exception is the gRPC message size itself (`--max-request-bytes`): gRPC refuses
a message over it before any InferX code runs, with its own RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from inferx.errors import InvalidArgument

KIB = 1024
MIB = 1024 * KIB

# A chain config is stored in etcd as one JSON record per version, and etcd refuses a
# request over 1.5 MiB by default (its --max-request-bytes); a record is kept well
# under that whatever the router's --max-config-bytes says.
MAX_STORED_CHAIN_BYTES = 1_000_000


def format_bytes(size: int) -> str:
    """`17 bytes`, `4.5 KiB`, `3.2 MiB`, `1 MiB`: short, binary units."""
    if size < KIB:
        return f"{size} byte" + ("" if size == 1 else "s")
    for unit, scale in (("GiB", 1024 * MIB), ("MiB", MIB), ("KiB", KIB)):
        if size >= scale:
            return f"{size / scale:.1f}".removesuffix(".0") + f" {unit}"
    raise AssertionError("unreachable")


def describe_excess(size: int, limit: int, *, unit: str = "bytes") -> tuple[str, str]:
    """(size, limit) as text; exact counts when rounding would make them look equal."""
    if unit != "bytes":
        return f"{size:,} {unit}", f"{limit:,}"
    shown, cap = format_bytes(size), format_bytes(limit)
    if shown == cap:
        return f"{size:,} bytes", f"{limit:,} bytes"
    return shown, cap


class LimitExceeded(InvalidArgument):
    """A request over one of the router's limits (INVALID_ARGUMENT)."""

    def __init__(
        self, what: str, size: int, limit: int, flag: str, *, unit: str = "bytes", message: str = ""
    ) -> None:
        shown, cap = describe_excess(size, limit, unit=unit)
        super().__init__(message or f"{what}: {shown} exceeds the router's limit of {cap} ({flag})")
        self.what = what
        self.size = size
        self.limit = limit
        self.flag = flag


def limit_problem(what: str, size: int, limit: int, flag: str, *, unit: str = "bytes") -> str:
    """The same sentence as `LimitExceeded`, as one line of a longer report."""
    return LimitExceeded(what, size, limit, flag, unit=unit).message


@dataclass(frozen=True)
class RequestLimits:
    """The router's limits; the defaults are `inferx-router`'s (its settings carry the
    flags). Chain-config limits are applied by `inferx.chain.validate.load_chain_text`."""

    max_input_bytes: int = 1 * MIB
    max_inputs: int = 64
    max_config_bytes: int = 256 * KIB
    max_nodes: int = 256
    max_output_tokens: int = 16_384
    http_max_body_bytes: int = 4 * MIB
    # max_tokens of a program call that sets none (0: none, the reply runs until the
    # model stops or its context is full, as on OpenAI and vLLM)
    default_output_tokens: int = 0

    def check_inputs(self, inputs: Mapping[str, str]) -> None:
        """RunChain's inputs: how many, and their total size (names and values, UTF-8)."""
        if len(inputs) > self.max_inputs:
            raise LimitExceeded("inputs", len(inputs), self.max_inputs, "--max-inputs", unit="inputs")
        total = 0
        for name, value in inputs.items():
            total += len(name.encode()) + len(value.encode())
        if total > self.max_input_bytes:
            raise LimitExceeded("inputs", total, self.max_input_bytes, "--max-input-bytes")

    def config_problem(self, text: str) -> str | None:
        """The size of a chain config's text, over --max-config-bytes, or None."""
        # Characters first: cheap, and UTF-8 never has fewer bytes than characters.
        if len(text) <= self.max_config_bytes // 4:
            return None
        size = len(text.encode())
        if size > self.max_config_bytes:
            return limit_problem("config", size, self.max_config_bytes, "--max-config-bytes")
        return None

    def nodes_problem(self, count: int) -> str | None:
        if count > self.max_nodes:
            return limit_problem("nodes", count, self.max_nodes, "--max-nodes", unit="nodes")
        return None

    def output_tokens_problem(self, what: str, tokens: int) -> str | None:
        if tokens > self.max_output_tokens:
            return limit_problem(what, tokens, self.max_output_tokens, "--max-output-tokens", unit="tokens")
        return None
