"""Tokens, roles and tenants as plain data: no I/O here.

A token is `ixt_<id>_<secret>`: the id names its record in etcd, the secret is 32
random bytes of which only the SHA-256 is stored. Secrets are random, not chosen by
people, so a plain hash is enough (no slow KDF is needed against guessing), and the
comparison is constant-time.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import re
import secrets
import time

from pydantic import BaseModel, ConfigDict, Field

TOKEN_PREFIX = "ixt_"
_TOKEN = re.compile(r"^ixt_([0-9a-f]{16})_([A-Za-z0-9_-]{43})$")
TENANT_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
DEFAULT_TENANT = "default"


class Role(enum.IntEnum):
    """Each role may do what the ones below it may."""

    RUN = 1  # run the tenant's chains, read its chains and its own runs
    MANAGE = 2  # put, label and roll back the tenant's chains
    ADMIN = 3  # tenants, tokens, tool-cache invalidation, full status

    @classmethod
    def parse(cls, text: str) -> Role:
        try:
            return cls[text.strip().upper()]
        except KeyError:
            raise ValueError(f"role must be run, manage or admin, got {text!r}") from None

    @property
    def label(self) -> str:
        return self.name.lower()


class TenantLimits(BaseModel):
    """Per-tenant limits; 0 means no limit."""

    model_config = ConfigDict(extra="forbid")

    max_concurrent_runs: int = Field(0, ge=0)
    tokens_per_minute: int = Field(0, ge=0)
    max_tier: int = Field(0, ge=0, le=3)  # highest tier the tenant may ask for (1 = realtime); 0 = any
    # What the tenant's runs and calls may cost in any hour (inferx.pricing); 0 = no budget
    cost_per_hour: float = Field(0.0, ge=0, allow_inf_nan=False)


class TenantRecord(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    limits: TenantLimits = TenantLimits()
    created_by: str = ""
    created_unix_ms: int = 0


class TokenRecord(BaseModel):
    model_config = ConfigDict(extra="ignore")

    token_id: str
    secret_sha256: str
    tenant: str
    role: Role
    name: str = ""  # what the token is for, for people
    created_by: str = ""
    created_unix_ms: int = 0
    expires_unix_ms: int = 0  # 0 = never

    def expired(self, now_unix_ms: int | None = None) -> bool:
        now = int(time.time() * 1000) if now_unix_ms is None else now_unix_ms
        return bool(self.expires_unix_ms) and now >= self.expires_unix_ms


class Principal(BaseModel):
    """Who is calling, once their token checked out."""

    model_config = ConfigDict(frozen=True)

    tenant: str
    role: Role
    token_id: str = ""
    name: str = ""

    @property
    def label(self) -> str:
        """How audit lines and the chain history name this caller."""
        who = self.name or self.token_id or "anonymous"
        return f"{self.tenant}/{who}"


# Used when the router runs with --insecure: everything is allowed, in the default tenant.
INSECURE_PRINCIPAL = Principal(tenant=DEFAULT_TENANT, role=Role.ADMIN, name="insecure")


def new_token() -> tuple[str, str, str]:
    """A fresh token: (token text, its id, SHA-256 of its secret)."""
    token_id = secrets.token_hex(8)
    secret = secrets.token_urlsafe(32)
    return f"{TOKEN_PREFIX}{token_id}_{secret}", token_id, hash_secret(secret)


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def split_token(text: str) -> tuple[str, str] | None:
    """(id, secret) of a well-formed token, else None."""
    match = _TOKEN.match(text.strip())
    return (match.group(1), match.group(2)) if match else None


def secret_matches(record: TokenRecord, secret: str) -> bool:
    return hmac.compare_digest(record.secret_sha256, hash_secret(secret))


def check_tenant_name(name: str) -> str:
    if not TENANT_NAME.match(name):
        raise ValueError(
            f"tenant name must be 1-63 lower-case letters, digits or '-' (starting with a letter or digit), "
            f"got {name!r}"
        )
    return name


# The least role each inferx.v1.Router method needs. A method missing here is refused
# (deny by default), so a new RPC cannot ship open by accident; a unit test checks
# that every method of the service is listed.
ROUTER_METHOD_ROLES: dict[str, Role] = {
    "RunChain": Role.RUN,
    "CallModel": Role.RUN,
    "GetRun": Role.RUN,
    "GetChainStats": Role.RUN,
    "GetChain": Role.RUN,
    "ListChains": Role.RUN,
    "ValidateChain": Role.RUN,
    "GetChainHistory": Role.RUN,
    "DiffChain": Role.RUN,
    "GetStatus": Role.RUN,  # without addresses and per-worker detail below admin
    "WhoAmI": Role.RUN,
    "PutChain": Role.MANAGE,
    "LabelChain": Role.MANAGE,
    "RollbackChain": Role.MANAGE,
    "InvalidateToolCache": Role.ADMIN,
    "GetToolCacheStats": Role.ADMIN,
    "CreateTenant": Role.ADMIN,
    "ListTenants": Role.ADMIN,
    "CreateToken": Role.ADMIN,
    "RevokeToken": Role.ADMIN,
    "ListTokens": Role.ADMIN,
    "GetPoolPrice": Role.RUN,
    "SetPoolPrice": Role.ADMIN,
    "GetAbStatus": Role.RUN,
    "StartAbTest": Role.MANAGE,
    "StopAbTest": Role.MANAGE,
}


def required_role(method: str) -> Role | None:
    """The role `/inferx.v1.Router/<Name>` needs, None for a method nobody may call."""
    return ROUTER_METHOD_ROLES.get(method.rsplit("/", 1)[-1])
