"""Calibration of the simulated GPU engine: the numbers the step-time model uses.

Defaults describe Llama-3-8B (fp16) on one A100-80GB, and every value says where it
comes from. A calibration file (YAML or JSON, the same keys) overrides any of them,
e.g. with numbers profiled on your own GPU:

    prefill_tokens_per_s: 15000
    decode_step_ms: 10.0

Sources:
  * prefill_tokens_per_s, decode_step_ms, batch_slowdown: Vidur's published profile
    of Llama-3-8B on an A100 (Agrawal et al., MLSys 2024): prefill about 15k tokens/s,
    a decode step about 10 ms at batch 1, about 13% slower at batch 32.
  * kv_read_ms_per_1k_tokens: KV bytes a decode step must read. Llama-3-8B keeps
    32 layers x 8 KV heads x 128 dims x 2 (K,V) x 2 bytes = 128 KiB per token; at the
    ~1.6 TB/s an A100 sustains that is 0.08 ms per 1,000 context tokens in the batch.
  * prefill_attention_ms: attention makes prefill cost grow with the context a chunk
    attends to: 4 x 32 layers x 4096 dims = 0.52 GFLOP per (new token, context token)
    pair, ~2.6 ms per million pairs at the ~200 TFLOP/s FlashAttention reaches on an
    A100. Re-prefilling a 32k context costs ~2.1 s linear + ~1.3 s attention.
  * kv_capacity_tokens: 80 GB x 0.9 (vLLM's gpu_memory_utilization) - 16 GB weights
    - ~4 GB activations = ~52 GiB of KV cache / 128 KiB per token = 425,984 tokens.
  * block_size 16, max_num_seqs 256, max_batched_tokens 8192: vLLM's defaults for an
    OpenAI-compatible server with chunked prefill (V1 engine).
  * host_kv_capacity_tokens, host_kv_gbps, kv_bytes_per_token: a KV offload tier in
    host memory (vLLM's native CPU offloading, `--kv-offloading-size`), off at 0.
    Prefix blocks the GPU evicts are kept there (LRU) and a prompt that finds them
    loads them back over PCIe instead of re-prefilling: ~25 GB/s is what a PCIe 4.0
    x16 link sustains (32 GB/s peak); 128 KiB per token is Llama-3-8B's KV (above),
    so a load runs at ~190k tokens/s against prefill's 15k.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from inferx.errors import InvalidArgument


class EngineProfile(BaseModel):
    """Step-time and memory parameters of one continuous-batching engine."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "llama-3-8b/a100-80gb (Vidur profile)"
    prefill_tokens_per_s: float = Field(15_000.0, gt=0)
    decode_step_ms: float = Field(10.0, gt=0)
    batch_slowdown: float = Field(0.13, ge=0, description="step growth from batch 1 to 32")
    kv_read_ms_per_1k_tokens: float = Field(0.08, ge=0)
    prefill_attention_ms: float = Field(2.6, ge=0, description="per 1e6 token pairs")
    kv_capacity_tokens: int = Field(425_984, gt=0)
    block_size: int = Field(16, gt=0)
    max_num_seqs: int = Field(256, gt=0)
    max_batched_tokens: int = Field(8192, gt=0, description="token budget of one step")
    host_kv_capacity_tokens: int = Field(0, ge=0, description="KV offload tier in host memory; 0 = none")
    host_kv_gbps: float = Field(25.0, gt=0, description="host <-> GPU KV transfer rate, GB/s")
    kv_bytes_per_token: int = Field(131_072, gt=0, description="KV bytes per token (all layers)")

    def policy_options(self) -> dict[str, float]:
        """What a policy that prices engine time is told of this engine (chain-aware's
        options of the same names): its prefill rate, what a decode step pays per
        context token in its batch, and a decode step's time without any. An
        operator's calibration, not workload knowledge: `inferx sim --profile` tells
        the simulated policy, `inferx-scheduler --engine-profile` the live one."""
        return {
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "kv_read_s_per_token": self.kv_read_ms_per_1k_tokens / 1e6,  # ms per 1k -> s per token
            "decode_step_s": self.decode_step_ms / 1e3,
        }

    @property
    def host_load_tokens_per_s(self) -> float:
        """Tokens of KV a load from the host tier brings back per second."""
        return self.host_kv_gbps * 1e9 / self.kv_bytes_per_token

    def decode_ms(self, batch: int) -> float:
        """Weight-bound part of a decode step for `batch` sequences."""
        return self.decode_step_ms * (1 + self.batch_slowdown * (max(batch, 1) - 1) / 31)

    def step_ms(
        self, decodes: int, prefill_tokens: int, context_tokens: int, prefill_pairs: float = 0
    ) -> float:
        """One engine iteration: the decode batch, the prefill chunks it carries (and the
        context they attend to: `prefill_pairs` new x context token pairs), and the KV
        the decoding sequences read (their whole contexts)."""
        ms = self.decode_ms(decodes) if decodes else 0.0
        ms += prefill_tokens / self.prefill_tokens_per_s * 1000
        ms += self.prefill_attention_ms * prefill_pairs / 1e6
        ms += self.kv_read_ms_per_1k_tokens * context_tokens / 1000
        return ms

    def alone_hop_s(self, uncached_tokens: int, context_tokens: int, output_tokens: int) -> float:
        """A hop alone on an idle engine: prefill its uncached tokens, then decode one
        sequence whose context grows from `context_tokens`. Used for SLOs and slowdown."""
        start = max(context_tokens - uncached_tokens, 0)
        pairs = prefill_pairs(start, uncached_tokens)
        prefill_s = self.step_ms(0, uncached_tokens, 0, pairs) / 1000
        # The step that finishes the prefill also samples the first token.
        decode_steps = max(output_tokens - 1, 0)
        mean_ctx = context_tokens + output_tokens / 2
        decode_s = decode_steps * self.step_ms(1, 0, int(mean_ctx)) / 1000
        return prefill_s + decode_s


def prefill_pairs(start: int, tokens: int) -> float:
    """(new token, context token) pairs when `tokens` are prefilled after `start`."""
    return tokens * (start + tokens / 2)


def load_profile(path: str | Path | None) -> EngineProfile:
    """The default profile, overridden by a YAML/JSON calibration file if given."""
    if path is None:
        return EngineProfile()
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise InvalidArgument(f"{path}: {exc.strerror or exc}") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise InvalidArgument(f"{path}: not valid YAML/JSON ({exc})") from None
    if not isinstance(data, dict):
        raise InvalidArgument(f"{path}: expected a mapping of profile keys")
    try:
        return EngineProfile(**data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise InvalidArgument(f"{path}: {problems}") from None
