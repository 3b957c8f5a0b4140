"""Routers are stateless for what clients can ask about finished runs (issue 15): on the
secure stack (real etcd with TLS, real processes, SIMULATED workers) with a second
router, a run through one router is traced (GetRun, `inferx trace`) and counted
(GetChainStats) through the other; another tenant is told it does not exist through
either; a router killed with kill -9 leaves its runs findable; and a shared record is
gone after --run-retention-s."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator

import grpc
import pytest

from inferx.devstack import LocalStack, ManagedProcess, wait_serving
from inferx.v1 import router_pb2
from tests.conftest import running_sim_stack, wait_workers_routed
from tests.integration.test_access import CHAIN as CHAIN_TEXT
from tests.integration.test_access import auth, make_tenant, make_token, router, run_chain, status_of
from tests.polling import poll_until

pytestmark = pytest.mark.integration

CHAIN = "customer_service_agent"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    with running_sim_stack(
        tmp_path_factory.mktemp("stateless"), workers=1, sim_speed=20, insecure=False
    ) as stack:
        yield stack


@pytest.fixture(scope="module")
def admin_token(stack: LocalStack) -> str:
    assert stack.admin_token
    return stack.admin_token


def start_router(stack: LocalStack, replica: int, *extra: str) -> ManagedProcess:
    proc = stack.start_service("router", list(extra), replica=replica)
    wait_serving(proc, 60)
    wait_workers_routed(stack, routers=[proc.address])  # its etcd watch has the workers
    return proc


def stop_router(stack: LocalStack, proc: ManagedProcess, replica: int) -> None:
    proc.stop()
    stack.services.pop(f"router-{replica}", None)


async def traced(stub, run_id: str, token: str) -> router_pb2.RunTrace:
    """GetRun, polled: the record is put in etcd just after the run's last event."""
    found: list[router_pb2.RunTrace] = []

    async def found_it() -> bool:
        try:
            found.append(
                await stub.GetRun(router_pb2.GetRunRequest(run_id=run_id), metadata=auth(token), timeout=10)
            )
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.NOT_FOUND, exc
            return False
        return True

    await poll_until(found_it, timeout_s=10, interval_s=0.05, what=f"run {run_id} to be shared")
    return found[-1]


async def get_run_status(stub, run_id: str, token: str) -> grpc.StatusCode:
    return await status_of(stub, "GetRun", router_pb2.GetRunRequest(run_id=run_id), token)


async def runs_counted(stub, token: str) -> int:
    try:
        stats = await stub.GetChainStats(
            router_pb2.GetChainStatsRequest(chain=CHAIN), metadata=auth(token), timeout=10
        )
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == grpc.StatusCode.NOT_FOUND, exc
        return 0
    return stats.runs


async def test_a_run_through_one_router_is_traced_and_counted_through_the_other(
    stack: LocalStack, admin_token: str
) -> None:
    first = start_router(stack, 1)
    try:
        async with router(stack, first.address) as one, router(stack) as two:
            before = await runs_counted(two, admin_token)
            finished = await run_chain(one, admin_token)
            assert finished.status == "ok", finished.error
            trace = await traced(two, finished.run_id, admin_token)
            assert trace.chain == CHAIN and trace.finished.run_id == finished.run_id
            assert [t.node_id for t in trace.timings] == [h.node_id for h in finished.hops]
            # a unique prefix works too, as with the router's own runs
            assert (await traced(two, finished.run_id[:8], admin_token)).finished.run_id == finished.run_id
            stats = await two.GetChainStats(
                router_pb2.GetChainStatsRequest(chain=CHAIN), metadata=auth(admin_token), timeout=10
            )
            assert stats.runs == before + 1
            # `inferx trace` against the other router
            assert stack.tls_ca is not None
            cli = subprocess.run(
                [
                    sys.executable, "-m", "inferx.cli.main", "trace", finished.run_id, "--json",
                    "--router", stack.router_address, "--token", admin_token, "--tls-ca", str(stack.tls_ca),
                ],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert cli.returncode == 0, cli.stderr
            assert finished.run_id in cli.stdout and CHAIN in cli.stdout
            json.loads(cli.stdout)
    finally:
        stop_router(stack, first, 1)


async def test_another_tenants_run_is_not_found_through_either_router(
    stack: LocalStack, admin_token: str
) -> None:
    first = start_router(stack, 2)
    try:
        async with router(stack, first.address) as one, router(stack) as two:
            await make_tenant(two, admin_token, "shared-a")
            await make_tenant(two, admin_token, "shared-b")
            a_manage = await make_token(two, admin_token, "shared-a", "manage")
            b_manage = await make_token(two, admin_token, "shared-b", "manage")
            for token in (a_manage, b_manage):  # each tenant has its own chain of that name
                await two.PutChain(
                    router_pb2.PutChainRequest(config=CHAIN_TEXT), metadata=auth(token), timeout=10
                )
            finished = await run_chain(one, a_manage)
            assert finished.status == "ok", finished.error
            await traced(two, finished.run_id, a_manage)
            for stub in (one, two):
                assert await get_run_status(stub, finished.run_id, b_manage) == grpc.StatusCode.NOT_FOUND
                assert await get_run_status(stub, finished.run_id[:8], b_manage) == grpc.StatusCode.NOT_FOUND
                assert (
                    await status_of(
                        stub, "GetChainStats", router_pb2.GetChainStatsRequest(chain=CHAIN), b_manage
                    )
                    == grpc.StatusCode.NOT_FOUND
                )
                stats = await stub.GetChainStats(
                    router_pb2.GetChainStatsRequest(chain=CHAIN), metadata=auth(a_manage), timeout=10
                )
                assert stats.runs == 1
    finally:
        stop_router(stack, first, 2)


async def test_runs_of_a_router_killed_with_kill_9_are_still_found(
    stack: LocalStack, admin_token: str
) -> None:
    doomed = start_router(stack, 3)
    try:
        async with router(stack, doomed.address) as one:
            runs = [await run_chain(one, admin_token) for _ in range(2)]
        async with router(stack) as two:
            for finished in runs:  # shared before the kill (the put follows the run at once)
                await traced(two, finished.run_id, admin_token)
            doomed.signal(signal.SIGKILL)
            doomed.wait(10)
            for finished in runs:
                trace = await traced(two, finished.run_id, admin_token)
                assert trace.finished.status == finished.status
    finally:
        stop_router(stack, doomed, 3)


async def test_a_shared_record_is_gone_after_the_retention(stack: LocalStack, admin_token: str) -> None:
    short = start_router(stack, 4, "--run-retention-s", "3")
    try:
        async with router(stack, short.address) as one, router(stack) as two:
            finished = await run_chain(one, admin_token)
            await traced(two, finished.run_id, admin_token)

            async def gone() -> bool:
                return await get_run_status(two, finished.run_id, admin_token) == grpc.StatusCode.NOT_FOUND

            await poll_until(gone, timeout_s=15, interval_s=0.25, what="the record's lease to end")
    finally:
        stop_router(stack, short, 4)
