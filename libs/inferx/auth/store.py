"""Tenants and tokens in etcd, and the router's watched copy of them.

  /inferx/v1/auth/tenants/<tenant>   -> TenantRecord JSON
  /inferx/v1/auth/tokens/<token id>  -> TokenRecord JSON (the secret's SHA-256, never the secret)

Revoking deletes the token's key; every router watches the prefix, so a revoked
token is refused everywhere as soon as the watch delivers the delete (milliseconds).
"""

from __future__ import annotations

import json
import time

import aetcd
from pydantic import ValidationError

from inferx import etcd
from inferx.auth.model import (
    DEFAULT_TENANT,
    Principal,
    Role,
    TenantLimits,
    TenantRecord,
    TokenRecord,
    check_tenant_name,
    new_token,
    secret_matches,
    split_token,
)
from inferx.errors import AlreadyExists, InvalidArgument, NotFound, Unauthenticated


def tenant_key(name: str) -> str:
    return f"{etcd.AUTH_TENANTS}{name}"


def token_key(token_id: str) -> str:
    return f"{etcd.AUTH_TOKENS}{token_id}"


def _now_ms() -> int:
    return int(time.time() * 1000)


async def create_tenant(
    client: aetcd.Client,
    name: str,
    limits: TenantLimits | None = None,
    *,
    created_by: str = "",
    exist_ok: bool = False,
) -> TenantRecord:
    """Store a new tenant (ALREADY_EXISTS if it is there, unless `exist_ok`)."""
    try:
        check_tenant_name(name)
    except ValueError as exc:
        raise InvalidArgument(f"tenant: {exc}") from None
    record = TenantRecord(
        name=name, limits=limits or TenantLimits(), created_by=created_by, created_unix_ms=_now_ms()
    )
    key = tenant_key(name).encode()
    tx = client.transactions
    created, _ = await client.transaction(
        compare=[tx.version(key) == 0], success=[tx.put(key, record.model_dump_json().encode())], failure=[]
    )
    if not created:
        existing = await get_tenant(client, name)
        if exist_ok and existing is not None:
            return existing
        raise AlreadyExists(f"tenant '{name}' already exists")
    return record


async def get_tenant(client: aetcd.Client, name: str) -> TenantRecord | None:
    value = await client.get(tenant_key(name).encode())
    return TenantRecord.model_validate_json(value.value) if value is not None else None


async def list_tenants(client: aetcd.Client) -> list[TenantRecord]:
    listing = await client.get_prefix(etcd.AUTH_TENANTS.encode())
    return sorted((TenantRecord.model_validate_json(kv.value) for kv in listing), key=lambda t: t.name)


async def create_token(
    client: aetcd.Client,
    *,
    tenant: str,
    role: Role,
    ttl_s: float = 0,
    name: str = "",
    created_by: str = "",
) -> tuple[str, TokenRecord]:
    """Issue a token for an existing tenant. Returns (the token text, shown once; its record)."""
    if await get_tenant(client, tenant) is None:
        raise NotFound(f"unknown tenant '{tenant}' (create it first: inferx tenant create {tenant})")
    if ttl_s < 0:
        raise InvalidArgument("ttl: must not be negative")
    text, token_id, digest = new_token()
    now = _now_ms()
    record = TokenRecord(
        token_id=token_id,
        secret_sha256=digest,
        tenant=tenant,
        role=role,
        name=name,
        created_by=created_by,
        created_unix_ms=now,
        expires_unix_ms=now + int(ttl_s * 1000) if ttl_s else 0,
    )
    await client.put(token_key(token_id).encode(), record.model_dump_json().encode())
    return text, record


async def revoke_token(client: aetcd.Client, token_id: str) -> TokenRecord:
    """Delete a token; NOT_FOUND if there is none with that id."""
    parsed = split_token(token_id)
    if parsed is not None:  # the whole token was given: take its id
        token_id = parsed[0]
    key = token_key(token_id).encode()
    value = await client.get(key)
    if value is None or not await client.delete(key):
        raise NotFound(f"no token with id '{token_id}' (see `inferx token list`)")
    return TokenRecord.model_validate_json(value.value)


async def list_tokens(client: aetcd.Client, tenant: str = "") -> list[TokenRecord]:
    listing = await client.get_prefix(etcd.AUTH_TOKENS.encode())
    records = (TokenRecord.model_validate_json(kv.value) for kv in listing)
    return sorted(
        (r for r in records if not tenant or r.tenant == tenant), key=lambda r: (r.tenant, r.created_unix_ms)
    )


async def bootstrap_admin_token(client: aetcd.Client, *, name: str = "bootstrap") -> str:
    """The first admin token, written straight to etcd by whoever holds etcd credentials
    (`inferx up`, `inferx token create --bootstrap`): creates the default tenant if missing."""
    await create_tenant(client, DEFAULT_TENANT, created_by="bootstrap", exist_ok=True)
    text, _ = await create_token(
        client, tenant=DEFAULT_TENANT, role=Role.ADMIN, name=name, created_by="bootstrap"
    )
    return text


class AuthDirectory:
    """The router's watched copy of tenants and tokens: authenticates without a round trip."""

    def __init__(self, client: aetcd.Client) -> None:
        # One watch over tenants and tokens, so this copy sees them in etcd's order: a
        # token made right after its tenant is never seen here before that tenant (with
        # a watch each, it could be, and was refused as "tenant no longer exists").
        self.mirror = etcd.PrefixMirror(client, etcd.AUTH, self._load)
        self._tokens: dict[str, TokenRecord] = {}
        self._tenants: dict[str, TenantRecord] = {}

    @property
    def mirrors(self) -> list[etcd.PrefixMirror]:
        return [self.mirror]

    def _load(self, items: dict[str, bytes]) -> None:
        tokens = {k: v for k, v in items.items() if k.startswith(etcd.AUTH_TOKENS)}
        tenants = {k: v for k, v in items.items() if k.startswith(etcd.AUTH_TENANTS)}
        self._tokens = _parse_all(tokens, TokenRecord, lambda r: r.token_id)
        self._tenants = _parse_all(tenants, TenantRecord, lambda r: r.name)

    def tenant(self, name: str) -> TenantRecord | None:
        return self._tenants.get(name)

    def authenticate(self, authorization: str | None) -> Principal:
        """The caller behind an `authorization: Bearer <token>` value, or UNAUTHENTICATED."""
        if not authorization:
            raise Unauthenticated(
                "no token: send `authorization: Bearer <token>` (inferx --token / INFERX_TOKEN)"
            )
        scheme, _, text = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not text.strip():
            raise Unauthenticated("authorization must be `Bearer <token>`")
        parsed = split_token(text)
        if parsed is None:
            raise Unauthenticated("malformed token")
        token_id, secret = parsed
        record = self._tokens.get(token_id)
        if record is None or not secret_matches(record, secret):
            raise Unauthenticated("unknown or revoked token")
        if record.expired():
            raise Unauthenticated(f"token {token_id} has expired")
        if record.tenant not in self._tenants:
            raise Unauthenticated(f"the tenant of token {token_id} no longer exists")
        return Principal(tenant=record.tenant, role=record.role, token_id=token_id, name=record.name)


def _parse_all(items: dict[str, bytes], model, key) -> dict:
    parsed = {}
    for value in items.values():
        try:
            record = model.model_validate_json(value)
        except (ValidationError, json.JSONDecodeError):
            continue  # a record this version cannot read grants nothing
        parsed[key(record)] = record
    return parsed
