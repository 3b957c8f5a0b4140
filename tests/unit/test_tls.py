"""inferx.tls: the local PKI, the checks of TLS files (one line naming the flag and the
file, never a traceback), the secure-by-default decision, and what the CLI picks up
from the local stack's stack.json."""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from inferx.cli import connect
from inferx.settings import ServiceSettings, load_settings
from inferx.tls import (
    NO_TLS_HINT,
    Security,
    TlsError,
    TlsFiles,
    Transport,
    generate_local_pki,
    load_tls,
    read_ca,
)
from inferx_router.__main__ import RouterSettings

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return generate_local_pki(tmp_path_factory.mktemp("pki") / "tls")


@pytest.fixture(scope="module")
def other(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    """Another CA's files: what a stranger holds."""
    return generate_local_pki(tmp_path_factory.mktemp("other") / "tls")


def one_line(exc: pytest.ExceptionInfo[TlsError]) -> str:
    message = str(exc.value)
    assert "\n" not in message
    return message


# ----- the local PKI ------------------------------------------------------------------------


def test_local_pki_is_a_ca_and_a_server_and_client_certificate(pki: TlsFiles) -> None:
    assert pki.cert is not None and pki.key is not None
    material = load_tls(pki)  # the checks pass: key matches, issued by the CA, valid now
    assert material.cert is not None
    ca = x509.load_pem_x509_certificate(pki.ca.read_bytes())
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    leaf = x509.load_pem_x509_certificate(pki.cert.read_bytes())
    names = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert names.get_values_for_type(x509.DNSName) == ["localhost"]
    usages = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert {u.dotted_string for u in usages} == {"1.3.6.1.5.5.7.3.1", "1.3.6.1.5.5.7.3.2"}  # server, client


def test_local_pki_keys_are_private_and_the_ca_key_is_not_kept(pki: TlsFiles) -> None:
    assert pki.key is not None
    assert stat.S_IMODE(pki.key.stat().st_mode) == 0o600
    assert stat.S_IMODE(pki.ca.parent.stat().st_mode) == 0o700
    assert sorted(p.name for p in pki.ca.parent.iterdir()) == ["ca.pem", "service.key", "service.pem"]


def test_local_pki_is_reused_unless_asked_or_hosts_change(tmp_path: Path) -> None:
    first = generate_local_pki(tmp_path)
    ca = first.ca.read_bytes()
    assert generate_local_pki(tmp_path).ca.read_bytes() == ca
    assert generate_local_pki(tmp_path, reuse=False).ca.read_bytes() != ca
    again = generate_local_pki(tmp_path, hosts=("127.0.0.1", "localhost", "router"))
    assert again.cert is not None
    leaf = x509.load_pem_x509_certificate(again.cert.read_bytes())
    names = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "router" in names.get_values_for_type(x509.DNSName)


# ----- checks of the files ------------------------------------------------------------------


def test_missing_file_names_the_flag_and_the_path(pki: TlsFiles, tmp_path: Path) -> None:
    with pytest.raises(TlsError) as exc:
        load_tls(TlsFiles(tmp_path / "nope.pem", pki.cert, pki.key))
    assert one_line(exc) == f"--tls-ca {tmp_path / 'nope.pem'}: no such file"


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_unreadable_key_is_permission_denied(pki: TlsFiles, tmp_path: Path) -> None:
    assert pki.key is not None
    key = tmp_path / "key.pem"
    key.write_bytes(pki.key.read_bytes())
    key.chmod(0)
    with pytest.raises(TlsError) as exc:
        load_tls(TlsFiles(pki.ca, pki.cert, key))
    assert one_line(exc) == f"--tls-key {key}: permission denied (cannot read it)"


def test_not_pem_empty_and_directory_are_named(pki: TlsFiles, tmp_path: Path) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("hello\n")
    empty = tmp_path / "empty.pem"
    empty.write_text("")
    with pytest.raises(TlsError, match=r"^--tls-cert .*junk.pem: not a PEM certificate"):
        load_tls(TlsFiles(pki.ca, junk, pki.key))
    with pytest.raises(TlsError, match=r"^--tls-key .*junk.pem: not a PEM private key$"):
        load_tls(TlsFiles(pki.ca, pki.cert, junk))
    with pytest.raises(TlsError, match=r"^--tls-ca .*empty.pem: the file is empty$"):
        load_tls(TlsFiles(empty, pki.cert, pki.key))
    with pytest.raises(TlsError, match=r"is a directory"):
        load_tls(TlsFiles(tmp_path, pki.cert, pki.key))
    with pytest.raises(TlsError, match=r"^--tls-ca .*junk.pem: not a PEM certificate"):
        read_ca(junk)


def test_key_of_another_certificate_is_a_mismatch(pki: TlsFiles, other: TlsFiles) -> None:
    with pytest.raises(TlsError) as exc:
        load_tls(TlsFiles(pki.ca, pki.cert, other.key))
    assert one_line(exc).startswith(
        f"--tls-key {other.key} does not match the certificate --tls-cert {pki.cert}"
    )


def test_certificate_of_another_ca_is_refused_at_start(pki: TlsFiles, other: TlsFiles) -> None:
    with pytest.raises(TlsError) as exc:
        load_tls(TlsFiles(pki.ca, other.cert, other.key))
    assert one_line(exc) == (
        f"--tls-cert {other.cert} was not issued by the CA in --tls-ca {pki.ca}: peers would refuse it"
    )


def test_encrypted_key_is_named(pki: TlsFiles, tmp_path: Path) -> None:
    assert pki.key is not None
    key = serialization.load_pem_private_key(pki.key.read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    encrypted = tmp_path / "enc.key"
    encrypted.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    with pytest.raises(TlsError, match=r"the key is encrypted; give an unencrypted PEM key$"):
        load_tls(TlsFiles(pki.ca, pki.cert, encrypted))


def test_partial_options_say_what_is_missing() -> None:
    with pytest.raises(TlsError, match=r"^--tls-cert needs --tls-key too"):
        TlsFiles.from_options("ca.pem", "cert.pem", "")
    with pytest.raises(TlsError, match=r"^--tls-cert/--tls-key need --tls-ca"):
        TlsFiles.from_options("", "cert.pem", "key.pem")
    assert TlsFiles.from_options("", "", "") is None
    assert TlsFiles.from_options("ca.pem", "", "") == TlsFiles(Path("ca.pem"))


# ----- secure by default ---------------------------------------------------------------------


def test_neither_tls_files_nor_insecure_is_refused_saying_what_to_pass() -> None:
    with pytest.raises(TlsError) as exc:
        Security.resolve(None, None, insecure=False)
    assert one_line(exc) == NO_TLS_HINT
    assert "--tls-ca" in NO_TLS_HINT and "--insecure" in NO_TLS_HINT


def test_insecure_and_tls_files_together_are_refused(pki: TlsFiles) -> None:
    with pytest.raises(TlsError, match="choose one"):
        Security.resolve(pki, None, insecure=True)


def test_a_service_needs_its_own_certificate(pki: TlsFiles) -> None:
    with pytest.raises(TlsError, match="--tls-ca needs --tls-cert and --tls-key"):
        Security.resolve(TlsFiles(pki.ca), None, insecure=False)


def test_settings_decide_the_transport(pki: TlsFiles) -> None:
    insecure = load_settings(ServiceSettings, "x", ["--insecure"]).security()
    assert (
        insecure.insecure
        and insecure.transport.insecure
        and insecure.server_credentials(require_client_auth=True) is None
    )
    flags = ["--tls-ca", str(pki.ca), "--tls-cert", str(pki.cert), "--tls-key", str(pki.key)]
    secure = load_settings(ServiceSettings, "x", [*flags, "--etcd-ca", str(pki.ca)]).security()
    assert not secure.insecure and secure.transport.description == "mutual TLS"
    assert secure.etcd is not None and secure.etcd.cert is None  # etcd: server-auth only here
    with pytest.raises(TlsError, match="^--etcd-cert needs --etcd-key"):
        load_settings(ServiceSettings, "x", [*flags, "--etcd-ca", str(pki.ca), "--etcd-cert", "c"]).security()


def test_internal_services_require_client_certificates_the_router_does_not() -> None:
    assert load_settings(ServiceSettings, "x", ["--insecure"]).tls_client_auth is True
    assert load_settings(RouterSettings, "inferx-router", ["--insecure"]).tls_client_auth is False
    assert load_settings(RouterSettings, "inferx-router", ["--insecure", "--tls-client-auth"]).tls_client_auth


def test_transport_server_auth_reads_only_the_ca(pki: TlsFiles, tmp_path: Path) -> None:
    assert Transport.server_auth(pki.ca).description == "TLS"
    with pytest.raises(TlsError, match="no such file"):
        Transport.server_auth(tmp_path / "missing.pem")


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], NO_TLS_HINT),
        (["--tls-ca", "/nonexistent/ca.pem", "--tls-cert", "c.pem", "--tls-key", "k.pem"], "no such file"),
    ],
)
def test_a_service_without_tls_or_insecure_exits_with_one_line(argv: list[str], expected: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "inferx_cache", "--etcd", "127.0.0.1:9", "--port", "0", *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith("inferx-cache: error: ") and expected in done.stderr


# ----- peers verified by a fixed name (--tls-server-name) ------------------------------------------


NAME = "inferx.internal"


@pytest.fixture(scope="module")
def named_pki(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    """One certificate for every pod, naming no address: only the SAN inferx.internal."""
    return generate_local_pki(tmp_path_factory.mktemp("named") / "tls", ["inferx.internal"])


def test_server_name_settings(pki: TlsFiles, monkeypatch: pytest.MonkeyPatch) -> None:
    flags = ["--tls-ca", str(pki.ca), "--tls-cert", str(pki.cert), "--tls-key", str(pki.key)]
    named = load_settings(ServiceSettings, "x", [*flags, "--tls-server-name", "inferx.internal"]).security()
    assert named.transport.server_name == "inferx.internal"
    assert named.transport.description == "mutual TLS, peers verified as inferx.internal"
    assert load_settings(ServiceSettings, "x", flags).security().transport.server_name is None
    monkeypatch.setenv("INFERX_TLS_SERVER_NAME", "peers.inferx.svc")
    assert load_settings(ServiceSettings, "x", flags).security().transport.server_name == "peers.inferx.svc"
    monkeypatch.delenv("INFERX_TLS_SERVER_NAME")
    etcd = [*flags, "--etcd-ca", str(pki.ca), "--etcd-server-name", "etcd.internal"]
    assert load_settings(ServiceSettings, "x", etcd).security().etcd_server_name == "etcd.internal"
    with pytest.raises(TlsError, match=r"^--tls-server-name names the peers' certificates: it needs"):
        load_settings(ServiceSettings, "x", ["--insecure", "--tls-server-name", "inferx.internal"]).security()
    with pytest.raises(TlsError, match=r"^--etcd-server-name names etcd's certificate: it needs --etcd-ca"):
        load_settings(ServiceSettings, "x", [*flags, "--etcd-server-name", "etcd.internal"]).security()


@pytest.mark.parametrize("name", ["inferx.internal:50051", "https://inferx.internal", "a b", "-x.internal"])
def test_server_name_must_be_a_dns_name(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        load_settings(ServiceSettings, "inferx-cache", ["--insecure", f"--tls-server-name={name}"])
    assert "inferx-cache: error: --tls-server-name: " in capsys.readouterr().err
    with pytest.raises(TlsError, match="not a DNS name"):
        Security.resolve(None, None, insecure=True, server_name=name)


async def test_a_peer_is_verified_by_the_name_on_its_certificate_not_its_address(named_pki: TlsFiles) -> None:
    """A real TLS handshake with a server at 127.0.0.1 whose certificate names only
    inferx.internal: refused as 127.0.0.1, accepted as inferx.internal (mutual TLS, and
    the synchronous channel too); the name never leaks into plaintext channels."""
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from inferx.tls import server_credentials

    material = load_tls(named_pki)
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_secure_port("127.0.0.1:0", server_credentials(material, require_client_auth=True))
    await server.start()
    address = f"127.0.0.1:{port}"
    try:
        named = Transport.mutual(material, server_name="inferx.internal")
        async with named.aio_channel(address) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        by_address = Transport.mutual(material)
        async with by_address.aio_channel(address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
        wrong = Transport.mutual(material, server_name="other.internal")
        async with wrong.aio_channel(address) as channel:
            with pytest.raises(grpc.aio.AioRpcError):
                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    finally:
        await server.stop(0)
    assert ("grpc.ssl_target_name_override", "inferx.internal") in named._options([])
    assert named._options([("grpc.ssl_target_name_override", "x")]) == [
        ("grpc.ssl_target_name_override", "inferx.internal")
    ]
    assert Transport.plaintext()._options([]) == [] and by_address._options([]) == []


# ----- the CLI finds the local stack -------------------------------------------------------------


def _args(**kw: object) -> argparse.Namespace:
    return argparse.Namespace(**{"router": "127.0.0.1:50051", "token": None, "tls_ca": None, **kw})


def test_cli_uses_the_local_stacks_ca_and_token_for_its_router(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".inferx").mkdir()
    token = tmp_path / ".inferx" / "admin.token"
    token.write_text("ixt_0123456789abcdef_" + "x" * 43 + "\n")
    stack = {"router": "127.0.0.1:50051", "tls_ca": "/s/ca.pem", "token_file": str(token), "http": None}
    (tmp_path / ".inferx" / "stack.json").write_text(json.dumps(stack))

    found = connect.resolve(_args())
    assert (found.tls_ca, found.token) == ("/s/ca.pem", "ixt_0123456789abcdef_" + "x" * 43)
    assert connect.resolve(_args(router="localhost:50051")).tls_ca == "/s/ca.pem"
    assert connect.resolve(_args(router="10.0.0.7:50051")) == connect.Connection("10.0.0.7:50051")
    # Given flags win, whole: the stack's token is not sent to another CA's router.
    assert connect.resolve(_args(tls_ca="/mine.pem")) == connect.Connection(
        "127.0.0.1:50051", None, "/mine.pem"
    )
    # Another token for the stack's router: still the stack's CA (public), never its token.
    assert connect.resolve(_args(token="t")) == connect.Connection("127.0.0.1:50051", "t", "/s/ca.pem")
    assert connect.resolve(_args(token="t", router="10.0.0.7:50051")) == connect.Connection(
        "10.0.0.7:50051", "t"
    )


def test_cli_calls_internal_services_verifying_the_stacks_server_name(
    named_pki: TlsFiles, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`inferx bench --router` dials the scheduler (an internal service) with the stack's
    certificate: by the name on it, when the stack's processes verify one another so."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("INFERX_TLS_SERVER_NAME", raising=False)
    (tmp_path / ".inferx").mkdir()
    stack = {"router": "127.0.0.1:50051", "tls_ca": str(named_pki.ca), "token_file": None}
    stack |= {"tls_cert": str(named_pki.cert), "tls_key": str(named_pki.key), "tls_server_name": NAME}
    (tmp_path / ".inferx" / "stack.json").write_text(json.dumps(stack))
    found = connect.resolve(_args())
    assert found.tls_server_name == NAME
    assert found.internal_transport().server_name == NAME
    monkeypatch.setenv("INFERX_TLS_SERVER_NAME", "other.internal")
    assert found.internal_transport().server_name == "other.internal"


def test_cli_without_a_stack_file_is_plaintext(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert connect.resolve(_args()) == connect.Connection("127.0.0.1:50051")


def test_cli_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERX_TOKEN", "from-env")
    monkeypatch.setenv("INFERX_TLS_CA", "/env/ca.pem")
    parser = argparse.ArgumentParser()
    connect.add_router_flags(parser)
    args = parser.parse_args([])
    assert (args.token, args.tls_ca) == ("from-env", "/env/ca.pem")
    args = parser.parse_args(["--token", "flag", "--tls-ca", "/flag.pem"])
    assert (args.token, args.tls_ca) == ("flag", "/flag.pem")


def test_cli_uses_the_local_stacks_ca_and_token_for_every_router_it_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`inferx up --replicas 2`: the second router (50151) is the stack's router too (issue #45)."""
    from types import SimpleNamespace

    from inferx.devstack import LocalStack, StackPorts

    monkeypatch.chdir(tmp_path)
    stack = LocalStack(tmp_path / ".inferx", StackPorts())
    stack.admin_token = "ixt_0123456789abcdef_" + "y" * 43
    stack.token_file.parent.mkdir(parents=True, exist_ok=True)
    stack.token_file.write_text(stack.admin_token + "\n")
    for name, port in (("router", 50051), ("scheduler", 50052), ("router-1", 50151)):
        stack.services[name] = SimpleNamespace(address=f"127.0.0.1:{port}")  # type: ignore[assignment]
    stack.write_stack_file()
    assert json.loads(stack.stack_file.read_text())["routers"] == ["127.0.0.1:50051", "127.0.0.1:50151"]
    assert stack.tls_ca is not None
    for router in ("127.0.0.1:50051", "127.0.0.1:50151", "localhost:50151"):
        found = connect.resolve(_args(router=router))
        assert (found.tls_ca, found.token) == (str(stack.tls_ca), stack.admin_token), router
    assert connect.resolve(_args(router="127.0.0.1:50052")) == connect.Connection("127.0.0.1:50052")


async def test_a_tls_plaintext_mismatch_is_named_not_is_it_running(pki: TlsFiles) -> None:
    """A plaintext client at a TLS port, a TLS client at a plaintext port, and a port
    nobody serves: each says which it is (issue #45)."""
    import grpc

    from inferx.client import InferxClient
    from inferx.devstack import free_port
    from inferx.errors import Unavailable

    async def failure(tls_server: bool, tls_client: bool) -> str:
        server = grpc.aio.server()
        if tls_server:
            from inferx.tls import server_credentials

            credentials = server_credentials(load_tls(pki), require_client_auth=False)
            port = server.add_secure_port("127.0.0.1:0", credentials)
        else:
            port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with InferxClient(f"127.0.0.1:{port}", tls_ca=pki.ca if tls_client else None) as client:
                with pytest.raises(Unavailable) as raised:
                    await client.list_chains()
            return str(raised.value)
        finally:
            await server.stop(None)

    plaintext_at_tls = await failure(tls_server=True, tls_client=False)
    assert "looks like a TLS port" in plaintext_at_tls and "--tls-ca" in plaintext_at_tls
    assert "is it running" not in plaintext_at_tls
    tls_at_plaintext = await failure(tls_server=False, tls_client=True)
    assert "looks like a plaintext (--insecure) port" in tls_at_plaintext
    assert "is it running" not in tls_at_plaintext
    async with InferxClient(f"127.0.0.1:{free_port()}") as client:
        with pytest.raises(Unavailable, match="is it running"):
            await client.list_chains()


# ----- tool endpoints: a router calls only its own kind --------------------------------------------


@pytest.mark.parametrize(
    ("router_insecure", "registered_tls", "expected"),
    [
        (False, True, None),
        (True, False, None),
        (False, False, "registered only as a plaintext endpoint"),
        (True, True, "registered only as a TLS endpoint"),
    ],
)
def test_router_resolves_only_tool_endpoints_of_its_own_transport(
    pki: TlsFiles, router_insecure: bool, registered_tls: bool, expected: str | None
) -> None:
    from inferx import etcd
    from inferx.discovery import ChannelPool, ServiceLocator
    from inferx.errors import FailedPrecondition
    from inferx_router.tools import ToolRouter

    transport = Transport.plaintext() if router_insecure else Transport.mutual(load_tls(pki))
    tools = ToolRouter(None, ServiceLocator(None), ChannelPool(transport), None)
    registration = {"address": "10.0.0.1:7000", "tls": registered_tls}
    tools.remote.items = {etcd.tool_key("weather", "a"): json.dumps(registration).encode()}
    if expected is None:
        assert tools.resolve("weather").target == "tool:weather@10.0.0.1:7000"
    else:
        with pytest.raises(FailedPrecondition, match=expected):
            tools.resolve("weather")


def test_inferx_up_says_where_the_ca_and_the_admin_token_are(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from inferx.devstack import LocalStack, StackPorts, print_addresses

    monkeypatch.chdir(tmp_path)
    stack = LocalStack(tmp_path / ".inferx", StackPorts())
    stack.admin_token = "ixt_x"
    print_addresses(stack, {"qwen-7b": {"pool": "tiny-llama"}}, [])
    printed = capsys.readouterr().out
    assert "CA .inferx/tls/ca.pem" in printed and "admin token: .inferx/admin.token (0600)" in printed
    assert "https://127.0.0.1:8000/v1" in printed
    insecure = LocalStack(tmp_path / "plain", StackPorts(), insecure=True)
    print_addresses(insecure, {}, [])
    assert "INSECURE: plaintext everywhere, no tokens" in capsys.readouterr().out
    assert not (tmp_path / "plain" / "tls").exists()
