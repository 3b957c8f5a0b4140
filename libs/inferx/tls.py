"""TLS for every InferX connection, in one place.

- `TlsFiles`: where a process's CA, certificate and key are (paths, as given by flags).
- `load_tls`: reads and checks them once, at start-up, so a wrong file is a one-line
  error naming the flag and the file (`TlsError`), never a handshake failure later.
- `Transport`: how this process opens gRPC channels -- mutual TLS with its own
  certificate (services, tool servers), TLS with a CA only (the SDK calling the
  router's public port), or plaintext (only with an explicit `--insecure`). Every
  channel InferX opens comes from `Transport.aio_channel` / `Transport.channel`. With a
  `server_name` (`--tls-server-name`) the peer's certificate is verified against that
  one name instead of the address dialled: services dial one another by the pod IPs
  they register, so one certificate naming e.g. `inferx.internal` serves every pod.
- `server_credentials`: what a gRPC server listens with; `require_client_auth` makes it
  refuse any peer without a certificate from the CA (mutual TLS).
- `generate_local_pki`: a throwaway CA and one service certificate (server AND client)
  for the local stack (`inferx up`, the tests).

`cryptography` is imported only to check files and to generate them (services and
`inferx up`); the SDK and the CLI read the CA file as bytes, so their start-up stays light.
"""

from __future__ import annotations

import datetime as _dt
import ipaddress
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from inferx.wire import CHANNEL_OPTIONS

if TYPE_CHECKING:
    from cryptography import x509

__all__ = [
    "ETCD_FLAGS",
    "SERVICE_FLAGS",
    "TlsError",
    "TlsFiles",
    "TlsMaterial",
    "Transport",
    "check_server_name",
    "generate_local_pki",
    "load_tls",
    "server_credentials",
]

PEM_CERTIFICATE = b"-----BEGIN CERTIFICATE-----"


class TlsError(Exception):
    """A TLS file or option that cannot work; the message is one line naming the flag
    and the file (what `inferx-<service>: error: ...` prints)."""


@dataclass(frozen=True)
class Flags:
    """The flag names a set of files came from, for error messages."""

    ca: str
    cert: str
    key: str


SERVICE_FLAGS = Flags("--tls-ca", "--tls-cert", "--tls-key")
ETCD_FLAGS = Flags("--etcd-ca", "--etcd-cert", "--etcd-key")


@dataclass(frozen=True)
class TlsFiles:
    """A CA bundle (PEM; what peers' certificates must be issued by) and this process's
    own certificate chain and private key (PEM). `cert`/`key` may be absent only where
    the process never presents a certificate (a client of a server-auth-only port)."""

    ca: Path
    cert: Path | None = None
    key: Path | None = None

    @classmethod
    def from_options(cls, ca: str, cert: str, key: str, flags: Flags = SERVICE_FLAGS) -> TlsFiles | None:
        """None when no file is given; a TlsError naming what is missing when only some are."""
        if not (ca or cert or key):
            return None
        if bool(cert) != bool(key):
            given, missing = (flags.cert, flags.key) if cert else (flags.key, flags.cert)
            raise TlsError(f"{given} needs {missing} too (a certificate and its private key)")
        if not ca:
            raise TlsError(f"{flags.cert}/{flags.key} need {flags.ca} (the CA that issued the peers)")
        return cls(Path(ca), Path(cert) if cert else None, Path(key) if key else None)


@dataclass(frozen=True)
class TlsMaterial:
    """The checked contents of `TlsFiles`."""

    files: TlsFiles
    ca: bytes
    cert: bytes | None
    key: bytes | None


def _read(path: Path, flag: str) -> bytes:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise TlsError(f"{flag} {path}: no such file") from None
    except IsADirectoryError:
        raise TlsError(f"{flag} {path}: is a directory, not a PEM file") from None
    except PermissionError:
        raise TlsError(f"{flag} {path}: permission denied (cannot read it)") from None
    except OSError as exc:
        raise TlsError(f"{flag} {path}: {exc.strerror or exc}") from None
    if not data.strip():
        raise TlsError(f"{flag} {path}: the file is empty")
    return data


def read_ca(path: str | Path, flag: str = "--tls-ca") -> bytes:
    """A CA bundle's bytes, checked only for looking like PEM certificates (no
    `cryptography` import: what the SDK and the CLI use)."""
    data = _read(Path(path), flag)
    if PEM_CERTIFICATE not in data:
        raise TlsError(f"{flag} {path}: not a PEM certificate (expected '-----BEGIN CERTIFICATE-----')")
    return data


def _certificates(data: bytes, path: Path, flag: str) -> list[x509.Certificate]:
    from cryptography import x509

    try:
        certs = x509.load_pem_x509_certificates(data)
    except ValueError:
        certs = []
    if not certs:
        raise TlsError(f"{flag} {path}: not a PEM certificate (expected '-----BEGIN CERTIFICATE-----')")
    return certs


def _private_key(data: bytes, path: Path, flag: str) -> Any:
    from cryptography.hazmat.primitives import serialization

    try:
        return serialization.load_pem_private_key(data, password=None)
    except TypeError:
        raise TlsError(f"{flag} {path}: the key is encrypted; give an unencrypted PEM key") from None
    except Exception:  # ValueError, UnsupportedAlgorithm: not a key we can use
        raise TlsError(f"{flag} {path}: not a PEM private key") from None


def _public_bytes(public_key: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return bytes(
        public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    )


def _issued_by_one_of(chain: list[x509.Certificate], authorities: list[x509.Certificate]) -> bool:
    """Whether some certificate of `chain` (the leaf, or an intermediate sent along with
    it) is one of `authorities` or was signed by one of them."""
    for cert in chain:
        for ca in authorities:
            if cert == ca:
                return True
            try:
                cert.verify_directly_issued_by(ca)
                return True
            except Exception:  # wrong issuer name, wrong signature, not a CA key type
                continue
    return False


def load_tls(files: TlsFiles, flags: Flags = SERVICE_FLAGS) -> TlsMaterial:
    """Read and check `files`: each readable PEM of the right kind, the key the
    certificate's, the certificate valid now and issued by the CA. TlsError otherwise."""
    ca = _read(files.ca, flags.ca)
    authorities = _certificates(ca, files.ca, flags.ca)
    if files.cert is None or files.key is None:
        return TlsMaterial(files, ca, None, None)
    cert = _read(files.cert, flags.cert)
    key = _read(files.key, flags.key)
    chain = _certificates(cert, files.cert, flags.cert)
    private_key = _private_key(key, files.key, flags.key)
    leaf = chain[0]
    if _public_bytes(leaf.public_key()) != _public_bytes(private_key.public_key()):
        raise TlsError(
            f"{flags.key} {files.key} does not match the certificate {flags.cert} {files.cert} "
            "(a key of another certificate?)"
        )
    now = _dt.datetime.now(_dt.UTC)
    if leaf.not_valid_after_utc < now:
        expired = f"{leaf.not_valid_after_utc:%Y-%m-%d}"
        raise TlsError(f"{flags.cert} {files.cert}: the certificate expired on {expired}")
    if leaf.not_valid_before_utc > now:
        raise TlsError(
            f"{flags.cert} {files.cert}: the certificate is not valid before "
            f"{leaf.not_valid_before_utc:%Y-%m-%d %H:%M} UTC"
        )
    if not _issued_by_one_of(chain, authorities):
        raise TlsError(
            f"{flags.cert} {files.cert} was not issued by the CA in {flags.ca} {files.ca}: "
            "peers would refuse it"
        )
    return TlsMaterial(files, ca, cert, key)


def server_credentials(material: TlsMaterial, *, require_client_auth: bool) -> grpc.ServerCredentials:
    """What a gRPC port listens with: this process's certificate; with
    `require_client_auth`, only peers presenting a certificate issued by the CA get in."""
    assert material.cert is not None and material.key is not None
    return grpc.ssl_server_credentials(
        [(material.key, material.cert)],
        root_certificates=material.ca,
        require_client_auth=require_client_auth,
    )


#: The gRPC channel option that makes TLS verify the peer's certificate against a given
#: name (and send it as SNI) instead of the host of the address dialled.
TARGET_NAME_OVERRIDE = "grpc.ssl_target_name_override"

# A DNS name as a certificate's subject alternative name carries it: labels of letters,
# digits and hyphens, dot-separated (no port, no scheme, no wildcard).
_DNS_LABEL = r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)"
_DNS_NAME = re.compile(rf"^{_DNS_LABEL}(\.{_DNS_LABEL})*\.?$")


def check_server_name(name: str, flag: str = "--tls-server-name") -> str:
    """`name` if it can be a certificate's DNS name; TlsError (one line) otherwise."""
    if len(name) > 253 or not _DNS_NAME.match(name):
        raise TlsError(
            f"{flag} {name!r}: not a DNS name (the name on the peers' certificates, "
            "e.g. inferx.internal; no port, no scheme)"
        )
    return name


@dataclass(frozen=True)
class Transport:
    """How this process opens gRPC channels. `credentials` None is plaintext, which only
    an explicit `--insecure` (or the SDK given no CA) chooses. `server_name`, with TLS:
    every peer's certificate is verified against that name, not the address dialled."""

    credentials: grpc.ChannelCredentials | None = None
    description: str = "plaintext"
    server_name: str | None = None

    @classmethod
    def plaintext(cls) -> Transport:
        return cls(None, "plaintext")

    @classmethod
    def mutual(cls, material: TlsMaterial, *, server_name: str | None = None) -> Transport:
        """TLS verifying the peer against the CA (and, with `server_name`, against that
        name instead of the address dialled), presenting this process's certificate."""
        kind = "mutual TLS" if material.cert is not None else "TLS"
        return cls(
            grpc.ssl_channel_credentials(
                root_certificates=material.ca,
                private_key=material.key,
                certificate_chain=material.cert,
            ),
            f"{kind}, peers verified as {server_name}" if server_name else kind,
            server_name or None,
        )

    @classmethod
    def server_auth(
        cls, ca: str | Path, flag: str = "--tls-ca", *, server_name: str | None = None
    ) -> Transport:
        """TLS verifying the server against the CA in `ca`, no client certificate (the
        SDK calling the router's public port)."""
        return cls(
            grpc.ssl_channel_credentials(root_certificates=read_ca(ca, flag)),
            f"TLS, server verified as {server_name}" if server_name else "TLS",
            server_name or None,
        )

    @property
    def insecure(self) -> bool:
        return self.credentials is None

    def _options(self, options: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
        chosen = [o for o in options if o[0] != TARGET_NAME_OVERRIDE]
        if self.credentials is not None and self.server_name:
            chosen.append((TARGET_NAME_OVERRIDE, self.server_name))
        return chosen

    def aio_channel(
        self,
        address: str,
        *,
        options: Sequence[tuple[str, Any]] = CHANNEL_OPTIONS,
        interceptors: Sequence[grpc.aio.ClientInterceptor] | None = None,
    ) -> grpc.aio.Channel:
        if self.credentials is None:
            return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
        return grpc.aio.secure_channel(
            address, self.credentials, options=self._options(options), interceptors=interceptors
        )

    def channel(self, address: str, *, options: Sequence[tuple[str, Any]] = CHANNEL_OPTIONS) -> grpc.Channel:
        """A synchronous channel (start-up health polling, scripts)."""
        if self.credentials is None:
            return grpc.insecure_channel(address, options=options)
        return grpc.secure_channel(address, self.credentials, options=self._options(options))


# ----- a local PKI -----------------------------------------------------------------------

CA_FILE = "ca.pem"
CERT_FILE, KEY_FILE = "service.pem", "service.key"


def _write_private(path: Path, data: bytes) -> None:
    """Create `path` readable by its owner only (never world-readable, not even briefly)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def _usable(files: TlsFiles, hosts: Sequence[str]) -> bool:
    """Existing local files still good for a while, and covering `hosts`."""
    from cryptography import x509

    try:
        load_tls(files)
        assert files.cert is not None
        leaf = x509.load_pem_x509_certificates(files.cert.read_bytes())[0]
        names = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (TlsError, OSError, ValueError, x509.ExtensionNotFound):
        return False
    have = {str(n) for n in names.get_values_for_type(x509.DNSName)}
    have |= {str(ip) for ip in names.get_values_for_type(x509.IPAddress)}
    soon = _dt.datetime.now(_dt.UTC) + _dt.timedelta(days=7)
    return set(hosts) <= have and leaf.not_valid_after_utc > soon


def generate_local_pki(
    directory: str | Path,
    hosts: Sequence[str] = ("127.0.0.1", "localhost"),
    *,
    reuse: bool = True,
    common_name: str = "InferX local CA",
) -> TlsFiles:
    """A CA and one certificate for every service (server AND client: mutual TLS),
    with `hosts` as subject alternative names, written to `directory` as `ca.pem`,
    `ca.key`, `service.pem`, `service.key` (keys 0600, the directory 0700). With
    `reuse`, files already there that are valid for a week more and cover `hosts` are
    kept, so a CA someone trusts does not change on every start."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    root = Path(directory)
    files = TlsFiles(root / CA_FILE, root / CERT_FILE, root / KEY_FILE)
    if reuse and _usable(files, hosts):
        return files
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o700)

    now = _dt.datetime.now(_dt.UTC) - _dt.timedelta(minutes=5)  # clocks of peers may lag a little
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + _dt.timedelta(days=3650))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(ca_ski, critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    key = ec.generate_private_key(ec.SECP256R1())
    alt_names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            alt_names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            alt_names.append(x509.DNSName(host))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "inferx-service")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + _dt.timedelta(days=825))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=True,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    pem = serialization.Encoding.PEM
    private = serialization.PrivateFormat.PKCS8
    plain = serialization.NoEncryption()
    _write_private(root / KEY_FILE, key.private_bytes(pem, private, plain))
    (root / CA_FILE).write_bytes(ca_cert.public_bytes(pem))
    (root / CERT_FILE).write_bytes(cert.public_bytes(pem))
    return files


# ----- what a process decided at start-up ------------------------------------------------

NO_TLS_HINT = (
    "no TLS files given: pass --tls-ca CA.pem --tls-cert CERT.pem --tls-key KEY.pem "
    "(mutual TLS; `inferx up` generates a local set under .inferx/tls/), or --insecure to run "
    "plaintext for development"
)


@dataclass(frozen=True)
class Security:
    """The transport a process runs with, decided once at start-up: mutual TLS with its
    own certificate, or plaintext because `--insecure` was given explicitly."""

    insecure: bool
    service: TlsMaterial | None  # None only when insecure
    etcd: TlsMaterial | None  # None: etcd is reached in plaintext
    transport: Transport
    #: --etcd-server-name: etcd's certificate is verified against this name, not the
    #: host of --etcd
    etcd_server_name: str | None = None

    @classmethod
    def resolve(
        cls,
        service: TlsFiles | None,
        etcd: TlsFiles | None,
        *,
        insecure: bool,
        server_name: str = "",
        etcd_server_name: str = "",
    ) -> Security:
        """Secure by default: TLS files, or an explicit `insecure`; neither (or both) is
        a TlsError saying what to pass. `server_name` (--tls-server-name): peers are
        verified against that name instead of the address dialled; `etcd_server_name`
        (--etcd-server-name) likewise for etcd."""
        if insecure and service is not None:
            raise TlsError("--insecure and --tls-ca/--tls-cert/--tls-key both given: choose one")
        if not insecure and service is None:
            raise TlsError(NO_TLS_HINT)
        if service is not None and (service.cert is None or service.key is None):
            raise TlsError("--tls-ca needs --tls-cert and --tls-key too (this process's own certificate)")
        if server_name:
            check_server_name(server_name)
            if service is None:
                raise TlsError(
                    "--tls-server-name names the peers' certificates: it needs --tls-ca/--tls-cert/"
                    "--tls-key, not --insecure"
                )
        if etcd_server_name:
            check_server_name(etcd_server_name, "--etcd-server-name")
            if etcd is None:
                raise TlsError("--etcd-server-name names etcd's certificate: it needs --etcd-ca")
        material = load_tls(service) if service is not None else None
        etcd_material = load_tls(etcd, ETCD_FLAGS) if etcd is not None else None
        transport = (
            Transport.mutual(material, server_name=server_name or None)
            if material is not None
            else Transport.plaintext()
        )
        return cls(insecure, material, etcd_material, transport, etcd_server_name or None)

    def server_credentials(self, *, require_client_auth: bool) -> grpc.ServerCredentials | None:
        """None in insecure mode (a plaintext port)."""
        if self.service is None:
            return None
        return server_credentials(self.service, require_client_auth=require_client_auth)

    def etcd_credentials(self) -> grpc.ChannelCredentials | None:
        return etcd_credentials(self.etcd)


def etcd_credentials(material: TlsMaterial | None) -> grpc.ChannelCredentials | None:
    if material is None:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=material.ca, private_key=material.key, certificate_chain=material.cert
    )


def insecure_warning(program: str) -> str:
    return (
        f"{program}: WARNING: --insecure: every connection of this process is PLAINTEXT and "
        "unauthenticated (no TLS, any peer accepted) and the router accepts calls WITHOUT tokens; "
        "for a development machine only"
    )


def main(argv: list[str] | None = None) -> None:
    """`python -m inferx.tls DIR [--host H ...]`: write a CA and a service certificate
    for those hosts (what `inferx up` does under .inferx/tls/), e.g. for docker-compose."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m inferx.tls", description=main.__doc__)
    parser.add_argument("directory")
    parser.add_argument(
        "--host",
        action="append",
        default=[],
        help="a name or IP address peers use to reach the services (repeat; default 127.0.0.1 and localhost)",
    )
    args = parser.parse_args(argv)
    hosts = args.host or ["127.0.0.1", "localhost"]
    files = generate_local_pki(args.directory, hosts, reuse=False)
    print(f"CA {files.ca}")
    print(f"certificate {files.cert} (server and client; {', '.join(hosts)})")
    print(f"key {files.key} (0600)")


if __name__ == "__main__":
    main()
