"""The wire, in one place: the options of every gRPC channel, and small conversions
between plain values and protobuf enums."""

from __future__ import annotations

from typing import cast

from inferx.v1 import common_pb2


def tier_to_proto(tier: int) -> common_pb2.Tier:
    """`inferx.scheduling.views.Tier` (or any int tier) as the proto enum: the values are
    the same by design; the cast only tells the type checker so."""
    return cast(common_pb2.Tier, int(tier))


CLIENT_KEEPALIVE_MS = 30_000

# Every gRPC channel of InferX (services and the SDK): keep idle channels healthy, and
# let big prompts through.
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    # While calls are open, ping every 30 s and give up on a peer silent for 10 s more: a
    # dead pod behind a mesh is noticed in seconds, not at the TCP timeout.
    ("grpc.keepalive_time_ms", CLIENT_KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.enable_retries", 0),
]


def server_options(
    *,
    max_connection_age_s: float,
    max_connection_age_grace_s: float,
    keepalive_time_s: float,
    keepalive_timeout_s: float,
) -> list[tuple[str, int]]:
    """Connection options of every InferX gRPC server (`ServiceSettings` has the knobs).
    A connection older than `max_connection_age_s` is sent a GOAWAY: calls in flight get
    `max_connection_age_grace_s` to finish and new calls go over a new connection, which
    an L4 balancer or mesh places on any replica -- so long-lived channels rebalance."""
    options = [
        ("grpc.keepalive_time_ms", int(keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(keepalive_timeout_s * 1000)),
        # Accept the clients' pings (every CLIENT_KEEPALIVE_MS during a quiet call): by
        # default a server tolerates one per 5 min and answers more with a GOAWAY
        # ("too_many_pings") that fails the calls on that connection.
        ("grpc.http2.min_recv_ping_interval_without_data_ms", CLIENT_KEEPALIVE_MS // 2),
        ("grpc.keepalive_permit_without_calls", 1),
    ]
    if max_connection_age_s > 0:
        options += [
            ("grpc.max_connection_age_ms", max(1, int(max_connection_age_s * 1000))),
            ("grpc.max_connection_age_grace_ms", int(max_connection_age_grace_s * 1000)),
        ]
    return options
