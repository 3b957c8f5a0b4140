"""`least-loaded`: FCFS, each hop to the worker with the fewest in-flight hops (ties: the
most free KV).

Imitates "least outstanding requests" balancing in front of vLLM replicas: Envoy's
LEAST_REQUEST / the Kubernetes Gateway API Inference Extension's queue-depth scorer,
vLLM production-stack's router without session keys, SGLang router's shortest-queue
mode. Faithful in the decision (exact in-flight counts, no sampling as in
power-of-two-choices, so it is the strongest variant of the idea); no affinity, so a
chain's next hop lands wherever load is lowest and its prefix is re-prefilled unless
that worker happens to hold it. The engines still cache prefixes (prefix caching on).
"""

from __future__ import annotations

from inferx.scheduling.peers.base import FcfsPeer
from inferx.scheduling.registry import register_policy


class LeastLoadedPolicy(FcfsPeer):
    name = "least-loaded"


@register_policy(
    "least-loaded",
    summary="FCFS queue, the worker with the fewest in-flight hops (ties: most free KV)",
    imitates="least-outstanding-requests balancing (Envoy LEAST_REQUEST, SGLang router shortest queue)",
)
def _least_loaded(time_scale: float = 1.0) -> LeastLoadedPolicy:
    return LeastLoadedPolicy()
