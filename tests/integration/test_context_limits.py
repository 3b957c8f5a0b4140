"""max_context_tokens on a node: reject with a clear message, or truncate the middle."""

from __future__ import annotations

import pytest

from inferx.client import InferxClient
from inferx.devstack import LocalStack
from tests.integration.faults import run_batch

pytestmark = pytest.mark.integration

CHAIN = """
agent_chain:
  name: guarded_MODE
  slo: {end_to_end_latency_p99: 5s}
  inputs: [history]
  nodes:
    - id: reply
      type: model_inference
      model: qwen-7b
      timeout: 2s
      max_tokens: 8
      max_context_tokens: 60
      context_overflow: MODE
      prompt: "SYSTEM: be brief\\n{{ inputs.history }}\\nUSER: and now?"
"""

# The sim engine counts 4 characters as a token: 30 lines of ~10 tokens each.
LONG_HISTORY = "\n".join(f"turn {i:02d}: some earlier words" for i in range(30))


async def test_reject_mode_fails_the_node_naming_the_limit(sim_stack: LocalStack) -> None:
    async with InferxClient(sim_stack.router_address) as client:
        await client.put_chain(CHAIN.replace("MODE", "reject"))
    (outcome,) = await run_batch(sim_stack, "guarded_reject", [{"history": LONG_HISTORY}])
    hop = outcome.finished.hops[0]
    assert hop.status == "error"
    assert "max_context_tokens 60" in hop.error and "INVALID_ARGUMENT" not in hop.error


async def test_truncate_mode_keeps_system_and_newest_turns(sim_stack: LocalStack) -> None:
    async with InferxClient(sim_stack.router_address) as client:
        await client.put_chain(CHAIN.replace("MODE", "truncate"))
    (outcome,) = await run_batch(sim_stack, "guarded_truncate", [{"history": LONG_HISTORY}])
    hop = outcome.finished.hops[0]
    assert hop.status == "ok", hop.error
    assert hop.usage.prompt_tokens + 8 <= 60
    (short,) = await run_batch(sim_stack, "guarded_truncate", [{"history": "turn 00: hi"}])
    assert short.finished.hops[0].usage.prompt_tokens < hop.usage.prompt_tokens
