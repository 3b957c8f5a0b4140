"""Sub-agent chains against real etcd, services and sim workers: a parent chain with a
`type: chain` node and a for_each fan-out; the children's outputs, their records nested
in `inferx trace`, the parent's deadline inherited; cycles and missing children refused
at `chain put`, naming the node."""

from __future__ import annotations

import json

import pytest

from inferx.client import InferxClient
from inferx.devstack import LocalStack
from inferx.errors import InvalidArgument
from inferx.v1 import router_pb2
from tests.integration.test_chain_runs import _cli

pytestmark = pytest.mark.integration

CHILD = """
agent_chain:
  name: sub_researcher
  slo: {end_to_end_latency_p99: 60s}
  inputs: [topic, item]
  nodes:
    - {id: look, type: model_inference, model: qwen-7b, timeout: 20s, max_tokens: 4,
       prompt: "Research {{ inputs.item }} for {{ inputs.topic }}"}
"""

SUMMARY = """
agent_chain:
  name: sub_summary
  slo: {end_to_end_latency_p99: 60s}
  inputs: [text]
  nodes:
    - {id: sum, type: model_inference, model: qwen-7b, timeout: 20s, max_tokens: 4,
       prompt: "Summarise {{ inputs.text }}"}
"""

PARENT = """
agent_chain:
  name: sub_parent
  tier: realtime
  slo: {end_to_end_latency_p99: 20s}
  inputs: [q, topics]
  nodes:
    - {id: each, type: chain, chain: sub_researcher, for_each: "{{ inputs.topics }}", max_concurrency: 2,
       timeout: 20s, inputs: {topic: "{{ inputs.q }}"}}
    - {id: wrap, type: chain, chain: sub_summary, label: prod, depends_on: [each], timeout: 20s,
       inputs: {text: "{{ nodes.each.output }}"}}
"""


async def test_parent_chain_runs_children_and_fan_out(sim_stack: LocalStack) -> None:
    async with InferxClient(sim_stack.router_address) as client:
        with pytest.raises(InvalidArgument, match="node 'each': chain: 'sub_researcher' cannot be run"):
            await client.put_chain(PARENT)
        await client.put_chain(CHILD)
        await client.put_chain(SUMMARY)
        with pytest.raises(
            InvalidArgument, match="node 'wrap': chain: 'sub_summary' label 'prod' cannot be run"
        ):
            await client.put_chain(PARENT)
        await client.label_chain("sub_summary", "prod", 1)
        await client.put_chain(PARENT)

        events = [
            e async for e in client.run_chain("sub_parent", {"q": "tea", "topics": "green\nblack\noolong"})
        ]
        finished = events[-1].chain_finished
        assert finished.status == "ok", finished.error
        each, wrap = finished.hops
        outputs = json.loads(each.output)
        assert len(outputs) == 3 and all(outputs)
        assert len(each.child_run_ids) == 3 and len(wrap.child_run_ids) == 1
        assert each.usage.completion_tokens > 0
        assert wrap.output and finished.output == wrap.output

        trace = await client._unary(client._stub.GetRun, router_pb2.GetRunRequest(run_id=finished.run_id))
        assert [child.finished.run_id for child in trace.children] == [
            *each.child_run_ids,
            *wrap.child_run_ids,
        ]
        for child in trace.children:
            assert child.parent_run_id == finished.run_id
            assert child.tier == "realtime"  # the parent's tier
            # the parent's deadline: what was left of its 20 s, not the child's own 60 s
            assert 0 < child.finished.slo_ms <= 20_000
        assert {c.chain for c in trace.children} == {"sub_researcher", "sub_summary"}

        # a chain naming a chain that leads back to it is refused
        loop = CHILD.replace("name: sub_researcher", "name: sub_loop_a").replace(
            "    - {id: look", "    - {id: back, type: chain, chain: sub_loop_b}\n    - {id: look"
        )
        with pytest.raises(InvalidArgument, match="node 'back': chain: 'sub_loop_b' cannot be run"):
            await client.put_chain(loop)
        await client.put_chain(SUMMARY.replace("sub_summary", "sub_loop_b"))
        await client.put_chain(loop)
        closing = SUMMARY.replace("sub_summary", "sub_loop_b").replace(
            "    - {id: sum",
            "    - {id: again, type: chain, chain: sub_loop_a, inputs: {topic: x, item: y}}\n    - {id: sum",
        )
        with pytest.raises(
            InvalidArgument, match=r"node 'again': chain: cycle sub_loop_b -> sub_loop_a -> sub_loop_b"
        ):
            await client.put_chain(closing)

    result = _cli(sim_stack, "trace", finished.run_id)
    assert result.returncode == 0, result.stderr
    assert "3 child runs" in result.stdout
    assert result.stdout.count("sub_researcher v1") == 3 and "sub_summary v1" in result.stdout
    assert "child [2]:" in result.stdout

    bad = _cli(sim_stack, "run", "sub_parent", "-i", "q=x", "-i", "topics=[1")
    assert "Traceback" not in bad.stderr
