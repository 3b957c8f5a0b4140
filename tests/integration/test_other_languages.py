"""Any language with gRPC can use InferX: a Node.js client (grpc-js loading the .proto
files at run time) runs a chain and sees the same errors."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from inferx.devstack import LocalStack
from tests.conftest import ROOT

pytestmark = pytest.mark.integration

CLIENT = ROOT / "examples" / "clients" / "node"


@pytest.fixture(scope="module")
def node_client() -> str:
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.fail("Node.js and npm are needed: `make setup` installs them (Debian: nodejs npm)")
    if not (CLIENT / "node_modules" / "@grpc" / "grpc-js").exists():  # `make setup` did not run
        subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=CLIENT, check=True, timeout=300)
    return node


def test_node_client_runs_the_example_chain(sim_stack: LocalStack, node_client: str) -> None:
    result = subprocess.run(
        [
            node_client,
            "run_chain.js",
            sim_stack.router_address,
            "customer_service_agent",
            "query=Where is my order?",
        ],
        cwd=CLIENT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    events = [json.loads(line) for line in result.stdout.splitlines()]
    # It asks for batched events and prints them unpacked: every node's start and finish.
    assert all("following" not in event for event in events)
    seen = [(e["event"], e[e["event"]].get("node_id", "")) for e in events]
    nodes = ["intent_recognition", "knowledge_retrieval", "response_generation"]
    assert sorted(seen[:-1]) == sorted((kind, n) for kind in ("node_started", "node_finished") for n in nodes)
    assert all(seen.index(("node_started", n)) < seen.index(("node_finished", n)) for n in nodes)
    finished = events[-1]["chain_finished"]
    assert finished["status"] == "ok"
    assert [h["node_id"] for h in finished["hops"]] == [
        "intent_recognition",
        "knowledge_retrieval",
        "response_generation",
    ]


def test_node_client_gets_the_status_code(sim_stack: LocalStack, node_client: str) -> None:
    result = subprocess.run(
        [node_client, "run_chain.js", sim_stack.router_address, "no_such_chain"],
        cwd=CLIENT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert result.stderr.startswith("NOT_FOUND: unknown chain 'no_such_chain'")
