"""`inferx pool price POOL [--prompt-per-1k X ...]`: a model pool's price, which every
hop and run reports its cost from (docs/concepts.md#cost)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import TYPE_CHECKING

from rich.console import Console

from inferx.cli import argtypes
from inferx.pricing import format_cost

if TYPE_CHECKING:
    from inferx.client import InferxClient
    from inferx.v1 import router_pb2

out = Console(highlight=False, soft_wrap=True)

ClientFactory = Callable[[argparse.Namespace], "InferxClient"]
_client: ClientFactory

_SETTERS = ("prompt_per_1k", "cached_per_1k", "output_per_1k", "gpu_second")


def price_line(price: router_pb2.PoolPrice) -> str:
    if not price.set:
        return f"pool '{price.pool}': no price (its hops cost 0)"
    cached = price.cached_per_1k if price.HasField("cached_per_1k") else price.prompt_per_1k
    return (
        f"pool '{price.pool}': prompt {format_cost(price.prompt_per_1k)}/1k · cached "
        f"{format_cost(cached)}/1k · output {format_cost(price.output_per_1k)}/1k · "
        f"GPU {format_cost(price.gpu_second)}/s"
    )


async def cmd_pool_price(args: argparse.Namespace) -> int:
    from google.protobuf import json_format

    given = {name: getattr(args, name) for name in _SETTERS if getattr(args, name) is not None}
    async with _client(args) as client:
        if given:
            price = await client.set_pool_price(args.pool, **given)
        else:
            price = await client.get_pool_price(args.pool)
    if args.json:
        print(json.dumps(json_format.MessageToDict(price, preserving_proto_field_name=True)))
    else:
        out.print(price_line(price), markup=False)
    return 0


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser, client: ClientFactory) -> None:
    global _client
    _client = client
    pool = sub.add_parser("pool", help="model pools: their prices (cost per hop and run)")
    pool_sub = pool.add_subparsers(dest="pool_command", required=True, metavar="ACTION")
    price = pool_sub.add_parser(
        "price",
        parents=[common],
        help="show a pool's price, or set it (admin) with any of the options; unset ones are 0",
    )
    price.add_argument("pool", help="a pool, or a model (its pool)")
    price.add_argument("--prompt-per-1k", type=argtypes.amount, metavar="X", help="per 1k prompt tokens")
    price.add_argument(
        "--cached-per-1k",
        type=argtypes.amount,
        metavar="X",
        help="per 1k prompt tokens served from the prefix cache (default: the prompt price)",
    )
    price.add_argument("--output-per-1k", type=argtypes.amount, metavar="X", help="per 1k generated tokens")
    price.add_argument(
        "--gpu-second", type=argtypes.amount, metavar="X", help="per second of a hop on its worker"
    )
    price.set_defaults(handler=cmd_pool_price)
