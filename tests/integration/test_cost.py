"""Cost per hop and run from the pools' prices in etcd, and `slo.max_cost`: runs planned
within it (fallback model, skipped non-critical node) or refused, on sim workers."""

from __future__ import annotations

import pytest

from inferx.client import InferxClient
from inferx.devstack import LocalStack
from inferx.errors import FailedPrecondition, InvalidArgument
from inferx.pricing import Price, hop_cost
from inferx.v1 import router_pb2
from tests.integration.test_chain_runs import _cli
from tests.integration.test_observability import metrics_addresses, scrape, total

pytestmark = pytest.mark.integration

CHAIN = """
agent_chain:
  name: NAME
  slo: {end_to_end_latency_p99: 20sMAX}
  inputs: [q]
  nodes:
    - {id: draft, type: model_inference, model: qwen-72b, fallback_model: qwen-7b, timeout: 15s,
       max_tokens: 20, prompt: "Draft an answer to {{ inputs.q }}"}
    - {id: polish, type: model_inference, model: qwen-72b, critical: false, timeout: 15s,
       max_tokens: 20, depends_on: [draft], prompt: "Polish {{ nodes.draft.output }}"}
"""

BIG = Price(prompt_per_1k=1.0, cached_per_1k=0.5, output_per_1k=10.0)
SMALL = Price(prompt_per_1k=0.1, output_per_1k=1.0)


def chain(name: str, max_cost: float | None = None) -> str:
    return CHAIN.replace("NAME", name).replace(
        "MAX", f", max_cost: {max_cost}" if max_cost is not None else ""
    )


async def finish(client: InferxClient, name: str):
    events = [e async for e in client.run_chain(name, {"q": "where is my order?"})]
    return events[-1].chain_finished


def expected(hop, price: Price) -> float:
    u = hop.usage
    return hop_cost(
        price,
        prompt_tokens=u.prompt_tokens,
        cached_prompt_tokens=u.cached_prompt_tokens,
        completion_tokens=u.completion_tokens,
    )


async def test_prices_costs_and_the_budget(sim_stack: LocalStack) -> None:
    async with InferxClient(sim_stack.router_address) as client:
        unset = await client.get_pool_price("qwen-72b")
        assert not unset.set and unset.pool == "tiny-llama"  # no price: its pool's (none)
        with pytest.raises(InvalidArgument, match="prompt_per_1k: must be a finite number >= 0"):
            await client.set_pool_price("tiny-llama", prompt_per_1k=-1)
        await client.set_pool_price("qwen-72b", prompt_per_1k=1.0, cached_per_1k=0.5, output_per_1k=10.0)
        await client.set_pool_price("qwen-7b", prompt_per_1k=0.1, output_per_1k=1.0)
        shown = await client.get_pool_price("qwen-72b")
        assert shown.set and shown.output_per_1k == 10.0 and shown.cached_per_1k == 0.5

        # Every hop's cost from its usage and its model's price; the run's is their sum.
        await client.put_chain(chain("priced"))
        run = await finish(client, "priced")  # SetPoolPrice applies at once on the router it reached
        assert run.status == "ok", run.error
        for hop in run.hops:
            assert hop.cost == pytest.approx(expected(hop, BIG)), hop
        assert run.cost == pytest.approx(sum(h.cost for h in run.hops)) and run.max_cost == 0
        assert run.slo_met

        # A budget under the plain estimate: draft on its cheaper fallback model.
        await client.put_chain(chain("budget_fallback", 0.35))
        run = await finish(client, "budget_fallback")
        hops = {h.node_id: h for h in run.hops}
        assert run.status == "ok", run.error
        assert (hops["draft"].degradation, hops["draft"].degradation_reason) == ("fallback_model", "budget")
        assert hops["draft"].model == "qwen-7b"
        assert hops["draft"].cost == pytest.approx(expected(hops["draft"], SMALL))
        assert hops["polish"].status == "ok" and not hops["polish"].degradation
        assert run.max_cost == 0.35 and run.cost <= 0.35

        # Tighter: the non-critical node is skipped as well.
        await client.put_chain(chain("budget_skip", 0.1))
        run = await finish(client, "budget_skip")
        hops = {h.node_id: h for h in run.hops}
        assert run.status == "ok", run.error
        assert hops["draft"].degradation == "fallback_model"
        assert (hops["polish"].status, hops["polish"].degradation_reason) == ("skipped", "budget")
        assert hops["polish"].cost == 0 and run.cost == pytest.approx(hops["draft"].cost)

        # Cannot fit at all: refused before it starts, naming the budget.
        await client.put_chain(chain("budget_refused", 0.0001))
        with pytest.raises(FailedPrecondition, match=r"over its slo\.max_cost 0\.0001"):
            await finish(client, "budget_refused")

        trace = await client._unary(client._stub.GetRun, router_pb2.GetRunRequest(chain="priced"))
        assert trace.finished.cost > 0
        stats = await client._unary(
            client._stub.GetChainStats, router_pb2.GetChainStatsRequest(chain="priced")
        )
        assert stats.cost.total > 0 and stats.cost.p50 > 0 and stats.cost.p99 >= stats.cost.p50

    # Counted per chain and tenant.
    samples = {}
    for address in (await metrics_addresses(sim_stack))["router"]:
        samples.update(scrape(address))
    assert total(samples, "inferx_chain_cost_total", chain="priced") > 0
    assert total(samples, "inferx_chain_budget_refusals_total", chain="budget_refused") == 1


SUB_PARENT = """
agent_chain:
  name: priced_parent
  slo: {end_to_end_latency_p99: 30s, max_cost: MAX}
  inputs: [q]
  nodes:
    - {id: ask, type: model_inference, model: qwen-7b, timeout: 15s, max_tokens: 8,
       prompt: "Plan {{ inputs.q }}"}
    - {id: sub, type: chain, chain: priced_child, depends_on: [ask], timeout: 15s,
       inputs: {q: "{{ nodes.ask.output }}"}}
"""


async def test_a_sub_agents_cost_is_its_parents(sim_stack: LocalStack) -> None:
    """A `type: chain` node costs what its child run cost: the parent's run cost (and so
    its slo.max_cost) includes it, while the per-chain counter counts each hop once."""
    async with InferxClient(sim_stack.router_address) as client:
        await client.set_pool_price("qwen-72b", prompt_per_1k=1.0, cached_per_1k=0.5, output_per_1k=10.0)
        await client.set_pool_price("qwen-7b", prompt_per_1k=0.1, output_per_1k=1.0)
        await client.put_chain(chain("priced_child"))
        await client.put_chain(SUB_PARENT.replace("MAX", "100"))
        run = await finish(client, "priced_parent")
        assert run.status == "ok", run.error
        ask, sub = run.hops
        assert ask.cost == pytest.approx(expected(ask, SMALL)) and ask.cost > 0
        (child_id,) = sub.child_run_ids
        child = await client._unary(client._stub.GetRun, router_pb2.GetRunRequest(run_id=child_id))
        assert child.finished.cost > 0 and sub.cost == pytest.approx(child.finished.cost)
        assert run.cost == pytest.approx(ask.cost + child.finished.cost)

        # The children's cost counts against the parent's budget: over it, the SLO is missed.
        # (the budget fits the parent's own model node, the plan's estimate, but not the child)
        await client.put_chain(SUB_PARENT.replace("MAX", f"{ask.cost + child.finished.cost / 2:.6f}"))
        over = await finish(client, "priced_parent")
        assert over.cost > over.max_cost and not over.slo_met

        # A child's own slo.max_cost is planned as a run's: one that cannot fit fails the node.
        await client.put_chain(chain("priced_tight_child", 0.0001))
        await client.put_chain(
            SUB_PARENT.replace("priced_parent", "priced_tight_parent")
            .replace("priced_child", "priced_tight_child")
            .replace("MAX", "100")
        )
        tight = await finish(client, "priced_tight_parent")
        assert tight.status == "error" and "over its slo.max_cost 0.0001" in tight.error, tight

    samples = {}
    for address in (await metrics_addresses(sim_stack))["router"]:
        samples.update(scrape(address))
    parents = total(samples, "inferx_chain_cost_total", chain="priced_parent")
    assert parents == pytest.approx(ask.cost + over.hops[0].cost)  # its own hops, not the child's


def test_cli_shows_prices_costs_and_refuses_bad_prices(sim_stack: LocalStack) -> None:
    result = _cli(sim_stack, "pool", "price", "qwen-7b", "--prompt-per-1k", "0.1", "--output-per-1k", "1")
    assert result.returncode == 0, result.stderr
    assert "pool 'qwen-7b': prompt 0.1/1k · cached 0.1/1k · output 1/1k" in result.stdout
    shown = _cli(sim_stack, "pool", "price", "qwen-7b")
    assert shown.returncode == 0 and "output 1/1k" in shown.stdout
    for bad in ("-1", "nan", "cheap"):
        refused = _cli(sim_stack, "pool", "price", "qwen-7b", "--output-per-1k", bad)
        assert refused.returncode == 2 and "--output-per-1k" in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr
    run = _cli(sim_stack, "run", "customer_service_agent", "-i", "query=Where is my order?")
    assert run.returncode == 0, run.stderr
    assert "cost " in run.stdout
    trace = _cli(sim_stack, "trace", "--chain", "customer_service_agent")
    assert trace.returncode == 0 and "cost " in trace.stdout, trace.stdout + trace.stderr
    stats = _cli(sim_stack, "stats", "customer_service_agent")
    assert stats.returncode == 0 and "cost   p50" in stats.stdout, stats.stdout + stats.stderr


async def test_program_calls_report_their_cost_in_the_openai_usage_and_call_model(
    sim_stack: LocalStack,
) -> None:
    import httpx

    async with InferxClient(sim_stack.router_address) as client:
        await client.set_pool_price("qwen-72b", prompt_per_1k=1.0, cached_per_1k=0.5, output_per_1k=10.0)
        events = [
            e async for e in client.call_model("qwen-72b", "hi there", max_tokens=6, program_name="priced")
        ]
        finished = events[-1].finished
        assert finished.cost > 0
        assert finished.cost == pytest.approx(
            hop_cost(
                BIG,
                prompt_tokens=finished.usage.prompt_tokens,
                cached_prompt_tokens=finished.usage.cached_prompt_tokens,
                completion_tokens=finished.usage.completion_tokens,
            )
        )
        trace = await client._unary(client._stub.GetRun, router_pb2.GetRunRequest(run_id=finished.run_id))
        assert trace.finished.hops[0].cost == pytest.approx(finished.cost)
    body = {"model": "qwen-72b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    async with httpx.AsyncClient(base_url=sim_stack.router_http_url, timeout=30) as http:
        reply = await http.post("/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        usage = reply.json()["usage"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        want = (usage["prompt_tokens"] - cached + cached * 0.5 + usage["completion_tokens"] * 10) / 1000
        assert usage["cost"] == pytest.approx(want)
        assert usage["cost"] > 0
        unpriced = await http.post("/chat/completions", json={**body, "model": "tiny-llama"})
        assert "cost" not in unpriced.json()["usage"]  # no price: no cost key


RUNTIME = """
agent_chain:
  name: budget_runtime
  slo: {end_to_end_latency_p99: 20s, max_cost: 40}
  inputs: [q]
  nodes:
    - {id: docs, type: tool_call, tool: vector_search, arguments: {query: "{{ inputs.q }}"}}
    - {id: answer, type: model_inference, model: qwen-72b, fallback_model: qwen-7b, timeout: 15s,
       max_tokens: 4, depends_on: [docs], prompt: "{{ nodes.docs.output }} {{ inputs.q }}"}
"""


async def test_a_prompt_larger_than_planned_takes_the_fallback_model_when_it_is_known(
    sim_stack: LocalStack,
) -> None:
    """The plan cannot know a tool's output: once the prompt is rendered, a node whose
    estimate no longer fits what is left of max_cost takes its cheaper fallback model."""
    async with InferxClient(sim_stack.router_address) as client:
        await client.set_pool_price("qwen-72b", prompt_per_1k=1000)  # 1 per prompt token
        await client.set_pool_price("qwen-7b")  # free
        await client.put_chain(RUNTIME)
        run = await finish(client, "budget_runtime")
        hops = {h.node_id: h for h in run.hops}
        assert run.status == "ok", run.error
        assert len(hops["docs"].output) > 4 * 40  # the documents alone are over the budget's tokens
        answer = hops["answer"]
        assert (answer.degradation, answer.degradation_reason, answer.model) == (
            "fallback_model",
            "budget",
            "qwen-7b",
        )
        assert run.cost == 0 and run.slo_met
