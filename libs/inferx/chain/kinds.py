"""Node kinds: what each `type:` of chain node means to the config and the runtime.

A kind owns its schema keys (beyond the common ones), the key it cannot do without,
its default retries and whether it is a model hop (scheduled on a worker) or work the
router does itself (tools, memory). The config schema, validation and the chain plan
read this table; the router's executors (`inferx_router.executors`) are registered
under the same names. A new node kind is one `NodeKind` here plus one executor there.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NodeKind:
    name: str
    keys: tuple[str, ...]  # node keys this kind uses beyond the common ones
    required: str | None  # a node of this kind must set this key
    is_model: bool  # a model hop: goes through the scheduler to a worker
    default_retries: int  # attempts after the first when the node does not say
    default_tool: str | None = None  # the tool used when the node names none


MODEL_INFERENCE = NodeKind(
    "model_inference",
    keys=(
        "model",
        "fallback_model",
        "prompt",
        "max_tokens",
        "temperature",
        "stop",
        "max_context_tokens",
        "context_overflow",
    ),
    required="model",
    is_model=True,
    # A model call is retried only when the node asks: a failed generation is usually
    # an overloaded or broken pool, and the fallback model is the better second try.
    default_retries=0,
)
TOOL_CALL = NodeKind(
    "tool_call", keys=("tool", "arguments"), required="tool", is_model=False, default_retries=2
)
MEMORY_RETRIEVAL = NodeKind(
    "memory_retrieval",
    keys=("tool", "arguments", "limit"),
    required=None,
    is_model=False,
    default_retries=2,
    default_tool="session_memory",
)

# A sub-agent: runs another stored chain (docs/concepts.md#sub-agent-chains). Its model
# hops are the child run's; the node itself is walked by the router, never retried
# unless it says `retries` (a retry runs the whole child again).
CHAIN = NodeKind(
    "chain",
    keys=("chain", "version", "label", "inputs", "for_each", "item_input", "max_concurrency"),
    required="chain",
    is_model=False,
    default_retries=0,
)

_KINDS: dict[str, NodeKind] = {
    kind.name: kind for kind in (MODEL_INFERENCE, TOOL_CALL, MEMORY_RETRIEVAL, CHAIN)
}


def node_kinds() -> tuple[str, ...]:
    return tuple(_KINDS)


def node_kind(name: str) -> NodeKind:
    """The kind called `name` (KeyError for an unknown one: the schema has already
    rejected it with a readable message, so reaching this is a bug)."""
    return _KINDS[name]
