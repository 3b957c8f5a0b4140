"""Tokens, roles and tenant limits as pure code (issue #17)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from inferx.auth.limits import QuotaExceeded, TenantQuotas, TierNotAllowed
from inferx.auth.model import (
    ROUTER_METHOD_ROLES,
    Principal,
    Role,
    TenantLimits,
    TokenRecord,
    check_tenant_name,
    new_token,
    required_role,
    secret_matches,
    split_token,
)
from inferx.cli.access import parse_duration
from inferx.errors import InvalidArgument
from inferx.v1 import router_pb2


def test_every_router_method_has_a_role_and_nothing_else_does() -> None:
    """Deny by default: a new RPC is refused until it is given a role here."""
    methods = set(router_pb2.DESCRIPTOR.services_by_name["Router"].methods_by_name)
    assert methods == set(ROUTER_METHOD_ROLES)
    assert required_role("/inferx.v1.Router/NoSuchMethod") is None
    assert required_role("/inferx.v1.Router/PutChain") is Role.MANAGE
    assert required_role("/inferx.v1.Router/CreateToken") is Role.ADMIN
    assert required_role("/inferx.v1.Router/RunChain") is Role.RUN


def test_a_new_token_splits_back_and_only_its_own_secret_matches() -> None:
    text, token_id, digest = new_token()
    parsed = split_token(text)
    assert parsed is not None and parsed[0] == token_id
    record = TokenRecord(token_id=token_id, secret_sha256=digest, tenant="t", role=Role.RUN)
    assert secret_matches(record, parsed[1])
    other = split_token(new_token()[0])
    assert other is not None and not secret_matches(record, other[1])
    assert digest not in text  # the stored hash is not in the token, nor the other way round
    assert parsed[1] not in record.model_dump_json()


@given(st.text(max_size=120))
def test_split_token_never_crashes_and_accepts_only_well_formed_tokens(text: str) -> None:
    parsed = split_token(text)
    if parsed is not None:
        assert text.strip().startswith("ixt_") and len(parsed[0]) == 16


def test_expiry_and_roles() -> None:
    record = TokenRecord(
        token_id="0" * 16, secret_sha256="x", tenant="t", role=Role.ADMIN, expires_unix_ms=1000
    )
    assert record.expired(now_unix_ms=1000) and not record.expired(now_unix_ms=999)
    assert not TokenRecord(token_id="0" * 16, secret_sha256="x", tenant="t", role=Role.RUN).expired()
    assert Role.RUN < Role.MANAGE < Role.ADMIN
    assert Role.parse(" Manage ") is Role.MANAGE
    with pytest.raises(ValueError, match="run, manage or admin"):
        Role.parse("root")
    assert Principal(tenant="a", role=Role.RUN, name="ci").label == "a/ci"


@pytest.mark.parametrize("name", ["", "A", "-a", "a_b", "a/b", "x" * 64])
def test_bad_tenant_names_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="tenant name"):
        check_tenant_name(name)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_max_tier_refuses_more_urgent_tiers_only() -> None:
    quotas = TenantQuotas()
    limits = TenantLimits(max_tier=2)  # standard at most
    with pytest.raises(TierNotAllowed, match="max_tier"):
        quotas.admit("t", limits, 1)
    quotas.admit("t", limits, 2)
    quotas.admit("t", limits, 3)
    assert quotas.running("t") == 2


def test_concurrent_runs_are_bounded_and_released() -> None:
    quotas = TenantQuotas()
    limits = TenantLimits(max_concurrent_runs=2)
    quotas.admit("t", limits, 2)
    quotas.admit("t", limits, 2)
    with pytest.raises(QuotaExceeded, match="max_concurrent_runs") as refused:
        quotas.admit("t", limits, 2)
    assert refused.value.retry_after_s == 1.0 and refused.value.limit == "concurrent_runs"
    quotas.admit("other", limits, 2)  # another tenant is not affected
    quotas.finished("t", limits, 0)
    quotas.admit("t", limits, 2)


def test_tokens_per_minute_refills_at_the_configured_rate() -> None:
    clock = Clock()
    quotas = TenantQuotas(clock)
    limits = TenantLimits(tokens_per_minute=600)  # 10 per second
    quotas.admit("t", limits, 2)
    quotas.finished("t", limits, 900)  # overdraws the bucket: 600 - 900 = -300
    with pytest.raises(QuotaExceeded, match="tokens_per_minute") as refused:
        quotas.admit("t", limits, 2)
    assert refused.value.retry_after_s == pytest.approx(30.1, abs=0.1)
    clock.now += 30.2
    quotas.admit("t", limits, 2)


@pytest.mark.parametrize(
    ("text", "seconds"), [("90", 90), ("90s", 90), ("15m", 900), ("12h", 43200), ("2d", 172800)]
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "0", "-5", "5w", "soon"])
def test_bad_durations_are_refused(text: str) -> None:
    with pytest.raises(InvalidArgument, match="--ttl"):
        parse_duration(text)
