"""Tokens, roles and tenants on the secure stack `inferx up` runs (real etcd with TLS,
real processes with mutual TLS, SIMULATED workers): every public method refuses a
missing, expired or revoked token; a `run` token cannot change chains; tenant B cannot
see, run, change or trace tenant A's chains or runs; tenant limits refuse with the
right status; the HTTP front takes the same tokens; the audit log names who did what."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from inferx.devstack import LocalStack, wait_serving
from inferx.tls import Transport
from inferx.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.conftest import EXAMPLES, running_sim_stack
from tests.polling import poll_until

pytestmark = pytest.mark.integration

CHAIN = (EXAMPLES / "chains" / "customer_service_agent.yaml").read_text()
ROUTER = router_pb2.DESCRIPTOR.services_by_name["Router"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """The secure stack (TLS everywhere, tokens checked), one sim worker, the example chains
    stored in the default tenant with the stack's admin token."""
    with running_sim_stack(
        tmp_path_factory.mktemp("access"), workers=1, sim_speed=20, insecure=False
    ) as stack:
        yield stack


@pytest.fixture(scope="module")
def admin_token(stack: LocalStack) -> str:
    assert stack.admin_token  # bootstrapped straight into etcd by the stack (inferx up does the same)
    return stack.admin_token


@contextlib.asynccontextmanager
async def router(stack: LocalStack, address: str = "") -> AsyncIterator[router_pb2_grpc.RouterStub]:
    """A channel to the router as an outside caller: TLS against the stack's CA, no client certificate."""
    assert stack.tls_ca is not None
    async with Transport.server_auth(stack.tls_ca).aio_channel(address or stack.router_address) as channel:
        yield router_pb2_grpc.RouterStub(channel)


def auth(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


async def call(stub, method: str, request, token: str | None):
    """A unary call, or a streaming one drained; returns the reply (or the events)."""
    metadata = auth(token) if token is not None else None
    rpc = getattr(stub, method)
    if ROUTER.methods_by_name[method].server_streaming:
        return [event async for event in rpc(request, metadata=metadata, timeout=20)]
    return await rpc(request, metadata=metadata, timeout=20)


async def status_of(stub, method: str, request, token: str | None) -> grpc.StatusCode:
    try:
        await call(stub, method, request, token)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def empty_request(method: str):
    return getattr(router_pb2, ROUTER.methods_by_name[method].input_type.name)()


async def make_token(stub, admin: str, tenant: str, role: str, **kw) -> str:
    reply = await stub.CreateToken(
        router_pb2.CreateTokenRequest(tenant=tenant, role=role, **kw), metadata=auth(admin), timeout=10
    )
    return reply.token


async def make_tenant(stub, admin: str, name: str, **limits) -> None:
    await stub.CreateTenant(
        router_pb2.CreateTenantRequest(name=name, limits=router_pb2.TenantLimits(**limits)),
        metadata=auth(admin),
        timeout=10,
    )


async def run_chain(
    stub, token: str, chain: str = "customer_service_agent", **kw
) -> router_pb2.ChainFinished:
    request = router_pb2.RunChainRequest(chain=chain, inputs={"query": "where is my order?"}, **kw)
    events = await call(stub, "RunChain", request, token)
    return events[-1].chain_finished


async def test_every_method_refuses_missing_expired_and_revoked_tokens(
    stack: LocalStack, admin_token: str
) -> None:
    async with router(stack) as stub:
        await make_tenant(stub, admin_token, "refusals")
        expired = await make_token(stub, admin_token, "refusals", "admin", ttl_s=0.5)
        revoked = await make_token(stub, admin_token, "refusals", "admin")
        await stub.RevokeToken(
            router_pb2.RevokeTokenRequest(token_id=revoked), metadata=auth(admin_token), timeout=10
        )
        await asyncio.sleep(0.6)
        tampered = admin_token[:-4] + ("AAAA" if not admin_token.endswith("AAAA") else "BBBB")
        for method in ROUTER.methods_by_name:
            for token in (None, expired, revoked, tampered, "not-a-token"):
                code = await status_of(stub, method, empty_request(method), token)
                assert code == grpc.StatusCode.UNAUTHENTICATED, (method, token and token[:12], code)


async def test_revocation_reaches_every_router_within_a_second(stack: LocalStack, admin_token: str) -> None:
    """Revoked through the first router, refused by a second one too (each watches etcd)."""
    second = stack.start_service("router", replica=1)
    wait_serving(second, 60)
    try:
        async with router(stack) as first, router(stack, second.address) as other:
            token = await make_token(first, admin_token, "default", "run")

            async def accepted_by_both() -> bool:
                # A new token reaches the other router by its etcd watch too: not at once.
                codes = [
                    await status_of(s, "WhoAmI", router_pb2.WhoAmIRequest(), token) for s in (first, other)
                ]
                return codes == [grpc.StatusCode.OK] * 2

            await poll_until(accepted_by_both, timeout_s=5.0, interval_s=0.02, what="both routers to accept")
            revoked_at = time.monotonic()
            await first.RevokeToken(
                router_pb2.RevokeTokenRequest(token_id=token), metadata=auth(admin_token), timeout=10
            )

            async def refused_by_both() -> bool:
                codes = [
                    await status_of(s, "WhoAmI", router_pb2.WhoAmIRequest(), token) for s in (first, other)
                ]
                return codes == [grpc.StatusCode.UNAUTHENTICATED] * 2

            await poll_until(refused_by_both, timeout_s=1.0, interval_s=0.02, what="both routers to refuse")
            assert time.monotonic() - revoked_at < 1.0
    finally:
        second.stop()
        del stack.services["router-1"]


async def test_roles_and_tenant_isolation(stack: LocalStack, admin_token: str) -> None:
    async with router(stack) as stub:
        await make_tenant(stub, admin_token, "tenant-a")
        await make_tenant(stub, admin_token, "tenant-b")
        a_run = await make_token(stub, admin_token, "tenant-a", "run", name="a-runner")
        a_manage = await make_token(stub, admin_token, "tenant-a", "manage", name="a-ops")
        b_manage = await make_token(stub, admin_token, "tenant-b", "manage")

        # A run token cannot change chains, nor do admin work.
        put = router_pb2.PutChainRequest(config=CHAIN)
        assert await status_of(stub, "PutChain", put, a_run) == grpc.StatusCode.PERMISSION_DENIED
        for method in ("CreateToken", "ListTokens", "CreateTenant", "InvalidateToolCache"):
            assert (
                await status_of(stub, method, empty_request(method), a_manage)
                == grpc.StatusCode.PERMISSION_DENIED
            )

        stored = await stub.PutChain(put, metadata=auth(a_manage), timeout=10)
        assert stored.version == 1
        history = await stub.GetChainHistory(
            router_pb2.ChainHistoryRequest(name=stored.name), metadata=auth(a_manage), timeout=10
        )
        assert history.versions[0].author == "tenant-a/a-ops"  # the authenticated caller, not a claim

        finished = await run_chain(stub, a_run)
        assert finished.status == "ok", finished.error

        # Tenant B: A's chain and run do not exist for it.
        name = stored.name
        for method, request in (
            ("GetChain", router_pb2.GetChainRequest(name=name)),
            ("GetChainHistory", router_pb2.ChainHistoryRequest(name=name)),
            ("RunChain", router_pb2.RunChainRequest(chain=name, inputs={"query": "x"})),
            ("LabelChain", router_pb2.LabelChainRequest(name=name, label="prod", version=1)),
            ("RollbackChain", router_pb2.RollbackChainRequest(name=name, to_version=1)),
            ("DiffChain", router_pb2.DiffChainRequest(name=name, from_version=1, to_version=1)),
            ("GetRun", router_pb2.GetRunRequest(run_id=finished.run_id)),
            ("GetChainStats", router_pb2.GetChainStatsRequest(chain=name)),
        ):
            assert await status_of(stub, method, request, b_manage) == grpc.StatusCode.NOT_FOUND, method
        listed = await stub.ListChains(router_pb2.ListChainsRequest(), metadata=auth(b_manage), timeout=10)
        assert name not in [c.name for c in listed.chains]
        # Nor is A's run B's "latest run".
        latest = router_pb2.GetRunRequest()
        assert await status_of(stub, "GetRun", latest, b_manage) == grpc.StatusCode.NOT_FOUND
        # B's chain of the same name is B's own, version 1; A's is untouched.
        assert (await stub.PutChain(put, metadata=auth(b_manage), timeout=10)).version == 1
        a_chain = await stub.GetChain(router_pb2.GetChainRequest(name=name), metadata=auth(a_run), timeout=10)
        assert a_chain.version == 1 and a_chain.author == "tenant-a/a-ops"
        # A sees its own run.
        trace = await stub.GetRun(
            router_pb2.GetRunRequest(run_id=finished.run_id), metadata=auth(a_run), timeout=10
        )
        assert trace.chain == name


async def test_tenant_limits(stack: LocalStack, admin_token: str) -> None:
    async with router(stack) as stub:
        await make_tenant(
            stub, admin_token, "limited", max_concurrent_runs=1, max_tier=common_pb2.TIER_STANDARD
        )
        manage = await make_token(stub, admin_token, "limited", "manage")
        await stub.PutChain(router_pb2.PutChainRequest(config=CHAIN), metadata=auth(manage), timeout=10)
        # The chain asks for realtime; the tenant may use standard at most.
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await run_chain(stub, manage)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "max_tier" in (refused.value.details() or "")
        # One run at a time: a second concurrent one is RESOURCE_EXHAUSTED with a retry hint.
        request = router_pb2.RunChainRequest(
            chain="customer_service_agent", inputs={"query": "hi"}, tier=common_pb2.TIER_STANDARD
        )
        first = stub.RunChain(request, metadata=auth(manage), timeout=20)
        await first.read()  # its first event: the run is under way
        with pytest.raises(grpc.aio.AioRpcError) as busy:
            await run_chain(stub, manage, tier=common_pb2.TIER_STANDARD)
        assert busy.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_concurrent_runs" in (busy.value.details() or "")
        assert ("inferx-retry-after-s", "1") in tuple(busy.value.trailing_metadata() or ())
        last = await first.read()
        while (event := await first.read()) is not grpc.aio.EOF:
            last = event
        assert last.chain_finished.status == "ok"


async def test_a_tenants_cost_budget_per_hour(stack: LocalStack, admin_token: str) -> None:
    async with router(stack) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await make_tenant(stub, admin_token, "negative", cost_per_hour=-1)
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "limits.cost_per_hour: must be a finite number >= 0" in (bad.value.details() or "")
        # One output token costs 1 here: a run of the example chain costs tens.
        await stub.SetPoolPrice(
            router_pb2.PoolPrice(pool="tiny-llama", output_per_1k=1000),
            metadata=auth(admin_token),
            timeout=10,
        )
        await make_tenant(stub, admin_token, "budgeted", cost_per_hour=100)
        manage = await make_token(stub, admin_token, "budgeted", "manage")
        await stub.PutChain(router_pb2.PutChainRequest(config=CHAIN), metadata=auth(manage), timeout=10)
        spent = 0.0
        for _ in range(10):
            try:
                finished = await run_chain(stub, manage)
            except grpc.aio.AioRpcError as exc:
                refused = exc
                break
            spent += finished.cost
            assert finished.cost > 0
        else:
            pytest.fail("the budget never refused a run")
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "its cost budget of 100 per hour (its cost_per_hour limit)" in (refused.details() or "")
        assert 0 < spent <= 100
        tenants = await stub.ListTenants(
            router_pb2.ListTenantsRequest(), metadata=auth(admin_token), timeout=10
        )
        assert {t.name: t.limits.cost_per_hour for t in tenants.tenants}["budgeted"] == 100
        await stub.SetPoolPrice(
            router_pb2.PoolPrice(pool="tiny-llama"), metadata=auth(admin_token), timeout=10
        )


async def test_http_front_takes_the_same_tokens(stack: LocalStack, admin_token: str) -> None:
    url = stack.router_http_url
    assert url.startswith("https://")
    async with httpx.AsyncClient(
        timeout=20, verify=ssl.create_default_context(cafile=str(stack.tls_ca))
    ) as http:
        assert (await http.get(f"{url}/models")).status_code == 401
        bad = await http.get(f"{url}/models", headers={"authorization": "Bearer ixt_nope"})
        assert bad.status_code == 401 and bad.json()["error"]["type"] == "authentication_error"
        good = await http.get(f"{url}/models", headers={"authorization": f"Bearer {admin_token}"})
        assert good.status_code == 200 and good.json()["data"]
        # Anthropic's SDKs send the key as x-api-key; their errors come in Anthropic's shape.
        body = {"model": "no-such-model", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
        refused = await http.post(f"{url}/messages", json=body, headers={"x-api-key": "ixt_nope"})
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
        known = await http.post(f"{url}/messages", json=body, headers={"x-api-key": admin_token})
        assert known.status_code == 404 and known.json()["error"]["type"] == "not_found_error"  # past auth


async def test_a_tenants_programs_are_its_own(stack: LocalStack, admin_token: str) -> None:
    """A program's record (HTTP front and CallModel alike) is its tenant's: another tenant
    gets NOT_FOUND for its id, its run id and its stats, and the same program id names a
    program of its own."""
    async with router(stack) as stub:
        await make_tenant(stub, admin_token, "prog-a")
        await make_tenant(stub, admin_token, "prog-b")
        a_run = await make_token(stub, admin_token, "prog-a", "run")
        b_run = await make_token(stub, admin_token, "prog-b", "run")
        verify = ssl.create_default_context(cafile=str(stack.tls_ca))
        body = {"model": "qwen-7b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        async with httpx.AsyncClient(timeout=20, verify=verify) as http:
            reply = await http.post(
                f"{stack.router_http_url}/chat/completions",
                json=body,
                headers={"authorization": f"Bearer {a_run}", "X-InferX-Program": "shared-id"},
            )
        assert reply.status_code == 200, reply.text
        request = router_pb2.ProgramCallRequest(
            model="qwen-7b", prompt="more", max_tokens=3, program_id="shared-id"
        )
        events = await call(stub, "CallModel", request, a_run)
        a_record = events[-1].finished.run_id
        assert a_record == reply.headers["X-InferX-Run"] and events[-1].finished.call_index == 1
        for method, lookup in (
            ("GetRun", router_pb2.GetRunRequest(run_id="shared-id")),
            ("GetRun", router_pb2.GetRunRequest(run_id=a_record)),
            ("GetRun", router_pb2.GetRunRequest(run_id=a_record[:8])),
            ("GetRun", router_pb2.GetRunRequest()),
            ("GetChainStats", router_pb2.GetChainStatsRequest(chain="openai")),
        ):
            assert await status_of(stub, method, lookup, b_run) == grpc.StatusCode.NOT_FOUND, lookup
        trace = await stub.GetRun(
            router_pb2.GetRunRequest(run_id="shared-id"), metadata=auth(a_run), timeout=10
        )
        assert trace.finished.run_id == a_record and len(trace.finished.hops) == 2
        b_events = await call(stub, "CallModel", request, b_run)
        assert b_events[-1].finished.run_id != a_record and b_events[-1].finished.call_index == 0


def test_admin_actions_are_audited(stack: LocalStack, admin_token: str) -> None:
    async def act() -> None:
        async with router(stack) as stub:
            await make_tenant(stub, admin_token, "audited")

    asyncio.run(act())
    log = Path(stack.services["router"].log_path).read_text()
    assert "principal=default/inferx-up action=tenant.create target=audited" in log


def _inferx(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "inferx.cli.main", *args], capture_output=True, text=True, timeout=60
    )


async def test_bootstrap_writes_an_admin_token_only_with_etcd_credentials(stack: LocalStack) -> None:
    """`inferx token create --bootstrap`: the first token, straight to etcd; an operator
    without etcd's client certificate cannot mint one."""
    assert stack.tls is not None
    refused = _inferx("token", "create", "--bootstrap", "--etcd", stack.etcd_endpoint)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert refused.stderr.startswith("inferx: INVALID_ARGUMENT: cannot write to etcd")
    tls = [
        "--etcd-ca",
        str(stack.tls.ca),
        "--etcd-cert",
        str(stack.tls.cert),
        "--etcd-key",
        str(stack.tls.key),
    ]
    made = _inferx("token", "create", "--bootstrap", "--etcd", stack.etcd_endpoint, "--name", "ops", *tls)
    assert made.returncode == 0, made.stderr
    token = made.stdout.strip()
    async with router(stack) as stub:
        me = await stub.WhoAmI(router_pb2.WhoAmIRequest(), metadata=auth(token), timeout=10)
    assert (me.tenant, me.role, me.token_name) == ("default", "admin", "ops")
