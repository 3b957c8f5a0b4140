"""Who is calling the router, and may they: the router's CallGuard, its audit log.

Every inferx.v1.Router call is checked before its handler runs (libs/inferx/server.py):
the bearer token names a principal (tenant + role); the method's least role
(`ROUTER_METHOD_ROLES`) must be met. The principal is then in a ContextVar for the
handler, which scopes everything it touches to the principal's tenant.
With --insecure no token is checked and every caller is the default tenant's admin.
"""

from __future__ import annotations

import logging
from contextvars import ContextVar

import grpc

from inferx.auth.model import INSECURE_PRINCIPAL, Principal, Role, required_role
from inferx.auth.store import AuthDirectory
from inferx.errors import PermissionDenied

ROUTER_PREFIX = "/inferx.v1.Router/"

# Set by the guard for the handler's task. No default: a handler reached without the
# guard (a wiring mistake) fails loudly instead of running as somebody.
_CALLER: ContextVar[Principal] = ContextVar("inferx_caller")

audit_log = logging.getLogger("inferx.audit")


def caller() -> Principal:
    return _CALLER.get()


def audit(action: str, target: str, **details: object) -> None:
    """One line per admin or config action: who, what, on what (the log line has the time)."""
    extra = "".join(f" {key}={value}" for key, value in details.items())
    audit_log.info("principal=%s action=%s target=%s%s", caller().label, action, target, extra)


class AccessControl:
    def __init__(self, directory: AuthDirectory | None) -> None:
        """`directory` None: --insecure, every caller is INSECURE_PRINCIPAL."""
        self.directory = directory

    @property
    def insecure(self) -> bool:
        return self.directory is None

    def authenticate(self, authorization: str | None) -> Principal:
        if self.directory is None:
            return INSECURE_PRINCIPAL
        return self.directory.authenticate(authorization)

    def authorize(self, principal: Principal, method: str) -> None:
        needed = required_role(method)
        if needed is None:
            raise PermissionDenied(f"{method} may not be called")
        if principal.role < needed:
            raise PermissionDenied(
                f"{method.rsplit('/', 1)[-1]} needs the {needed.label} role; "
                f"this token has {principal.role.label}"
            )

    def guard(self, method: str, context: grpc.aio.ServicerContext) -> None:
        if not method.startswith(ROUTER_PREFIX):
            return
        authorization = None
        for key, value in context.invocation_metadata() or ():
            if key == "authorization":
                authorization = value if isinstance(value, str) else value.decode(errors="replace")
                break
        principal = self.authenticate(authorization)
        self.authorize(principal, method)
        _CALLER.set(principal)


def as_caller(principal: Principal) -> None:
    """Set the caller for code that is not behind the gRPC guard (the HTTP front)."""
    _CALLER.set(principal)


__all__ = ["AccessControl", "Role", "as_caller", "audit", "caller"]
