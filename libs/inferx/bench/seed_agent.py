"""The `seed-agent` scenario (pure parts): an agent chain shaped like the seed's --
8 model calls in sequence, a knowledge-tool call between each pair, and a context
that grows along the chain -- plus the metrics the scenario reports.

The chain (`chain_yaml()`):
  step1 -> kb1 -> step2 -> kb2 -> ... -> kb7 -> step8
  * step k's prompt is step k-1's prompt, step k-1's completion, the knowledge the
    tool returned, then a short header for step k: a long stable prefix (the system
    prompt, then the conversation so far) followed by the new tokens. A worker that
    kept the chain's KV blocks prefills only the new part;
  * kb k is a `cacheable` call of `kb_search` (a ToolService the benchmark serves,
    with a lognormal latency) whose query depends only on the run's topic and the
    step, so runs on the same topic repeat the same queries (the tool cache's case).

Reusable-prefix hit rate: for step k >= 2, `reusable_k` = the tokens its prompt
shares with step k-1's prompt (the longest common token prefix); the hit rate is
sum(min(cached_k, reusable_k)) / sum(reusable_k). Round-robin over N workers finds
the chain's prefix on the worker about 1/N of the time; chain affinity nearly always.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from inferx.chain.template import render

CHAIN_NAME = "seed_agent"
MODEL = "tiny-llama"
TOOL = "kb_search"
STEPS = 8

ASPECTS = ("policy", "order history", "shipping", "payment", "returns", "escalation", "final check")
STEP_LABELS = (
    "understand the request",
    "look up the order",
    "check the shipping state",
    "check the payment",
    "check the return rules",
    "decide on escalation",
    "draft the answer",
    "review the answer",
)
TOPICS = (
    "late delivery",
    "refund for a damaged item",
    "change of address",
    "missing tracking number",
    "double charge on the card",
    "return of a gift",
)

SYSTEM_PROMPT = (
    "You are the support agent of an online store. You work in steps; after each step "
    "you write short notes for the next step, and you may look things up in the store's "
    "knowledge base. Follow the store policy exactly.\n\n"
    "Store policy. Orders ship within two business days; the tracking number is emailed "
    "when the parcel leaves the warehouse. Shipping takes three to five business days; "
    "express shipping takes one or two days and costs more. If the tracking page shows "
    "no update for a week, open an investigation with the carrier and tell the customer "
    "what happens next. A refund is issued when an item is returned in its original "
    "condition within thirty days; refunds go to the original card and appear on the "
    "statement within five to ten days. Shipping costs are refunded only when the item "
    "arrived damaged or the wrong item was sent. The address cannot be changed after the "
    "parcel has shipped; the customer may ask the carrier to hold it at a pickup point. "
    "For orders that have not shipped, the agent can update the address, cancel the "
    "order, or split it into two shipments. Every change is recorded in the order "
    "history with the time and the name of the agent. A double charge is reversed by "
    "the payment provider within three days; the agent checks both charges first. Gifts "
    "are returned for store credit unless the buyer asks for a refund. Escalate to a "
    "human when the customer is angry, when the amount is above two hundred dollars, or "
    "when the carrier lost the parcel.\n\n"
) * 3  # a long, stable system prompt: about 1.2k tokens on the tiny model's tokenizer


def step_id(k: int) -> str:
    return f"step{k}"


def tool_id(k: int) -> str:
    return f"kb{k}"


def step_prompt(k: int) -> str:
    """The prompt template of step k (1-based): step k-1's template, its completion,
    the knowledge looked up after it, and step k's header."""
    text = SYSTEM_PROMPT + "Customer message: {{ inputs.query }}\n"
    for j in range(1, k):
        text += (
            f"\nNotes of step {j}: {{{{ nodes.{step_id(j)}.output }}}}\n"
            f"Knowledge ({ASPECTS[j - 1]}): {{{{ nodes.{tool_id(j)}.output }}}}\n"
        )
    return text + f"\nStep {k} of {STEPS}, {STEP_LABELS[k - 1]}. Notes:"


def chain_yaml(
    *, max_tokens: int = 16, step_timeout_s: float = 30.0, tool_timeout_s: float = 10.0, slo_s: float = 320.0
) -> str:
    """The chain config (seed format + InferX extensions) as YAML text."""
    import yaml

    nodes: list[dict[str, object]] = []
    for k in range(1, STEPS + 1):
        step: dict[str, object] = {
            "id": step_id(k),
            "type": "model_inference",
            "model": MODEL,
            "timeout": f"{step_timeout_s:g}s",
            "max_tokens": max_tokens,
            "prompt": step_prompt(k),
        }
        if k > 1:
            step["depends_on"] = [step_id(k - 1), tool_id(k - 1)]
        nodes.append(step)
        if k < STEPS:
            nodes.append(
                {
                    "id": tool_id(k),
                    "type": "tool_call",
                    "tool": TOOL,
                    "timeout": f"{tool_timeout_s:g}s",
                    "cacheable": True,
                    "depends_on": [step_id(k)],
                    "arguments": {"query": f"{{{{ inputs.topic }}}}: {ASPECTS[k - 1]}"},
                }
            )
    document = {
        "agent_chain": {
            "name": CHAIN_NAME,
            "description": "Seed-shaped agent: 8 model calls, knowledge-tool calls, growing context.",
            "tier": "standard",
            "inputs": {"query": {"description": "the customer's message"}, "topic": {"description": "topic"}},
            "slo": {"end_to_end_latency_p99": f"{slo_s:g}s"},
            "nodes": nodes,
        }
    }
    return yaml.safe_dump(document, sort_keys=False, width=1000)


@dataclass(frozen=True)
class Arrival:
    at_s: float
    inputs: dict[str, str]


def arrivals(count: int, rate_per_s: float, seed: int = 7) -> list[Arrival]:
    """Poisson arrivals; each run a unique customer message on one of a few topics."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(count):
        topic = rng.choice(TOPICS)
        order = rng.randrange(10_000, 99_999)
        query = f"Hello, this is about order {order}: {topic}. Run {i}. What can you do for me?"
        out.append(Arrival(round(t, 3), {"query": query, "topic": topic}))
        t += rng.expovariate(rate_per_s)
    return out


def rendered_prompts(inputs: dict[str, str], outputs: dict[str, str]) -> list[str]:
    """The prompts the router sent for steps 1..8, given the run's node outputs."""
    return [render(step_prompt(k), inputs, outputs) for k in range(1, STEPS + 1)]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def reusable_tokens(prompt_ids: Sequence[Sequence[int]]) -> list[int]:
    """Per step (the first included, as 0): tokens shared with the previous prompt."""
    return [0] + [common_prefix(prompt_ids[k - 1], prompt_ids[k]) for k in range(1, len(prompt_ids))]


@dataclass(frozen=True)
class HopReuse:
    reusable: int
    cached: int


def reuse_hit_rate(hops: Sequence[HopReuse]) -> float:
    """sum(min(cached, reusable)) / sum(reusable) over hops with something to reuse."""
    reusable = sum(h.reusable for h in hops)
    if reusable == 0:
        return float("nan")
    return sum(min(h.cached, h.reusable) for h in hops) / reusable
