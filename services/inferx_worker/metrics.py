"""Prometheus metrics of the model-worker (bounded labels: no request ids)."""

from prometheus_client import Counter, Gauge, Histogram

from inferx_worker.engines.base import EngineChunk

REQUESTS_RUNNING = Gauge("inferx_worker_requests_running", "Generate calls in progress")
REQUESTS_TOTAL = Counter("inferx_worker_requests_total", "Finished generate calls")
PROMPT_TOKENS = Counter("inferx_worker_prompt_tokens_total", "Prompt tokens processed")
CACHED_PROMPT_TOKENS = Counter(
    "inferx_worker_cached_prompt_tokens_total", "Prompt tokens served from the prefix cache"
)
COMPLETION_TOKENS = Counter("inferx_worker_completion_tokens_total", "Tokens generated")
CONTEXT_TRUNCATIONS = Counter(
    "inferx_worker_context_truncations_total", "Prompts cut to fit max_context_tokens"
)
CHAT_RENDERS = Counter(
    "inferx_worker_chat_renders_total",
    "Chats rendered into a prompt, by whose rendering: template=model (the model's own chat "
    "template), generic (InferX's, for a model without one) or server (the openai engine's "
    "server, sent the chat whole on /v1/chat/completions)",
    ["template"],
)
ENGINE_SECONDS = Histogram(
    "inferx_worker_engine_seconds",
    "Engine time per request",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)


def observe_finished(chunk: EngineChunk, engine_ms: float) -> None:
    REQUESTS_TOTAL.inc()
    PROMPT_TOKENS.inc(chunk.prompt_tokens)
    CACHED_PROMPT_TOKENS.inc(chunk.cached_prompt_tokens)
    COMPLETION_TOKENS.inc(chunk.completion_tokens)
    ENGINE_SECONDS.observe(engine_ms / 1000)
