"""`inferx tenant ...`, `inferx token ...`, `inferx whoami`: who may do what (docs/security.md).

The first admin token cannot come from the router (nobody could call it yet): `inferx
token create --bootstrap --etcd HOST:PORT` writes one straight to etcd, which only a
holder of etcd credentials can do; `inferx up` does this for the local stack.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from inferx.cli import argtypes
from inferx.errors import InvalidArgument
from inferx.pricing import format_cost

if TYPE_CHECKING:
    from inferx.client import InferxClient

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)

ClientFactory = Callable[[argparse.Namespace], "InferxClient"]
_client: ClientFactory

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd]?)$")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
TIERS = {"any": 0, "realtime": 1, "standard": 2, "batch": 3}


def parse_duration(text: str) -> float:
    """'90s', '15m', '12h', '30d' or plain seconds."""
    match = _DURATION.match(text.strip())
    if not match or float(match.group(1)) <= 0:
        raise InvalidArgument(f"--ttl {text!r}: expected a positive duration like 3600, 15m, 12h or 30d")
    return float(match.group(1)) * _UNIT_S[match.group(2)]


def _ms_time(unix_ms: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(unix_ms / 1000)) if unix_ms else "never"


def _as_dict(message) -> dict:
    from google.protobuf import json_format

    return json_format.MessageToDict(message, preserving_proto_field_name=True)


async def cmd_whoami(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        me = await client.whoami()
    if args.json:
        print(json.dumps(_as_dict(me)))
    elif me.insecure:
        out.print("[yellow]the router runs with --insecure: no tokens are checked[/yellow]")
    else:
        out.print(f"tenant {me.tenant}, role {me.role}, token {me.token_id} ({me.token_name or 'unnamed'})")
    return 0


async def cmd_tenant_create(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        tenant = await client.create_tenant(
            args.name,
            max_concurrent_runs=args.max_concurrent_runs,
            tokens_per_minute=args.tokens_per_minute,
            max_tier=TIERS[args.max_tier],  # type: ignore[arg-type]
            cost_per_hour=args.cost_per_hour,
        )
    if args.json:
        print(json.dumps(_as_dict(tenant)))
    else:
        out.print(f"created tenant {tenant.name}")
    return 0


async def cmd_tenant_list(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        reply = await client.list_tenants()
    if args.json:
        print(json.dumps(_as_dict(reply)))
        return 0
    table = Table("tenant", "concurrent runs", "tokens/min", "cost/hour", "max tier", "created by", "created")
    names = {v: k for k, v in TIERS.items()}
    for t in reply.tenants:
        table.add_row(
            t.name,
            str(t.limits.max_concurrent_runs or "-"),
            str(t.limits.tokens_per_minute or "-"),
            format_cost(t.limits.cost_per_hour) if t.limits.cost_per_hour else "-",
            names.get(int(t.limits.max_tier), "?"),
            t.created_by,
            _ms_time(t.created_unix_ms),
        )
    out.print(table)
    return 0


async def cmd_token_create(args: argparse.Namespace) -> int:
    ttl_s = parse_duration(args.ttl) if args.ttl else 0.0
    if args.bootstrap:
        if args.tenant not in ("", "default") or args.role not in (None, "admin") or args.ttl:
            raise InvalidArgument(
                "--bootstrap always makes an admin token of tenant 'default' that never expires"
            )
        return await _bootstrap(args)
    if args.etcd or args.etcd_ca or args.etcd_cert or args.etcd_key or args.etcd_server_name:
        raise InvalidArgument(
            "the --etcd flags are for --bootstrap; other tokens are made through the router"
        )
    async with _client(args) as client:
        reply = await client.create_token(args.tenant, args.role or "run", ttl_s=ttl_s, name=args.name or "")
    if args.json:
        print(json.dumps({"token": reply.token, **_as_dict(reply.info)}))
    else:
        err.print(
            f"token {reply.info.token_id} for tenant {reply.info.tenant}, role {reply.info.role}, "
            f"expires {_ms_time(reply.info.expires_unix_ms)}; it is shown once, store it now:"
        )
        print(reply.token)
    return 0


async def _bootstrap(args: argparse.Namespace) -> int:
    from inferx.auth.store import bootstrap_admin_token
    from inferx.etcd import ETCD_DOWN_ERRORS, make_client
    from inferx.tls import ETCD_FLAGS, TlsError, TlsFiles

    if not args.etcd:
        raise InvalidArgument("--bootstrap needs --etcd HOST:PORT (the token is written straight to etcd)")
    try:
        tls = TlsFiles.from_options(args.etcd_ca or "", args.etcd_cert or "", args.etcd_key or "", ETCD_FLAGS)
        client = make_client(args.etcd, tls=tls, server_name=args.etcd_server_name or None)
    except (ValueError, TlsError) as exc:
        raise InvalidArgument(str(exc)) from None
    try:
        token = await bootstrap_admin_token(client, name=args.name or "bootstrap")
    except ETCD_DOWN_ERRORS as exc:
        raise InvalidArgument(f"cannot write to etcd at {args.etcd}: {exc}") from None
    finally:
        await client.close()
    err.print("admin token of tenant 'default' (shown once, store it now):")
    print(token)
    return 0


async def cmd_token_revoke(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        info = await client.revoke_token(args.token_id)
    if args.json:
        print(json.dumps(_as_dict(info)))
    else:
        out.print(f"revoked token {info.token_id} of tenant {info.tenant}")
    return 0


async def cmd_token_list(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        reply = await client.list_tokens(args.tenant or "")
    if args.json:
        print(json.dumps(_as_dict(reply)))
        return 0
    table = Table("token id", "tenant", "role", "name", "created by", "created", "expires")
    for t in reply.tokens:
        table.add_row(
            t.token_id,
            t.tenant,
            t.role,
            t.name,
            t.created_by,
            _ms_time(t.created_unix_ms),
            _ms_time(t.expires_unix_ms),
        )
    out.print(table)
    return 0


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser, client: ClientFactory) -> None:
    global _client
    _client = client

    whoami = sub.add_parser("whoami", parents=[common], help="the tenant and role of your token")
    whoami.set_defaults(handler=cmd_whoami)

    tenant = sub.add_parser("tenant", help="tenants (admin)")
    tenant_sub = tenant.add_subparsers(dest="tenant_command", required=True, metavar="ACTION")
    create = tenant_sub.add_parser("create", parents=[common], help="create a tenant with its limits")
    create.add_argument("name")
    create.add_argument(
        "--max-concurrent-runs", type=argtypes.count, default=0, metavar="N", help="0 = no limit"
    )
    create.add_argument(
        "--tokens-per-minute", type=argtypes.count, default=0, metavar="N", help="0 = no limit"
    )
    create.add_argument(
        "--cost-per-hour",
        type=argtypes.amount,
        default=0.0,
        metavar="X",
        help="what its runs and calls may cost in any hour, at the pools' prices (0 = no budget)",
    )
    create.add_argument("--max-tier", choices=list(TIERS), default="any", help="most urgent tier allowed")
    create.set_defaults(handler=cmd_tenant_create)
    tlist = tenant_sub.add_parser("list", parents=[common], help="every tenant")
    tlist.set_defaults(handler=cmd_tenant_list)

    token = sub.add_parser("token", help="API tokens (admin)")
    token_sub = token.add_subparsers(dest="token_command", required=True, metavar="ACTION")
    tcreate = token_sub.add_parser("create", parents=[common], help="issue a token (printed once)")
    tcreate.add_argument("--tenant", default="", help="the tenant (default: your token's)")
    tcreate.add_argument("--role", choices=["run", "manage", "admin"], help="default: run")
    tcreate.add_argument("--ttl", help="lifetime, e.g. 3600, 15m, 12h, 30d (default: never expires)")
    tcreate.add_argument("--name", help="what the token is for")
    tcreate.add_argument(
        "--bootstrap",
        action="store_true",
        help="write the first admin token of tenant 'default' straight to etcd (needs --etcd)",
    )
    tcreate.add_argument("--etcd", metavar="HOST:PORT", help="with --bootstrap: etcd to write to")
    tcreate.add_argument("--etcd-ca", metavar="PEM", help="with --bootstrap: etcd's CA (etcd over TLS)")
    tcreate.add_argument("--etcd-cert", metavar="PEM", help="with --bootstrap: your etcd client certificate")
    tcreate.add_argument("--etcd-key", metavar="PEM", help="with --bootstrap: the key of --etcd-cert")
    tcreate.add_argument(
        "--etcd-server-name",
        metavar="NAME",
        help="with --bootstrap: verify etcd by this name on its certificate",
    )
    tcreate.set_defaults(handler=cmd_token_create)
    revoke = token_sub.add_parser("revoke", parents=[common], help="revoke a token on every router")
    revoke.add_argument("token_id")
    revoke.set_defaults(handler=cmd_token_revoke)
    tklist = token_sub.add_parser("list", parents=[common], help="tokens (never their secrets)")
    tklist.add_argument("--tenant", help="only this tenant's")
    tklist.set_defaults(handler=cmd_token_list)
