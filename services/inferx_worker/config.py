"""Options of `inferx-worker` (flags or INFERX_* environment variables)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from inferx.settings import ServiceSettings

DEFAULT_MODEL_PATH = ".inferx/models/tiny-llama"


class WorkerSettings(ServiceSettings):
    model: str = Field(..., description="the model pool this worker serves, e.g. qwen-7b")
    engine: str = Field(
        "vllm",
        description="a registered engine: vllm (in-process AsyncLLM), openai (an OpenAI-compatible "
        "server), or sim (SIMULATED latency model)",
    )
    openai_base_url: str = Field(
        "http://127.0.0.1:8000", description="openai: the server's base URL (without /v1)"
    )
    openai_api_key: str = Field("", description="openai: bearer token, if the server wants one")
    openai_kv_capacity_tokens: int = Field(
        100_000, gt=0, description="openai: KV capacity to register (the server does not report it)"
    )
    openai_chat_endpoint: Literal["on", "off"] = Field(
        "on",
        description="openai: send chats to the server's /v1/chat/completions (on: the server renders them "
        "with the model's chat template and may read tool calls and enforce tool_choice itself; vLLM needs "
        "--enable-auto-tool-choice --tool-call-parser NAME for chats with tools) or, off, InferX's generic "
        "rendering to /v1/completions (servers without a chat endpoint); prompts always go to "
        "/v1/completions",
    )
    model_path: str = Field(
        DEFAULT_MODEL_PATH,
        description="vllm: model directory or hub id (default: the generated tiny model); "
        "openai: the model name the server serves; sim: a model directory whose chat template "
        "renders chats (the generic rendering when it has none)",
    )
    dummy_weights: Literal["auto", "yes", "no"] = Field(
        "auto", description="random weights (auto: yes when the directory has no weight files)"
    )
    max_model_len: int = Field(4096, gt=0, description="vllm: longest prompt + completion")
    max_num_seqs: int = Field(32, gt=0, description="concurrent sequences in the engine")
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="vllm: memory fraction (default: 0.9 GPU, 0.1 CPU)"
    )
    kv_cache_tokens: int | None = Field(
        None, gt=0, description="vllm: cap the KV cache at this many tokens (vLLM's num_gpu_blocks_override)"
    )
    kv_offload_gib: float | None = Field(
        None,
        gt=0,
        description="vllm, GPU only: a KV offload tier of this many GiB of host memory (vLLM's native "
        "CPU offloading, --kv-offloading-size): evicted prefix blocks are loaded back instead of "
        "re-prefilled; refused on the CPU build",
    )
    kv_offload_gbps: float = Field(
        25.0, gt=0, description="vllm: host-to-GPU KV transfer rate assumed for the offload tier (GB/s)"
    )
    sim_speed: float = Field(1.0, gt=0, description="sim: run this many times faster than real time")
    sim_profile: str | None = Field(
        None, description="sim: engine calibration file (YAML/JSON of inferx.sim.profile keys)"
    )
    sim_decode_step_ms: float | None = Field(
        None, gt=0, description="sim: decode step at batch 1 (default: the profile's, 10 ms)"
    )
    sim_prefill_tokens_per_s: float | None = Field(
        None, gt=0, description="sim: prefill throughput (default: the profile's, 15k tokens/s)"
    )
    sim_script: str | None = Field(
        None,
        description="sim: SIMULATED replies, a YAML/JSON list of {when, reply} rules: the first rule "
        "whose `when` occurs in the rendered prompt gives the reply (e.g. a tool call), at the sim's "
        "speed; other prompts get the synthetic text (inferx.sim.script)",
    )
    sim_kv_capacity_tokens: int | None = Field(
        None, gt=0, description="sim: KV-cache size in tokens (default: the profile's)"
    )
    prefix_caching: bool = Field(
        True, description="vllm, sim: automatic prefix caching (off: for A/B benchmarks)"
    )
    tool_call_format: str = Field(
        "auto",
        description="how the model writes tool calls, registered for the routers (and read by the sim's "
        "--openai-http-port): hermes (<tool_call> blocks), llama3_json (a reply of JSON calls), mistral "
        "([TOOL_CALLS]), pythonic ([f(x=1)]), deepseek_v3 (<｜tool▁calls▁begin｜>), granite "
        "(<|tool_call|>[...]); auto: what the model's chat template says (none known: the router's "
        "default, hermes)",
    )
    reasoning_parser: str = Field(
        "auto",
        description="how a reasoning model's replies carry its thinking, registered for the routers "
        "(and read by the sim's --openai-http-port), as vLLM's --reasoning-parser: deepseek_r1 (the "
        "reply starts thinking, up to </think>), qwen3 (<think>...</think> first), none; chat replies "
        "get it apart as reasoning_content. auto: qwen3 for the openai engine on its chat endpoint (it "
        "writes the server's reasoning_content back between <think> tags), none otherwise",
    )
    warm_up: bool = Field(True, description="run one short request before reporting ready")
    openai_http_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="sim: also serve OpenAI-compatible HTTP on this port (/v1/chat/completions, "
        "/v1/completions, /v1/models, /health, /metrics with vLLM's names, /get_load, "
        "/get_server_info), from the same engine as gRPC; 0 = off",
    )

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, value: str) -> str:
        from inferx_worker.engines.registry import engine_info

        return engine_info(value).name  # ValueError names the registered engines

    @field_validator("tool_call_format")
    @classmethod
    def _known_format(cls, value: str) -> str:
        from inferx.openai_compat.toolcalls import check_format

        return value if value == "auto" else check_format(value)  # ValueError names the formats

    @field_validator("reasoning_parser")
    @classmethod
    def _known_reasoning_parser(cls, value: str) -> str:
        from inferx.openai_compat.reasoning import check_reasoning_parser

        if value in ("auto", "none"):
            return value
        return check_reasoning_parser(value) if value else "none"  # ValueError names the parsers

    @field_validator("model")
    @classmethod
    def _pool_name(cls, value: str) -> str:
        if not value or "/" in value or value.strip() != value:
            raise ValueError("must be a pool name without '/' or spaces, e.g. qwen-7b")
        return value

    @field_validator("openai_http_port")
    @classmethod
    def _http_needs_sim(cls, value: int, info: ValidationInfo) -> int:
        if value and info.data.get("engine") != "sim":
            raise ValueError(
                "only the sim engine serves HTTP here (vLLM serves its own with `vllm serve`; "
                "put a worker in front of it with --engine openai)"
            )
        return value
