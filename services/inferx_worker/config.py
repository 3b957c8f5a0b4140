"""Options of `inferx-worker` (flags or INFERX_* environment variables)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from inferx.settings import ServiceSettings

DEFAULT_MODEL_PATH = ".inferx/models/tiny-llama"


class WorkerSettings(ServiceSettings):
    model: str = Field(..., description="the model pool this worker serves, e.g. qwen-7b")
    engine: Literal["vllm", "sim"] = Field(
        "vllm", description="vllm (in-process AsyncLLM) or sim (SIMULATED latency model)"
    )
    model_path: str = Field(
        DEFAULT_MODEL_PATH,
        description="model directory or hub id for vllm (default: the generated tiny model)",
    )
    dummy_weights: Literal["auto", "yes", "no"] = Field(
        "auto", description="random weights (auto: yes when the directory has no weight files)"
    )
    max_model_len: int = Field(4096, gt=0, description="vllm: longest prompt + completion")
    max_num_seqs: int = Field(32, gt=0, description="concurrent sequences in the engine")
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="vllm: memory fraction (default: 0.9 GPU, 0.1 CPU)"
    )
    sim_speed: float = Field(1.0, gt=0, description="sim: run this many times faster than real time")
    sim_decode_step_ms: float = Field(10.0, gt=0, description="sim: decode step at batch 1")
    sim_prefill_tokens_per_s: float = Field(15000.0, gt=0, description="sim: prefill throughput")
    warm_up: bool = Field(True, description="run one short request before reporting ready")

    @field_validator("model")
    @classmethod
    def _pool_name(cls, value: str) -> str:
        if not value or "/" in value or value.strip() != value:
            raise ValueError("must be a pool name without '/' or spaces, e.g. qwen-7b")
        return value
