"""etcd access shared by every service: the key layout, a lease keeper that survives
outages, and a prefix mirror that lists then watches and re-lists after any error.

The client is `aetcd` (asyncio, maintained); `etcd3` 0.12 cannot be imported with
protobuf >= 4.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import aetcd
import aetcd.exceptions
import aetcd.rpc
import aetcd.utils
import aetcd.watcher
import grpc

from inferx.tls import ETCD_FLAGS, TARGET_NAME_OVERRIDE, TlsFiles, TlsMaterial, etcd_credentials, load_tls

T = TypeVar("T")

log = logging.getLogger(__name__)

ROOT = "/inferx/v1"

# One flat description of the key layout (DESIGN.md); every key is built here.
SERVICES = f"{ROOT}/services/"
WORKERS = f"{ROOT}/workers/"
TOOLS = f"{ROOT}/tools/"
CHAINS = f"{ROOT}/chains/"
MODELS = f"{ROOT}/models/"
PRICES = f"{ROOT}/prices/"  # <pool> -> its price (inferx.pricing), `inferx pool price`
AUTH = f"{ROOT}/auth/"  # tenants and tokens, watched as one (`inferx.auth.store.AuthDirectory`)
AUTH_TENANTS = f"{AUTH}tenants/"
AUTH_TOKENS = f"{AUTH}tokens/"
RUNS = f"{ROOT}/runs/"  # finished run records, <tenant>/<run id>, under leases (retention)
PARTITIONS = f"{ROOT}/partitions/"  # <kind>/<pool> -> the instance that owns the pool (lease)
PROGRAMS = f"{ROOT}/programs/"  # <tenant>/<program id> -> the router holding it open (lease)


def service_key(kind: str, instance_id: str) -> str:
    return f"{SERVICES}{kind}/{instance_id}"


def worker_key(pool: str, worker_id: str) -> str:
    return f"{WORKERS}{pool}/{worker_id}"


def tool_key(tool: str, instance_id: str) -> str:
    return f"{TOOLS}{tool}/{instance_id}"


def model_key(model: str) -> str:
    return f"{MODELS}{model}"


def price_key(pool: str) -> str:
    return f"{PRICES}{pool}"


def runs_prefix(tenant: str) -> str:
    """Where a tenant's finished run records are (tenant names hold no '/')."""
    return f"{RUNS}{tenant}/"


def run_key(tenant: str, run_id: str) -> str:
    return f"{runs_prefix(tenant)}{run_id}"


def program_key(tenant: str, program_id: str) -> str:
    """Which router holds a dynamic program open (tenant names hold no '/'; the
    program id, as the client gave it, may)."""
    return f"{PROGRAMS}{tenant}/{program_id}"


def partitions_prefix(kind: str) -> str:
    """Where the owners of `kind`'s partitions are (one key per model pool)."""
    return f"{PARTITIONS}{kind}/"


def partition_key(kind: str, pool: str) -> str:
    return f"{partitions_prefix(kind)}{pool}"


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """'host:port' -> (host, port); a bad value raises ValueError naming it."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"etcd endpoint must be HOST:PORT, got {endpoint!r}")
    return host, int(port)


class TlsClient(aetcd.Client):
    """`aetcd.Client` over TLS: aetcd opens only plaintext channels, in `connect` and
    nowhere else, so this is its `connect` (aetcd 1.0) with a secure channel instead;
    every other method uses the channel and stubs it leaves on the client."""

    def __init__(self, *, credentials: grpc.ChannelCredentials, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._credentials = credentials
        self._is_connecting: bool = False  # aetcd's own, typed here for the checker

    async def connect(self) -> None:
        try:
            await self._connect_tls()
        except aetcd.rpc.AioRpcError as exc:
            aetcd.exceptions._handle_exception(exc)

    async def _connect_tls(self) -> None:
        if self._connected.is_set():
            return
        if self._is_connecting:  # another task is connecting: wait for it
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        try:
            self._is_connecting = True
            target = f"{self._host}:{self._port}"
            self.channel = aetcd.rpc.secure_channel(target, self._credentials, options=self._options.items())
            if self._username is not None and self._password is not None:
                self.auth_stub = aetcd.rpc.AuthStub(self.channel)
                request = aetcd.rpc.AuthenticateRequest(name=self._username, password=self._password)
                reply = await self.auth_stub.Authenticate(request, timeout=self._timeout)
                self.metadata = (("token", reply.token),)
            self.kvstub = aetcd.rpc.KVStub(self.channel)
            self.clusterstub = aetcd.rpc.ClusterStub(self.channel)
            self.leasestub = aetcd.rpc.LeaseStub(self.channel)
            self.maintenancestub = aetcd.rpc.MaintenanceStub(self.channel)
            self._watcher = aetcd.watcher.Watcher(
                aetcd.rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata
            )
            self._connected.set()
        finally:
            self._is_connecting = False


def make_client(
    endpoint: str,
    *,
    timeout_s: int = 5,
    tls: TlsFiles | TlsMaterial | None = None,
    server_name: str | None = None,
) -> aetcd.Client:
    """A client of etcd at `endpoint`; over TLS (verifying etcd against `tls.ca`, and
    presenting `tls.cert` when given) when `tls` is set. With `server_name`
    (--etcd-server-name) etcd's certificate is verified against that name instead of the
    endpoint's host. Bad files raise TlsError."""
    host, port = parse_endpoint(endpoint)
    # Per-call timeout so a call made while etcd is down fails instead of hanging.
    if tls is None:
        return aetcd.Client(host=host, port=port, timeout=timeout_s)
    material = load_tls(tls, ETCD_FLAGS) if isinstance(tls, TlsFiles) else tls
    credentials = etcd_credentials(material)
    assert credentials is not None
    options = {TARGET_NAME_OVERRIDE: server_name} if server_name else None
    return TlsClient(host=host, port=port, timeout=timeout_s, credentials=credentials, options=options)


# Errors that mean "etcd is not reachable right now" rather than a bug of ours.
ETCD_DOWN_ERRORS: tuple[type[BaseException], ...] = (
    aetcd.exceptions.ClientError,
    ConnectionError,
    asyncio.TimeoutError,
    OSError,
)


class LeaseKeeper:
    """Keeps a set of keys alive under one lease.

    Keep-alive runs every TTL/3. If the lease is lost (etcd was unreachable longer
    than the TTL, or etcd restarted), a new lease is granted and every key re-put as
    soon as etcd answers again: never a crash loop, never a restart.
    """

    def __init__(self, client: aetcd.Client, ttl_s: int = 10) -> None:
        self._client = client
        self._ttl_s = ttl_s
        self._keys: dict[str, bytes] = {}
        self._lease: aetcd.leases.Lease | None = None
        self._task: asyncio.Task[None] | None = None
        self._registered = asyncio.Event()
        self.regrants = 0  # how many times the lease had to be granted again

    @property
    def ttl_s(self) -> int:
        return self._ttl_s

    @property
    def lease_id(self) -> int | None:
        return self._lease.id if self._lease else None

    async def put(self, key: str, value: bytes) -> None:
        """Keep `key` = `value` under the lease (now, if the lease is held)."""
        self._keys[key] = value
        if self._lease is not None:
            try:
                await self._client.put(key.encode(), value, lease=self._lease.id)
            except ETCD_DOWN_ERRORS as exc:
                log.warning("etcd put of %s failed (%s); will retry with the lease", key, exc)
                self._lease = None  # forces a re-grant and re-put of everything

    def forget(self, key: str) -> None:
        """Stop keeping `key` (it stays in etcd under the lease, but is not put again
        when the lease is granted anew)."""
        self._keys.pop(key, None)

    async def delete(self, key: str) -> None:
        """Stop keeping `key` and delete it now."""
        self._keys.pop(key, None)
        try:
            await self._client.delete(key.encode())
        except ETCD_DOWN_ERRORS as exc:
            log.warning("etcd delete of %s failed (%s); it ends with the lease", key, exc)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="lease-keeper")

    async def wait_registered(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._registered.wait(), timeout_s)
            return True
        except TimeoutError:
            return False

    async def close(self, *, revoke: bool = True) -> None:
        """Stop keep-alive; revoke the lease so the keys vanish at once."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if revoke and self._lease is not None:
            try:
                await self._client.revoke_lease(self._lease.id)
            except ETCD_DOWN_ERRORS as exc:
                log.warning("could not revoke lease (%s); keys expire within %ss", exc, self._ttl_s)
        self._lease = None

    async def _grant_and_put(self) -> None:
        lease = await self._client.lease(self._ttl_s)
        for key, value in self._keys.items():
            await self._client.put(key.encode(), value, lease=lease.id)
        self._lease = lease

    async def _run(self) -> None:
        interval = max(self._ttl_s / 3, 0.2)
        failing = False
        while True:
            try:
                if self._lease is None:
                    await self._grant_and_put()
                    if self._registered.is_set():
                        self.regrants += 1
                        log.warning("etcd lease re-granted; %d keys re-put", len(self._keys))
                    self._registered.set()
                else:
                    reply = await self._client.refresh_lease(self._lease.id)
                    if reply is None or reply.TTL <= 0:
                        log.warning("etcd lease %x expired; granting a new one", self._lease.id)
                        self._lease = None
                        continue
                if failing:
                    log.info("etcd reachable again")
                    failing = False
                await asyncio.sleep(interval)
            except asyncio.CancelledError:
                raise
            except ETCD_DOWN_ERRORS as exc:
                if not failing:
                    log.warning("etcd unreachable (%s); keeping local state and retrying", exc)
                    failing = True
                await asyncio.sleep(min(1.0, interval))


async def wait_watched(
    find: Callable[[], T | None], updated: Callable[[], asyncio.Event], timeout_s: float
) -> T | None:
    """What `find()` returns once it is not None, re-asked on each change of a watched
    mirror (`updated()`: the event set on its next change), waiting up to `timeout_s`;
    None when the time runs out."""
    loop = asyncio.get_running_loop()
    until = loop.time() + timeout_s
    while (found := find()) is None:
        left = until - loop.time()
        if left <= 0:
            return None
        try:
            await asyncio.wait_for(updated().wait(), left)
        except TimeoutError:
            return None
    return found


class PrefixMirror:
    """A local copy of every key under a prefix, kept current by a watch.

    Lists the prefix, then watches from the next revision. On any watch error
    (etcd down, revision compacted) it keeps the last known items -- so services go
    on serving with what they hold -- and re-lists when etcd is back.
    """

    def __init__(
        self,
        client: aetcd.Client,
        prefix: str,
        on_change: Callable[[dict[str, bytes]], None] | None = None,
        *,
        on_event: Callable[[str, bytes | None], None] | None = None,
    ) -> None:
        self._client = client
        self.prefix = prefix
        self.items: dict[str, bytes] = {}
        self._on_change = on_change
        # Per key changed (None: deleted), for a mirror too large to hand over whole on
        # each change; on a re-list, every key that differs from what was known.
        self._on_event = on_event
        self._task: asyncio.Task[None] | None = None
        self._synced = asyncio.Event()
        self._updated = asyncio.Event()  # set (and replaced) on each change

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"mirror:{self.prefix}")

    async def wait_synced(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._synced.wait(), timeout_s)
            return True
        except TimeoutError:
            return False

    async def wait_value(self, key: str, value: bytes, timeout_s: float) -> bool:
        """Wait up to `timeout_s` until the mirror holds `value` at `key`: a writer's own
        write is then what its next mirrored read sees (read-your-writes). True once seen;
        False on time out, or at once when the mirror is not watching."""
        if self._task is None:
            return False
        seen = await wait_watched(
            lambda: True if self.items.get(key) == value else None, lambda: self._updated, timeout_s
        )
        return bool(seen)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    def _event(self, key: str, value: bytes | None) -> None:
        if self._on_event is not None:
            try:
                self._on_event(key, value)
            except Exception:  # a bad listener must not kill the watch
                log.exception("listener of %s failed", self.prefix)

    def _changed(self) -> None:
        self._updated.set()
        self._updated = asyncio.Event()
        if self._on_change is not None:
            try:
                self._on_change(dict(self.items))
            except Exception:  # a bad listener must not kill the watch
                log.exception("listener of %s failed", self.prefix)

    async def _run(self) -> None:
        failing = False
        while True:
            watch = None
            try:
                listing = await self._client.get_prefix(self.prefix.encode())
                known, self.items = self.items, {kv.key.decode(): kv.value for kv in listing}
                revision = listing.header.revision if listing.header else 0
                for key in known.keys() - self.items.keys():
                    self._event(key, None)
                for key, value in self.items.items():
                    if known.get(key) != value:
                        self._event(key, value)
                self._changed()
                self._synced.set()
                if failing:
                    log.info("watch of %s restored (%d keys)", self.prefix, len(self.items))
                    failing = False
                watch = await self._client.watch_prefix(self.prefix.encode(), start_revision=revision + 1)
                async for event in watch:
                    key = event.kv.key.decode()
                    if event.kind == "PUT":
                        self.items[key] = event.kv.value
                        self._event(key, event.kv.value)
                    else:
                        self.items.pop(key, None)
                        self._event(key, None)
                    self._changed()
                # The iterator ends only when cancelled; loop to re-list.
            except asyncio.CancelledError:
                if watch is not None:
                    await _quiet_cancel(watch)
                raise
            except ETCD_DOWN_ERRORS as exc:
                if not failing:
                    log.warning("watch of %s lost (%s); serving the last known state", self.prefix, exc)
                    failing = True
                await asyncio.sleep(0.5)
            except Exception:
                log.exception("watch of %s failed; re-listing", self.prefix)
                await asyncio.sleep(0.5)


async def _quiet_cancel(watch: object) -> None:
    try:
        await watch.cancel()  # type: ignore[attr-defined]
    except Exception:  # the stream may already be gone
        pass


async def get_prefix_newest(client: aetcd.Client, prefix: str, limit: int) -> list[tuple[str, bytes]]:
    """The newest `limit` keys under `prefix` (by creation revision) with their values,
    newest first: a bounded listing (aetcd's get_prefix has no limit)."""
    await client.connect()
    key = prefix.encode()
    request = aetcd.rpc.RangeRequest(
        key=key,
        range_end=aetcd.utils.prefix_range_end(key),
        limit=limit,
        sort_order=aetcd.rpc.RangeRequest.DESCEND,
        sort_target=aetcd.rpc.RangeRequest.CREATE,
    )
    try:
        reply = await client.kvstub.Range(
            request, timeout=getattr(client, "_timeout", None), metadata=client.metadata
        )
    except aetcd.rpc.AioRpcError as exc:
        aetcd.exceptions._handle_exception(exc)  # raises the ClientError it maps to
        raise
    return [(kv.key.decode(), kv.value) for kv in reply.kvs]
