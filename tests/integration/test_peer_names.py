"""`--tls-server-name`: peers verified by a fixed name, not by the address dialled.

Services register and dial addresses (pod IPs on Kubernetes, 127.0.0.1 here) that no
certificate shared by every pod can name. The stack here has one certificate whose only
subject alternative name is `inferx.internal`; every process runs with
`--tls-server-name inferx.internal` (and `--etcd-server-name`), and a chain runs through
router, cache, scheduler, memory-pool and a worker, all dialled at 127.0.0.1. Without
the flag the same certificate is refused: a router started without it serves, but
reaches no scheduler.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator

import grpc
import pytest
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inferx import etcd
from inferx.client import InferxClient
from inferx.devstack import LocalStack, wait_serving
from inferx.tls import Transport, load_tls
from tests.conftest import dump_logs, running_sim_stack

pytestmark = pytest.mark.integration

NAME = "inferx.internal"


@pytest.fixture(scope="module")
def named(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    root = tmp_path_factory.mktemp("named")
    with running_sim_stack(root / ".inferx", workers=1, insecure=False, tls_server_name=NAME) as stack:
        yield stack


def health(transport: Transport, address: str) -> int:
    with transport.channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3).status


async def run(client: InferxClient, query: str):
    events = [e async for e in client.run_chain("customer_service_agent", {"query": query})]
    return events[-1].chain_finished


def test_the_stacks_certificate_names_no_address(named: LocalStack) -> None:
    assert named.tls is not None and named.tls.cert is not None
    leaf = x509.load_pem_x509_certificates(named.tls.cert.read_bytes())[0]
    names = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == [NAME]
    assert names.get_values_for_type(x509.IPAddress) == []
    flags = named.transport_flags()
    assert flags[flags.index("--tls-server-name") + 1] == NAME
    assert all(w.address.startswith("127.0.0.1:") for w in named.workers)
    assert ipaddress.ip_address(named.services["scheduler"].address.rsplit(":", 1)[0]).is_loopback


async def test_a_chain_runs_through_every_service_dialled_by_address_verified_by_name(
    named: LocalStack,
) -> None:
    hops = []
    async with named.client() as client:
        for query in ("Where is my order?", "Where is my order?"):
            finished = await run(client, query)
            assert finished.status == "ok", finished.error
            assert [h.status for h in finished.hops] == ["ok", "ok", "ok"]
            hops += finished.hops
    # router -> scheduler -> worker (with the memory-pool's reservations) for the model
    # hops; router -> cache replica for the tool hop's result (stored, then found)
    assert all(h.worker_id for h in hops if h.model)
    assert not any(h.cache_unavailable for h in hops)
    assert any(h.cache_hit for h in hops)


async def test_without_the_name_the_same_certificate_is_refused(named: LocalStack) -> None:
    assert named.tls is not None
    material = load_tls(named.tls)
    scheduler = named.services["scheduler"].address
    assert health(named.transport, scheduler) == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as exc:
        health(Transport.mutual(material), scheduler)  # verified as 127.0.0.1: not on it
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
    # etcd, likewise (--etcd-server-name)
    client = etcd.make_client(named.etcd_endpoint, timeout_s=2, tls=material)
    try:
        with pytest.raises(etcd.ETCD_DOWN_ERRORS):
            await client.get(b"/inferx/v1/models/qwen-7b")
    finally:
        await client.close()

    # A router with everything but --tls-server-name: it reaches etcd (by name), serves,
    # and refuses the scheduler's certificate, so no model hop of a chain runs.
    flags = named.transport_flags()
    at = flags.index("--tls-server-name")
    router = named.start_service("router", replica=1, transport_flags=flags[:at] + flags[at + 2 :])
    try:
        wait_serving(router, 60)
        assert named.tls_ca is not None
        transport = Transport.server_auth(named.tls_ca, server_name=NAME)
        async with InferxClient(
            router.address, token=named.admin_token, transport=transport, timeout_s=30
        ) as client:
            finished = await run(client, "Where is my order?")
        assert finished.status != "ok"
        model_hops = [h for h in finished.hops if h.model]
        assert model_hops and all(h.status != "ok" for h in model_hops), finished
        assert not any(h.worker_id for h in finished.hops)
        # "cannot reach scheduler at 127.0.0.1:P ... Hostname Verification Check failed"
        first = model_hops[0].error
        assert "cannot reach scheduler" in first and "verification" in first.lower(), first
    except BaseException:
        dump_logs(named)
        raise
    finally:
        router.stop()
