"""A tool server in another process speaks inferx.v1.ToolService; registered in etcd,
chains call it, and cacheable results come from the cache the second time."""

from __future__ import annotations

import json

import grpc
import pytest

from inferx import etcd
from inferx.client import InferxClient
from inferx.devstack import LocalStack, free_port
from inferx.etcd import LeaseKeeper, make_client
from inferx.v1 import tool_pb2, tool_pb2_grpc

pytestmark = pytest.mark.integration

CHAIN = """
agent_chain:
  name: weather_chain
  slo: {end_to_end_latency_p99: 5s}
  inputs: [city]
  nodes:
    - id: lookup
      type: tool_call
      tool: weather
      timeout: 2s
      cacheable: CACHEABLE
      arguments: {city: "{{ inputs.city }}"}
    - id: say
      type: model_inference
      model: qwen-7b
      timeout: 2s
      depends_on: [lookup]
      prompt: "Weather: {{ nodes.lookup.output }}. Say it nicely:"
"""


class WeatherTool(tool_pb2_grpc.ToolServiceServicer):
    def __init__(self) -> None:
        self.calls: list[dict] = []

    async def Invoke(self, request, context):
        args = json.loads(request.arguments_json)
        self.calls.append(args)
        if args.get("city") == "Atlantis":
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such city: Atlantis")
        return tool_pb2.ToolResponse(result_json=json.dumps({"city": args["city"], "sky": "clear"}))


@pytest.fixture
async def weather_server(sim_stack: LocalStack):
    tool = WeatherTool()
    server = grpc.aio.server()
    tool_pb2_grpc.add_ToolServiceServicer_to_server(tool, server)
    port = server.add_insecure_port(f"127.0.0.1:{free_port()}")
    await server.start()
    client = make_client(sim_stack.etcd_endpoint)
    keeper = LeaseKeeper(client, ttl_s=5)
    await keeper.put(
        etcd.tool_key("weather", "test-1"),
        json.dumps({"address": f"127.0.0.1:{port}", "version": "1"}).encode(),
    )
    keeper.start()
    assert await keeper.wait_registered(5)
    yield tool
    await keeper.close()
    await client.close()
    await server.stop(0)


async def _finish(client: InferxClient, city: str):
    events = [e async for e in client.run_chain("weather_chain", {"city": city})]
    return events[-1].chain_finished


async def _wait_tool_visible(client: InferxClient, city: str):
    # The router learns about the tool through its etcd watch: a moment after the put.
    for _ in range(50):
        finished = await _finish(client, city)
        lookup = finished.hops[0]
        if "neither built in nor registered" not in lookup.error:
            return finished
    raise AssertionError("router never saw the tool registration")


async def test_registered_tool_server_is_called_and_cached(sim_stack, weather_server) -> None:
    async with InferxClient(sim_stack.router_address) as client:
        await client.put_chain(CHAIN.replace("CACHEABLE", "true"))
        first = await _wait_tool_visible(client, "Paris")
        assert first.status == "ok", first.error
        assert json.loads(first.hops[0].output) == {"city": "Paris", "sky": "clear"}
        calls = len(weather_server.calls)
        second = await _finish(client, "Paris")
        assert second.hops[0].cache_hit
        assert len(weather_server.calls) == calls  # served from the cache, tool not called

        failed = await _finish(client, "Atlantis")
        assert failed.status == "error"
        assert failed.hops[0].status == "error" and "Atlantis" in failed.hops[0].error
        assert failed.hops[1].status == "skipped"


async def test_non_cacheable_tool_is_called_every_time(sim_stack, weather_server) -> None:
    async with InferxClient(sim_stack.router_address) as client:
        await client.put_chain(CHAIN.replace("CACHEABLE", "false"))
        await _wait_tool_visible(client, "Oslo")
        calls = len(weather_server.calls)
        again = await _finish(client, "Oslo")
        assert not again.hops[0].cache_hit
        assert len(weather_server.calls) == calls + 1
