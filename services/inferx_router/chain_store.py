"""Chain configs as immutable, numbered versions in etcd.

  /inferx/v1/chains/<tenant>/<name>/versions/<n>  -> {"config": <normalised document>,
                                                    "author", "message", "created_unix_ms"}
  /inferx/v1/chains/<tenant>/<name>/latest        -> n   (only moved by a compare-and-swap txn)
  /inferx/v1/chains/<tenant>/<name>/active        -> n
  /inferx/v1/chains/<tenant>/<name>/labels/<l>    -> n

Every chain belongs to a tenant (`default` when the router runs without tokens): two
tenants may use the same chain name, and neither can see the other's.

Reads come from a watched local mirror, so a new active version reaches new runs
as soon as etcd reports it, and the router keeps serving the versions it holds
while etcd is unreachable. Parsed configs are cached: a version never changes.
"""

from __future__ import annotations

import difflib
import json
import logging
import re
import time
from dataclasses import dataclass

import aetcd

from inferx import etcd
from inferx.chain.plan import ChainPlan
from inferx.chain.schema import ChainConfig, ChainConfigError
from inferx.chain.subchains import reference_problems
from inferx.chain.template import NODE_ID_RE
from inferx.chain.validate import ValidatedChain, load_chain_document, load_chain_text
from inferx.chain.yamlio import dump_config_yaml
from inferx.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from inferx.limits import MAX_STORED_CHAIN_BYTES, RequestLimits, describe_excess

log = logging.getLogger("inferx.router.chains")

MAX_PUT_ATTEMPTS = 20
# How long a write waits for this router's own mirror to show it, so the caller's next
# read or run through the same router sees what it just wrote (the watch takes ms).
READ_YOUR_WRITES_S = 2.0
CHAIN_NAME = re.compile(NODE_ID_RE)
LABEL = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,62}$")


def _key(tenant: str, name: str, *parts: str) -> str:
    # A name that no chain can have (e.g. one with '/') must never reach into other keys.
    if not CHAIN_NAME.fullmatch(name):
        raise NotFound(f"unknown chain {name!r} (see `inferx chain list`)")
    return "/".join([f"{etcd.CHAINS}{tenant}/{name}", *parts])


@dataclass(frozen=True)
class StoredVersion:
    tenant: str
    name: str
    version: int
    config: ChainConfig
    author: str
    message: str
    created_unix_ms: int
    plan: ChainPlan  # the version's graph facts, computed once for all its runs

    def to_yaml(self) -> str:
        return dump_config_yaml(self.config)


class ChainStore:
    def __init__(self, client: aetcd.Client) -> None:
        self._client = client
        self.mirror = etcd.PrefixMirror(client, etcd.CHAINS)
        self._parsed: dict[tuple[str, str, int], StoredVersion] = {}

    # ----- writes -------------------------------------------------------------------

    async def put(
        self,
        tenant: str,
        text: str,
        *,
        message: str = "",
        author: str = "",
        expect_version: int = 0,
        activate: bool = True,
        limits: RequestLimits | None = None,
    ) -> tuple[StoredVersion, bool]:
        """Validate and store `text` as version latest+1. Returns (version, activated).
        Nothing is written unless it is valid (within `limits`, when given) and fits etcd."""
        validated = load_chain_text(text, source="config", limits=limits)
        config = validated.config
        if problems := await reference_problems(config, self._child_config(tenant)):
            raise ChainConfigError(problems)  # a missing child, or a cycle between chains
        created_unix_ms = int(time.time() * 1000)
        record = {
            "config": config.to_document(),
            "author": author,
            "message": message,
            "created_unix_ms": created_unix_ms,
        }
        # UTF-8 as is (not \uXXXX escapes, up to 3x the size), and checked: etcd refuses a
        # record over its request limit with an error that is no fault of etcd's health.
        encoded = json.dumps(record, ensure_ascii=False).encode()
        if len(encoded) > MAX_STORED_CHAIN_BYTES:
            shown, cap = describe_excess(len(encoded), MAX_STORED_CHAIN_BYTES)
            raise InvalidArgument(
                f"config: the version to store (normalised config, message and author) takes {shown}, "
                f"more than the {cap} a chain version may take in etcd"
            )
        latest_key = _key(tenant, config.name, "latest")
        tx = self._client.transactions
        for _ in range(MAX_PUT_ATTEMPTS):
            current = await self._etcd(self._client.get(latest_key.encode()))
            latest = int(current.value) if current is not None else 0
            if expect_version and expect_version != latest:
                raise FailedPrecondition(
                    f"chain '{config.name}' is at version {latest}, not {expect_version}; nothing was written"
                )
            version = latest + 1
            guard = (
                tx.mod(latest_key.encode()) == current.mod_revision
                if current is not None
                else tx.version(latest_key.encode()) == 0
            )
            ops = [
                tx.put(_key(tenant, config.name, "versions", str(version)).encode(), encoded),
                tx.put(latest_key.encode(), str(version).encode()),
            ]
            if activate:
                ops.append(tx.put(_key(tenant, config.name, "active").encode(), str(version).encode()))
            succeeded, _ = await self._etcd(
                self._client.transaction(compare=[guard], success=ops, failure=[])
            )
            if succeeded:
                # The last key the transaction wrote: once mirrored, so are the others.
                await self._mirrored(_key(tenant, config.name, "active" if activate else "latest"), version)
                stored = StoredVersion(
                    tenant,
                    config.name,
                    version,
                    config,
                    author,
                    message,
                    created_unix_ms,
                    ChainPlan.build(config),
                )
                self._parsed[(tenant, config.name, version)] = stored
                return stored, activate
            # Someone else stored a version between our read and our write: try n+2.
        raise FailedPrecondition(f"chain '{config.name}': too many concurrent writers, try again")

    def _child_config(self, tenant: str):
        async def resolve(name: str, version: int, label: str) -> ChainConfig:
            return (await self.resolve(tenant, name, version, label)).config

        return resolve

    # ----- reads --------------------------------------------------------------------

    async def resolve(self, tenant: str, name: str, version: int = 0, label: str = "") -> StoredVersion:
        """The version asked for: explicit number, else a label, else the active one."""
        if not name:
            raise InvalidArgument("chain: must not be empty")
        if version and label:
            raise InvalidArgument("give either version or label, not both")
        if not version:
            pointer = _key(tenant, name, "labels", label) if label else _key(tenant, name, "active")
            raw = await self._read(pointer)
            if raw is None:
                if label:
                    raise NotFound(f"chain '{name}' has no label '{label}'")
                raise NotFound(f"unknown chain '{name}' (see `inferx chain list`)")
            version = int(raw)
        cached = self._parsed.get((tenant, name, version))
        if cached is not None:
            return cached
        raw = await self._read(_key(tenant, name, "versions", str(version)))
        if raw is None:
            if await self._read(_key(tenant, name, "latest")) is None:
                raise NotFound(f"unknown chain '{name}' (see `inferx chain list`)")
            raise NotFound(f"chain '{name}' has no version {version}")
        record = json.loads(raw)
        # Checked when it was put; the size caps on config text do not apply to it again.
        validated: ValidatedChain = load_chain_document(record["config"], source=f"{name} v{version}")
        stored = StoredVersion(
            tenant,
            name,
            version,
            validated.config,
            record.get("author", ""),
            record.get("message", ""),
            int(record.get("created_unix_ms", 0)),
            validated.plan,
        )
        self._parsed[(tenant, name, version)] = stored
        return stored

    # ----- history, labels, rollback (read etcd itself: these must be exact) ------------

    async def history(self, tenant: str, name: str) -> list[StoredVersion]:
        """Every version, newest first."""
        prefix = _key(tenant, name, "versions", "")
        listing = await self._etcd(self._client.get_prefix(prefix.encode()))
        versions = sorted((int(kv.key.decode().rsplit("/", 1)[1]) for kv in listing), reverse=True)
        if not versions:
            raise NotFound(f"unknown chain '{name}' (see `inferx chain list`)")
        return [await self.resolve(tenant, name, v) for v in versions]

    async def labels(self, tenant: str, name: str) -> dict[str, int]:
        prefix = _key(tenant, name, "labels", "")
        listing = await self._etcd(self._client.get_prefix(prefix.encode()))
        return {kv.key.decode().removeprefix(prefix): int(kv.value) for kv in listing}

    async def active_version(self, tenant: str, name: str) -> int:
        got = await self._etcd(self._client.get(_key(tenant, name, "active").encode()))
        return int(got.value) if got is not None else 0

    async def diff(self, tenant: str, name: str, from_version: int, to_version: int) -> str:
        old = await self.resolve(tenant, name, from_version)
        new = await self.resolve(tenant, name, to_version)
        return "".join(
            difflib.unified_diff(
                old.to_yaml().splitlines(keepends=True),
                new.to_yaml().splitlines(keepends=True),
                fromfile=f"{name} v{from_version}",
                tofile=f"{name} v{to_version}",
            )
        )

    async def label(self, tenant: str, name: str, label: str, version: int) -> int:
        """Point `label` at `version` (which must exist); returns the previous target."""
        if not LABEL.match(label):
            raise InvalidArgument(f"label: {label!r} must be letters, digits, '_', '.', '-'")
        if label in ("active", "latest"):
            raise InvalidArgument(f"label: '{label}' is reserved")
        if version <= 0:
            raise InvalidArgument("version: must be a positive version number")
        await self.resolve(tenant, name, version)  # NOT_FOUND for an unknown chain or version
        key = _key(tenant, name, "labels", label).encode()
        tx = self._client.transactions
        version_key = _key(tenant, name, "versions", str(version)).encode()
        previous = await self._etcd(self._client.get(key))
        ok, _ = await self._etcd(
            self._client.transaction(
                compare=[tx.version(version_key) > 0],
                success=[tx.put(key, str(version).encode())],
                failure=[],
            )
        )
        if not ok:
            raise NotFound(f"chain '{name}' has no version {version}")
        await self._mirrored(key.decode(), version)
        return int(previous.value) if previous is not None else 0

    async def rollback(self, tenant: str, name: str, to_version: int = 0) -> tuple[int, int]:
        """Move the active pointer (compare-and-swap on it); history stays as it is."""
        key = _key(tenant, name, "active").encode()
        current = await self._etcd(self._client.get(key))
        if current is None:
            raise NotFound(f"unknown chain '{name}' (see `inferx chain list`)")
        active = int(current.value)
        target = to_version or active - 1
        if target <= 0:
            raise FailedPrecondition(f"chain '{name}' is at version {active}: nothing to roll back to")
        if target == active:
            raise FailedPrecondition(f"chain '{name}' is already at version {active}")
        await self.resolve(tenant, name, target)  # NOT_FOUND for a version that does not exist
        tx = self._client.transactions
        ok, _ = await self._etcd(
            self._client.transaction(
                compare=[tx.mod(key) == current.mod_revision],
                success=[tx.put(key, str(target).encode())],
                failure=[],
            )
        )
        if not ok:
            raise FailedPrecondition(f"chain '{name}': the active version changed meanwhile; retry")
        await self._mirrored(key.decode(), target)
        return active, target

    async def _mirrored(self, key: str, version: int) -> None:
        """Wait (bounded) until the mirror shows the pointer just written, so reads that
        come from it (a get or a run right after a put, label or rollback) see the write.
        A slow watch only delays the reply; the write itself has succeeded."""
        await self.mirror.wait_value(key, str(version).encode(), READ_YOUR_WRITES_S)

    def names(self, tenant: str) -> list[str]:
        """The tenant's chain names."""
        prefix = f"{etcd.CHAINS}{tenant}/"
        keys = (key.removeprefix(prefix) for key in self.mirror.items if key.startswith(prefix))
        return sorted({key.split("/", 1)[0] for key in keys})

    def pointer(self, tenant: str, name: str, which: str) -> int:
        raw = self.mirror.items.get(_key(tenant, name, which))
        return int(raw) if raw else 0

    async def _read(self, key: str) -> bytes | None:
        """From the mirror; a miss (e.g. written a moment ago) reads etcd directly."""
        value = self.mirror.items.get(key)
        if value is not None:
            return value
        try:
            got = await self._client.get(key.encode())
        except etcd.ETCD_DOWN_ERRORS:
            return None  # etcd down: serve only what the mirror holds
        return got.value if got is not None else None

    @staticmethod
    async def _etcd(awaitable):
        try:
            return await awaitable
        except etcd.ETCD_DOWN_ERRORS as exc:
            raise Unavailable(f"etcd is unreachable ({exc}); chain configs cannot be changed now") from None
