"""The router's limits on what callers send (issue #17, docs/limits.md), each on its own:
the wording of a refusal, RunChain inputs, chain configs (size, nodes, output tokens,
and the bounds every config has), the stored form of a chain version, the HTTP front's
body and max_tokens, status messages gRPC can carry, and the settings that set them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from inferx import MAX_UINT32
from inferx.auth.limits import TenantQuotas
from inferx.chain.validate import MAX_CONFIG_CHARS, ChainConfigError, load_chain_document, load_chain_text
from inferx.errors import InvalidArgument, fit_status_message
from inferx.limits import KIB, MAX_STORED_CHAIN_BYTES, MIB, LimitExceeded, RequestLimits, format_bytes
from inferx.openai_compat.errors import BodyTooLarge, error_reply
from inferx.openai_compat.schema import ChatCompletionRequest, CompletionRequest, parse_body
from inferx.pools import PoolDirectory
from inferx.server import _decoder
from inferx.settings import ServiceSettings, load_settings
from inferx.v1 import router_pb2
from inferx_router.__main__ import RouterSettings
from inferx_router.access import AccessControl
from inferx_router.chain_store import ChainStore
from inferx_router.http_front import OpenAIFront
from inferx_router.program_calls import ProgramCalls
from inferx_router.programs import ProgramBook
from inferx_router.records import RunStore

# ----- wording ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("size", "text"),
    [
        (0, "0 bytes"),
        (1, "1 byte"),
        (1023, "1023 bytes"),
        (KIB, "1 KiB"),
        (1536, "1.5 KiB"),
        (3 * MIB, "3 MiB"),
    ],
)
def test_sizes_read_in_binary_units(size: int, text: str) -> None:
    assert format_bytes(size) == text


def test_a_refusal_names_what_how_much_the_limit_and_its_flag() -> None:
    error = LimitExceeded("inputs", int(3.2 * MIB), MIB, "--max-input-bytes")
    assert isinstance(error, InvalidArgument)
    assert error.message == "inputs: 3.2 MiB exceeds the router's limit of 1 MiB (--max-input-bytes)"
    # one byte over: rounding would print "1 MiB exceeds ... 1 MiB", so exact counts instead
    assert LimitExceeded("inputs", MIB + 1, MIB, "--max-input-bytes").message == (
        "inputs: 1,048,577 bytes exceeds the router's limit of 1,048,576 bytes (--max-input-bytes)"
    )


# ----- RunChain inputs -------------------------------------------------------------------


def test_inputs_are_limited_by_count_and_by_utf8_bytes_of_names_and_values() -> None:
    limits = RequestLimits(max_inputs=2, max_input_bytes=10)
    limits.check_inputs({"a": "x" * 9})  # 10 bytes: at the limit
    with pytest.raises(
        LimitExceeded, match=r"^inputs: 3 inputs exceeds the router's limit of 2 \(--max-inputs\)$"
    ):
        limits.check_inputs({"a": "", "b": "", "c": ""})
    with pytest.raises(LimitExceeded, match=r"--max-input-bytes"):
        limits.check_inputs({"a": "é" * 5})  # 5 characters, 11 bytes


# ----- chain configs -------------------------------------------------------------------


def chain(nodes: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"agent_chain": {"name": "c", "slo": {"end_to_end_latency_p99": "5s"}, "nodes": nodes, **extra}}


def model_node(node_id: str = "a", **fields: Any) -> dict[str, Any]:
    return {"id": node_id, "type": "model_inference", "model": "qwen-7b", **fields}


LIMITS = RequestLimits(max_config_bytes=2 * KIB, max_nodes=3, max_output_tokens=64)


def problems(document: Any, limits: RequestLimits | None = LIMITS) -> list[str]:
    with pytest.raises(ChainConfigError) as caught:
        load_chain_text(yaml.safe_dump(document, allow_unicode=True), limits=limits)
    return caught.value.problems


def test_a_config_over_its_size_is_refused_before_it_is_parsed() -> None:
    text = yaml.safe_dump(chain([model_node(prompt="é" * 1500)]), allow_unicode=True)
    assert len(text) < 2 * KIB < len(text.encode())  # bytes count, not characters
    with pytest.raises(ChainConfigError) as caught:
        load_chain_text(text, limits=LIMITS)
    assert caught.value.problems == [
        f"config: {format_bytes(len(text.encode()))} exceeds the router's limit of 2 KiB (--max-config-bytes)"
    ]
    with pytest.raises(ChainConfigError, match="--max-config-bytes"):
        load_chain_text("{" * 3000, limits=LIMITS)  # garbage too: its size is the first problem
    assert load_chain_text(text).config.nodes[0].prompt == "é" * 1500  # without limits: offline validation


def test_nodes_per_chain_are_limited() -> None:
    assert problems(chain([model_node(f"n{i}") for i in range(4)])) == [
        "nodes: 4 nodes exceeds the router's limit of 3 (--max-nodes)"
    ]
    load_chain_text(yaml.safe_dump(chain([model_node(f"n{i}") for i in range(3)])), limits=LIMITS)


def test_max_tokens_of_model_nodes_is_limited_and_reported_with_other_problems() -> None:
    found = problems(chain([model_node(max_tokens=65), model_node("b", depends_on=["zz"])]))
    assert found == [
        "node 'a': max_tokens: 65 tokens exceeds the router's limit of 64 (--max-output-tokens)",
        "node 'b': depends_on: unknown node 'zz'",
    ]
    # a tool node ignores max_tokens (a warning), so the limit does not apply to it
    tool = {"id": "t", "type": "tool_call", "tool": "vector_search", "max_tokens": 1000}
    validated = load_chain_text(yaml.safe_dump(chain([tool])), limits=LIMITS)
    assert "node 't': max_tokens: ignored for tool_call nodes" in validated.warnings


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"max_tokens": MAX_UINT32 + 1}, "max_tokens: must be less than or equal to 4294967295"),
        (
            {"max_context_tokens": 5_000_000_000},
            "max_context_tokens: must be less than or equal to 4294967295",
        ),
        ({"timeout": "721h"}, "timeout: must be at most 30 days (2592000000ms), got 2.5956e+09ms"),
        ({"timeout": 1e300}, "timeout: must be at most 30 days"),
        ({"cache_ttl": "1e300ms"}, "cache_ttl: must be at most 30 days"),
        ({"temperature": 2.5}, "temperature: must be less than or equal to 2"),
    ],
)
def test_every_config_has_bounds_the_wire_can_carry(fields: dict[str, Any], problem: str) -> None:
    """Found by fuzzing: configs past these were stored, then every run failed INTERNAL."""
    (found,) = problems(chain([model_node(**fields)]), limits=None)
    assert found.startswith(f"node 'a': {problem}")


def test_the_slo_is_bounded_too() -> None:
    document = chain([model_node()])
    document["agent_chain"]["slo"]["end_to_end_latency_p99"] = 1e300
    assert problems(document, limits=None) == [
        "slo.end_to_end_latency_p99: must be at most 30 days (2592000000ms), got 1e+300ms"
    ]


def test_json_escapes_of_surrogate_pairs_are_joined_and_lone_surrogates_refused() -> None:
    """Found by fuzzing: YAML reads "\\ud83d\\ude00" as two lone surrogates; one in an error
    message made the gRPC call hang (no status could be sent)."""
    document = chain([model_node(prompt="hi \U0001f600")])
    text = json.dumps(document)  # ensure_ascii: the emoji as a \\ud83d\\ude00 pair
    assert "\\ud83d\\ude00" in text
    assert load_chain_text(text).config.nodes[0].prompt == "hi \U0001f600"
    with pytest.raises(ChainConfigError, match=r"'\\ud87f': not valid Unicode \(a lone surrogate\)"):
        load_chain_text('{"\\ud87f": null}')
    with pytest.raises(ChainConfigError, match="lone surrogate"):
        load_chain_text(text.replace("\\ude00", ""))


def test_a_stored_version_loads_whatever_the_size_of_its_text() -> None:
    """Stored versions are read back as documents: re-encoded as escaped JSON text, this one
    (accepted when put) was over the text cap, and the chain could not be resolved."""
    document = chain([model_node(prompt="é" * 400_000)])
    assert len(json.dumps(document)) > MAX_CONFIG_CHARS
    assert load_chain_document(document).config.nodes[0].prompt == "é" * 400_000


class NoEtcd:
    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"etcd touched: {name}")


async def test_a_version_too_big_for_etcd_is_refused_before_anything_is_written() -> None:
    """Found by fuzzing: etcd refused the record, and the router reported etcd unreachable."""
    store = ChainStore(NoEtcd())
    config = yaml.safe_dump(chain([model_node()]))
    with pytest.raises(InvalidArgument) as caught:
        await store.put("default", config, message="m" * MAX_STORED_CHAIN_BYTES, limits=RequestLimits())
    assert caught.value.message.startswith(
        "config: the version to store (normalised config, message and author)"
    )
    assert caught.value.message.endswith("more than the 976.6 KiB a chain version may take in etcd")


# ----- gRPC: requests that are not protobuf, and status messages -----------------------------


def test_a_request_that_is_not_protobuf_is_invalid_argument() -> None:
    decode = _decoder(router_pb2.PutChainRequest.FromString, "/inferx.v1.Router/PutChain")
    assert decode(router_pb2.PutChainRequest(config="x").SerializeToString()).config == "x"
    with pytest.raises(
        InvalidArgument, match=r"^/inferx.v1.Router/PutChain: the request is not a valid protobuf"
    ):
        decode(b"\xff\xff\xff")
    assert _decoder(None, "/m")(b"raw") == b"raw"


def encoded_size(message: str) -> int:
    """Bytes of `message` in the grpc-message trailer (percent-encoded)."""
    return sum(1 if " " <= c <= "~" and c != "%" else 3 * len(c.encode()) for c in message)


def test_status_messages_are_cut_to_fit_the_trailer_and_made_valid_utf8() -> None:
    assert fit_status_message("short") == "short"
    for text in ("x" * 10_000, "é" * 4000, "\U0001f600" * 3000, "input 'a': " + "%" * 5000):
        cut = fit_status_message(text)
        assert encoded_size(cut) <= 4096 and cut.endswith("more characters)") and cut[:5] == text[:5]
    assert fit_status_message("bad \ud800") == "bad \\ud800"


# ----- the HTTP front ------------------------------------------------------------------------


class NoScheduler:
    async def run_hop(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a refused call reached the scheduler")


@pytest.fixture
def http() -> Iterator[TestClient]:
    directory = PoolDirectory()
    directory.model_to_pool = {"m": "pool"}
    limits = RequestLimits(http_max_body_bytes=200, max_output_tokens=8)
    access = AccessControl(None)  # --insecure: these tests are about sizes, not tokens
    calls = ProgramCalls(
        directory,
        NoScheduler(),
        access=access,
        quotas=TenantQuotas(),
        default_timeout_s=5,
        book=ProgramBook(RunStore()),
        request_limits=limits,
    )
    front = OpenAIFront(calls, access=access, request_limits=limits)
    with TestClient(front.app()) as client:
        yield client


def test_a_body_over_the_limit_is_a_413_with_or_without_content_length(http: TestClient) -> None:
    body = json.dumps({"model": "m", "prompt": "x" * 300}).encode()
    declared = http.post("/v1/completions", content=body)
    assert declared.status_code == 413
    assert declared.json()["error"] == {
        "message": f"body: {len(body)} bytes exceeds the router's limit of 200 bytes (--http-max-body-bytes)",
        "type": "invalid_request_error",
        "param": "body",
        "code": "request_too_large",
    }
    chunked = http.post("/v1/chat/completions", content=iter([body[:150], body[150:]]))
    assert chunked.status_code == 413
    assert chunked.json()["error"]["message"] == (
        "body: larger than the router's limit of 200 bytes (--http-max-body-bytes)"
    )


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 9}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2**40}, "max_tokens"),  # was a 500
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9},
            "max_completion_tokens",
        ),
    ],
)
def test_max_tokens_over_the_limit_is_a_400_naming_it(
    http: TestClient, path: str, fields: dict[str, Any], param: str
) -> None:
    reply = http.post(path, json={"model": "m", **fields})
    assert reply.status_code == 400
    error = reply.json()["error"]
    tokens = fields.get("max_tokens") or fields["max_completion_tokens"]
    assert error["param"] == param
    assert (
        error["message"]
        == f"{param}: {tokens:,} tokens exceeds the router's limit of 8 (--max-output-tokens)"
    )


def test_a_lone_surrogate_in_a_body_is_a_400_not_a_500() -> None:
    with pytest.raises(InvalidArgument, match="lone UTF-16 surrogate"):
        parse_body(CompletionRequest, b'{"model": "m", "prompt": "\\ud800"}')
    assert parse_body(CompletionRequest, b'{"model": "m", "prompt": "\\ud83d\\ude00"}').prompt == "\U0001f600"


@pytest.mark.parametrize(
    "raw",
    [
        '{"model": "m", "prompt": "\ud800"}'.encode("utf-8", "surrogatepass"),  # raw bytes, no escape
        '{"model": "m", "prompt": "\udfff"}'.encode("utf-16", "surrogatepass"),
        '{"model": "m", "prompt": "\udc00"}'.encode("utf-32-le", "surrogatepass"),
    ],
    ids=["utf-8 bytes", "utf-16", "utf-32"],
)
def test_a_lone_surrogate_without_an_escape_is_refused_too(raw: bytes) -> None:
    """json.loads decodes bytes with 'surrogatepass': a surrogate written as raw bytes
    reaches the decoded body without any \\u escape (orjson refuses these bodies; the
    `json` reading they fall back to lets them through to load_object's check)."""
    with pytest.raises(InvalidArgument, match="lone UTF-16 surrogate"):
        parse_body(CompletionRequest, raw)


@settings(max_examples=300, deadline=None)
@given(
    # hypothesis's characters() never draws a surrogate: mix them in
    text=st.lists(st.one_of(st.characters(), st.integers(0xD800, 0xDFFF).map(chr)), max_size=6).map("".join),
    encoding=st.sampled_from(["utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-32", "utf-32-be"]),
    ascii_escapes=st.booleans(),
)
def test_a_body_is_refused_exactly_when_it_holds_a_surrogate(
    text: str, encoding: str, ascii_escapes: bool
) -> None:
    body = json.dumps({"model": "m", "prompt": text}, ensure_ascii=ascii_escapes)
    raw = body.encode(encoding, "surrogatepass")
    # What the body says, decoded (a pair written as two escapes, or as UTF-16 units, is
    # one character; one written as UTF-8 bytes stays two lone surrogates).
    decoded = json.loads(raw)["prompt"]
    if any(0xD800 <= ord(c) <= 0xDFFF for c in decoded):
        with pytest.raises(InvalidArgument, match="lone UTF-16 surrogate"):
            parse_body(CompletionRequest, raw)
    else:
        assert parse_body(CompletionRequest, raw).prompt == decoded


def test_body_too_large_maps_to_413() -> None:
    assert error_reply(BodyTooLarge(300, 200)).status == 413


# ----- settings ------------------------------------------------------------------------------


def test_the_router_takes_each_limit_as_a_flag_with_the_documented_defaults() -> None:
    defaults = load_settings(RouterSettings, "inferx-router", [])
    assert defaults.request_limits == RequestLimits()
    assert defaults.max_request_bytes == 4 * MIB
    assert load_settings(ServiceSettings, "inferx-x", []).max_request_bytes == 16 * MIB
    flags = [
        "--max-request-bytes=2048",
        "--max-input-bytes=10",
        "--max-inputs=2",
        "--max-config-bytes=100",
        "--max-nodes=4",
        "--max-output-tokens=5",
        "--http-max-body-bytes=50",
    ]
    settings = load_settings(RouterSettings, "inferx-router", flags)
    assert settings.max_request_bytes == 2048
    assert settings.request_limits == RequestLimits(10, 2, 100, 4, 5, 50)


def test_a_default_for_calls_without_max_tokens_within_the_limit() -> None:
    flags = ["--max-output-tokens=5", "--default-max-output-tokens=3"]
    assert load_settings(RouterSettings, "inferx-router", flags).request_limits.default_output_tokens == 3


def test_a_default_over_the_limit_is_refused_at_start(capsys) -> None:
    with pytest.raises(SystemExit):
        load_settings(
            RouterSettings, "inferx-router", ["--max-output-tokens=5", "--default-max-output-tokens=6"]
        )
    assert "--default-max-output-tokens 6 is over --max-output-tokens 5" in capsys.readouterr().err


@pytest.mark.parametrize("default", [0, 6])
def test_a_program_call_without_max_tokens_gets_the_default(default: int) -> None:
    limits = RequestLimits(max_output_tokens=8, default_output_tokens=default)
    directory = PoolDirectory()
    directory.model_to_pool = {"m": "pool"}
    calls = ProgramCalls(
        directory,
        NoScheduler(),
        access=AccessControl(None),
        quotas=TenantQuotas(),
        default_timeout_s=5,
        book=ProgramBook(RunStore()),
        request_limits=limits,
    )
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert calls.prepare(ChatCompletionRequest.model_validate(chat)).max_tokens == default  # 0: not set
    assert calls.prepare(ChatCompletionRequest.model_validate({**chat, "max_tokens": 2})).max_tokens == 2


@pytest.mark.parametrize(
    "flag",
    [
        "--max-config-bytes=1000001",
        "--max-output-tokens=4294967296",
        "--max-request-bytes=10",
        "--max-nodes=0",
    ],
)
def test_limits_past_what_the_system_can_take_are_refused_at_start(flag: str, capsys) -> None:
    with pytest.raises(SystemExit):
        load_settings(RouterSettings, "inferx-router", [flag])
    assert flag.split("=")[0] in capsys.readouterr().err
