"""A dynamic program whose calls land on two routers stays one program (issue #15), on
real etcd and real processes (SIMULATED workers): 2 routers, `Router.CallModel`.

* calls alternating between the routers: the hop index goes on (0, 1, 2, ... whichever
  router takes the call), each router hands the program over to the other, and
  `GetRun(<program id>)` through either router shows every call, in order, once the
  program ended; the worker (the scheduler's chain key is the program) stays the same;
* a router stopped (SIGTERM) while it holds a program: the program's next call, on the
  other router, continues its count, and the trace shows the calls made before.
With `--no-shared-programs` (what a router did before) the second router starts the
program's count at 0 again: both tests fail (checked: call indexes 0, 1, 2, 0, 1, 3, ...).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import grpc
import pytest

from inferx.client import InferxClient
from inferx.devstack import LocalStack, read_models_file, wait_serving
from inferx.v1 import router_pb2, router_pb2_grpc
from tests.conftest import EXAMPLES, make_stack, started
from tests.integration.test_observability import metrics_addresses, scrape, total
from tests.polling import poll_until

pytestmark = pytest.mark.integration

MODEL = "qwen-7b"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    def start(stack: LocalStack) -> None:
        stack.start_core()
        second = stack.start_service("router", replica=1)
        stack.load_models(read_models_file(EXAMPLES / "models.yaml"))
        for _ in range(2):
            stack.start_worker("tiny-llama", "sim", ["--sim-speed", "5"])
        wait_serving(second, 60)

    # Guarded: its workers routed by both routers before each test.
    with started(make_stack(tmp_path_factory.mktemp("program-routers")), start, guard=True) as stack:
        yield stack


async def call(
    address: str, program_id: str, text: str, *, end: bool = False
) -> router_pb2.ProgramCallFinished:
    async with InferxClient(address, timeout_s=30) as client:
        events = [
            event
            async for event in client.call_model(
                MODEL, text, max_tokens=8, program_id=program_id, program_name="roaming", program_end=end
            )
        ]
    finished = [e.finished for e in events if e.HasField("finished")]
    assert finished, events
    return finished[-1]


async def trace(address: str, program_id: str) -> router_pb2.RunTrace:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        return await stub.GetRun(router_pb2.GetRunRequest(run_id=program_id), timeout=10)


async def full_trace(address: str, program_id: str, calls: int) -> router_pb2.RunTrace:
    """The program's trace once it shows `calls` calls (records are shared a moment after they end)."""

    async def shown() -> router_pb2.RunTrace | None:
        found = await trace(address, program_id)
        return found if len(found.finished.hops) >= calls and found.finished.status != "running" else None

    found = await poll_until(shown, timeout_s=15, interval_s=0.2, what=f"{calls} calls of {program_id}")
    assert found is not None
    return found


def routers(stack: LocalStack) -> list[str]:
    return [stack.services["router"].address, stack.services["router-1"].address]


async def test_a_program_whose_calls_alternate_between_routers_stays_one_program(stack: LocalStack) -> None:
    a, b = routers(stack)
    program = f"roam-{uuid.uuid4().hex[:8]}"
    plan = [a, a, a, b, b, a, b]  # three hand-overs
    context = "Plan the trip."
    done = []
    for i, address in enumerate(plan):
        finished = await call(address, program, f"{context} Step {i}:", end=i == len(plan) - 1)
        context += f" Step {i}: {finished.run_id[:4]}"
        done.append(finished)
    assert [f.call_index for f in done] == list(range(len(plan)))
    assert all(f.program_id == program for f in done)
    # one record per stay on a router, each continuing the one before
    stays = [done[0].run_id, done[3].run_id, done[5].run_id, done[6].run_id]
    assert len(set(stays)) == 4
    assert [f.run_id for f in done] == [stays[0]] * 3 + [stays[1]] * 2 + [stays[2], stays[3]]
    # The scheduler keys the program by its id, not by the router: one worker throughout.
    assert len({f.worker_id for f in done}) == 1, [f.worker_id for f in done]
    # three hand-overs, each given by one router and taken by the other
    given = taken = 0.0
    for metrics_address in (await metrics_addresses(stack))["router"]:
        samples = scrape(metrics_address)
        given += total(samples, "inferx_program_handovers_total", outcome="given")
        taken += total(samples, "inferx_program_handovers_total", outcome="taken")
    assert given == taken == 3, (given, taken)
    for address in (a, b):
        found = await full_trace(address, program, len(plan))
        assert [h.node_id for h in found.finished.hops] == [f"call-{i}" for i in range(len(plan))]
        assert found.program_id == program and found.finished.status == "ok"
        starts = [t.start_ms for t in found.timings]
        assert starts == sorted(starts), starts
        assert [list(t.depends_on) for t in found.timings][1:] == [
            [f"call-{i}"] for i in range(len(plan) - 1)
        ]


async def test_a_router_stopped_while_holding_a_program_hands_it_over(stack: LocalStack) -> None:
    a, b = routers(stack)
    program = f"restart-{uuid.uuid4().hex[:8]}"
    first = [await call(b, program, f"Count. Step {i}:") for i in range(2)]
    stack.services.pop("router-1").stop()  # SIGTERM
    after = await call(a, program, "Count. Step 2:", end=True)
    assert [f.call_index for f in first] + [after.call_index] == [0, 1, 2]
    found = await full_trace(a, program, 3)
    assert [h.node_id for h in found.finished.hops] == ["call-0", "call-1", "call-2"]
