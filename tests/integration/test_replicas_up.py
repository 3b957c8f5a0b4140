"""`inferx up --replicas N` (issue 15): N of each of router, scheduler, memory-pool and
cache on one machine, each serving and registered in etcd, the schedulers electing one
owner for the pool, and `inferx status --json` listing every instance. Real etcd and
processes, SIMULATED workers."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections import Counter

import pytest

from inferx import etcd
from inferx.devstack import SERVICE_KINDS, LocalStack, read_models_file
from inferx.partitions import Owner
from tests.conftest import EXAMPLES, dump_logs, make_stack
from tests.polling import poll_until

pytestmark = pytest.mark.integration


async def registered_and_elected(stack: LocalStack) -> None:
    async with stack.etcd_client() as client:
        listing = await client.get_prefix(etcd.SERVICES.encode())
        kinds = Counter(kv.key.decode().removeprefix(etcd.SERVICES).split("/")[0] for kv in listing)
        assert {kind: kinds[kind] for kind in SERVICE_KINDS} == dict.fromkeys(SERVICE_KINDS, 2)

        async def owner() -> Owner | None:
            found = await client.get(etcd.partition_key("scheduler", "tiny-llama").encode())
            return Owner.decode(found.value) if found is not None else None

        elected = await poll_until(owner, timeout_s=10, what="an owner of the pool")
        assert elected is not None
        assert elected.address in {stack.services[n].address for n in ("scheduler", "scheduler-1")}


def test_two_replicas_of_each_service_register_and_serve_chains(tmp_path) -> None:
    stack = make_stack(tmp_path)
    try:
        stack.start_core(replicas=2)
        stack.load_models(read_models_file(EXAMPLES / "models.yaml"))
        stack.start_worker("tiny-llama", "sim", ["--sim-speed", "20"])
        stack.wait_workers(60)  # routed by both routers: a chain goes through each
        stack.put_chains(sorted((EXAMPLES / "chains").glob("*.yaml")))
        assert sorted(stack.services) == sorted([*SERVICE_KINDS, *(f"{k}-1" for k in SERVICE_KINDS)])
        asyncio.run(registered_and_elected(stack))
        status = subprocess.run(
            [sys.executable, "-m", "inferx.cli.main", "status", "--json", "--router", stack.router_address],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert status.returncode == 0, status.stderr
        listed = Counter(s["kind"] for s in json.loads(status.stdout)["services"])
        assert {kind: listed[kind] for kind in SERVICE_KINDS} == dict.fromkeys(SERVICE_KINDS, 2)
        for router in ("router", "router-1"):  # a chain through each router
            run = subprocess.run(
                [
                    sys.executable, "-m", "inferx.cli.main", "run", "customer_service_agent",
                    "--input", "query=Where is my order?", "--json",
                    "--router", stack.services[router].address,
                ],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert run.returncode == 0, run.stderr
            assert json.loads(run.stdout)["status"] == "ok"
    except BaseException:
        dump_logs(stack)
        raise
    finally:
        stack.stop()
