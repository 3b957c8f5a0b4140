"""Partitions by model pool, each owned by one instance under an etcd lease.

A partitioned service (the scheduler) serves a model pool only while it owns the pool's
key, `/inferx/v1/partitions/<kind>/<pool>` -> {"instance_id", "address", "lease"}, put
under the owner's own lease in a transaction that succeeds only when the key is absent
(leader election per pool). Every instance campaigns for the pools it may serve (its
`--pools`, default: every pool seen in etcd); when an owner dies its lease ends, etcd
deletes its keys, and the others' watches see it and campaign at once: a partition
moves within the lease TTL. Callers (routers) find a pool's owner in a watched mirror
of the prefix, with no etcd read per call.

Pure parts (what to campaign for, who owns what) are functions with no I/O, tested on
their own; `PartitionElector` does the etcd I/O. An owner keeps its partitions until
etcd says its lease is gone, also while etcd cannot be reached (`PartitionElector.owns`
says why).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import aetcd

from inferx import etcd

log = logging.getLogger(__name__)

# The partition of a service that elects one leader for every pool (the memory-pool's
# ledger): `/inferx/v1/partitions/memory-pool/*`.
ALL_POOLS = "*"


@dataclass(frozen=True)
class Owner:
    """Who owns a partition: the instance, where to reach it, and the lease it holds it under."""

    instance_id: str
    address: str
    lease: int = 0

    def encode(self) -> bytes:
        return json.dumps(
            {"instance_id": self.instance_id, "address": self.address, "lease": self.lease}
        ).encode()

    @staticmethod
    def decode(value: bytes) -> Owner | None:
        try:
            data = json.loads(value)
            return Owner(str(data["instance_id"]), str(data["address"]), int(data.get("lease", 0)))
        except (ValueError, KeyError, TypeError):
            return None


def parse_owners(prefix: str, items: Mapping[str, bytes]) -> dict[str, Owner]:
    """Mirror items (`<prefix><pool>` -> owner JSON) -> pool -> owner; malformed values skipped."""
    owners: dict[str, Owner] = {}
    for key, value in items.items():
        pool = key.removeprefix(prefix)
        owner = Owner.decode(value)
        if owner is None or not pool or "/" in pool:
            log.warning("ignoring malformed partition owner at %s", key)
            continue
        owners[pool] = owner
    return owners


def eligible(pool: str, wanted: frozenset[str] | None) -> bool:
    """May this instance serve `pool`? `wanted` None: any pool."""
    return wanted is None or pool in wanted


def pools_to_campaign(
    wanted: frozenset[str] | None, seen: Iterable[str], owners: Mapping[str, Owner]
) -> list[str]:
    """The pools to try to take now: those this instance may serve (`wanted`, or every
    pool `seen` when None) that nobody owns. Sorted, so instances campaign in one order."""
    candidates = set(seen) if wanted is None else set(wanted)
    return sorted(pool for pool in candidates if pool not in owners)


class OwnerTable:
    """Who owns each partition of `kind`, from a watched mirror of its prefix."""

    def __init__(self, client: aetcd.Client, kind: str, on_change: Callable[[], None] | None = None) -> None:
        self.kind = kind
        self.prefix = etcd.partitions_prefix(kind)
        self.owners: dict[str, Owner] = {}
        self._on_change = on_change
        self._updated = asyncio.Event()
        self.mirror = etcd.PrefixMirror(client, self.prefix, self._update)

    def start(self) -> None:
        self.mirror.start()

    async def close(self) -> None:
        await self.mirror.close()

    def _update(self, items: dict[str, bytes]) -> None:
        owners = parse_owners(self.prefix, items)
        moved = {p for p in set(owners) | set(self.owners) if owners.get(p) != self.owners.get(p)}
        for pool in sorted(moved):
            before, after = self.owners.get(pool), owners.get(pool)
            log.info(
                "%s partition %s: %s -> %s",
                self.kind,
                pool,
                before.instance_id if before else "(none)",
                after.instance_id if after else "(none)",
            )
        self.owners = owners
        self._updated.set()
        self._updated = asyncio.Event()
        if self._on_change is not None:
            self._on_change()

    def owner(self, pool: str) -> Owner | None:
        return self.owners.get(pool)

    def address_of(self, pool: str) -> str | None:
        owner = self.owners.get(pool)
        return owner.address if owner is not None else None

    async def wait_owner(self, pool: str, timeout_s: float, *, not_address: str = "") -> Owner | None:
        """The owner of `pool` once it has one (other than `not_address`: the one that
        just failed), waiting up to `timeout_s`; None when the time runs out."""

        def other_owner() -> Owner | None:
            owner = self.owners.get(pool)
            return owner if owner is not None and owner.address != not_address else None

        return await etcd.wait_watched(other_owner, lambda: self._updated, timeout_s)


class PartitionElector:
    """Campaigns for the partitions this instance may serve and keeps those it won under
    one lease of its own (not the registration's: losing the partitions must not
    unregister the service, nor the reverse)."""

    def __init__(
        self,
        client: aetcd.Client,
        kind: str,
        *,
        instance_id: str,
        address: str,
        ttl_s: int,
        wanted: frozenset[str] | None = None,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self._client = client
        self.kind = kind
        self.instance_id = instance_id
        self.address = address
        self.ttl_s = ttl_s
        self.wanted = wanted
        self.table = OwnerTable(client, kind, on_change=self._changed)
        self._on_change = on_change
        self._seen: set[str] = set()
        self._lease: int | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()  # one campaign transaction at a time
        # When the latest renewal etcd accepted was sent (the lease runs at least a TTL
        # from then), and when `confirm` last failed to reach etcd.
        self._renewed_at = 0.0
        self._confirm_failed_at = -math.inf
        self._confirm_lock = asyncio.Lock()  # one confirming renewal for every waiting call
        self._first_round = asyncio.Event()  # the first campaign is done

    # ----- what the service asks -------------------------------------------------------

    def owns(self, pool: str) -> bool:
        """The pool's key names this instance under its current lease. Held until etcd
        says the lease is gone (or we resign), also while etcd cannot be reached: then
        nobody can be elected in our place either, and the services go on serving
        with what they hold, as they do for everything else during an etcd outage.
        The price, only when this instance alone is cut off from an etcd the others
        reach: it serves its pools alongside their new owner until it reaches etcd
        again (for schedulers, affinity split for that time, never a wrong result).
        What the services check before serving a call is `confirm`."""
        owner = self.table.owner(pool)
        return (
            owner is not None
            and self._lease is not None
            and owner.instance_id == self.instance_id
            and owner.lease == self._lease
        )

    async def confirm(self, pool: str) -> bool:
        """`owns`, made sure of with etcd when the lease may have run out by our own
        clock (no renewal accepted for a TTL: this process stalled, or etcd was slow).
        A stalled owner wakes with its calls, its watch and its renewal all queued, and
        another instance may have taken its pools meanwhile; checked here, it refuses
        before serving beside the new owner (for the memory-pool: two ledgers granting
        the same room). If etcd cannot be reached the answer stays `owns` (see there),
        asked again no more than every third of a TTL."""
        if not self.owns(pool):
            return False
        if time.monotonic() - self._renewed_at < self.ttl_s:
            return True
        async with self._confirm_lock:
            now = time.monotonic()
            lease = self._lease
            overdue = now - self._renewed_at >= self.ttl_s
            if lease is not None and overdue and now - self._confirm_failed_at >= self._interval:
                try:
                    reply = await asyncio.wait_for(self._client.refresh_lease(lease), self._interval)
                except etcd.ETCD_DOWN_ERRORS as exc:  # a timeout included
                    self._confirm_failed_at = time.monotonic()
                    log.warning("could not confirm the %s partition lease (%s); serving on", self.kind, exc)
                else:
                    self._renewed(lease, reply, now)
        return self.owns(pool)

    def owned(self) -> list[str]:
        return sorted(pool for pool in self.table.owners if self.owns(pool))

    def may_serve(self, pool: str) -> bool:
        return eligible(pool, self.wanted)

    def set_seen(self, pools: Iterable[str]) -> None:
        """The pools seen in etcd (workers, model mappings): the default candidates."""
        seen = set(pools)
        if seen != self._seen:
            self._seen = seen
            self._wake.set()

    async def campaign(self, pool: str) -> bool:
        """Try to take `pool` now (a hop for an unowned pool arrived); True if owned after."""
        if not self.may_serve(pool) or self._lease is None:
            return False
        try:
            await self._try_take([pool])
        except etcd.ETCD_DOWN_ERRORS as exc:  # the caller answers "no owner yet"
            log.warning("campaign for %s %s failed: %s", self.kind, pool, exc)
        return self.owns(pool)

    # ----- life cycle ------------------------------------------------------------------

    def start(self) -> None:
        self.table.start()
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"partitions:{self.kind}")

    async def wait_first_round(self, timeout_s: float) -> bool:
        """Wait until the first campaign is done (a lone instance then owns what it may
        serve, before it reports SERVING); False if etcd did not answer in time."""
        try:
            await asyncio.wait_for(self._first_round.wait(), timeout_s)
            return True
        except TimeoutError:
            return False

    async def resign(self) -> None:
        """Give every partition up at once (revoke the lease): on a clean shutdown the
        others take them now, not a TTL later."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        lease, self._lease = self._lease, None
        if lease is not None:
            try:
                await self._client.revoke_lease(lease)
            except etcd.ETCD_DOWN_ERRORS as exc:
                log.warning("could not revoke the partition lease (%s); it ends within %ss", exc, self.ttl_s)

    async def close(self) -> None:
        await self.resign()
        await self.table.close()

    def _changed(self) -> None:
        self._wake.set()  # an owner gone: campaign now
        if self._on_change is not None:
            self._on_change()

    @property
    def _interval(self) -> float:
        """How often the lease is renewed: three chances per TTL."""
        return max(self.ttl_s / 3, 0.2)

    def _renewed(self, lease: int, reply, sent: float) -> bool:
        """Take etcd's answer to a renewal of `lease` sent at `sent`: False (and every
        partition of the lease lost) when the lease is gone."""
        if reply is None or reply.TTL <= 0:
            if self._lease == lease:
                log.warning("partition lease %x expired: every partition of it is lost", lease)
                self._lease = None
                self._changed()
            return False
        if self._lease == lease:
            self._renewed_at = max(self._renewed_at, sent)
        return True

    async def _run(self) -> None:
        await self.table.mirror.wait_synced(30)
        interval = self._interval
        next_renewal = 0.0
        while True:
            try:
                now = time.monotonic()
                if self._lease is None:
                    sent = time.monotonic()
                    lease = await self._client.lease(self.ttl_s)
                    self._lease, self._renewed_at = lease.id, sent
                    next_renewal = time.monotonic() + interval
                elif now >= next_renewal:
                    sent = time.monotonic()
                    if not self._renewed(self._lease, await self._client.refresh_lease(self._lease), sent):
                        continue
                    next_renewal = sent + interval
                todo = pools_to_campaign(self.wanted, self._seen, self.table.owners)
                if todo:
                    await self._try_take(todo)
                self._first_round.set()
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), max(next_renewal - time.monotonic(), 0.01))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # etcd down, or a put under a lease that just ended
                # Never let the loop die (the lease would lapse quietly): check the
                # lease at once on the next round, then campaign again.
                if isinstance(exc, etcd.ETCD_DOWN_ERRORS):
                    log.warning("etcd unreachable for partitions (%s); retrying", exc)
                else:
                    log.exception("partition campaign failed; retrying")
                next_renewal = 0.0
                await asyncio.sleep(min(1.0, interval))

    async def _try_take(self, pools: list[str]) -> None:
        async with self._lock:
            lease = self._lease
            if lease is None:
                return
            me = Owner(self.instance_id, self.address, lease)
            tx = self._client.transactions
            for pool in pools:
                if pool in self.table.owners:
                    continue
                key = etcd.partition_key(self.kind, pool).encode()
                won, _ = await self._client.transaction(
                    compare=[tx.create(key) == 0], success=[tx.put(key, me.encode(), lease=lease)], failure=[]
                )
                if won:
                    log.info("%s %s now owns partition %s", self.kind, self.instance_id, pool)
                    # Our own mirror may not have seen the put yet: owns() reads it,
                    # and the service learns of its new partition now, not a watch later.
                    self.table.owners = {**self.table.owners, pool: me}
                    self._changed()
