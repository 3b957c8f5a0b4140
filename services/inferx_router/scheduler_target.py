"""Which scheduler a model hop goes to: the owner of its model pool's partition
(`inferx.partitions`), from a watched mirror of the owners, with no etcd read per hop.

When a hop cannot run where it was sent, the failure decides what happens (`classify`,
`HopAttempts`: pure, unit-tested):
  * NOT_OWNER: the scheduler does not own the pool and names the owner (FAILED_PRECONDITION
    with the owner's address in the `inferx-partition-owner` trailer): the hop never
    started there, so it goes to the owner named (a few times at most: ownership moves);
  * NO_OWNER: nobody owns the pool yet (UNAVAILABLE with an empty owner trailer): wait
    for the election, within the hop's time;
  * OWNER_LOST: the call broke without a status from the scheduler's code (its process
    died, its connection dropped): wait for the partition to move to another instance
    (within the lease TTL, bounded by the hop's time) and re-submit the hop there --
    once, with the same run and hop ids; a second loss fails the hop (the chain's own
    retries and degradation take over from there). A hop whose text was already
    streamed to the caller is not re-submitted (the caller would see text twice).
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

import grpc

from inferx.discovery import ServiceLocator
from inferx.errors import OWNER_KEY, SERVICE_STATUS_KEY
from inferx.partitions import OwnerTable
from inferx.pools import PoolDirectory

log = logging.getLogger("inferx.router.partitions")

MAX_REDIRECTS = 3
MAX_RESUBMITS = 1


class Failure(enum.Enum):
    NOT_OWNER = "not_owner"
    NO_OWNER = "no_owner"
    OWNER_LOST = "owner_lost"
    OTHER = "other"


# What gRPC says when the TLS handshake failed: a misconfiguration (a certificate, a
# name), not a dead scheduler; the caller must see it at once, not after a failover wait.
TLS_FAILURE_WORDS = ("handshake", "ssl", "certificate", "verification")


def classify(code: grpc.StatusCode, trailers: dict[str, str], details: str = "") -> Failure:
    """What a failed SubmitHop means for where the hop goes next."""
    if OWNER_KEY in trailers:
        return Failure.NOT_OWNER if trailers[OWNER_KEY] else Failure.NO_OWNER
    # A status raised by the scheduler's own code carries SERVICE_STATUS_KEY; an
    # UNAVAILABLE without it came from the transport: the scheduler is gone (the
    # connection broke, or nothing listens at its address any more).
    if code == grpc.StatusCode.UNAVAILABLE and SERVICE_STATUS_KEY not in trailers:
        if any(word in details.lower() for word in TLS_FAILURE_WORDS):
            return Failure.OTHER
        return Failure.OWNER_LOST
    return Failure.OTHER


@dataclass
class HopAttempts:
    """How many more times one hop may be sent to a scheduler (pure)."""

    redirects: int = 0
    resubmits: int = 0

    def again(self, failure: Failure, *, streamed: bool) -> bool:
        """Record `failure`; True when the hop may be sent again."""
        if failure in (Failure.NOT_OWNER, Failure.NO_OWNER):
            # Refused before it started: nothing ran, nothing was streamed.
            self.redirects += 1
            return self.redirects <= MAX_REDIRECTS
        if failure == Failure.OWNER_LOST and not streamed:
            self.resubmits += 1
            return self.resubmits <= MAX_RESUBMITS
        return False


def trailers_of(exc: grpc.aio.AioRpcError) -> dict[str, str]:
    return {key: str(value) for key, value in exc.trailing_metadata() or ()}


class SchedulerTargets:
    def __init__(
        self,
        services: ServiceLocator,
        owners: OwnerTable,
        directory: PoolDirectory,
        *,
        failover_wait_s: float,
    ) -> None:
        self._services = services
        self.owners = owners
        self._directory = directory
        self._failover_wait_s = failover_wait_s  # about the lease TTL: when a dead owner's pools move

    async def first(self, model: str, timeout_s: float) -> str | None:
        """Where a hop goes first: its pool's owner; with none (no worker of the pool
        yet, or schedulers that do not partition), any scheduler: it campaigns for the
        pool, or says why it cannot serve it."""
        owner = self.owners.owner(self._directory.pool_of(model))
        if owner is not None:
            return owner.address
        return await self._services.wait_pick("scheduler", timeout_s)

    async def after(
        self, model: str, failure: Failure, failed: str, named: str, timeout_s: float
    ) -> str | None:
        """Where the hop goes after `failure` at `failed` (`named`: the owner it named)."""
        pool = self._directory.pool_of(model)
        if failure == Failure.NOT_OWNER and named and named != failed:
            return named
        if failure == Failure.OWNER_LOST:
            # The partition moves once the dead owner's lease ends (about the TTL).
            owner = await self.owners.wait_owner(
                pool, min(timeout_s, self._failover_wait_s), not_address=failed
            )
            if owner is not None:
                log.info("pool %s: owner %s lost; re-submitting to %s", pool, failed, owner.address)
                return owner.address
        else:
            owner = await self.owners.wait_owner(pool, timeout_s)
            if owner is not None:
                return owner.address
        owner = self.owners.owner(pool)
        return owner.address if owner is not None else await self._services.wait_pick("scheduler", 0)
