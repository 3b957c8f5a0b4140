"""The wire, in one place: the options of every gRPC channel, and small conversions
between plain values and protobuf enums."""

from __future__ import annotations

from typing import cast

from inferx.v1 import common_pb2


def tier_to_proto(tier: int) -> common_pb2.Tier:
    """`inferx.scheduling.views.Tier` (or any int tier) as the proto enum: the values are
    the same by design; the cast only tells the type checker so."""
    return cast(common_pb2.Tier, int(tier))


# Every gRPC channel of InferX (services and the SDK): keep idle channels healthy, and
# let big prompts through.
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.enable_retries", 0),
]
