"""The vllm engine's arguments for the KV offload tier and the KV cache cap
(`inferx-worker --kv-offload-gib`, `--kv-cache-tokens`): mapped to vLLM's native CPU
offloading on a GPU, refused with a clear error on the CPU build; what the worker
registers and reports (GetLoad) so the scheduler's retention knows the tier."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from inferx_worker.config import WorkerSettings
from inferx_worker.engines import vllm_engine
from inferx_worker.engines.base import EngineCapacity, EngineError, EngineLoad
from inferx_worker.engines.vllm_engine import VllmEngine, _kv_bytes_per_token


def engine(**kw: object) -> VllmEngine:
    return VllmEngine("/models/m", dummy_weights=True, **kw)  # type: ignore[arg-type]


def test_on_a_gpu_the_flag_turns_on_vllms_native_cpu_offloading() -> None:
    kwargs = engine(kv_offload_gib=64.0).engine_kwargs(on_gpu=True)
    assert kwargs["kv_offloading_size"] == 64.0
    assert kwargs["kv_offloading_backend"] == "native"
    assert "kv_offloading_size" not in engine().engine_kwargs(on_gpu=True)  # off by default


def test_on_the_cpu_build_the_flag_is_refused_with_a_reason() -> None:
    with pytest.raises(EngineError, match="--kv-offload-gib needs a GPU"):
        engine(kv_offload_gib=4.0).engine_kwargs(on_gpu=False)
    assert "kv_offloading_size" not in engine().engine_kwargs(on_gpu=False)


def test_the_kv_cache_cap_becomes_a_block_count_on_either_device() -> None:
    assert (
        engine(kv_cache_tokens=1000).engine_kwargs(on_gpu=False)["num_gpu_blocks_override"] == 32
    )  # 32-token blocks
    assert (
        engine(kv_cache_tokens=1000).engine_kwargs(on_gpu=True)["num_gpu_blocks_override"] == 63
    )  # 16-token blocks
    assert "num_gpu_blocks_override" not in engine().engine_kwargs(on_gpu=False)


def test_the_flags_reach_the_engine_from_the_worker_settings() -> None:
    settings = WorkerSettings(
        model="m", model_path=".", kv_offload_gib=8, kv_offload_gbps=12.5, kv_cache_tokens=512
    )
    built = vllm_engine.from_settings(settings)
    assert isinstance(built, VllmEngine)
    assert (built.kv_offload_gib, built.kv_offload_gbps, built.kv_cache_tokens) == (8, 12.5, 512)
    with pytest.raises(ValueError):
        WorkerSettings(model="m", kv_offload_gib=0)


def test_kv_bytes_per_token_follow_the_model_shape() -> None:
    import torch

    model = SimpleNamespace(
        dtype=torch.float16,
        get_num_layers=lambda _p: 32,
        get_num_kv_heads=lambda _p: 8,
        get_head_size=lambda: 128,
    )
    config = SimpleNamespace(
        model_config=model, parallel_config=None, cache_config=SimpleNamespace(cache_dtype="auto")
    )
    assert _kv_bytes_per_token(config) == 131_072  # Llama-3-8B: 128 KiB
    config.cache_config.cache_dtype = "fp8_e4m3"
    assert _kv_bytes_per_token(config) == 65_536


def test_get_load_reports_the_offload_tier() -> None:
    from inferx_worker.servicer import ModelWorkerServicer

    class Fake:
        def load(self) -> EngineLoad:
            return EngineLoad(1, 0, 0.5)

        def capacity(self) -> EngineCapacity:
            return EngineCapacity(
                1000, 4, 16, host_kv_capacity_tokens=50_000, host_kv_load_tokens_per_s=190_000.0
            )

    servicer = ModelWorkerServicer(Fake(), "w1")  # type: ignore[arg-type]
    load = asyncio.run(servicer.GetLoad(None, None))  # type: ignore[arg-type]
    assert load.host_kv_capacity_tokens == 50_000
    assert load.host_kv_load_tokens_per_s == pytest.approx(190_000.0)
