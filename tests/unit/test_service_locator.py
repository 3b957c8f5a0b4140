"""`ServiceLocator.wait_pick`: a hop that finds no scheduler registered (one restarting,
or a lease lapsed under load) waits for one within its time instead of failing."""

from __future__ import annotations

import asyncio

from google.protobuf import json_format

from inferx.discovery import ServiceLocator
from inferx.v1 import common_pb2


def registration(kind: str, address: str) -> bytes:
    info = common_pb2.ServiceInfo(kind=kind, instance_id=f"{kind}-1", address=address)
    return json_format.MessageToJson(info).encode()


def locator() -> ServiceLocator:
    return ServiceLocator(client=None)  # the mirror is fed by hand, never started


async def test_waits_for_a_registration_that_arrives_in_time() -> None:
    services = locator()
    loop = asyncio.get_running_loop()
    loop.call_later(0.05, services._update, {"/s/cache": registration("cache", "c:1")})
    loop.call_later(0.1, services._update, {"/s/sched": registration("scheduler", "s:1")})
    assert await services.wait_pick("scheduler", timeout_s=5.0) == "s:1"


async def test_gives_up_at_its_timeout() -> None:
    services = locator()
    services._update({"/s/cache": registration("cache", "c:1")})  # others come and go meanwhile
    assert await services.wait_pick("scheduler", timeout_s=0.1) is None


async def test_answers_at_once_when_one_is_registered() -> None:
    services = locator()
    services._update({"/s/sched": registration("scheduler", "s:1")})
    assert await services.wait_pick("scheduler", timeout_s=0.0) == "s:1"


def test_a_kind_that_elects_a_leader_is_picked_at_its_leader() -> None:
    services = locator()
    services._update(
        {
            "/s/mp1": registration("memory-pool", "m:1"),
            "/s/mp2": json_format.MessageToJson(
                common_pb2.ServiceInfo(kind="memory-pool", instance_id="memory-pool-2", address="m:2")
            ).encode(),
        }
    )
    leader: list[str | None] = ["m:2"]
    services.follow_leader("memory-pool", lambda: leader[0])
    assert {services.pick("memory-pool") for _ in range(4)} == {"m:2"}
    leader[0] = None  # an election under way: any instance (it names the leader or campaigns)
    assert {services.pick("memory-pool") for _ in range(4)} == {"m:1", "m:2"}
    assert services.leader("scheduler") is None
