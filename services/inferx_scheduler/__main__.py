"""`inferx-scheduler`: owns the per-pool hop queues and dispatches to live workers."""

from __future__ import annotations

from inferx import etcd
from inferx.discovery import ChannelPool, ServiceLocator
from inferx.partitions import ALL_POOLS, OwnerTable, PartitionElector
from inferx.pools import PoolDirectory
from inferx.server import ServiceComponent, ServiceRuntime, run_service
from inferx.v1 import scheduler_pb2, scheduler_pb2_grpc
from inferx_scheduler import metrics
from inferx_scheduler.budget_sync import KvBudget
from inferx_scheduler.config import SchedulerSettings
from inferx_scheduler.dispatcher import HopDispatcher
from inferx_scheduler.health import WorkerHealth
from inferx_scheduler.kv_events import KvEventSubscriber
from inferx_scheduler.lookahead import LookAhead
from inferx_scheduler.servicer import SchedulerServicer


class SchedulerComponent(ServiceComponent):
    service_names = (scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name,)

    def __init__(self, runtime: ServiceRuntime, settings: SchedulerSettings) -> None:
        self.directory = PoolDirectory()
        self.channels = ChannelPool(runtime.transport)
        self.health = WorkerHealth(
            self.directory,
            self.channels,
            on_change=lambda: self.dispatcher.dispatch(),
            on_silent=lambda address, reason: self.servicer.worker_streams.abandon(address, reason),
        )
        self.dispatcher = HopDispatcher(
            self.directory,
            settings.max_queued_per_pool,
            settings.policy,
            usable=self.health.usable,
            time_scale=settings.time_scale,
            policy_options=settings.policy_options(),
        )
        self.services = ServiceLocator(runtime.etcd)
        # The memory-pools elect one ledger: every Reserve, Release and budget sync goes there.
        self.ledger = OwnerTable(runtime.etcd, "memory-pool")
        self.services.follow_leader("memory-pool", lambda: self.ledger.address_of(ALL_POOLS))
        self.kv_events = (
            KvEventSubscriber(self.directory, self.channels, self.dispatcher.prefix_index)
            if settings.kv_events
            else None
        )
        self._health_interval_s = settings.health_check_interval_s
        self.budget = (
            KvBudget(
                self.services,
                self.channels,
                holder=runtime.instance_id,
                sync_s=settings.kv_budget_sync_s,
                ttl_s=settings.kv_budget_ttl_s,
                on_reachable=lambda ok, why: self.servicer._set_conservative(not ok, why),
            )
            if settings.reserve_kv and settings.kv_budget
            else None
        )
        self.lookahead = (
            LookAhead(
                self.dispatcher.queue,
                self.services,
                self.channels,
                holder=runtime.instance_id,
                lease_s=settings.lookahead_lease_s / settings.time_scale,
                growth=settings.lookahead_growth,
                budget=self.budget,
            )
            # Only policies that plan ahead (chain-aware) use it; peers do not look ahead.
            if settings.lookahead and settings.policy == "chain-aware"
            else None
        )

        # One owner per model pool (leader election under an etcd lease): the routers
        # send a pool's hops to its owner only, so its queue, affinity and load are whole.
        self.partitions = (
            PartitionElector(
                runtime.etcd,
                "scheduler",
                instance_id=runtime.instance_id,
                address=runtime.address,
                ttl_s=settings.lease_ttl_s,
                wanted=settings.wanted_pools(),
                on_change=lambda: self._publish_partitions(),
            )
            if settings.partitions
            else None
        )

        def pools_seen() -> None:
            if self.partitions is not None:
                pools = set(self.directory.workers_by_pool) | set(self.directory.model_to_pool.values())
                self.partitions.set_seen(pools)

        def on_workers(items: dict[str, bytes]) -> None:
            self.directory.update_workers(items)
            pools_seen()
            self.dispatcher.dispatch()  # new workers take queued hops; gone ones fail theirs

        def on_models(items: dict[str, bytes]) -> None:
            self.directory.update_models(items)
            pools_seen()

        self.workers = etcd.PrefixMirror(runtime.etcd, etcd.WORKERS, on_workers)
        self.models = etcd.PrefixMirror(runtime.etcd, etcd.MODELS, on_models)
        self.servicer = SchedulerServicer(
            self.dispatcher,
            self.services,
            self.channels,
            settings.reserve_kv,
            self.health,
            settings.max_redispatch,
            holder=runtime.instance_id,
            lookahead=self.lookahead,
            max_kv_wait_s=settings.max_kv_wait_s,
            budget=self.budget,
            hop_streams=settings.hop_streams,
            partitions=self.partitions,
        )
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(self.servicer, runtime.server)

    def _publish_partitions(self) -> None:
        if self.partitions is not None:
            for pool in self.partitions.table.owners:
                metrics.OWNED_PARTITIONS.labels(pool).set(1 if self.partitions.owns(pool) else 0)

    async def ready(self) -> None:
        for mirror in (self.workers, self.models, self.services.mirror, self.ledger.mirror):
            mirror.start()
        for mirror in (self.workers, self.models, self.services.mirror, self.ledger.mirror):
            await mirror.wait_synced(timeout_s=30)
        self.health.start(self._health_interval_s)
        if self.kv_events is not None:
            self.kv_events.start()
        if self.budget is not None:
            self.budget.start()
        if self.partitions is not None:
            self.partitions.start()
            # Serving only once the first campaign is done: a lone instance owns what
            # it may serve from its first call (etcd down: go on, it campaigns later).
            await self.partitions.wait_first_round(timeout_s=5)

    async def draining(self) -> None:
        # Hand the pools over now: the routers send new hops to the next owner while
        # the hops already here drain.
        if self.partitions is not None:
            await self.partitions.resign()

    async def stop(self) -> None:
        if self.partitions is not None:
            await self.partitions.close()
        await self.servicer.drain_releases()  # before the channels close under them
        if self.budget is not None:
            await self.budget.close()  # hands the budget back
        if self.lookahead is not None:
            await self.lookahead.close()
        await self.health.close()
        if self.kv_events is not None:
            await self.kv_events.close()
        for mirror in (self.workers, self.models, self.services.mirror, self.ledger.mirror):
            await mirror.close()
        await self.servicer.worker_streams.close()
        await self.channels.close()


async def build(runtime: ServiceRuntime, settings: SchedulerSettings) -> SchedulerComponent:
    return SchedulerComponent(runtime, settings)


def main() -> None:
    run_service("scheduler", SchedulerSettings, build)


if __name__ == "__main__":
    main()
