"""Small conversions between plain values and protobuf enums, in one place."""

from __future__ import annotations

from typing import cast

from inferx.v1 import common_pb2


def tier_to_proto(tier: int) -> common_pb2.Tier:
    """`inferx.scheduling.views.Tier` (or any int tier) as the proto enum: the values are
    the same by design; the cast only tells the type checker so."""
    return cast(common_pb2.Tier, int(tier))
