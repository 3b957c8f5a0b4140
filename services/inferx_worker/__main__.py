"""`inferx-worker`: serves one engine for one model pool and registers it in etcd."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from inferx import etcd
from inferx.httpserve import EmbeddedHttpServer
from inferx.openai_compat.toolcalls import DEFAULT_FORMAT, detect_format
from inferx.server import ServiceComponent, ServiceRuntime, run_service, to_json_bytes
from inferx.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from inferx_worker.config import WorkerSettings
from inferx_worker.engines.base import Engine, EngineRequest
from inferx_worker.engines.registry import make_engine
from inferx_worker.servicer import ModelWorkerServicer

if TYPE_CHECKING:
    from inferx_worker.http_api import WorkerHttpApi

log = logging.getLogger("inferx.worker")


class WorkerComponent(ServiceComponent):
    service_names = (worker_pb2.DESCRIPTOR.services_by_name["ModelWorker"].full_name,)

    def __init__(self, runtime: ServiceRuntime, settings: WorkerSettings, engine: Engine) -> None:
        self._runtime = runtime
        self._settings = settings
        self._engine = engine
        self._http_api: WorkerHttpApi | None = None
        self._http: EmbeddedHttpServer | None = None
        if settings.openai_http_port:
            from inferx_worker.http_api import WorkerHttpApi

            # Its chat replies' tool calls are read in the format the worker registers
            # for the routers (none known: the routers' default too).
            tool_format = self._tool_call_format() or DEFAULT_FORMAT
            self._http_api = WorkerHttpApi(
                engine, settings.model, runtime.instance_id, tool_format, self._reasoning_parser()
            )
            self._http = EmbeddedHttpServer(
                self._http_api.app(),
                settings.host,
                settings.openai_http_port,
                drain_timeout_s=settings.drain_timeout_s,
            )

    async def ready(self) -> None:
        await self._engine.start()
        if self._settings.warm_up:
            request = EngineRequest(request_id="warm-up", prompt="warm up the engine", max_tokens=4)
            async for _ in self._engine.generate(request):
                pass
        if self._http is not None and self._http_api is not None:
            try:
                address = await self._http.start()
            except OSError as exc:
                raise RuntimeError(f"cannot serve HTTP on --openai-http-port: {exc}") from None
            self._http_api.serving = True
            print(f"inferx-worker OpenAI-compatible HTTP on http://{address}/v1", flush=True)
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
            host_kv_capacity_tokens=capacity.host_kv_capacity_tokens,
            host_kv_load_tokens_per_s=capacity.host_kv_load_tokens_per_s,
            tool_call_format=self._tool_call_format(),
            reasoning_parser=self._reasoning_parser(),
        )
        key = etcd.worker_key(self._settings.model, self._runtime.instance_id)
        await self._runtime.leases.put(key, to_json_bytes(info))
        log.info("worker registered at %s: %s", key, info)

    def _tool_call_format(self) -> str:
        """--tool-call-format, else the one the engine writes calls in, else what the chat
        template says ("" when none says)."""
        if self._settings.tool_call_format != "auto":
            return self._settings.tool_call_format
        return (
            self._engine.writes_tool_call_format() or detect_format(self._engine.chat_template_source()) or ""
        )

    def _reasoning_parser(self) -> str:
        """--reasoning-parser ("" for none), else (auto) the one the engine writes for."""
        parser = self._settings.reasoning_parser
        if parser == "auto":
            return self._engine.writes_reasoning_parser() or ""
        return "" if parser == "none" else parser

    async def ending_streams(self) -> None:
        hub = self._engine.kv_events()
        if hub is not None:
            hub.close()  # KV-event streams follow the cache for ever: end them

    async def stop(self) -> None:
        if self._http is not None and self._http_api is not None:
            self._http_api.serving = False  # /health says so; calls in flight finish
            await self._http.stop()
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
