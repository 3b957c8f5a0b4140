"""`inferx-worker`: serves one engine for one model pool and registers it in etcd."""

from __future__ import annotations

import logging

from inferx import etcd
from inferx.server import ServiceComponent, ServiceRuntime, run_service, to_json_bytes
from inferx.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from inferx_worker.config import WorkerSettings
from inferx_worker.engines.base import Engine, EngineRequest
from inferx_worker.engines.registry import make_engine
from inferx_worker.servicer import ModelWorkerServicer

log = logging.getLogger("inferx.worker")


class WorkerComponent(ServiceComponent):
    service_names = (worker_pb2.DESCRIPTOR.services_by_name["ModelWorker"].full_name,)

    def __init__(self, runtime: ServiceRuntime, settings: WorkerSettings, engine: Engine) -> None:
        self._runtime = runtime
        self._settings = settings
        self._engine = engine

    async def ready(self) -> None:
        await self._engine.start()
        if self._settings.warm_up:
            request = EngineRequest(request_id="warm-up", prompt="warm up the engine", max_tokens=4)
            async for _ in self._engine.generate(request):
                pass
        capacity = self._engine.capacity()
        info = common_pb2.WorkerInfo(
            worker_id=self._runtime.instance_id,
            pool=self._settings.model,
            address=self._runtime.address,
            engine=self._engine.name,
            model_path=self._engine.model_path,
            kv_capacity_tokens=capacity.kv_capacity_tokens,
            max_concurrency=capacity.max_concurrency,
            block_size=capacity.block_size,
        )
        key = etcd.worker_key(self._settings.model, self._runtime.instance_id)
        await self._runtime.leases.put(key, to_json_bytes(info))
        log.info("worker registered at %s: %s", key, info)

    async def stop(self) -> None:
        await self._engine.stop()


async def build(runtime: ServiceRuntime, settings: WorkerSettings) -> WorkerComponent:
    engine = make_engine(settings)
    worker_pb2_grpc.add_ModelWorkerServicer_to_server(
        ModelWorkerServicer(engine, runtime.instance_id), runtime.server
    )
    return WorkerComponent(runtime, settings, engine)


def main() -> None:
    run_service("worker", WorkerSettings, build)


if __name__ == "__main__":
    main()
