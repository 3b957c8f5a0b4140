"""Run a whole local InferX (etcd + the five services) as child processes.

`inferx up` / `make run` use it in the foreground; the integration tests use the same
code with free ports and a temporary directory, so what the tests start is what
users start. Every child gets its own process group, so stopping it stops anything
it spawned too (vLLM's engine-core subprocess included).

Secure by default: a local CA and one service certificate under `<state>/tls/`, etcd
serving TLS and accepting only clients with a certificate from that CA, every service
started with mutual TLS, the first admin token in `<state>/admin.token` (0600), and
`<state>/stack.json` telling clients (the CLI) where the router, the CA and the token
are. `insecure=True` (`inferx up --insecure`) is the plaintext development mode.

`tls_server_name="inferx.internal"` is the stack as Kubernetes runs it: the one
certificate names only that DNS name (no address), and every process verifies its
peers and etcd against it (`--tls-server-name`, `--etcd-server-name`), since the
addresses dialled (127.0.0.1 here, pod IPs there) are on no certificate.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inferx.tls import Security, TlsFiles, Transport, generate_local_pki

if TYPE_CHECKING:
    import aetcd

    from inferx.client import InferxClient

SERVICE_KINDS = ("router", "scheduler", "memory-pool", "cache")

# Linux's prctl(PR_SET_PDEATHSIG), looked up here, in the parent: the child of a fork only
# calls it (no dlopen, no import between fork and exec).
_PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None


def _terminated_with_parent(parent_pid: int) -> Callable[[], None] | None:
    """A `preexec_fn`: the started process gets SIGTERM (drains, exits) when the one that
    started it dies -- even by SIGKILL (`kill -9`, the OOM killer), where no clean-up runs
    -- instead of living on orphaned, holding the stack's ports. (Linux: the signal comes
    when the *thread* that started it ends; stacks are started from the main thread or
    an executor's, which lives as long as the stack.)"""
    if _prctl is None:
        return None
    prctl = _prctl

    def arm() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent_pid:  # the parent died before the call: too late for it
            os._exit(1)

    return arm


#: ports this process has handed out, so two services of one stack never get the same one
_handed_out: set[int] = set()
#: names the slice "index/count" for this process and the processes it starts (a test's
#: `inferx bench` or `inferx dev` starts a stack of its own: in the whole range, it could
#: take a port another test process has just chosen and not yet bound)
PORT_SLICE_ENV = "INFERX_PORT_SLICE"


def _port_slice_from_env() -> tuple[int, int]:
    index, _, count = os.environ.get(PORT_SLICE_ENV, "0/1").partition("/")
    try:
        parsed = int(index), int(count)
    except ValueError:
        parsed = (0, 1)
    return parsed if 0 <= parsed[0] < parsed[1] else (0, 1)


#: (index, count): this process hands out ports from slice `index` of `count` equal slices
#: of free_port's range only, so that processes choosing ports at the same time (parallel
#: test processes: pytest-xdist's workers) never choose the same one before it is bound
port_slice: tuple[int, int] = _port_slice_from_env()


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux's default if unknown)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("0.0.0.0", port))  # also fails if 127.0.0.1:port is taken
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port nobody listens on now, for a service started next.

    Chosen *below* the kernel's ephemeral range: a port from `bind(0)` lies inside it,
    where any outgoing connection (a gRPC or etcd client of another test's stack) may take
    it in the moment between this probe and the service's own bind, which failed CI once
    with "Address already in use". Never the same port twice in one process, nor one of
    another process's `port_slice`."""
    low, _high = _ephemeral_range()
    floor = 20000
    index, count = port_slice
    if (low - floor) // count >= 2000:
        width = (low - floor) // count
        first = floor + index * width
        for _ in range(500):
            port = random.randint(first, first + width - 1)
            if port not in _handed_out and _bindable(port):
                _handed_out.add(port)
                return port
    while True:  # no room below the ephemeral range: the kernel's choice
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def port_in_use(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


class StackError(Exception):
    """Something the user can fix; the message says what."""


@dataclass
class ManagedProcess:
    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    address: str = ""
    metrics_port: int = 0
    popen: subprocess.Popen[bytes] | None = None
    #: how to reach its gRPC port (health polling): the stack's mutual TLS, or plaintext
    transport: Transport = field(default_factory=Transport.plaintext)

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        self.popen = subprocess.Popen(
            self.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **self.env},
            start_new_session=True,  # own process group: we can stop it and its children
            preexec_fn=_terminated_with_parent(os.getpid()),
        )
        log.close()

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.popen is not None and self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass

    def wait(self, timeout_s: float) -> int:
        """The exit status, once the started process has ended (TimeoutExpired if not)."""
        if self.popen is None:
            raise StackError(f"{self.name} was never started")
        return self.popen.wait(timeout_s)

    def stop(self, timeout_s: float = 20.0) -> None:
        self.signal(signal.SIGTERM)
        self.reap(timeout_s)

    def reap(self, timeout_s: float = 20.0) -> None:
        """Once it was sent SIGTERM: wait for its exit (SIGKILL after `timeout_s`), then
        end whatever is left of its process group."""
        if self.popen is None:
            return
        try:
            self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.popen.wait(5)
        # Children of the group (e.g. vLLM's engine core) must not outlive it.
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def stop_together(procs: Sequence[ManagedProcess], timeout_s: float = 20.0) -> None:
    """Stop `procs` at once: SIGTERM to each, then wait for them all, within one
    `timeout_s` (SIGKILL for any still running then)."""
    for proc in procs:
        proc.signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        proc.reap(max(0.0, deadline - time.monotonic()))


def wait_serving(proc: ManagedProcess, timeout_s: float, service: str = "") -> float:
    """Poll gRPC health until SERVING; fail early (with the log) if the process exits."""
    started = time.monotonic()
    deadline = started + timeout_s
    with proc.transport.channel(proc.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if not proc.alive():
                raise StackError(f"{proc.name} exited during start-up; its log ends with:\n{proc.log_tail()}")
            try:
                # wait_for_ready: the call itself drives the channel's reconnection. Under
                # grpc's polling I/O (every `inferx` command's, `inferx.grpc_io`) a sync
                # channel whose first connect was refused connects again only while some
                # thread polls it, which a fail-fast call that fails at once does not:
                # ~15 s per service for servers up in one (tests/unit/test_wait_serving.py).
                reply = stub.Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=1.0, wait_for_ready=True
                )
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return time.monotonic() - started
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise StackError(f"{proc.name} not serving after {timeout_s:.0f}s; its log ends with:\n{proc.log_tail()}")


def worker_pool(proc: ManagedProcess) -> str:
    """The model pool a worker process serves (its --model flag; "" when it has none)."""
    argv = proc.argv
    return argv[argv.index("--model") + 1] if "--model" in argv[:-1] else ""


def find_etcd() -> str:
    path = shutil.which("etcd")
    if path is None:
        raise StackError("etcd is not installed: run `make setup` (or install etcd >= 3.4)")
    return path


@dataclass
class StackPorts:
    etcd: int = 2379
    etcd_peer: int = 2380
    router: int = 50051
    scheduler: int = 50052
    memory_pool: int = 50053
    cache: int = 50054
    worker_base: int = 50061
    metrics_base: int = 9100
    router_http: int = 8000  # the router's OpenAI-compatible HTTP front; 0 = off
    #: replica i of a service listens on its kind's port + i * this (`inferx up
    #: --replicas`: router 50051, 50151, ...); 0: any free port
    replica_step: int = 100

    @classmethod
    def free(cls) -> StackPorts:
        return cls(
            etcd=free_port(),
            etcd_peer=free_port(),
            router=free_port(),
            scheduler=free_port(),
            memory_pool=free_port(),
            cache=free_port(),
            worker_base=0,
            metrics_base=0,
            router_http=free_port(),
            replica_step=0,
        )

    def replica_port(self, kind: str, replica: int) -> int:
        """The port of replica `replica` of `kind` (0: pick a free one)."""
        if replica == 0:
            return self.service_port(kind)
        return self.service_port(kind) + replica * self.replica_step if self.replica_step else 0

    def service_port(self, kind: str) -> int:
        return {
            "router": self.router,
            "scheduler": self.scheduler,
            "memory-pool": self.memory_pool,
            "cache": self.cache,
        }[kind]


class LocalStack:
    def __init__(
        self,
        state_dir: Path,
        ports: StackPorts | None = None,
        *,
        lease_ttl_s: int = 10,
        fresh_etcd: bool = False,
        python: str = sys.executable,
        knowledge_base: Path | None = None,
        insecure: bool = False,
        tls_server_name: str | None = None,
        embedded_scheduler: bool = False,
        scheduler_flags: Sequence[str] = (),
    ) -> None:
        """`embedded_scheduler`: each router runs the scheduler in its own process
        (`inferx-router --embedded-scheduler`); `start_core` then starts no scheduler
        process. `scheduler_flags` go to the scheduler wherever it runs."""
        if insecure and tls_server_name:
            raise StackError("a server name for TLS peers makes no sense with insecure=True")
        self.state_dir = state_dir
        self.ports = ports or StackPorts()
        self.embedded_scheduler = embedded_scheduler
        self.scheduler_flags = list(scheduler_flags)
        self.lease_ttl_s = lease_ttl_s
        self.fresh_etcd = fresh_etcd
        self.python = python
        self.knowledge_base = knowledge_base
        self.insecure = insecure
        #: the one DNS name on the stack's certificate, which every process verifies its
        #: peers and etcd against; None: the certificate names 127.0.0.1 and localhost
        self.tls_server_name = tls_server_name
        self.etcd: ManagedProcess | None = None
        self.services: dict[str, ManagedProcess] = {}
        self.workers: list[ManagedProcess] = []
        self._metrics_next = self.ports.metrics_base
        #: the local CA and the one certificate every process of the stack uses (server
        #: and client); None when insecure
        self.tls: TlsFiles | None = None
        #: how this process reaches the stack's services: mutual TLS with that certificate
        self.transport = Transport.plaintext()
        self.admin_token: str | None = None
        if not insecure:
            hosts = (tls_server_name,) if tls_server_name else ("127.0.0.1", "localhost")
            self.tls = generate_local_pki(state_dir / "tls", hosts, reuse=not fresh_etcd)
            from inferx.tls import load_tls

            self.transport = Transport.mutual(load_tls(self.tls), server_name=tls_server_name)

    @property
    def etcd_endpoint(self) -> str:
        return f"127.0.0.1:{self.ports.etcd}"

    @property
    def router_address(self) -> str:
        return f"127.0.0.1:{self.ports.router}"

    @property
    def router_addresses(self) -> list[str]:
        """Every router this stack started, the first one first."""
        started = [
            p.address for name, p in self.services.items() if name == "router" or name.startswith("router-")
        ]
        return started or [self.router_address]

    @property
    def scheduler_address(self) -> str:
        """The (first) scheduler: its process, or the one inside the router."""
        if "scheduler" in self.services:
            return self.services["scheduler"].address
        if self.embedded_scheduler and self.ports.scheduler:
            return f"127.0.0.1:{self.ports.scheduler}"
        raise StackError("no scheduler started (an embedded one needs a fixed port to be found)")

    @property
    def router_http_url(self) -> str:
        """The base URL of the router's OpenAI-compatible front ('' when it is off);
        https (the router's certificate, issued by `tls_ca`) unless insecure."""
        if not self.ports.router_http:
            return ""
        scheme = "http" if self.insecure else "https"
        return f"{scheme}://127.0.0.1:{self.ports.router_http}/v1"

    @property
    def tls_ca(self) -> Path | None:
        """The CA file clients verify the router (and every service) against."""
        return self.tls.ca if self.tls is not None else None

    @property
    def token_file(self) -> Path:
        return self.state_dir / "admin.token"

    @property
    def stack_file(self) -> Path:
        return self.state_dir / "stack.json"

    def transport_flags(self) -> list[str]:
        """What every process of the stack is started with: its TLS and etcd TLS files
        (and the name on their certificate, with `tls_server_name`), or --insecure."""
        if self.tls is None:
            return ["--insecure"]
        ca, cert, key = str(self.tls.ca), str(self.tls.cert), str(self.tls.key)
        flags = ["--tls-ca", ca, "--tls-cert", cert, "--tls-key", key] + [
            "--etcd-ca",
            ca,
            "--etcd-cert",
            cert,
            "--etcd-key",
            key,
        ]
        if self.tls_server_name:
            flags += ["--tls-server-name", self.tls_server_name, "--etcd-server-name", self.tls_server_name]
        return flags

    def security(self) -> Security:
        """What an in-process server of this stack (a tool server, say) runs with: the
        stack's certificate for its port and for etcd, or insecure."""
        name = self.tls_server_name or ""
        return Security.resolve(
            self.tls, self.tls, insecure=self.insecure, server_name=name, etcd_server_name=name
        )

    def client(
        self, *, token: str | None = None, timeout_s: float | None = None, address: str | None = None
    ) -> InferxClient:
        """An SDK client of the router (or of the router at `address`) as an outside
        caller: TLS verifying the router against the stack's CA (and the name on its
        certificate, with `tls_server_name`), with the admin token (or `token`)."""
        from inferx.client import InferxClient

        transport = None
        if self.tls is not None and self.tls_server_name:
            transport = Transport.server_auth(self.tls.ca, server_name=self.tls_server_name)
        return InferxClient(
            address or self.router_address,
            token=token if token is not None else self.admin_token,
            tls_ca=self.tls_ca,
            timeout_s=timeout_s,
            transport=transport,
        )

    def etcd_client(self, *, timeout_s: int = 5) -> aetcd.Client:
        """A client of the stack's etcd, with the stack's client certificate."""
        from inferx import etcd

        return etcd.make_client(
            self.etcd_endpoint, timeout_s=timeout_s, tls=self.tls, server_name=self.tls_server_name
        )

    def _metrics_port(self) -> int:
        if not self.ports.metrics_base:
            return 0
        port, self._metrics_next = self._metrics_next, self._metrics_next + 1
        return port

    # ----- etcd ---------------------------------------------------------------------

    def start_etcd(self, timeout_s: float = 20.0) -> ManagedProcess:
        for port in (self.ports.etcd, self.ports.etcd_peer):
            if port_in_use(port):
                raise StackError(f"port {port} is in use: is another etcd or `make run` running?")
        # Its own data per mode: a member's URLs (http or https) are kept in its data.
        data_dir = self.state_dir / ("etcd" if self.insecure else "etcd-tls")
        if self.fresh_etcd and data_dir.exists():
            shutil.rmtree(data_dir)
        scheme = "http" if self.tls is None else "https"
        client = f"{scheme}://127.0.0.1:{self.ports.etcd}"
        peer = f"{scheme}://127.0.0.1:{self.ports.etcd_peer}"
        argv = [
            find_etcd(),
            "--name",
            "inferx",
            "--data-dir",
            str(data_dir),
            "--listen-client-urls",
            client,
            "--advertise-client-urls",
            client,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            f"inferx={peer}",
        ]
        if self.tls is not None:
            # Clients (every service, tool server, `inferx up` itself) must present a
            # certificate from the stack's CA: nothing else can register a worker or a tool.
            ca, cert, key = str(self.tls.ca), str(self.tls.cert), str(self.tls.key)
            argv += ["--client-cert-auth", "--trusted-ca-file", ca, "--cert-file", cert, "--key-file", key]
            argv += ["--peer-client-cert-auth", "--peer-trusted-ca-file", ca]
            argv += ["--peer-cert-file", cert, "--peer-key-file", key]
        proc = ManagedProcess(
            "etcd", argv, self.state_dir / "logs" / "etcd.log", address=f"127.0.0.1:{self.ports.etcd}"
        )
        proc.start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not proc.alive():
                raise StackError(f"etcd exited during start-up:\n{proc.log_tail()}")
            if port_in_use(self.ports.etcd):
                break
            time.sleep(0.1)
        else:
            proc.stop()
            raise StackError(f"etcd did not listen on {self.ports.etcd} within {timeout_s:.0f}s")
        self.etcd = proc
        if self.tls is not None:
            try:
                self.admin_token = self._admin_token(deadline)
            except BaseException:
                self.etcd = None
                proc.stop()
                raise
        return proc

    def _admin_token(self, deadline: float) -> str:
        """The admin token of `token_file` when etcd still has it, else a new one written
        there (0600): the first credential of a fresh stack, written straight to etcd."""
        from inferx import etcd
        from inferx.auth.model import TokenRecord, secret_matches, split_token
        from inferx.auth.store import bootstrap_admin_token, token_key

        async def still_valid(client: aetcd.Client, text: str) -> bool:
            parts = split_token(text)
            if parts is None:
                return False
            found = await client.get(token_key(parts[0]).encode())
            if found is None:
                return False
            try:
                record = TokenRecord.model_validate_json(found.value)
            except ValueError:
                return False
            return secret_matches(record, parts[1]) and not record.expired()

        async def token() -> str:
            client = self.etcd_client()
            async with client:
                try:
                    kept = self.token_file.read_text().strip()
                except OSError:
                    kept = ""
                if kept and await still_valid(client, kept):
                    return kept
                return await bootstrap_admin_token(client, name="inferx-up")

        while True:  # etcd listens a moment before it serves (leader election)
            try:
                text = asyncio.run(token())
                break
            except etcd.ETCD_DOWN_ERRORS as exc:
                if time.monotonic() > deadline:
                    raise StackError(f"etcd did not answer over TLS: {exc}\n{self.etcd_tail()}") from None
                time.sleep(0.2)
        self.token_file.unlink(missing_ok=True)
        fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(text + "\n")
        return text

    def etcd_tail(self) -> str:
        return self.etcd.log_tail() if self.etcd is not None else ""

    # ----- services -----------------------------------------------------------------

    def _service_argv(
        self,
        kind: str,
        port: int,
        metrics_port: int,
        extra: Sequence[str],
        transport_flags: Sequence[str] | None = None,
    ) -> list[str]:
        module = "inferx_" + kind.replace("-", "_")
        return [
            self.python,
            "-m",
            module,
            "--etcd",
            self.etcd_endpoint,
            "--port",
            str(port),
            "--metrics-port",
            str(metrics_port),
            "--lease-ttl-s",
            str(self.lease_ttl_s),
            *(self.transport_flags() if transport_flags is None else transport_flags),
            *extra,
        ]

    def start_service(
        self,
        kind: str,
        extra: Sequence[str] = (),
        *,
        replica: int = 0,
        transport_flags: Sequence[str] | None = None,
        metrics_port: int | None = None,
    ) -> ManagedProcess:
        """Start one service; replica > 0 starts another instance (its kind's port +
        replica x `ports.replica_step`, or any free port), registered as
        services[f"{kind}-{replica}"]. `transport_flags` replace the stack's TLS flags,
        as in `start_worker`; `metrics_port` the stack's choice of its /metrics port
        (`ports.metrics_base` and up, else any the service picks)."""
        port = self.ports.replica_port(kind, replica) or free_port()
        step = self.ports.replica_step
        name = kind if replica == 0 else f"{kind}-{replica}"
        if metrics_port is None:
            metrics_port = self._metrics_port()
        extra = list(extra)
        if kind == "scheduler":
            extra += self.scheduler_flags
        if kind == "router" and self.knowledge_base is not None:
            extra += ["--knowledge-base", str(self.knowledge_base)]
        if kind == "router" and self.embedded_scheduler:
            extra += ["--embedded-scheduler"]
            scheduler_port = self.ports.replica_port("scheduler", replica)
            if scheduler_port:  # the scheduler's usual port, now in the router's process
                extra += ["--scheduler-port", str(scheduler_port)]
            if self.scheduler_flags:
                extra += ["--scheduler-flags", shlex.join(self.scheduler_flags)]
        if kind == "router" and self.ports.router_http and (replica == 0 or step):
            # each router its own OpenAI front: 8000, 8001, ...
            extra += ["--http-port", str(self.ports.router_http + replica)]
        proc = ManagedProcess(
            name,
            self._service_argv(kind, port, metrics_port, extra, transport_flags),
            self.state_dir / "logs" / f"{name}.log",
            address=f"127.0.0.1:{port}",
            metrics_port=metrics_port,
            transport=self.transport,
        )
        proc.start()
        self.services[name] = proc
        return proc

    def start_worker(
        self,
        pool: str,
        engine: str,
        extra: Sequence[str] = (),
        port: int = 0,
        *,
        transport_flags: Sequence[str] | None = None,
    ) -> ManagedProcess:
        """`transport_flags` replace the stack's TLS flags (`transport_flags()`): a test
        starts a worker with another CA's certificate, say."""
        index = len(self.workers)
        if not port:
            port = self.ports.worker_base + index if self.ports.worker_base else free_port()
        metrics_port = self._metrics_port()
        argv = self._service_argv(
            "worker", port, metrics_port, ["--model", pool, "--engine", engine, *extra], transport_flags
        )
        proc = ManagedProcess(
            f"worker-{index}",
            argv,
            self.state_dir / "logs" / f"worker-{index}.log",
            address=f"127.0.0.1:{port}",
            metrics_port=metrics_port,
            transport=self.transport,
        )
        proc.start()
        self.workers.append(proc)
        return proc

    def start_core(self, timeout_s: float = 60.0, *, replicas: int = 1) -> None:
        """etcd, then `replicas` of each of router, scheduler, memory-pool and cache,
        all SERVING (each registers itself in etcd; the schedulers elect an owner per
        model pool among themselves)."""
        if replicas < 1:
            raise StackError(f"--replicas must be at least 1, got {replicas}")
        if self.etcd is None:
            self.start_etcd()
        names = []
        for replica in range(replicas):
            for kind in SERVICE_KINDS:
                if kind == "scheduler" and self.embedded_scheduler:
                    continue  # each router runs one
                name = kind if replica == 0 else f"{kind}-{replica}"
                if name not in self.services:
                    self.start_service(kind, replica=replica)
                names.append(name)
        for name in names:
            wait_serving(self.services[name], timeout_s)
        self.write_stack_file()

    def workers_not_routed(self, workers: Sequence[ManagedProcess], router: str = "") -> list[str]:
        """What still keeps each of `workers` from taking hops ([] when nothing does).

        A worker answering SERVING on its own port is not yet one the stack sends hops to:
        its registration (under its etcd lease) must have reached the router's watch
        (which answers "no live worker serves model ..." until then), the watch of the
        scheduler that owns its pool (every scheduler that lists the pool, without
        partitions) with its circuit breaker closed, and the memory-pool's ledger (when a
        memory-pool answers). All three
        are read through the router's GetStatus (the router at `router`, default the
        first) and each scheduler's GetSchedulerStatus. A worker whose lease lapsed (a
        starved process) is missing again until it re-registers."""
        from inferx.v1 import router_pb2, router_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

        def code(exc: grpc.RpcError) -> str:
            return exc.code().name if hasattr(exc, "code") else type(exc).__name__

        router_transport = Transport.plaintext()
        if self.tls is not None:
            router_transport = Transport.server_auth(self.tls.ca, server_name=self.tls_server_name)
        metadata = (("authorization", f"Bearer {self.admin_token}"),) if self.admin_token else None
        router = router or self.router_address
        try:
            with router_transport.channel(router) as channel:
                status = router_pb2_grpc.RouterStub(channel).GetStatus(
                    router_pb2.GetStatusRequest(), timeout=5.0, metadata=metadata, wait_for_ready=True
                )
        except grpc.RpcError as exc:
            return [f"the router at {router} does not answer GetStatus ({code(exc)})"]
        missing: list[str] = []
        registered = {(w.address, w.pool): w.worker_id for w in status.workers}
        ids: dict[str, tuple[str, str]] = {}  # worker process name -> (worker id, pool)
        for proc in workers:
            pool = worker_pool(proc)
            worker_id = registered.get((proc.address, pool))
            if worker_id is None:
                missing.append(
                    f"the router at {router} does not see {proc.name} (pool '{pool}' at {proc.address})"
                )
            else:
                ids[proc.name] = (worker_id, pool)
        schedulers = [s.address for s in status.services if s.kind == "scheduler"]
        if not schedulers:
            missing.append(f"the router at {router} sees no scheduler")
        views: dict[str, list[set[str]]] = {}  # pool -> the worker ids each scheduler listing it sees
        breakers: dict[str, str] = {}  # worker id -> its breaker's state where a scheduler's is not closed
        for address in schedulers:
            try:
                # Fail-fast on a fresh channel: a scheduler killed a moment ago (its
                # registration outlives it by its lease) answers nothing, at once.
                with self.transport.channel(address) as channel:
                    reply = scheduler_pb2_grpc.SchedulerStub(channel).GetSchedulerStatus(
                        scheduler_pb2.SchedulerStatusRequest(), timeout=5.0
                    )
            except grpc.RpcError:
                continue  # the pools it owned move to another
            for pool_status in reply.pools:
                views.setdefault(pool_status.pool, []).append(
                    {w.worker.worker_id for w in pool_status.workers}
                )
            breakers.update({w: state for w, state in reply.worker_breakers.items() if state != "closed"})
        for name, (worker_id, pool) in ids.items():
            seen_by = views.get(pool, [])
            if not seen_by:
                missing.append(f"no scheduler that answers owns pool '{pool}' (of {name}) yet")
            elif not all(worker_id in seen for seen in seen_by):
                missing.append(f"the scheduler of pool '{pool}' does not see {name} ({worker_id}) yet")
            elif worker_id in breakers:  # it failed health checks or a hop a moment ago
                missing.append(f"the scheduler's circuit breaker of {name} is {breakers[worker_id]}")
        if not any(problem.startswith(("memory-pool", "no memory-pool")) for problem in status.problems):
            in_ledger = {row.worker_id for row in status.memory}
            missing += [
                f"the memory-pool's ledger does not have {name} ({worker_id}) yet"
                for name, (worker_id, _pool) in ids.items()
                if worker_id not in in_ledger
            ]
        return missing

    def wait_workers(
        self,
        timeout_s: float = 60.0,
        workers: Sequence[ManagedProcess] | None = None,
        routers: Sequence[str] | None = None,
    ) -> float:
        """Wait until each of `workers` (default: every worker process still running) is
        SERVING and routed -- seen by each router at `routers` (default: every router
        process of the stack still running), the scheduler that owns its pool and the
        memory-pool (`workers_not_routed`) -- and return the seconds it took. StackError
        naming what is still missing once `timeout_s` has passed, or at once with its log
        when a worker exits."""
        started = time.monotonic()
        deadline = started + timeout_s
        procs = [w for w in self.workers if w.alive()] if workers is None else list(workers)
        if not procs:
            return 0.0
        if routers is None:
            routers = [p.address for p in self.services.values() if p.name.startswith("router") and p.alive()]
        for proc in procs:
            wait_serving(proc, max(0.1, deadline - time.monotonic()))
        while True:
            for proc in procs:
                if not proc.alive():
                    raise StackError(f"{proc.name} exited; its log ends with:\n{proc.log_tail()}")
            missing = [
                problem for router in routers or [""] for problem in self.workers_not_routed(procs, router)
            ]
            if not missing:
                return time.monotonic() - started
            if time.monotonic() >= deadline:
                raise StackError(
                    f"workers not routed after {timeout_s:.0f}s (SERVING, but not yet sent hops): "
                    + "; ".join(missing)
                )
            time.sleep(0.1)

    def write_stack_file(self) -> Path:
        """`<state>/stack.json`: what a client of this stack needs (the CLI reads it when
        its --router is this router and it is given no --token/--tls-ca)."""
        info = {
            "router": self.router_address,
            # every router this stack started (`--replicas`): each is its router, with
            # its CA and token (the CLI matches --router against all of them)
            "routers": self.router_addresses,
            "tls_ca": str(self.tls.ca) if self.tls is not None else None,
            "token_file": str(self.token_file) if self.admin_token else None,
            "http": self.router_http_url or None,
            # the service certificate, for tools that call internal services directly
            # (`inferx bench --router`); the key is readable by its owner only
            "tls_cert": str(self.tls.cert) if self.tls is not None else None,
            "tls_key": str(self.tls.key) if self.tls is not None else None,
            # the name on that certificate, which internal services are verified against
            "tls_server_name": self.tls_server_name,
            "etcd": self.etcd_endpoint,
            "insecure": self.insecure,
        }
        self.stack_file.parent.mkdir(parents=True, exist_ok=True)
        self.stack_file.write_text(json.dumps(info, indent=2) + "\n")
        return self.stack_file

    # ----- configuration ------------------------------------------------------------

    def load_models(self, mapping: Mapping[str, str | Mapping[str, Any]]) -> None:
        """Write model mappings to etcd (/inferx/v1/models/<model>): a pool name, or an
        entry ({"pool": ..., "tool_call_format": ...}, checked: ValueError for a format
        InferX does not know)."""
        from inferx import etcd
        from inferx.pools import model_entry

        entries = {
            model: model_entry({"pool": spec} if isinstance(spec, str) else spec)
            for model, spec in mapping.items()
        }

        async def put() -> None:
            client = self.etcd_client()
            async with client:
                for model, entry in entries.items():
                    await client.put(etcd.model_key(model).encode(), json.dumps(entry).encode())

        asyncio.run(put())

    def put_chains(self, files: Sequence[Path], message: str = "loaded by inferx up") -> list[str]:
        """Store each chain file unless its active version already has that content."""
        from inferx.chain.validate import load_chain_text
        from inferx.chain.yamlio import dump_config_yaml
        from inferx.errors import NotFound

        async def put() -> list[str]:
            done = []
            async with self.client() as client:
                for path in files:
                    text = path.read_text()
                    config = load_chain_text(text, source=str(path)).config
                    wanted, name = dump_config_yaml(config), config.name
                    try:
                        current = await client.get_chain(name)
                        if current.config_yaml == wanted:
                            done.append(f"{name} v{current.version} (unchanged)")
                            continue
                    except NotFound:
                        pass
                    reply = await client.put_chain(text, message=message, author="inferx-up")
                    done.append(f"{reply.name} v{reply.version}")
            return done

        return asyncio.run(put())

    # ----- teardown -----------------------------------------------------------------

    def stop(self) -> None:
        """Workers first (they drain), then the services, etcd last; the processes of
        each group stop together (each one's drain and deregistration grace, a second
        or more, at once rather than one after another)."""
        stop_together(list(reversed(self.workers)))
        stop_together(list(reversed(self.services.values())))
        if self.etcd is not None:
            self.etcd.stop()
        self.stack_file.unlink(missing_ok=True)  # nothing to connect to any more


def read_models_file(path: Path) -> dict[str, dict[str, str]]:
    """model -> {pool: NAME} (and tool_call_format, when given: a known format, else a
    StackError naming the model and the formats)."""
    from inferx.pools import model_entry

    data = yaml.safe_load(path.read_text()) or {}
    models = data.get("models") if isinstance(data, dict) else None
    if not isinstance(models, dict):
        raise StackError(f"{path}: expected a top-level 'models:' mapping of model -> {{pool: NAME}}")
    mapping = {}
    for model, spec in models.items():
        try:
            mapping[str(model)] = model_entry(spec)
        except ValueError as exc:
            raise StackError(f"{path}: model '{model}': {exc}") from None
    return mapping


def run_foreground(
    engine: str = "vllm",
    workers: int = 1,
    http_port: int = 8000,
    insecure: bool = False,
    replicas: int = 1,
    embedded_scheduler: bool = True,
) -> int:
    """`inferx up`: start everything, load the examples, wait for Ctrl-C, stop everything.
    `embedded_scheduler` (the default): each router runs the scheduler in its process,
    one process crossing fewer per model hop (issue #45: the faster path is the default)."""
    root = Path.cwd()
    examples = root / "examples"
    if not (examples / "models.yaml").exists():
        print(
            "inferx up: error: run it from the InferX checkout (examples/models.yaml not found)",
            file=sys.stderr,
        )
        return 2
    if insecure:
        print(
            "inferx up: WARNING: --insecure: etcd and every service run PLAINTEXT with no certificates, "
            "and the router accepts calls WITHOUT tokens; for a development machine only",
            file=sys.stderr,
            flush=True,
        )
    stack = LocalStack(
        root / ".inferx",
        StackPorts(router_http=http_port),
        knowledge_base=examples / "knowledge_base.jsonl",
        insecure=insecure,
        embedded_scheduler=embedded_scheduler,
    )

    def on_signal(signum, frame):  # noqa: ARG001
        # Once: a second SIGTERM (or a Ctrl-C) must not break into the clean-up.
        for stopping in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(stopping, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)  # the terminal or ssh session went away
    try:
        mapping = read_models_file(examples / "models.yaml")
        pool = sorted({entry["pool"] for entry in mapping.values()})[0]
        step("etcd", lambda: stack.start_etcd())
        services = "router (scheduler inside)" if embedded_scheduler else "router, scheduler"
        what = f"{services}, memory-pool, cache" + (f" (x{replicas})" if replicas > 1 else "")
        step(what, lambda: stack.start_core(replicas=replicas))
        stack.load_models(mapping)
        worker_extra = (
            ["--model-path", str(root / ".inferx" / "models" / "tiny-llama")] if engine == "vllm" else []
        )
        for _ in range(workers):
            stack.start_worker(pool, engine, worker_extra)
        note = " (vLLM loads the model: about 40 s on a CPU)" if engine == "vllm" else " (SIMULATED engine)"
        for worker in stack.workers:
            step(
                f"{worker.name} [{engine}, pool {pool}]{note}",
                lambda w=worker: wait_serving(w, 600),
            )
        loaded = stack.put_chains(sorted((examples / "chains").glob("*.yaml")))
        print_addresses(stack, mapping, loaded)
        print('\nTry:  inferx run customer_service_agent --input query="Where is my order?"')
        print("Logs: .inferx/logs/   Ctrl-C stops everything.", flush=True)
        processes = [p for p in [stack.etcd, *stack.services.values(), *stack.workers] if p is not None]
        exited: set[str] = set()
        while report_exits(processes, exited):
            time.sleep(1)
        print("\ninferx up: every process has exited", file=sys.stderr)
        return 1
    except StackError as exc:
        print(f"\ninferx up: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nstopping...", flush=True)
        return 0
    finally:
        # A second Ctrl-C or SIGTERM must not skip the clean-up.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stack.stop()
        print("all InferX processes stopped", flush=True)


def report_exits(processes: list[ManagedProcess], exited: set[str], out: TextIO | None = None) -> bool:
    """`inferx up`'s watch: say (once, with its log's end) which processes have exited
    since the last look -- the others keep running, as a worker dying is what the rest
    of InferX is built to survive (its hops go to the pool's other workers) -- and
    whether any is still running."""
    out = out if out is not None else sys.stderr
    for proc in processes:
        if proc.name in exited or proc.alive():
            continue
        exited.add(proc.name)
        status = proc.popen.returncode if proc.popen is not None else None
        how = f"was killed by signal {-status}" if status is not None and status < 0 else f"exited ({status})"
        print(
            f"\n{proc.name} {how}; the other processes keep running (Ctrl-C stops them). "
            f"Its log ({_shown(proc.log_path)}) ends with:\n{proc.log_tail()}",
            file=out,
            flush=True,
        )
    return len(exited) < len(processes)


def _shown(path: Path) -> Path:
    return path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path


def step(what: str, action) -> None:
    print(f"starting {what} ...", end="", flush=True)
    started = time.monotonic()
    action()
    print(f" ok ({time.monotonic() - started:.1f}s)", flush=True)


def print_addresses(stack: LocalStack, mapping: dict[str, dict[str, str]], loaded: list[str]) -> None:
    """Plain lines, not a table: addresses must stay whole in any terminal width."""
    print("\nInferX is running:")
    rows = [("etcd", stack.etcd)] + list(stack.services.items()) + [(w.name, w) for w in stack.workers]
    for name, proc in rows:
        if proc is None:
            continue
        metrics = f"http://127.0.0.1:{proc.metrics_port}/metrics" if proc.metrics_port else "-"
        log = (
            proc.log_path.relative_to(Path.cwd())
            if proc.log_path.is_relative_to(Path.cwd())
            else proc.log_path
        )
        print(f"  {name:<12} grpc {proc.address:<16} metrics {metrics:<34} log {log}")
    if stack.router_http_url:
        print(f"  OpenAI-compatible HTTP (router): {stack.router_http_url}")
    if stack.tls is not None:
        print(
            f"  TLS: CA {_shown(stack.tls.ca)} (mutual TLS between services; etcd needs a client certificate)"
        )
        print(f"  admin token: {_shown(stack.token_file)} (0600)   stack: {_shown(stack.stack_file)}")
        print(
            "  the inferx CLI run from this directory uses both; elsewhere: "
            f"--tls-ca {_shown(stack.tls.ca)} --token $(cat {_shown(stack.token_file)})"
        )
    else:
        print("  INSECURE: plaintext everywhere, no tokens (inferx up --insecure)")
    print("  models: " + ", ".join(f"{m} -> pool {e['pool']}" for m, e in sorted(mapping.items())))
    print("  chains: " + ", ".join(loaded))
