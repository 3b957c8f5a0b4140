"""Load the example model -> pool mappings and chains into a running InferX (what
`inferx up` does for the local stack); docker-compose runs it once as `seed`.

    python deploy/scripts/seed.py --etcd etcd:2379 --router router:50051
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from inferx import etcd
from inferx.chain.validate import load_chain_text
from inferx.chain.yamlio import dump_config_yaml
from inferx.client import InferxClient
from inferx.devstack import read_models_file
from inferx.errors import InferxError, NotFound

ROOT = Path(__file__).resolve().parents[2]


async def seed(etcd_endpoint: str, router: str, examples: Path, wait_s: float) -> None:
    client = etcd.make_client(etcd_endpoint)
    async with client:
        for model, pool in read_models_file(examples / "models.yaml").items():
            await client.put(etcd.model_key(model).encode(), json.dumps({"pool": pool}).encode())
            print(f"model {model} -> pool {pool}")
    deadline = asyncio.get_running_loop().time() + wait_s
    async with InferxClient(router) as inferx:
        for path in sorted((examples / "chains").glob("*.yaml")):
            text = path.read_text()
            config = load_chain_text(text, source=str(path)).config
            while True:  # the router may still be starting
                try:
                    try:
                        if (await inferx.get_chain(config.name)).config_yaml == dump_config_yaml(config):
                            print(f"chain {config.name} unchanged")
                            break
                    except NotFound:
                        pass
                    reply = await inferx.put_chain(text, message="seed", author="seed")
                    print(f"chain {reply.name} v{reply.version}")
                    break
                except InferxError as exc:
                    if asyncio.get_running_loop().time() > deadline:
                        raise
                    print(f"waiting for the router: {exc.message}", file=sys.stderr)
                    await asyncio.sleep(2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--etcd", default="127.0.0.1:2379")
    parser.add_argument("--router", default="127.0.0.1:50051")
    parser.add_argument("--examples", type=Path, default=ROOT / "examples")
    parser.add_argument("--wait-s", type=float, default=120.0)
    args = parser.parse_args()
    asyncio.run(seed(args.etcd, args.router, args.examples, args.wait_s))


if __name__ == "__main__":
    main()
