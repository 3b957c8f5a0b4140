"""Helpers of the fault-injection tests: run a batch of concurrent chains and account
for every one of them (completed, or ended with an explicit error status)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import grpc

from inferx import etcd
from inferx.client import InferxClient
from inferx.devstack import LocalStack, free_port
from inferx.errors import InferxError
from inferx.etcd import LeaseKeeper, make_client
from inferx.v1 import router_pb2, tool_pb2_grpc
from tests.polling import poll_until

HANG_S = 60.0  # a run that takes longer than this counts as hung


@dataclass
class Outcome:
    chain_finished: router_pb2.ChainFinished | None = None
    error: InferxError | None = None

    @property
    def ok(self) -> bool:
        return self.chain_finished is not None and self.chain_finished.status == "ok"

    @property
    def finished(self) -> router_pb2.ChainFinished:
        """The run's ChainFinished; an AssertionError naming the error if it ended without."""
        assert self.chain_finished is not None, f"the run failed: {self.error}"
        return self.chain_finished


async def run_batch(
    stack: LocalStack, chain: str, inputs: list[dict[str, str]], *, stagger_s: float = 0.0
) -> list[Outcome]:
    """Run one chain per inputs entry concurrently; every run must end within HANG_S."""

    async def one(i: int, client: InferxClient) -> Outcome:
        await asyncio.sleep(i * stagger_s)
        try:
            finished = None
            async for event in client.run_chain(chain, inputs[i]):
                if event.WhichOneof("event") == "chain_finished":
                    finished = event.chain_finished
            assert finished is not None, "stream ended without chain_finished"
            return Outcome(chain_finished=finished)
        except InferxError as exc:
            return Outcome(error=exc)

    async with InferxClient(stack.router_address) as client:
        tasks = [asyncio.create_task(one(i, client)) for i in range(len(inputs))]
        done, pending = await asyncio.wait(tasks, timeout=HANG_S + len(inputs) * stagger_s)
        for task in pending:
            task.cancel()
        assert not pending, f"{len(pending)} of {len(tasks)} runs hung"
        return [task.result() for task in tasks]


def describe(outcomes: list[Outcome]) -> str:
    rows = []
    for o in outcomes:
        if o.error is not None:
            rows.append(f"{o.error.code.name}: {o.error.message}")
        elif not o.ok:
            rows.append(f"{o.finished.status}: {o.finished.error}")
    return "\n".join(rows)


class ToolServer:
    """A ToolService in this process, registered in the stack's etcd under a lease."""

    def __init__(self, stack: LocalStack, name: str, servicer, *, idempotency_keys: bool = False) -> None:
        self.stack, self.name, self.servicer = stack, name, servicer
        self.idempotency_keys = idempotency_keys

    async def __aenter__(self) -> ToolServer:
        self.server = grpc.aio.server()
        tool_pb2_grpc.add_ToolServiceServicer_to_server(self.servicer, self.server)
        port = self.server.add_insecure_port(f"127.0.0.1:{free_port()}")
        await self.server.start()
        self.client = make_client(self.stack.etcd_endpoint)
        self.keeper = LeaseKeeper(self.client, ttl_s=5)
        registration = {"address": f"127.0.0.1:{port}", "idempotency_keys": self.idempotency_keys}
        await self.keeper.put(etcd.tool_key(self.name, "test"), json.dumps(registration).encode())
        self.keeper.start()
        assert await self.keeper.wait_registered(5)
        # The router learns of the tool through its etcd watch: wait until it has.
        async with InferxClient(self.stack.router_address) as client:

            async def seen() -> bool:
                return self.name in (await client.status()).tools

            await poll_until(seen, timeout_s=10, what=f"the router to see tool '{self.name}'")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.keeper.close()
        await self.client.close()
        await self.server.stop(0)
