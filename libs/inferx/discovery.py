"""Finding other services through etcd, and reusing one gRPC channel per address."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable

import aetcd
import grpc
from google.protobuf import json_format

from inferx import etcd, telemetry
from inferx.tls import Transport
from inferx.v1 import common_pb2
from inferx.wire import CHANNEL_OPTIONS

log = logging.getLogger(__name__)

__all__ = ["CHANNEL_OPTIONS", "ChannelPool", "ServiceLocator"]


class ChannelPool:
    """One channel per address, all opened by `transport` (a service's: mutual TLS with
    its certificate, or plaintext under --insecure)."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self.transport.aio_channel(
                address, options=CHANNEL_OPTIONS, interceptors=telemetry.client_interceptors()
            )
            self._channels[address] = channel
        return channel

    async def forget(self, address: str) -> None:
        channel = self._channels.pop(address, None)
        if channel is not None:
            await channel.close()

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()


class ServiceLocator:
    """Live instances of every service kind, from `/inferx/v1/services/`."""

    def __init__(self, client: aetcd.Client) -> None:
        self.mirror = etcd.PrefixMirror(client, etcd.SERVICES, self._update)
        self._by_kind: dict[str, list[common_pb2.ServiceInfo]] = {}
        self._round_robin = itertools.count()
        self._updated = asyncio.Event()  # set on every change, for `wait_pick`
        # kinds whose instances elect one leader (the memory-pool's one ledger): its address
        self._leaders: dict[str, Callable[[], str | None]] = {}

    def start(self) -> None:
        self.mirror.start()

    async def close(self) -> None:
        await self.mirror.close()

    def _update(self, items: dict[str, bytes]) -> None:
        by_kind: dict[str, list[common_pb2.ServiceInfo]] = {}
        for key, value in items.items():
            try:
                info = json_format.Parse(value, common_pb2.ServiceInfo(), ignore_unknown_fields=True)
            except json_format.ParseError:
                log.warning("ignoring malformed service registration at %s", key)
                continue
            by_kind.setdefault(info.kind, []).append(info)
        for infos in by_kind.values():
            infos.sort(key=lambda i: i.instance_id)
        self._by_kind = by_kind
        self._updated.set()
        self._updated = asyncio.Event()

    def instances(self, kind: str) -> list[common_pb2.ServiceInfo]:
        return list(self._by_kind.get(kind, ()))

    def all(self) -> list[common_pb2.ServiceInfo]:
        return [info for infos in self._by_kind.values() for info in infos]

    async def wait_pick(self, kind: str, timeout_s: float) -> str | None:
        """Like `pick`, but when no instance of `kind` is registered, wait up to
        `timeout_s` for one (a service whose lease lapsed under load re-registers;
        the caller's deadline, not a race, decides)."""
        return await etcd.wait_watched(lambda: self.pick(kind), lambda: self._updated, timeout_s)

    def follow_leader(self, kind: str, leader: Callable[[], str | None]) -> None:
        """`kind`'s instances elect one leader (`leader()` says where it is, None while
        there is none): `pick(kind)` answers it while there is one."""
        self._leaders[kind] = leader

    def leader(self, kind: str) -> str | None:
        found = self._leaders.get(kind)
        return found() if found is not None else None

    def pick(self, kind: str) -> str | None:
        """Address of `kind`'s elected leader if it has one, else of one live instance
        of `kind` (round-robin), or None."""
        leader = self.leader(kind)
        if leader:
            return leader
        infos = self._by_kind.get(kind)
        if not infos:
            return None
        return infos[next(self._round_robin) % len(infos)].address
