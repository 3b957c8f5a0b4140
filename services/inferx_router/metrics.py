"""Prometheus metrics of the router. Labels are bounded: chain, node, tier, status --
never run ids."""

from prometheus_client import Counter, Histogram

from inferx.v1 import router_pb2

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 3, 5, 7.5, 10, 15, 30, 60)

CHAIN_SECONDS = Histogram(
    "inferx_chain_latency_seconds",
    "End-to-end chain latency",
    ["chain", "tier", "status"],
    buckets=_LATENCY_BUCKETS,
)
CHAIN_SLO = Counter("inferx_chain_slo_total", "Chains by whether they met their SLO", ["chain", "met"])
NODE_SECONDS = Histogram(
    "inferx_node_latency_seconds",
    "Latency of each chain node",
    ["chain", "node", "status"],
    buckets=_LATENCY_BUCKETS,
)
TOOL_CACHE = Counter("inferx_tool_cache_lookups_total", "Tool-result cache look-ups", ["tool", "result"])
TOKENS = Counter("inferx_tokens_total", "Tokens of model hops", ["chain", "kind"])


def observe_chain(chain: str, tier: str, finished: router_pb2.ChainFinished) -> None:
    CHAIN_SECONDS.labels(chain, tier, finished.status).observe(finished.latency_ms / 1000)
    CHAIN_SLO.labels(chain, "true" if finished.slo_met else "false").inc()


def observe_node(chain: str, node: str, result: router_pb2.NodeFinished) -> None:
    NODE_SECONDS.labels(chain, node, result.status).observe(result.latency_ms / 1000)
    if result.tool and result.status == "ok":
        TOOL_CACHE.labels(result.tool, "hit" if result.cache_hit else "miss").inc()
    if result.model:
        TOKENS.labels(chain, "prompt").inc(result.usage.prompt_tokens)
        TOKENS.labels(chain, "cached_prompt").inc(result.usage.cached_prompt_tokens)
        TOKENS.labels(chain, "completion").inc(result.usage.completion_tokens)


RETRIES = Counter("inferx_retries_total", "Retried attempts of chain nodes", ["chain", "node", "reason"])
DEGRADATIONS = Counter("inferx_degradations_total", "Degraded chain nodes", ["chain", "node", "kind"])


def observe_retry(chain: str, node: str, reason: str) -> None:
    RETRIES.labels(chain, node, reason).inc()


def observe_degradation(chain: str, node: str, kind: str) -> None:
    DEGRADATIONS.labels(chain, node, kind).inc()
