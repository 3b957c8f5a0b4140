"""`inferx-worker`: serves one engine for one model pool and registers it in etcd."""

from __future__ import annotations

import logging
from pathlib import Path

from inferx import etcd
from inferx.server import ServiceComponent, ServiceRuntime, run_service, to_json_bytes
from inferx.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from inferx_worker.config import WorkerSettings
from inferx_worker.engines.base import Engine, EngineRequest
from inferx_worker.servicer import ModelWorkerServicer

log = logging.getLogger("inferx.worker")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def make_engine(settings: WorkerSettings) -> Engine:
    if settings.engine == "sim":
        from inferx.sim.profile import load_profile
        from inferx_worker.engines.sim_engine import SimEngine, SimParams

        log.warning("engine 'sim' is SIMULATED: latency model only, no model runs")
        return SimEngine(
            SimParams.with_overrides(
                load_profile(settings.sim_profile),
                speed=settings.sim_speed,
                prefix_caching=settings.prefix_caching,
                decode_step_ms=settings.sim_decode_step_ms,
                prefill_tokens_per_s=settings.sim_prefill_tokens_per_s,
                max_num_seqs=settings.max_num_seqs,
                kv_capacity_tokens=settings.sim_kv_capacity_tokens,
            )
        )
    if settings.engine == "openai":
        from inferx_worker.engines.openai_engine import OpenAIEngine

        return OpenAIEngine(
            settings.openai_base_url,
            settings.model_path,
            api_key=settings.openai_api_key,
            kv_capacity_tokens=settings.openai_kv_capacity_tokens,
            max_concurrency=settings.max_num_seqs,
        )
    from inferx_worker.engines.vllm_engine import VllmEngine

    path = Path(settings.model_path)
    if settings.dummy_weights == "auto":
        dummy = path.is_dir() and not any(f.suffix in WEIGHT_SUFFIXES for f in path.iterdir())
    else:
        dummy = settings.dummy_weights == "yes"
    if path.is_dir():
        model = str(path.resolve())
    elif "/" in settings.model_path and not settings.model_path.startswith((".", "/")):
        model = settings.model_path  # a hub id such as Qwen/Qwen2.5-7B-Instruct
    else:
        raise SystemExit(
            f"inferx-worker: error: --model-path {settings.model_path!r} is not a directory "
            "(run `make model` to generate the tiny local model, or pass a model dir or hub id)"
        )
    return VllmEngine(
        model,
        dummy_weights=dummy,
        max_model_len=settings.max_model_len,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        max_num_seqs=settings.max_num_seqs,
        prefix_caching=settings.prefix_caching,
    )


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
