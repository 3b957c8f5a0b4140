"""Load the example model -> pool mappings and chains into a running InferX (what
`inferx up` does for the local stack); docker-compose runs it once as `seed`.

    python deploy/scripts/seed.py --etcd etcd:2379 --router router:50051 --insecure

or, against a stack with TLS: --etcd-ca/--etcd-cert/--etcd-key (a client certificate
etcd accepts), --tls-ca (the CA of the router's certificate) and --token (a `manage`
or `admin` token; INFERX_TOKEN).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

from inferx import etcd
from inferx.chain.validate import load_chain_text
from inferx.chain.yamlio import dump_config_yaml
from inferx.client import InferxClient
from inferx.devstack import read_models_file
from inferx.errors import InferxError, NotFound
from inferx.tls import ETCD_FLAGS, TlsFiles

ROOT = Path(__file__).resolve().parents[2]


async def seed(args: argparse.Namespace) -> None:
    etcd_endpoint, router, examples, wait_s = args.etcd, args.router, args.examples, args.wait_s
    etcd_tls = TlsFiles.from_options(
        args.etcd_ca or "", args.etcd_cert or "", args.etcd_key or "", ETCD_FLAGS
    )
    client = etcd.make_client(etcd_endpoint, tls=etcd_tls)
    async with client:
        for model, entry in read_models_file(examples / "models.yaml").items():
            # the checked entry as it is: {"pool": ...} and a tool_call_format when given
            await client.put(etcd.model_key(model).encode(), json.dumps(entry).encode())
            print(f"model {model} -> pool {entry['pool']}")
    deadline = asyncio.get_running_loop().time() + wait_s
    async with InferxClient(router, tls_ca=args.tls_ca, token=args.token) as inferx:
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
    parser.add_argument("--insecure", action="store_true", help="plaintext etcd and router (say so)")
    parser.add_argument("--tls-ca", help="CA of the router's certificate")
    parser.add_argument("--token", default=os.environ.get("INFERX_TOKEN"), help="API token (INFERX_TOKEN)")
    parser.add_argument("--etcd-ca")
    parser.add_argument("--etcd-cert")
    parser.add_argument("--etcd-key")
    args = parser.parse_args()
    if not args.insecure and not (args.tls_ca and args.etcd_ca):
        parser.error("give --tls-ca and --etcd-ca (with --etcd-cert/--etcd-key), or --insecure")
    asyncio.run(seed(args))


if __name__ == "__main__":
    main()
