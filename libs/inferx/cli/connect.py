"""Where the CLI's calls go, and with which credentials.

Every command that calls the router takes `--router` (env INFERX_ROUTER), `--token`
(env INFERX_TOKEN) and `--tls-ca` (env INFERX_TLS_CA). When no CA is given and
`--router` is a router of the local stack `inferx up` runs from this directory
(`.inferx/stack.json` lists them all, `--replicas` included), that stack's CA is used,
and its admin token unless `--token` gives another, so `inferx run ...` next to
`make run` needs no flags. A given `--tls-ca` wins whole: the stack's token is never
sent to a router verified by another CA.

Light on purpose: building the parser imports nothing but argparse and os; the client
and TLS code load when a command runs.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from inferx import DEFAULT_ROUTER
from inferx.errors import InferxError

if TYPE_CHECKING:
    from inferx.client import InferxClient
    from inferx.tls import Transport

#: where `inferx up` writes what a client needs (relative to the directory it runs in)
STACK_FILE = Path(".inferx") / "stack.json"


def add_router_flags(parser: argparse.ArgumentParser, *, router: bool = True) -> None:
    """--router (unless the command defines its own), --token, --tls-ca."""
    if router:
        parser.add_argument(
            "--router",
            default=os.environ.get("INFERX_ROUTER", DEFAULT_ROUTER),
            metavar="HOST:PORT",
            help="router address (env INFERX_ROUTER, default %(default)s)",
        )
    parser.add_argument(
        "--token",
        default=os.environ.get("INFERX_TOKEN") or None,
        metavar="TOKEN",
        help="API token, sent as `authorization: Bearer` (env INFERX_TOKEN; default: the local "
        "stack's admin token, see .inferx/stack.json)",
    )
    parser.add_argument(
        "--tls-ca",
        default=os.environ.get("INFERX_TLS_CA") or None,
        metavar="CA.pem",
        help="CA that issued the router's certificate: call it over TLS (env INFERX_TLS_CA; default: "
        "the local stack's CA when --router is its router; neither: plaintext)",
    )


@dataclass(frozen=True)
class Connection:
    router: str
    token: str | None = None
    tls_ca: str | None = None
    #: the local stack's service certificate and key (from stack.json): for commands
    #: that call internal services directly (`inferx bench --router`)
    tls_cert: str | None = None
    tls_key: str | None = None
    #: the name on the internal services' certificates (stack.json's `tls_server_name`)
    tls_server_name: str | None = None

    def client(self) -> InferxClient:
        from inferx.client import InferxClient
        from inferx.tls import TlsError

        try:
            return InferxClient(self.router, token=self.token, tls_ca=self.tls_ca)
        except TlsError as exc:
            raise InferxError(str(exc)) from None

    def internal_transport(self) -> Transport:
        """Mutual TLS with the local stack's service certificate (INFERX_TLS_CERT and
        INFERX_TLS_KEY override it), or plaintext when the router is called in plaintext.
        The services are verified against the name on their certificate where there is
        one (INFERX_TLS_SERVER_NAME, else the stack's), as the services verify one another."""
        from inferx.tls import TlsError, TlsFiles, Transport, load_tls

        if not self.tls_ca:
            return Transport.plaintext()
        cert = os.environ.get("INFERX_TLS_CERT") or self.tls_cert
        key = os.environ.get("INFERX_TLS_KEY") or self.tls_key
        if not cert or not key:
            raise InferxError(
                "this command calls internal services, which accept only mutual TLS: set "
                "INFERX_TLS_CERT and INFERX_TLS_KEY to a certificate issued by the stack's CA"
            )
        try:
            server_name = os.environ.get("INFERX_TLS_SERVER_NAME") or self.tls_server_name
            return Transport.mutual(
                load_tls(TlsFiles(Path(self.tls_ca), Path(cert), Path(key))), server_name=server_name or None
            )
        except TlsError as exc:
            raise InferxError(str(exc)) from None


def _same_router(a: str, b: str) -> bool:
    def norm(address: str) -> str:
        host, _, port = address.rpartition(":")
        return f"{'127.0.0.1' if host == 'localhost' else host}:{port}"

    return norm(a) == norm(b)


def read_stack_file(path: Path = STACK_FILE) -> dict | None:
    """The local stack's description, or None when there is none (or it is not JSON)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _stack_routers(stack: dict) -> list[str]:
    """Every router of the local stack: `routers` (all that `inferx up` started, with
    `--replicas` more than one) and `router` (the first, all an older file names)."""
    routers = stack.get("routers")
    known = [str(r) for r in routers] if isinstance(routers, list) else []
    return [*known, str(stack.get("router", ""))]


def _read_token(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError as exc:
        raise InferxError(f"cannot read the local stack's admin token {path}: {exc.strerror}") from None


def resolve(args: argparse.Namespace, router: str | None = None) -> Connection:
    """The connection a command asked for: its flags, else the local stack's file."""
    address = router or args.router
    token = getattr(args, "token", None)
    tls_ca = getattr(args, "tls_ca", None)
    if tls_ca:
        return Connection(address, token, tls_ca)
    stack = read_stack_file()
    if stack is None or not any(_same_router(known, address) for known in _stack_routers(stack)):
        return Connection(address, token)
    if token:  # another token for the local stack's router: still its CA (never its token elsewhere)
        return Connection(address, token, stack.get("tls_ca") or None)
    token_file = stack.get("token_file")
    return Connection(
        address,
        _read_token(token_file) if token_file else None,
        stack.get("tls_ca") or None,
        stack.get("tls_cert") or None,
        stack.get("tls_key") or None,
        stack.get("tls_server_name") or None,
    )


def client(args: argparse.Namespace) -> InferxClient:
    return resolve(args).client()
