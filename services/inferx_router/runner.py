"""Walks one chain run: independent nodes run concurrently, each node starts when its
dependencies are done, a failed or timed-out node skips its dependents, and every
step is reported as a RunEvent on a queue the servicer streams to the caller."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import grpc

from inferx.chain.schema import ChainConfig, NodeSpec
from inferx.chain.template import render
from inferx.chain.validate import sinks
from inferx.discovery import ChannelPool, ServiceLocator
from inferx.errors import InferxError, Unavailable, from_rpc_error
from inferx.v1 import common_pb2, router_pb2, scheduler_pb2, scheduler_pb2_grpc
from inferx_router import metrics
from inferx_router.chain_store import StoredVersion
from inferx_router.tools import SESSION_MEMORY, ToolCall, ToolRouter

log = logging.getLogger("inferx.router.run")

TIERS = {
    "realtime": common_pb2.TIER_REALTIME,
    "standard": common_pb2.TIER_STANDARD,
    "batch": common_pb2.TIER_BATCH,
}


@dataclass
class NodeOutcome:
    finished: router_pb2.NodeFinished
    done: asyncio.Event = field(default_factory=asyncio.Event)


def default_prompt(node: NodeSpec, inputs: dict[str, str], outputs: dict[str, str]) -> str:
    """Without a template: stable part first (inputs), then upstream results, so hops of
    one chain share a prefix the engine's prefix cache can reuse."""
    lines = [f"{key}: {value}" for key, value in sorted(inputs.items())]
    lines += [f"[{dep}] {outputs.get(dep, '')}" for dep in node.depends_on]
    lines.append(f"Task ({node.id}):")
    return "\n".join(lines)


def tool_output_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


class ChainRun:
    def __init__(
        self,
        chain: StoredVersion,
        inputs: dict[str, str],
        *,
        session_id: str,
        tier: int,
        services: ServiceLocator,
        channels: ChannelPool,
        tools: ToolRouter,
    ) -> None:
        self.chain = chain
        self.config: ChainConfig = chain.config
        self.inputs = inputs
        self.session_id = session_id
        self.run_id = uuid.uuid4().hex[:16]
        self.tier = tier or TIERS.get(str(self.config.tier), common_pb2.TIER_STANDARD)
        self._services = services
        self._channels = channels
        self._tools = tools
        self.events: asyncio.Queue[router_pb2.RunEvent | None] = asyncio.Queue()
        self._outcomes: dict[str, NodeOutcome] = {}
        self._outputs: dict[str, str] = {}
        self._started = time.perf_counter()
        self._deadline_ms = int(time.time() * 1000 + self.config.slo.latency_p99_ms)

    def _at_ms(self) -> float:
        return (time.perf_counter() - self._started) * 1000

    def _emit(self, **event: Any) -> None:
        self.events.put_nowait(router_pb2.RunEvent(run_id=self.run_id, at_ms=self._at_ms(), **event))

    async def run(self) -> router_pb2.ChainFinished:
        """Execute every node; always ends with a ChainFinished event."""
        nodes = {node.id: node for node in self.config.nodes}
        self._outcomes = {node_id: NodeOutcome(router_pb2.NodeFinished(node_id=node_id)) for node_id in nodes}
        try:
            await asyncio.gather(*(self._run_node(node) for node in nodes.values()))
        finally:
            finished = self._finish()
            self._emit(chain_finished=finished)
            self.events.put_nowait(None)
        if finished.status == "ok" and self.session_id:
            await self._tools.remember(self.session_id, {"inputs": self.inputs, "output": finished.output})
        return finished

    def _finish(self) -> router_pb2.ChainFinished:
        latency_ms = self._at_ms()
        hops = [self._outcomes[node.id].finished for node in self.config.nodes]
        failed = [hop for hop in hops if hop.status != "ok"]
        status = "ok" if not failed else "error"
        slo_ms = self.config.slo.latency_p99_ms
        output = "\n".join(self._outputs.get(node_id, "") for node_id in sinks(self.config))
        finished = router_pb2.ChainFinished(
            run_id=self.run_id,
            status=status,
            latency_ms=latency_ms,
            slo_ms=slo_ms,
            slo_met=status == "ok" and latency_ms <= slo_ms,
            hops=hops,
            chain_version=self.chain.version,
            output=output,
            error="; ".join(f"{hop.node_id}: {hop.error}" for hop in failed if hop.error),
        )
        metrics.observe_chain(self.config.name, str(self.config.tier), finished)
        return finished

    async def _run_node(self, node: NodeSpec) -> None:
        outcome = self._outcomes[node.id]
        result = outcome.finished
        result.node_type = node.type
        try:
            for dep in node.depends_on:
                await self._outcomes[dep].done.wait()
            blocked = [dep for dep in node.depends_on if self._outcomes[dep].finished.status != "ok"]
            if blocked:
                result.status = "skipped"
                result.error = f"upstream {', '.join(blocked)} did not finish"
                self._emit(node_finished=result)
                return
            self._emit(node_started=router_pb2.NodeStarted(node_id=node.id, node_type=node.type))
            started = time.perf_counter()
            try:
                async with asyncio.timeout(node.timeout_ms / 1000):
                    if node.type == "model_inference":
                        await self._model_node(node, result)
                    else:
                        await self._tool_node(node, result)
                result.status = "ok"
                self._outputs[node.id] = result.output
            except TimeoutError:
                result.status = "timeout"
                result.error = f"timed out after {node.timeout_ms:g}ms"
            except InferxError as exc:
                result.status = "error"
                result.error = exc.message
            result.latency_ms = (time.perf_counter() - started) * 1000
            metrics.observe_node(self.config.name, node.id, result)
            self._emit(node_finished=result)
        finally:
            outcome.done.set()

    async def _model_node(self, node: NodeSpec, result: router_pb2.NodeFinished) -> None:
        result.model = node.model or ""
        if node.prompt:
            prompt = render(node.prompt, self.inputs, self._outputs)
        else:
            prompt = default_prompt(node, self.inputs, self._outputs)
        address = self._services.pick("scheduler")
        if address is None:
            raise Unavailable("no scheduler is registered in etcd")
        stub = scheduler_pb2_grpc.SchedulerStub(self._channels.get(address))
        request = scheduler_pb2.HopRequest(
            context=common_pb2.HopContext(
                run_id=self.run_id,
                hop_id=node.id,
                session_id=self.session_id,
                chain_name=self.config.name,
                chain_version=self.chain.version,
                tier=self.tier,
                priority=node.priority_rank,
                chain_deadline_unix_ms=self._deadline_ms,
            ),
            model=node.model or "",
            prompt=prompt,
            sampling=common_pb2.SamplingOptions(max_tokens=node.max_tokens, temperature=node.temperature),
        )
        try:
            async for event in stub.SubmitHop(request, timeout=node.timeout_ms / 1000):
                if event.kind == scheduler_pb2.HopEvent.KIND_DISPATCHED:
                    result.worker_id = event.worker_id
                elif event.kind == scheduler_pb2.HopEvent.KIND_FINISHED:
                    result.output = event.text
                    result.usage.CopyFrom(event.usage)
                    result.queue_ms = event.queue_ms
                    result.worker_id = event.worker_id
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise TimeoutError from None
            raise from_rpc_error(exc, target=f"scheduler at {address}") from None

    async def _tool_node(self, node: NodeSpec, result: router_pb2.NodeFinished) -> None:
        tool = node.tool or SESSION_MEMORY
        result.tool = tool
        if node.arguments:
            arguments: dict[str, Any] = {
                name: render(template, self.inputs, self._outputs)
                for name, template in node.arguments.items()
            }
        else:
            arguments = dict(self.inputs)
        if node.type == "memory_retrieval" and tool == SESSION_MEMORY:
            arguments.setdefault("limit", node.limit)
        call = ToolCall(tool, arguments, self.run_id, self.session_id, node.timeout_ms / 1000)
        outcome = await self._tools.call(call, cacheable=node.cacheable, cache_ttl_s=node.cache_ttl_ms / 1000)
        result.output = tool_output_text(outcome.value)
        result.cache_hit = outcome.cache_hit
