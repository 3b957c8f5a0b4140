"""Bad input against a real router (issue #17): its explicit limits answer with the status
and a message naming them, through gRPC and the OpenAI-compatible HTTP front; and
property-based fuzzing of RunChain, PutChain, ValidateChain and the HTTP front finds

- no crash: every service stays alive and the router SERVING, no traceback in any log;
- no INTERNAL or UNKNOWN status (HTTP: no 5xx but 503 for a model without workers, and
  504 when the call set its own deadline);
- nothing written on rejection: the keys under /inferx/v1/chains/ are unchanged after
  every refused PutChain, and after every ValidateChain.

One stack (etcd, the four services, one SIMULATED sim worker) serves the whole module.
Its router runs with small limits, so that requests over them are cheap to generate.
Examples found by the fuzzers are kept as `@example`s (the bugs they showed are fixed).
"""

from __future__ import annotations

import asyncio
import json
import string
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from inferx import etcd
from inferx.devstack import LocalStack
from inferx.v1 import router_pb2, router_pb2_grpc
from inferx.wire import CHANNEL_OPTIONS
from tests.conftest import dump_logs, make_stack

pytestmark = pytest.mark.integration

KIB = 1024
LIMITS = {
    "--max-request-bytes": 256 * KIB,
    "--max-input-bytes": 16 * KIB,
    "--max-inputs": 8,
    "--max-config-bytes": 16 * KIB,
    "--max-nodes": 12,
    "--max-output-tokens": 64,
    "--default-max-output-tokens": 5,
    "--http-max-body-bytes": 32 * KIB,
}
MODEL = "qwen-7b"
NO_WORKER_MODEL = "orphan-model"  # mapped to a pool no worker serves: UNAVAILABLE / 503
# INTERNAL and UNKNOWN are bugs; DEADLINE_EXCEEDED here means the router never answered
# (every call the fuzzers make ends in seconds), and "Stream removed" a status that could
# not be sent (e.g. an error message over gRPC's 8 KiB trailer limit).
NEVER = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED}


def assert_answered(code: grpc.StatusCode, details: str) -> None:
    assert code not in NEVER and not details.startswith("Stream removed"), (code, details)


# Statuses a config call may answer while etcd is up: anything else is a bug.
CONFIG_CODES = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,  # PutChain's expect_version
    grpc.StatusCode.RESOURCE_EXHAUSTED,  # gRPC's own, over --max-request-bytes
}
FUZZ = settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)

# ----- chains the RunChain fuzzer runs ----------------------------------------------------

FIXTURE_CHAINS: dict[str, dict[str, Any]] = {
    "fx_declared": {
        "name": "fx_declared",
        "slo": {"end_to_end_latency_p99": "5s"},
        "inputs": {"q": {}, "lang": {"default": "en", "required": False}},
        "nodes": [
            {"id": "recall", "type": "memory_retrieval", "timeout": "2s", "critical": False},
            {
                "id": "answer",
                "type": "model_inference",
                "model": MODEL,
                "depends_on": ["recall"],
                "timeout": "3s",
                "max_tokens": 4,
                "prompt": "[{{ inputs.lang }}] {{ inputs.q }} {{ nodes.recall.output }}",
            },
        ],
    },
    "fx_implicit": {
        "name": "fx_implicit",
        "slo": {"end_to_end_latency_p99": "5s"},
        "nodes": [
            {
                "id": "search",
                "type": "tool_call",
                "tool": "vector_search",
                "timeout": "2s",
                "cacheable": True,
                "arguments": {"query": "{{ inputs.a }}"},
            },
            {
                "id": "say",
                "type": "model_inference",
                "model": MODEL,
                "depends_on": ["search"],
                "max_tokens": 3,
            },
        ],
    },
    "fx_orphan": {
        "name": "fx_orphan",
        "slo": {"end_to_end_latency_p99": "5s"},
        "nodes": [{"id": "think", "type": "model_inference", "model": NO_WORKER_MODEL, "max_tokens": 2}],
    },
}


def chain_text(chain: dict[str, Any]) -> str:
    return yaml.safe_dump({"agent_chain": chain}, sort_keys=False, allow_unicode=True)


# ----- the stack and its observers ------------------------------------------------------


class ChainKeys:
    """The etcd keys of chain configs, read with aetcd as the services do."""

    def __init__(self, endpoint: str) -> None:
        self._loop = asyncio.new_event_loop()

        async def connect():
            return etcd.make_client(endpoint)

        self._client = self._loop.run_until_complete(connect())

    def snapshot(self) -> dict[bytes, tuple[bytes, int]]:
        async def read() -> dict[bytes, tuple[bytes, int]]:
            listing = await self._client.get_prefix(etcd.CHAINS.encode())
            return {kv.key: (kv.value, kv.mod_revision) for kv in listing}

        return self._loop.run_until_complete(read())

    def close(self) -> None:
        self._loop.run_until_complete(self._client.close())
        self._loop.close()


class Logs:
    """What every process of the stack has logged since the last look."""

    def __init__(self, stack: LocalStack) -> None:
        self._paths = [proc.log_path for proc in [*stack.services.values(), *stack.workers]]
        self._offsets = {path: path.stat().st_size for path in self._paths}

    def new_tracebacks(self) -> list[str]:
        found = []
        for path in self._paths:
            with path.open("rb") as log:
                log.seek(self._offsets[path])
                text = log.read().decode(errors="replace")
                self._offsets[path] = log.tell()
            if "Traceback" in text or "unhandled error" in text:
                found.append(f"----- {path.name} -----\n{text[-4000:]}")
        return found


class Router:
    """Sync gRPC access to the router, and the checks every example ends with."""

    def __init__(self, stack: LocalStack) -> None:
        self.stack = stack
        # The SDK's options: large messages go out, so the router's own limit answers.
        self.channel = grpc.insecure_channel(stack.router_address, options=CHANNEL_OPTIONS)
        self.stub = router_pb2_grpc.RouterStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.keys = ChainKeys(stack.etcd_endpoint)
        self.logs = Logs(stack)
        self.http = httpx.Client(base_url=stack.router_http_url, timeout=30)

    def call(self, method, request, timeout_s: float = 10) -> tuple[grpc.StatusCode, str, Any]:
        try:
            return grpc.StatusCode.OK, "", method(request, timeout=timeout_s)
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or "", None

    def run(self, request: router_pb2.RunChainRequest) -> tuple[grpc.StatusCode, str, list]:
        events: list[router_pb2.RunEvent] = []
        try:
            for event in self.stub.RunChain(request, timeout=15):
                events.append(event)
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or "", events
        return grpc.StatusCode.OK, "", events

    def begin(self) -> None:
        """Start an example: what earlier ones logged is not its business."""
        self.logs.new_tracebacks()

    def assert_healthy(self) -> None:
        for proc in [*self.stack.services.values(), *self.stack.workers]:
            assert proc.alive(), f"{proc.name} died; its log ends with:\n{proc.log_tail()}"
        reply = self.health.Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        tracebacks = self.logs.new_tracebacks()
        assert not tracebacks, "\n".join(tracebacks)

    def close(self) -> None:
        self.http.close()
        self.keys.close()
        self.channel.close()


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    stack = make_stack(tmp_path_factory.mktemp("bad-input"))
    try:
        stack.start_etcd()
        stack.start_service("router", [str(part) for flag, value in LIMITS.items() for part in (flag, value)])
        stack.start_core()
        stack.load_models({MODEL: "tiny-llama", NO_WORKER_MODEL: "orphans"})
        stack.start_worker("tiny-llama", "sim", ["--sim-speed", "50"])
        stack.wait_workers(60)  # SERVING and routed (tests/conftest.py's wait_workers_routed)
        client = Router(stack)
        for chain in FIXTURE_CHAINS.values():
            client.stub.PutChain(router_pb2.PutChainRequest(config=chain_text(chain)), timeout=30)
        # A second version of fx_declared, and a label on the first.
        second = {**FIXTURE_CHAINS["fx_declared"], "description": "v2"}
        client.stub.PutChain(router_pb2.PutChainRequest(config=chain_text(second)), timeout=30)
        client.stub.LabelChain(router_pb2.LabelChainRequest(name="fx_declared", label="prod", version=1))
    except BaseException:
        dump_logs(stack)
        stack.stop()
        raise
    try:
        yield client
    finally:
        client.close()
        stack.stop()


# ----- each limit, through gRPC and HTTP -------------------------------------------------


def test_a_call_without_max_tokens_gets_the_routers_default(router: Router) -> None:
    """--default-max-output-tokens bounds a call that sets no max_tokens (the sim
    engine's own natural end, 64 tokens, is further); one that sets its own is its own."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    unset = router.http.post("/chat/completions", json=chat).json()
    assert unset["choices"][0]["finish_reason"] == "length"
    assert unset["usage"]["completion_tokens"] == LIMITS["--default-max-output-tokens"]
    own = router.http.post("/chat/completions", json={**chat, "max_tokens": 7}).json()
    assert own["usage"]["completion_tokens"] == 7


def test_each_limit_names_itself_through_grpc_and_http(router: Router) -> None:
    router.begin()
    stub, call = router.stub, router.call
    run = router.run

    code, details, _ = run(
        router_pb2.RunChainRequest(chain="fx_declared", inputs={"q": "x" * (17 * KIB - 1)})
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details == "inputs: 17 KiB exceeds the router's limit of 16 KiB (--max-input-bytes)"

    many = {f"i{n}": "x" for n in range(9)}
    code, details, _ = run(router_pb2.RunChainRequest(chain="fx_implicit", inputs=many))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details == "inputs: 9 inputs exceeds the router's limit of 8 (--max-inputs)"

    before = router.keys.snapshot()
    big = {**FIXTURE_CHAINS["fx_orphan"], "name": "too_big", "description": "é" * (9 * KIB)}
    code, details, _ = call(stub.PutChain, router_pb2.PutChainRequest(config=chain_text(big)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("config: 18.") and details.endswith(
        "KiB exceeds the router's limit of 16 KiB (--max-config-bytes)"
    )

    wide = {
        "name": "too_wide",
        "slo": {"end_to_end_latency_p99": "5s"},
        "nodes": [{"id": f"n{n}", "type": "model_inference", "model": MODEL} for n in range(13)],
    }
    code, details, _ = call(stub.PutChain, router_pb2.PutChainRequest(config=chain_text(wide)))
    assert (code, details) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "nodes: 13 nodes exceeds the router's limit of 12 (--max-nodes)",
    )

    greedy = {**FIXTURE_CHAINS["fx_orphan"], "name": "too_greedy"}
    greedy["nodes"] = [{**greedy["nodes"][0], "max_tokens": 65}]
    for method, request in [
        (stub.PutChain, router_pb2.PutChainRequest(config=chain_text(greedy))),
        (stub.ValidateChain, router_pb2.ValidateChainRequest(config=chain_text(greedy))),
    ]:
        code, details, _ = call(method, request)
        assert (code, details) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "node 'think': max_tokens: 65 tokens exceeds the router's limit of 64 (--max-output-tokens)",
        )
    assert router.keys.snapshot() == before  # nothing written

    # Over --max-request-bytes gRPC itself answers, before any InferX code runs.
    code, details, _ = call(stub.ValidateChain, router_pb2.ValidateChainRequest(config="x" * (300 * KIB)))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details

    # Not protobuf at all: INVALID_ARGUMENT (gRPC alone would answer UNKNOWN).
    raw = router.channel.unary_unary("/inferx.v1.Router/PutChain")
    code, details, _ = call(raw, b"\x0a\x02\xff\xfe")
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "not a valid protobuf message" in details

    # HTTP: an OpenAI-shaped 413 for the body (with or without a Content-Length), 400 for max_tokens.
    body = json.dumps({"model": MODEL, "prompt": "x" * (33 * KIB)}).encode()
    for content in (body, iter([body[: 16 * KIB], body[16 * KIB :]])):
        reply = router.http.post("/completions", content=content)
        assert reply.status_code == 413, reply.text
        error = reply.json()["error"]
        assert (error["param"], error["code"], error["type"]) == (
            "body",
            "request_too_large",
            "invalid_request_error",
        )
        assert (
            "exceeds the router's limit of 32 KiB (--http-max-body-bytes)" in error["message"]
            or error["message"] == "body: larger than the router's limit of 32 KiB (--http-max-body-bytes)"
        )
    reply = router.http.post(
        "/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 65},
    )
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "max_completion_tokens"
    assert error["message"] == (
        "max_completion_tokens: 65 tokens exceeds the router's limit of 64 (--max-output-tokens)"
    )
    router.assert_healthy()


def test_a_long_error_message_keeps_its_status(router: Router) -> None:
    """Found by the RunChain fuzzer: an error naming a long input overflowed gRPC's 8 KiB
    trailer limit, and the client got RESOURCE_EXHAUSTED "Stream removed" instead."""
    router.begin()
    name = "é" * 4000
    code, details, _ = router.run(router_pb2.RunChainRequest(chain="fx_declared", inputs={name: "x"}))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("input 'ééé") and details.endswith("more characters)")


# ----- strategies -------------------------------------------------------------------------

NO_SURROGATES = st.characters(codec="utf-8")  # what a protobuf string can hold
text = st.text(NO_SURROGATES, max_size=24)
TRICKY_STRINGS = [
    "",
    " ",
    "0",
    "-3s",
    "3x",
    "1e309",
    "nan",
    "inf",
    "99.9%",
    "150%",
    "null",
    "~",
    "\x00",
    "\u202e\u0301",
    "é" * 40,
    "{{ inputs.q }}",
    "{{ nodes.a.output }}",
    "{{ nodes.zz.output }}",
    "{{",
    "}} {{ inputs. }}",
    "{% for x in y %}",
    "!!python/object:os.system",
    "model_inference",
    "tool_call",
    "memory_retrieval",
]
HUGE_NUMBERS = [0, -1, 63, 64, 65, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63, 2**64, 10**30, -(10**30)]
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from(HUGE_NUMBERS),
    st.floats(),  # nan and infinities too
    st.sampled_from([1e308, -1e308, 5e-324, 2.592e9, 2.6e9]),
    text,
    st.sampled_from(TRICKY_STRINGS),
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.one_of(text, st.integers()), inner, max_size=3)
    ),
    max_leaves=8,
)

CHAIN_KEYS = ["name", "description", "tier", "inputs", "slo", "retry_budget", "nodes", "bogus"]
NODE_KEYS = [
    "id",
    "type",
    "model",
    "tool",
    "depends_on",
    "prompt",
    "arguments",
    "max_tokens",
    "temperature",
    "fallback_model",
    "critical",
    "retries",
    "idempotent",
    "max_context_tokens",
    "context_overflow",
    "cache_ttl",
    "priority",
    "cacheable",
    "timeout",
    "limit",
    "fallback_output",
    "colour",
]
NUMERIC_NODE_KEYS = [
    "max_tokens",
    "max_context_tokens",
    "retries",
    "limit",
    "temperature",
    "timeout",
    "cache_ttl",
]


@st.composite
def base_chains(draw: st.DrawFn) -> dict[str, Any]:
    """A valid chain: a path of nodes of every type."""
    count = draw(st.integers(1, 5))
    nodes: list[dict[str, Any]] = []
    for index in range(count):
        node: dict[str, Any] = {"id": f"n{index}", "timeout": "2s"}
        kind = draw(st.sampled_from(["model_inference", "tool_call", "memory_retrieval"]))
        node["type"] = kind
        if kind == "model_inference":
            node.update(model=MODEL, max_tokens=draw(st.integers(1, 8)), prompt="q: {{ inputs.q }}")
        elif kind == "tool_call":
            node.update(tool="vector_search", arguments={"query": "{{ inputs.q }}"})
        if index:
            node["depends_on"] = [f"n{index - 1}"]
        nodes.append(node)
    name = "gen_" + draw(st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True))
    return {"name": name, "slo": {"end_to_end_latency_p99": "5s"}, "nodes": nodes}


@st.composite
def mutated_chains(draw: st.DrawFn) -> dict[str, Any]:
    """A valid chain with up to four of: wrong types, unknown or missing keys, cycles,
    duplicate ids, numbers out of range, too many nodes, unicode, long strings."""
    chain = draw(base_chains())
    nodes: list[Any] = chain["nodes"]
    for _ in range(draw(st.integers(0, 4))):
        mutation = draw(
            st.sampled_from(
                [
                    "chain_key",
                    "node_key",
                    "number",
                    "drop",
                    "cycle",
                    "self",
                    "duplicate",
                    "many",
                    "long",
                    "slo",
                    "inputs",
                    "node_not_mapping",
                ]
            )
        )
        node = draw(st.sampled_from(nodes)) if nodes and isinstance(nodes, list) else None
        if mutation == "chain_key":
            chain[draw(st.sampled_from(CHAIN_KEYS) | text)] = draw(values)
        elif mutation == "node_key" and isinstance(node, dict):
            node[draw(st.sampled_from(NODE_KEYS) | text)] = draw(values)
        elif mutation == "number" and isinstance(node, dict):
            node[draw(st.sampled_from(NUMERIC_NODE_KEYS))] = draw(st.sampled_from(HUGE_NUMBERS) | st.floats())
        elif mutation == "drop":
            target = node if isinstance(node, dict) and draw(st.booleans()) else chain
            if target:
                target.pop(draw(st.sampled_from(sorted(target, key=str))), None)
        elif (
            mutation == "cycle" and isinstance(nodes, list) and len(nodes) >= 2 and isinstance(nodes[0], dict)
        ):
            nodes[0]["depends_on"] = [f"n{len(nodes) - 1}"]
        elif mutation == "self" and isinstance(node, dict):
            node["depends_on"] = [node.get("id"), "nowhere"]
        elif mutation == "duplicate" and isinstance(nodes, list) and nodes:
            nodes.append(dict(nodes[0]) if isinstance(nodes[0], dict) else nodes[0])
        elif mutation == "many" and isinstance(nodes, list):
            wanted = draw(st.sampled_from([11, 12, 13, 40]))
            nodes.extend(
                {"id": f"m{n}", "type": "model_inference", "model": MODEL} for n in range(wanted - len(nodes))
            )
        elif mutation == "long" and isinstance(node, dict):
            node["prompt"] = draw(st.sampled_from(["x", "é", "\U0001f600"])) * draw(
                st.integers(4_000, 17_000)
            )
        elif mutation == "slo":
            chain["slo"] = {"end_to_end_latency_p99": draw(values), "availability": draw(values)}
        elif mutation == "inputs":
            chain["inputs"] = draw(values)
        elif mutation == "node_not_mapping" and isinstance(nodes, list) and nodes:
            nodes[0] = draw(values)
    return chain


def render(document: Any, draw: st.DrawFn) -> str:
    """YAML (block or flow style, escaped or raw unicode) or JSON."""
    form = draw(st.sampled_from(["yaml", "flow", "json"]))
    try:
        if form == "json":
            return json.dumps(document, ensure_ascii=draw(st.booleans()))
        return yaml.safe_dump(document, default_flow_style=form == "flow", allow_unicode=draw(st.booleans()))
    except (TypeError, ValueError, RecursionError):  # e.g. JSON of non-string keys
        return yaml.safe_dump(document)


YAML_SOUP = st.lists(
    st.sampled_from(
        [
            "agent_chain:",
            "  name: x",
            "  nodes:",
            "  slo: {end_to_end_latency_p99: 1s}",
            "    - {id: a, type: model_inference, model: qwen-7b}",
            "- ",
            "{",
            "}",
            "[",
            "]",
            ": ",
            ",",
            "&a ",
            "*a",
            "*b",
            "<<: *a",
            "!!python/object/apply:os.system ['true']",
            "!!binary ",
            "? ",
            "|",
            ">",
            "%YAML 1.1",
            "---",
            "...",
            "\t",
            "\n",
            "  ",
            "'",
            '"',
            "#",
            "\\",
            "\x00",
            "\ufeff",
        ]
    ),
    max_size=40,
).map("".join)


def nested(depth: int) -> str:
    return "agent_chain: {name: deep, nodes: " + "[" * depth + "]" * depth + "}"


def laughs(levels: int) -> str:
    lines = ["a: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{n}: &a{n} [{', '.join([f'*a{n - 1}'] * 10)}]" for n in range(1, levels)]
    return "\n".join(lines) + f"\nagent_chain: {{name: lol, nodes: *a{levels - 1}}}\n"


@st.composite
def configs(draw: st.DrawFn) -> str:
    """Chain config text: structured but wrong, or raw garbage."""
    kind = draw(
        st.sampled_from(["mutated", "mutated", "mutated", "valid", "wrapper", "text", "soup", "special"])
    )
    if kind == "valid":
        return render({"agent_chain": draw(base_chains())}, draw)
    if kind == "mutated":
        return render({"agent_chain": draw(mutated_chains())}, draw)
    if kind == "wrapper":  # the document around agent_chain is wrong
        return render(draw(st.one_of(values, st.dictionaries(text, values, max_size=3))), draw)
    if kind == "text":
        return draw(st.text(NO_SURROGATES, max_size=300))
    if kind == "soup":
        return draw(YAML_SOUP)
    return draw(
        st.sampled_from(
            [nested(50), nested(900), nested(5000), laughs(3), laughs(6), "agent_chain: " + "-" * 5000]
        )
    )


# ----- the fuzzers --------------------------------------------------------------------------


@FUZZ
@given(config=configs())
@example(config=laughs(6))  # aliases: a billion laughs is refused by the value cap
@example(config=nested(5000))  # deeper than Python's recursion limit
@example(config='{"\\ud87f": null}')  # a lone surrogate in the error: the call hung (no status sent)
def test_validate_chain_never_fails_inside_and_never_writes(router: Router, config: str) -> None:
    router.begin()
    before = router.keys.snapshot()
    code, details, _ = router.call(router.stub.ValidateChain, router_pb2.ValidateChainRequest(config=config))
    event(code.name)
    assert_answered(code, details)
    assert code in CONFIG_CODES - {grpc.StatusCode.FAILED_PRECONDITION}, (code, details)
    assert router.keys.snapshot() == before
    router.assert_healthy()


@FUZZ
@given(
    config=configs(),
    message=st.text(NO_SURROGATES, max_size=40),
    author=st.text(NO_SURROGATES, max_size=20),
    expect_version=st.one_of(st.just(0), st.integers(0, 2**32 - 1)),
    no_activate=st.booleans(),
)
# Found by this fuzzer: YAML reads the escape as a lone UTF-16 surrogate, which then sat in
# the error message, and gRPC could not send it: the call hung until its deadline.
@example(config='{"\\u0096\\ud87f\\uded6": null}', message="", author="", expect_version=0, no_activate=False)
@example(config='{"\\ud87f": null}', message="", author="", expect_version=0, no_activate=False)
def test_put_chain_writes_nothing_when_it_refuses(
    router: Router, config: str, message: str, author: str, expect_version: int, no_activate: bool
) -> None:
    router.begin()
    before = router.keys.snapshot()
    request = router_pb2.PutChainRequest(
        config=config, message=message, author=author, expect_version=expect_version, no_activate=no_activate
    )
    code, details, reply = router.call(router.stub.PutChain, request)
    event(f"put {code.name}")
    assert_answered(code, details)
    assert code in CONFIG_CODES, (code, details)
    if code != grpc.StatusCode.OK:
        assert router.keys.snapshot() == before, f"{code.name} {details!r} but etcd changed"
    else:  # what was stored runs or is refused cleanly: never INTERNAL
        code, details, events = router.run(
            router_pb2.RunChainRequest(chain=reply.name, version=reply.version, inputs={"q": "hello"})
        )
        event(f"run {code.name}")
        assert_answered(code, details)
        if code == grpc.StatusCode.OK:
            assert events and events[-1].HasField("chain_finished")
    router.assert_healthy()


MAX_MS = 30 * 24 * 3_600_000  # the schema's bound on every duration
UINT32 = 2**32 - 1


def up_to(bound: int, *, least: int = 1) -> st.SearchStrategy:
    """A number within [least, bound]: small ones, any, or the bound itself."""
    return st.one_of(st.integers(least, min(bound, 10)), st.integers(least, bound), st.just(bound))


durations = st.one_of(st.integers(1, MAX_MS), st.sampled_from([1, 1.5, "3s", MAX_MS, "720h", f"{MAX_MS}ms"]))
# One of these may replace a value: just past a bound, or far past it.
PAST_BOUNDS: dict[str, list[Any]] = {
    "max_tokens": [LIMITS["--max-output-tokens"] + 1, 2**32, 2**63, 10**30],
    "max_context_tokens": [2**32, 5_000_000_000, 2**63],
    "limit": [2**32, 10**30],
    "retries": [11, 2**32],
    "temperature": [2.0001, 1e300],
    "timeout": [MAX_MS + 1, "721h", 1e300, 1.7e308],
}


@st.composite
def chains_near_bounds(draw: st.DrawFn) -> dict[str, Any]:
    """Valid chains whose numbers sit anywhere up to the schema's and the router's
    bounds, and half of them with one value past a bound."""
    count = draw(st.integers(1, LIMITS["--max-nodes"]))
    models = [MODEL, NO_WORKER_MODEL] if draw(st.integers(0, 5)) == 5 else [MODEL]  # UNAVAILABLE, rarely
    nodes = []
    for index in range(count):
        kind = draw(st.sampled_from(["model_inference", "tool_call", "memory_retrieval"]))
        node: dict[str, Any] = {
            "id": f"n{index}",
            "type": kind,
            "timeout": draw(durations),
            "retries": draw(up_to(10, least=0)),
            "priority": draw(st.sampled_from(["high", "medium", "normal", "low"])),
            "critical": draw(st.booleans()),
        }
        if index and draw(st.booleans()):
            node["depends_on"] = [f"n{draw(st.integers(0, index - 1))}"]
        if kind == "model_inference":
            node["model"] = draw(st.sampled_from(models))
            node["max_tokens"] = draw(up_to(LIMITS["--max-output-tokens"]))
            node["temperature"] = draw(st.floats(0, 2))
            if draw(st.booleans()):
                node["max_context_tokens"] = draw(st.one_of(st.integers(1, 100), up_to(UINT32)))
                node["context_overflow"] = draw(st.sampled_from(["reject", "truncate"]))
            if draw(st.booleans()):
                node["fallback_output"] = draw(st.text(NO_SURROGATES, max_size=20))
        elif kind == "tool_call":
            node["tool"] = draw(st.sampled_from(["vector_search", "no_such_tool"]))
            node["arguments"] = {"query": draw(st.text(NO_SURROGATES, max_size=20))}
            node["cacheable"] = draw(st.booleans())
            node["cache_ttl"] = draw(durations)
        else:
            node["limit"] = draw(up_to(UINT32))
        nodes.append(node)
    chain = {
        "name": "edge_" + draw(st.from_regex(r"[a-z0-9]{1,6}", fullmatch=True)),
        "tier": draw(st.sampled_from(["realtime", "standard", "batch"])),
        "slo": {"end_to_end_latency_p99": draw(durations), "availability": draw(st.floats(0.001, 1))},
        "retry_budget": draw(up_to(100, least=0)),
        "nodes": nodes,
    }
    if draw(st.booleans()):
        field = draw(st.sampled_from([*sorted(PAST_BOUNDS), "slo", "retry_budget"]))
        if field == "slo":
            chain["slo"]["end_to_end_latency_p99"] = draw(st.sampled_from(PAST_BOUNDS["timeout"]))
        elif field == "retry_budget":
            chain["retry_budget"] = draw(st.sampled_from([101, 2**32]))
        else:  # on a node that uses the field
            kind = {"limit": "memory_retrieval"}.get(field, "model_inference")
            users = [node for node in nodes if node["type"] == kind or field in ("timeout", "retries")]
            if users:
                draw(st.sampled_from(users))[field] = draw(st.sampled_from(PAST_BOUNDS[field]))
    return chain


def one_node(**fields: Any) -> dict[str, Any]:
    node = {"id": "a", "type": "model_inference", "model": MODEL, **fields}
    return {"name": "edge_x", "slo": {"end_to_end_latency_p99": "5s"}, "nodes": [node]}


@FUZZ
@given(chain=chains_near_bounds(), session_id=st.sampled_from(["", "s1"]))
# Accepted, then every run failed INTERNAL (uint32 on the wire): now refused.
@example(chain=one_node(max_tokens=2**32), session_id="")
@example(chain=one_node(max_context_tokens=5_000_000_000), session_id="")
# Accepted, then every run failed INTERNAL (the deadline past int64 unix ms): now refused.
@example(chain={**one_node(), "slo": {"end_to_end_latency_p99": 1e300}}, session_id="")
def test_configs_near_their_bounds_run_or_are_refused_cleanly(
    router: Router, chain: dict[str, Any], session_id: str
) -> None:
    router.begin()
    before = router.keys.snapshot()
    code, details, reply = router.call(
        router.stub.PutChain, router_pb2.PutChainRequest(config=chain_text(chain))
    )
    event(f"put {code.name}")
    if code != grpc.StatusCode.OK:
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
        assert router.keys.snapshot() == before
    else:
        code, details, events = router.run(
            router_pb2.RunChainRequest(chain=reply.name, version=reply.version, session_id=session_id)
        )
        event(f"run {code.name}")
        assert_answered(code, details)
        if code == grpc.StatusCode.OK:
            assert events and events[-1].HasField("chain_finished")
            event(f"chain {events[-1].chain_finished.status}")
    router.assert_healthy()


VALID_INPUTS = {"fx_declared": ["q", "lang"], "fx_implicit": ["a", "b"], "fx_orphan": []}
wild_names = st.one_of(
    st.sampled_from(["", "gen_", "../fx_declared", "fx_declared/latest", "fx_orphan "]), text
)
wild_input_names = st.one_of(st.sampled_from(["", "1a", "a-b", "lang"]), text)
wild_input_values = st.one_of(
    st.sampled_from(TRICKY_STRINGS),
    st.text(NO_SURROGATES, max_size=200),
    st.integers(15 * KIB, 17 * KIB).map(lambda n: "y" * n),
)


@st.composite
def run_requests(draw: st.DrawFn) -> dict[str, Any]:
    """A valid RunChain request of one of the fixture chains, with 0-3 fields made wrong."""
    chain = draw(st.sampled_from(sorted(VALID_INPUTS)))
    names = VALID_INPUTS[chain]
    inputs = {
        name: draw(st.text(NO_SURROGATES, max_size=40))
        for name in names
        if draw(st.booleans()) or name in "qa"
    }
    request: dict[str, Any] = {
        "chain": chain,
        "version": draw(st.sampled_from([0, 1])),
        "label": "",
        "inputs": inputs,
        "session_id": draw(st.sampled_from(["", "s1", "s2"])),
        "tier": draw(st.integers(0, 3)),
    }
    for _ in range(draw(st.integers(0, 3))):
        field = draw(st.sampled_from(["chain", "version", "label", "inputs", "inputs", "session_id", "tier"]))
        if field == "chain":
            request["chain"] = draw(wild_names)
        elif field == "version":
            request["version"] = draw(st.one_of(st.integers(0, 3), st.integers(0, 2**32 - 1)))
        elif field == "label":
            request["label"] = draw(st.one_of(st.sampled_from(["prod", "active", "latest", "../x"]), text))
        elif field == "inputs":
            request["inputs"] = {
                **request["inputs"],
                **draw(st.dictionaries(wild_input_names, wild_input_values, min_size=1, max_size=9)),
            }
        elif field == "session_id":
            request["session_id"] = draw(st.one_of(text, st.text(NO_SURROGATES, min_size=200, max_size=2000)))
        else:
            request["tier"] = draw(st.integers(-(2**31), 2**31 - 1))
    return request


@FUZZ
@given(fields=run_requests())
@example(fields={"chain": "fx_declared", "inputs": {"é" * 4000: "x"}})
def test_run_chain_never_fails_inside(router: Router, fields: dict[str, Any]) -> None:
    router.begin()
    request = router_pb2.RunChainRequest(**fields)  # any int is a proto3 enum value on the wire
    code, details, events = router.run(request)
    event(code.name)
    assert_answered(code, details)
    if code == grpc.StatusCode.OK:
        assert events and events[-1].HasField("chain_finished")
        event(f"chain {events[-1].chain_finished.status}")
    router.assert_healthy()


RAW_METHODS = ["RunChain", "PutChain", "ValidateChain"]


@FUZZ
@given(method=st.sampled_from(RAW_METHODS), payload=st.binary(max_size=512))
@example(method="RunChain", payload=b"\x0a\x02\xff\xfe")  # bad UTF-8: was UNKNOWN
@example(method="PutChain", payload=b"\xff\xff\xff")  # corrupt wire format: was UNKNOWN
def test_raw_bytes_are_invalid_argument_not_unknown(router: Router, method: str, payload: bytes) -> None:
    router.begin()
    before = router.keys.snapshot()
    path = f"/inferx.v1.Router/{method}"
    if method == "RunChain":
        stream = router.channel.unary_stream(path)
        call = lambda request, timeout: list(stream(request, timeout=timeout))  # noqa: E731
    else:
        call = router.channel.unary_unary(path)
    code, details, _ = router.call(call, payload)
    event(code.name)
    assert_answered(code, details)
    if code != grpc.StatusCode.OK:
        assert router.keys.snapshot() == before
    router.assert_healthy()


# ----- the HTTP front ---------------------------------------------------------------------

HEADER_TEXT = st.text(string.ascii_letters + string.digits + string.punctuation + " ", max_size=140)
VALID_HEADERS = {
    "X-InferX-Program": st.from_regex(r"[A-Za-z0-9._:-]{1,20}", fullmatch=True),
    "X-InferX-Tier": st.sampled_from(["realtime", "standard", "batch", "BATCH"]),
    "X-InferX-Deadline-Ms": st.integers(5_000, 86_400_000).map(str),
    "X-InferX-Program-End": st.sampled_from(["true", "false", "1", "no"]),
    "X-InferX-Program-Name": st.from_regex(r"[A-Za-z0-9._-]{1,20}", fullmatch=True),
    "X-Session-Id": st.from_regex(r"[A-Za-z0-9._:-]{1,20}", fullmatch=True),
}
# (h11, under httpx, refuses to send a value with spaces around it)
wild_header = st.one_of(
    HEADER_TEXT.map(str.strip), st.sampled_from(["", "0", "1", "86400001", "-5", "1e3", "a" * 129])
)


@st.composite
def identity_headers(draw: st.DrawFn) -> dict[str, str]:
    """Some X-InferX-* headers with valid values, and sometimes one wrong."""
    headers = {}
    for name, valid in VALID_HEADERS.items():
        if draw(st.booleans()) and (name != "X-InferX-Program-End" or "X-InferX-Program" in headers):
            headers[name] = draw(valid)
    if draw(st.integers(0, 3)) == 3:  # (hypothesis favours small numbers: 0 would be often)
        headers[draw(st.sampled_from(sorted(VALID_HEADERS)))] = draw(wild_header)
    return headers


CALL_KEYS = [
    "top_p",
    "model",
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "stream",
    "stream_options",
    "n",
    "tools",
    "tool_choice",
    # program identity in the body (vLLM router's contracts, session fields)
    "agentic_context",
    "vllm_xargs",
    "agent_hint",
    "session_id",
    "session_params",
    # the Responses API's
    "input",
    "instructions",
    "max_output_tokens",
    "previous_response_id",
    "text",
    "include",
    "truncation",
]


@st.composite
def http_bodies(draw: st.DrawFn, api: str) -> bytes:
    kind = draw(st.sampled_from(["mutated", "mutated", "mutated", "mutated", "json", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=300))
    if kind == "json":
        return json.dumps(draw(values)).encode()
    body: dict[str, Any] = {"model": draw(st.sampled_from([MODEL, MODEL, NO_WORKER_MODEL, "nope", ""]))}
    chat, words = api != "completion", draw(st.text(NO_SURROGATES, min_size=1, max_size=30))
    conversation = "input" if api == "responses" else "messages" if chat else "prompt"
    body[conversation] = [{"role": "user", "content": words}] if chat else words
    body["max_output_tokens" if api == "responses" else "max_tokens"] = draw(st.integers(1, 8))
    if api == "anthropic" and draw(st.booleans()):  # Anthropic's blocks
        kinds = st.sampled_from(["text", "tool_use", "tool_result", "thinking", "image"]) | text
        block_keys = st.sampled_from(["text", "id", "name", "input", "tool_use_id", "content", "thinking"])
        blocks = st.lists(
            st.builds(
                lambda kind, fields: {"type": kind, **fields}, kinds, st.dictionaries(block_keys, values)
            ),
            max_size=3,
        )
        role = draw(st.sampled_from(["user", "assistant"]))
        body["messages"] = [*body["messages"], {"role": role, "content": draw(blocks)}]
    body["stream"] = draw(st.booleans())
    if kind == "mutated":
        for _ in range(draw(st.sampled_from([0, 0, 1, 2, 3]))):
            mutation = draw(st.sampled_from(["key", "number", "drop", "message", "long"]))
            if mutation == "key":
                body[draw(st.sampled_from(CALL_KEYS) | text)] = draw(values)
            elif mutation == "number":
                key = draw(
                    st.sampled_from(
                        ["max_tokens", "max_completion_tokens", "max_output_tokens", "temperature", "n"]
                    )
                )
                body[key] = draw(st.sampled_from(HUGE_NUMBERS) | st.floats())
            elif mutation == "drop" and body:
                body.pop(draw(st.sampled_from(sorted(body))))
            elif mutation == "message" and chat:
                message = {"role": draw(st.sampled_from(["user", "tool", "robot", ""]) | text)}
                message["content"] = draw(
                    st.one_of(
                        values, st.lists(st.fixed_dictionaries({"type": values, "text": values}), max_size=2)
                    )
                )
                if api == "responses" and draw(st.booleans()):  # an item of another kind
                    item_types = ["function_call", "function_call_output", "reasoning", "item_reference"]
                    item_keys = st.sampled_from(["call_id", "name", "arguments", "output", "id"])
                    fields: dict[str, Any] = draw(st.dictionaries(item_keys, values, max_size=4))
                    message = {"type": draw(st.sampled_from(item_types) | text), **fields}
                previous = body.get(conversation)
                body[conversation] = [*(previous if isinstance(previous, list) else []), message]
            elif mutation == "long":
                size = draw(st.integers(30 * KIB, 34 * KIB))
                body[conversation] = [{"role": "user", "content": "z" * size}] if chat else "z" * size
    return json.dumps(body, ensure_ascii=draw(st.booleans())).encode()


HTTP_PATHS = {
    "chat": "/chat/completions",
    "completion": "/completions",
    "responses": "/responses",
    "anthropic": "/messages",
}
http_calls = st.sampled_from(sorted(HTTP_PATHS)).flatmap(
    lambda api: st.tuples(st.just(api), http_bodies(api))
)


@FUZZ
@given(call=http_calls, headers=identity_headers(), chunked=st.booleans())
# max_tokens past uint32: was a 500 (the hop could not be encoded); now a 400 naming the limit
@example(
    call=("completion", b'{"model": "qwen-7b", "prompt": "hi", "max_tokens": 1099511627776}'),
    headers={},
    chunked=False,
)
# a JSON escape of a lone surrogate: the prompt could not be encoded for the hop
@example(
    call=("chat", b'{"model": "qwen-7b", "messages": [{"role": "user", "content": "\\ud800"}]}'),
    headers={},
    chunked=False,
)
# a body over 4 MiB reached the scheduler, whose gRPC refusal came back as a 429; now a 413
@example(
    call=("completion", b'{"model": "qwen-7b", "prompt": "' + b"x" * (64 * KIB) + b'"}'),
    headers={},
    chunked=True,
)
def test_http_front_never_answers_5xx_but_503(
    router: Router, call: tuple[str, bytes], headers: dict[str, str], chunked: bool
) -> None:
    router.begin()
    api, body = call
    path = HTTP_PATHS[api]
    content: bytes | Iterator[bytes] = iter([body[:100], body[100:]]) if chunked else body
    with router.http.stream("POST", path, content=content, headers=headers) as reply:
        raw = reply.read()
    status = reply.status_code
    event(str(status))
    if status >= 400:
        event(f"{status} {raw[:40]!r}")
    allowed_5xx = {503} | ({504} if "X-InferX-Deadline-Ms" in headers else set())
    assert status < 500 or status in allowed_5xx, (status, raw[:500])
    if status >= 400:
        error = json.loads(raw)["error"]
        if api == "anthropic":  # Anthropic's shape
            assert set(error) == {"message", "type"} and error["message"] and error["type"] != "api_error"
        else:
            assert set(error) == {"message", "type", "param", "code"} and error["message"]
    elif reply.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
        assert events, raw[:500]
        for data in events[:-1]:
            payload = json.loads(data)
            if "error" in payload:
                assert payload["error"]["type"] not in ("server_error", "api_error"), payload
        if api == "responses":  # typed events, the last one the end (or an error)
            last = json.loads(events[-1])["type"]
            assert last in ("response.completed", "response.incomplete", "error"), events[-1]
        elif api == "anthropic":
            assert json.loads(events[-1])["type"] in ("message_stop", "error"), events[-1]
        else:
            assert events[-1] == "[DONE]" or "error" in json.loads(events[-1])
    router.assert_healthy()
