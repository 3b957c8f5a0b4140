"""The secure stack `inferx up` runs by default (real processes, real etcd, real TLS):
mutual TLS between services, TLS on the router's gRPC and HTTP ports, etcd that
accepts only clients with a certificate from the stack's CA, TLS tool endpoints.

Refused here: a plaintext client of the router; a plaintext, certificate-less or
other-CA client of an internal service; a worker whose certificate another CA issued
(it registers, but never runs a hop); any etcd client without the CA's client
certificate, so a worker or a tool server without one never registers.
"""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inferx import etcd
from inferx.client import InferxClient
from inferx.devstack import LocalStack, ManagedProcess, free_port
from inferx.errors import Unavailable
from inferx.etcd import make_client
from inferx.tls import TlsFiles, TlsMaterial, Transport, generate_local_pki, load_tls
from tests.conftest import ROOT, running_sim_stack
from tests.integration.test_other_languages import CLIENT as NODE_CLIENT
from tests.integration.test_other_languages import node_client  # noqa: F401 (its fixture, used here)
from tests.polling import poll_until

pytestmark = pytest.mark.integration

CHAIN = """
agent_chain:
  name: NAME
  slo: {end_to_end_latency_p99: 5s}
  inputs: [city]
  nodes:
    - id: lookup
      type: tool_call
      tool: TOOL
      timeout: 2s
      arguments: {city: "{{ inputs.city }}"}
"""


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """A secure stack whose state is `<dir>/.inferx`, as `inferx up` run in `<dir>`."""
    root = tmp_path_factory.mktemp("secure")
    with running_sim_stack(root / ".inferx", workers=1, insecure=False) as stack:
        yield stack


@pytest.fixture(scope="module")
def stranger(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    """A CA and certificate of someone else's: valid TLS, not the stack's."""
    return generate_local_pki(tmp_path_factory.mktemp("stranger") / "tls")


async def finish(client: InferxClient, chain: str, inputs: dict[str, str]):
    events = [e async for e in client.run_chain(chain, inputs)]
    return events[-1].chain_finished


def health(transport: Transport, address: str) -> int:
    with transport.channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
    return reply.status


def refused(transport: Transport, address: str) -> None:
    with pytest.raises(grpc.RpcError) as exc:
        health(transport, address)
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE


async def etcd_keys(stack: LocalStack, prefix: str) -> set[str]:
    async with stack.etcd_client() as client:
        return {kv.key.decode() for kv in await client.get_prefix(prefix.encode())}


# ----- the stack and its clients ----------------------------------------------------------------


def test_secure_stack_writes_its_ca_token_and_stack_file(secure: LocalStack) -> None:
    assert secure.tls is not None and secure.admin_token
    assert stat.S_IMODE(secure.token_file.stat().st_mode) == 0o600
    assert secure.token_file.read_text().strip() == secure.admin_token
    info = json.loads(secure.stack_file.read_text())
    assert info["router"] == secure.router_address
    assert info["tls_ca"] == str(secure.tls.ca) and info["token_file"] == str(secure.token_file)
    assert info["http"].startswith("https://127.0.0.1:")


async def test_chain_runs_through_the_router_over_tls(secure: LocalStack) -> None:
    async with InferxClient(secure.router_address, tls_ca=secure.tls_ca, token=secure.admin_token) as client:
        finished = await finish(client, "customer_service_agent", {"query": "Where is my order?"})
    assert finished.status == "ok", finished.error
    assert [h.status for h in finished.hops] == ["ok", "ok", "ok"]


async def test_plaintext_client_of_the_router_is_refused(secure: LocalStack) -> None:
    async with InferxClient(secure.router_address) as client:
        with pytest.raises(Unavailable):
            await client.status()


async def test_router_with_another_cas_certificate_is_not_trusted(secure: LocalStack, stranger) -> None:
    async with InferxClient(secure.router_address, tls_ca=stranger.ca) as client:
        with pytest.raises(Unavailable):
            await client.status()


def test_internal_service_refuses_plaintext_no_certificate_and_another_ca(
    secure: LocalStack, stranger: TlsFiles
) -> None:
    scheduler = secure.services["scheduler"].address
    assert health(secure.transport, scheduler) == health_pb2.HealthCheckResponse.SERVING  # the stack's own
    refused(Transport.plaintext(), scheduler)
    assert secure.tls_ca is not None
    refused(Transport.server_auth(secure.tls_ca), scheduler)  # right CA, but no client certificate
    refused(Transport.mutual(load_tls(stranger)), scheduler)  # a certificate of another CA


def test_https_front_serves_with_the_routers_certificate(secure: LocalStack) -> None:
    assert secure.tls_ca is not None
    url = secure.router_http_url + "/models"
    context = ssl.create_default_context(cafile=str(secure.tls_ca))
    headers = {"authorization": f"Bearer {secure.admin_token}"}
    reply = httpx.get(url, verify=context, timeout=10, headers=headers)
    assert reply.status_code == 200 and "qwen-7b" in reply.text
    with pytest.raises(httpx.HTTPError):
        httpx.get(url.replace("https://", "http://"), timeout=10)
    with pytest.raises(httpx.ConnectError):  # a client that does not know the stack's CA
        httpx.get(url, timeout=10)


def _cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERX_")}
    return subprocess.run(
        [sys.executable, "-m", "inferx.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        env=env,
    )


def test_cli_next_to_the_stack_finds_its_ca_and_token(secure: LocalStack, tmp_path: Path) -> None:
    router = ["--router", secure.router_address]
    here = _cli(secure.state_dir.parent, "status", "--json", *router)
    assert here.returncode == 0, here.stderr
    assert json.loads(here.stdout)["services"]
    elsewhere = _cli(tmp_path, "status", *router)  # no stack.json there: plaintext, refused
    assert elsewhere.returncode == 1 and elsewhere.stderr.startswith("inferx: UNAVAILABLE")
    assert secure.tls_ca is not None
    no_token = _cli(tmp_path, "status", "--json", *router, "--tls-ca", str(secure.tls_ca))
    assert no_token.returncode == 1 and no_token.stderr.startswith("inferx: UNAUTHENTICATED")
    assert secure.admin_token is not None
    flags = _cli(
        tmp_path, "status", "--json", *router, "--tls-ca", str(secure.tls_ca), "--token", secure.admin_token
    )
    assert flags.returncode == 0, flags.stderr


# ----- a service of another CA ------------------------------------------------------------------


async def test_worker_with_another_cas_certificate_never_gets_a_hop(
    secure: LocalStack, stranger: TlsFiles
) -> None:
    """It holds the stack's etcd certificate (so it registers) but serves with another
    CA's certificate: the scheduler cannot reach it, and every chain runs elsewhere."""
    assert secure.tls is not None
    before = await etcd_keys(secure, etcd.WORKERS)
    flags = ["--tls-ca", str(stranger.ca), "--tls-cert", str(stranger.cert), "--tls-key", str(stranger.key)]
    flags += ["--etcd-ca", str(secure.tls.ca), "--etcd-cert", str(secure.tls.cert)]
    flags += ["--etcd-key", str(secure.tls.key)]
    foreign = secure.start_worker("tiny-llama", "sim", ["--sim-speed", "5"], transport_flags=flags)
    try:

        async def registered() -> set[str]:
            return await etcd_keys(secure, etcd.WORKERS) - before

        await poll_until(registered, timeout_s=30, what="the foreign worker to register")
        foreign_id = (await registered()).pop().rsplit("/", 1)[1]
        refused(secure.transport, foreign.address)  # the stack cannot verify it
        workers: set[str] = set()
        async with secure.client() as client:
            for i in range(8):
                finished = await finish(client, "customer_service_agent", {"query": f"order {i}?"})
                assert finished.status == "ok", finished.error
                workers |= {h.worker_id for h in finished.hops if h.worker_id}
        assert workers and foreign_id not in workers
    finally:
        foreign.stop()


# ----- etcd: no client certificate, no registration ---------------------------------------------


async def test_etcd_refuses_clients_without_the_cas_client_certificate(
    secure: LocalStack, stranger: TlsFiles
) -> None:
    assert secure.tls is not None and stranger.cert is not None and stranger.key is not None
    key = b"/inferx/v1/tools/intruder/x"
    ca = secure.tls.ca.read_bytes()
    # (load_tls would refuse the last one before any connection: built by hand here)
    other = TlsMaterial(stranger, ca, stranger.cert.read_bytes(), stranger.key.read_bytes())
    for tls in (None, load_tls(TlsFiles(secure.tls.ca)), other):
        client = make_client(secure.etcd_endpoint, timeout_s=2, tls=tls)
        try:
            with pytest.raises(etcd.ETCD_DOWN_ERRORS):
                await client.put(key, b'{"address": "127.0.0.1:1"}')
        finally:
            await client.close()
    assert await etcd_keys(secure, "/inferx/v1/tools/intruder/") == set()


async def test_worker_without_an_etcd_certificate_never_registers(secure: LocalStack) -> None:
    assert secure.tls is not None
    before = await etcd_keys(secure, etcd.WORKERS)
    service_only = secure.transport_flags()[:6]  # --tls-*: no --etcd-*
    assert service_only[0] == "--tls-ca" and "--etcd-ca" not in service_only
    worker = secure.start_worker("tiny-llama", "sim", ["--sim-speed", "5"], transport_flags=service_only)
    try:
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            assert await etcd_keys(secure, etcd.WORKERS) == before
            await asyncio.sleep(0.5)
        assert "PLAINTEXT" in worker.log_path.read_text()  # it was told where it stands
    finally:
        worker.stop()


# ----- tool servers ------------------------------------------------------------------------------


def start_weather_tool(stack: LocalStack, name: str, flags: list[str]) -> ManagedProcess:
    proc = ManagedProcess(
        name,
        [
            sys.executable,
            str(ROOT / "examples" / "tools" / "weather_tool.py"),
            "--etcd",
            stack.etcd_endpoint,
            "--port",
            str(free_port()),
            "--instance-id",
            name,
            "--lease-ttl-s",
            "3",
            *flags,
        ],
        stack.state_dir / "logs" / f"{name}.log",
    )
    proc.start()
    return proc


async def test_tool_server_registers_as_a_tls_endpoint_and_is_called_with_tls(secure: LocalStack) -> None:
    tool = start_weather_tool(secure, "weather-tls", secure.transport_flags())
    try:
        key = etcd.tool_key("weather", "weather-tls")

        async def registration() -> dict | None:
            async with secure.etcd_client() as client:
                found = await client.get(key.encode())
            return json.loads(found.value) if found is not None else None

        row = await poll_until(registration, timeout_s=30, what="the weather tool to register")
        assert row["tls"] is True
        async with secure.client() as client:
            await client.put_chain(CHAIN.replace("NAME", "weather_tls").replace("TOOL", "weather"))

            async def ran():
                finished = await finish(client, "weather_tls", {"city": "Paris"})
                return finished if "neither built in" not in finished.hops[0].error else None

            finished = await poll_until(ran, timeout_s=10, what="the router to see the tool")
        assert finished.status == "ok", finished.error
        assert json.loads(finished.hops[0].output) == {"city": "Paris", "sky": "clear"}
    finally:
        tool.stop()


async def test_router_does_not_call_a_plaintext_tool_endpoint(secure: LocalStack) -> None:
    """Registered by someone holding etcd credentials, but plaintext: prompts would
    leave in the clear, so the router refuses, naming why."""
    async with secure.etcd_client() as client:
        lease = await client.lease(30)
        await client.put(etcd.tool_key("legacy", "x").encode(), b'{"address": "127.0.0.1:9"}', lease=lease.id)
    async with secure.client() as client:
        await client.put_chain(CHAIN.replace("NAME", "legacy_tool").replace("TOOL", "legacy"))

        async def ran():
            finished = await finish(client, "legacy_tool", {"city": "Oslo"})
            return finished if "neither built in" not in finished.hops[0].error else None

        finished = await poll_until(ran, timeout_s=10, what="the router to see the tool")
    assert finished.status == "error"
    assert "registered only as a plaintext endpoint" in finished.hops[0].error


async def test_tool_server_without_an_etcd_certificate_never_registers(secure: LocalStack) -> None:
    tool = start_weather_tool(secure, "weather-nocert", secure.transport_flags()[:6])
    try:
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            assert await etcd_keys(secure, etcd.tool_key("weather", "weather-nocert")) == set()
            await asyncio.sleep(0.5)
        assert tool.alive()
        assert "refuses or cannot be reached" in tool.log_path.read_text()
    finally:
        tool.stop()


def test_bench_against_the_secure_stack_calls_its_scheduler_with_the_stacks_certificate(
    secure: LocalStack, tmp_path: Path
) -> None:
    """`inferx bench --router` run next to the stack: the router over TLS with its CA and
    token, the scheduler with mutual TLS with the certificate stack.json names."""
    from inferx.sim.profile import EngineProfile
    from inferx.sim.trace import TraceConfig, generate, write_trace

    trace_file = tmp_path / "trace.jsonl"
    config = TraceConfig(seed=5, duration_s=2.0, rate_per_s=1.0, mix={"bfcl": 1.0})
    write_trace(generate(config, EngineProfile()), trace_file)
    argv = ["bench", "--router", secure.router_address, "--trace", str(trace_file), "--rate", "1"]
    argv += ["--speed", "20", "--timeout", "120", "--results", str(tmp_path / "r.json"), "--json"]
    done = _cli(secure.state_dir.parent, *argv)
    assert done.returncode == 0, done.stderr
    (summary,) = json.loads(done.stdout)["summaries"]
    assert summary["overall"]["completed"] == summary["overall"]["chains"] >= 1


def test_node_client_runs_a_chain_over_tls_with_the_token(
    secure: LocalStack, request: pytest.FixtureRequest
) -> None:
    """Another language against the secure stack: grpc-js with the stack's CA."""
    node = request.getfixturevalue("node_client")
    env = {**os.environ, "INFERX_TLS_CA": str(secure.tls_ca), "INFERX_TOKEN": secure.admin_token or ""}
    argv = [node, "run_chain.js", secure.router_address, "customer_service_agent", "query=hi"]
    done = subprocess.run(argv, cwd=NODE_CLIENT, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1])["chain_finished"]["status"] == "ok"
    plain = subprocess.run(argv, cwd=NODE_CLIENT, capture_output=True, text=True, timeout=60)
    assert plain.returncode == 1 and plain.stderr.startswith("UNAVAILABLE")
