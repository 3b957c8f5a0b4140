"""`inferx-scheduler`: owns the per-pool hop queues and dispatches to live workers."""

from __future__ import annotations

from inferx import etcd
from inferx.discovery import ChannelPool, ServiceLocator
from inferx.pools import PoolDirectory
from inferx.server import ServiceComponent, ServiceRuntime, run_service
from inferx.v1 import scheduler_pb2, scheduler_pb2_grpc
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
            self.directory, self.channels, on_change=lambda: self.dispatcher.dispatch()
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

        def on_workers(items: dict[str, bytes]) -> None:
            self.directory.update_workers(items)
            self.dispatcher.dispatch()  # new workers take queued hops; gone ones fail theirs

        self.workers = etcd.PrefixMirror(runtime.etcd, etcd.WORKERS, on_workers)
        self.models = etcd.PrefixMirror(runtime.etcd, etcd.MODELS, self.directory.update_models)
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
        )
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(self.servicer, runtime.server)

    async def ready(self) -> None:
        for mirror in (self.workers, self.models, self.services.mirror):
            mirror.start()
        for mirror in (self.workers, self.models, self.services.mirror):
            await mirror.wait_synced(timeout_s=30)
        self.health.start(self._health_interval_s)
        if self.kv_events is not None:
            self.kv_events.start()
        if self.budget is not None:
            self.budget.start()

    async def stop(self) -> None:
        await self.servicer.drain_releases()  # before the channels close under them
        if self.budget is not None:
            await self.budget.close()  # hands the budget back
        if self.lookahead is not None:
            await self.lookahead.close()
        await self.health.close()
        if self.kv_events is not None:
            await self.kv_events.close()
        for mirror in (self.workers, self.models, self.services.mirror):
            await mirror.close()
        await self.channels.close()


async def build(runtime: ServiceRuntime, settings: SchedulerSettings) -> SchedulerComponent:
    return SchedulerComponent(runtime, settings)


def main() -> None:
    run_service("scheduler", SchedulerSettings, build)


if __name__ == "__main__":
    main()
