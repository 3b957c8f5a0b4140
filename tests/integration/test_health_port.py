"""`--health-port`: what Kubernetes' native gRPC probes call on a secure stack.

The kubelet's gRPC probes speak plaintext and present no client certificate, so they can
never pass against a service's mutual-TLS port. A real service process (the cache) of a
secure stack, started with `--health-port`, answers grpc.health.v1 there in plaintext,
goes NOT_SERVING there from SIGTERM on, serves nothing else on that port (no reflection,
none of its own methods), while its serving port still refuses plaintext.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from inferx.devstack import LocalStack, ManagedProcess, free_port, wait_serving
from inferx.tls import Transport
from inferx.v1 import cache_pb2, cache_pb2_grpc
from tests.conftest import dump_logs, make_stack, started

pytestmark = pytest.mark.integration

CACHE = "inferx.v1.Cache"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """A secure stack (mutual TLS, TLS etcd): etcd alone; the tests start the cache."""

    def start(stack: LocalStack) -> None:
        stack.start_etcd()

    with started(make_stack(tmp_path_factory.mktemp("health") / ".inferx", insecure=False), start) as stack:
        yield stack


def start_cache(stack: LocalStack, replica: int, health_port: int) -> ManagedProcess:
    extra = ["--health-port", str(health_port), "--deregister-grace-s", "3", "--drain-timeout-s", "2"]
    proc = stack.start_service("cache", extra, replica=replica)
    try:
        wait_serving(proc, 60)  # its serving port, over the stack's mutual TLS
    except BaseException:
        dump_logs(stack)
        raise
    return proc


def check(transport: Transport, address: str, service: str = "") -> int:
    with transport.channel(address) as channel:
        request = health_pb2.HealthCheckRequest(service=service)
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=3).status


def reflect(transport: Transport, address: str) -> list[str]:
    """The service names server reflection lists at `address`."""
    with transport.channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        replies = list(stub.ServerReflectionInfo(iter([request]), timeout=3))
    return [s.name for s in replies[0].list_services_response.service]


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as exc:
        call()
    return exc.value.code()


def test_health_port_answers_plaintext_checks_while_the_serving_port_refuses_plaintext(
    stack: LocalStack,
) -> None:
    health_port = free_port()
    proc = start_cache(stack, 1, health_port)
    try:
        probe = f"127.0.0.1:{health_port}"
        plaintext = Transport.plaintext()
        serving = health_pb2.HealthCheckResponse.SERVING
        assert check(plaintext, probe) == serving  # what `grpc: {port: ...}` asks
        assert check(plaintext, probe, CACHE) == serving
        # the serving port: mutual TLS only, as before
        assert check(stack.transport, proc.address) == serving
        assert code_of(lambda: check(plaintext, proc.address)) == grpc.StatusCode.UNAVAILABLE
    finally:
        proc.stop()


def test_health_port_serves_nothing_but_health(stack: LocalStack) -> None:
    health_port = free_port()
    proc = start_cache(stack, 2, health_port)
    try:
        probe = f"127.0.0.1:{health_port}"
        plaintext = Transport.plaintext()
        # over mutual TLS, the serving port lists the cache, health and reflection ...
        assert {CACHE, "grpc.health.v1.Health"} <= set(reflect(stack.transport, proc.address))
        # ... the health port has no reflection, and none of the cache's methods
        assert code_of(lambda: reflect(plaintext, probe)) == grpc.StatusCode.UNIMPLEMENTED
        with plaintext.channel(probe) as channel:
            cache = cache_pb2_grpc.CacheStub(channel)
            get = cache_pb2.CacheGetRequest(key="k")
            assert code_of(lambda: cache.Get(get, timeout=3)) == grpc.StatusCode.UNIMPLEMENTED
            stats = cache_pb2.CacheStatsRequest()
            assert code_of(lambda: cache.GetCacheStats(stats, timeout=3)) == grpc.StatusCode.UNIMPLEMENTED
        # nor does it speak TLS: a probe is plaintext, and so is the port
        assert code_of(lambda: check(stack.transport, probe)) == grpc.StatusCode.UNAVAILABLE
    finally:
        proc.stop()


def test_health_port_says_not_serving_from_sigterm_through_the_drain(stack: LocalStack) -> None:
    """Readiness fails as soon as the pod is told to stop (the kubelet then takes it out
    of the endpoints), while the process still drains; the port closes only at exit."""
    health_port = free_port()
    proc = start_cache(stack, 3, health_port)
    probe = f"127.0.0.1:{health_port}"
    try:
        assert check(Transport.plaintext(), probe) == health_pb2.HealthCheckResponse.SERVING
        proc.signal(signal.SIGTERM)
        seen = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and proc.alive():
            try:
                seen.append(check(Transport.plaintext(), probe))
            except grpc.RpcError:
                break  # the process has stopped the port on its way out
            if health_pb2.HealthCheckResponse.NOT_SERVING in seen:
                break
            time.sleep(0.1)
        assert health_pb2.HealthCheckResponse.NOT_SERVING in seen, (seen, proc.log_tail())
        assert proc.wait(15) == 0
    finally:
        proc.stop()


def test_health_port_in_use_is_a_one_line_startup_error(stack: LocalStack) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = stack.start_service("cache", ["--health-port", str(port)], replica=4)
        try:
            assert proc.wait(30) == 1
        finally:
            proc.stop()
    log = proc.log_path.read_text()
    assert "(--health-port" in log and "Traceback" not in log, log
