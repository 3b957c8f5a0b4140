"""The router's tool breakers as `inferx status` and the metrics show them: only for the
tool endpoints registered now (a server that deregistered takes its breaker with it)."""

from __future__ import annotations

import json

from inferx import etcd
from inferx.discovery import ChannelPool, ServiceLocator
from inferx.resilience import BreakerState
from inferx.tls import Transport
from inferx_router.tools import ToolRouter


def test_an_endpoint_that_deregistered_leaves_the_breaker_board() -> None:
    tools = ToolRouter(None, ServiceLocator(None), ChannelPool(Transport.plaintext()), None)
    tools.remote.items = {
        etcd.tool_key("weather", "a"): json.dumps({"address": "10.0.0.1:7000"}).encode(),
        etcd.tool_key("weather", "b"): json.dumps({"address": "10.0.0.2:7000"}).encode(),
        etcd.tool_key("broken", "c"): b"not json",
    }
    for target in ("tool:weather@10.0.0.1:7000", "tool:weather@10.0.0.2:7000", "tool:vector_search"):
        tools.breakers.get(target).force_open(0.0)
    assert set(tools.breaker_states()) == {
        "tool:weather@10.0.0.1:7000",
        "tool:weather@10.0.0.2:7000",
        "tool:vector_search",  # built in: never deregisters
    }
    del tools.remote.items[etcd.tool_key("weather", "a")]  # its server went away
    states = tools.breaker_states()
    assert states == {
        "tool:vector_search": BreakerState.OPEN,
        "tool:weather@10.0.0.2:7000": BreakerState.OPEN,
    }
    assert "tool:weather@10.0.0.1:7000" not in tools.breakers.breakers
