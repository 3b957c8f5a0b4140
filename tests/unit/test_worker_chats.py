"""Chats on the worker: the servicer renders GenerateRequest.chat_json with the engine's
chat template (the generic rendering that came with it where there is none, counted as
such), and the sim engine's SIMULATED script replies (inferx.sim.script)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inferx.chat_template import ChatTemplate
from inferx.errors import InvalidArgument
from inferx.sim.profile import EngineProfile
from inferx.sim.script import SimScript
from inferx.tinymodel import make_tiny_model
from inferx.v1 import common_pb2, worker_pb2
from inferx_worker import metrics
from inferx_worker.engines.base import EngineRequest
from inferx_worker.engines.sim_engine import SimEngine, SimParams
from inferx_worker.servicer import ModelWorkerServicer

CALL = '<tool_call>\n{"name": "lookup_order", "arguments": {"order_id": "7"}}\n</tool_call>'
SCRIPT = [
    {"when": "<tool_response>\nshipped", "reply": "Order 7 has shipped."},
    {"when": "Where is order 7?", "reply": CALL},
]
CHAT = {"messages": [{"role": "user", "content": "Where is order 7?"}]}


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> ChatTemplate:
    found = ChatTemplate.from_model_dir(make_tiny_model(tmp_path_factory.mktemp("m") / "tiny"))
    assert found is not None
    return found


def sim(template: ChatTemplate | None = None, script: SimScript | None = None) -> SimEngine:
    return SimEngine(SimParams(profile=EngineProfile(), speed=100), chat_template=template, script=script)


async def generate(engine: SimEngine, request: worker_pb2.GenerateRequest) -> list[worker_pb2.GenerateChunk]:
    await engine.start()
    try:
        servicer = ModelWorkerServicer(engine, "w1")
        return [chunk async for chunk in servicer.Generate(request, None)]
    finally:
        await engine.stop()


def request(prompt: str, chat: dict | None = None, max_tokens: int = 64) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(
        context=common_pb2.HopContext(run_id="r", hop_id="h"),
        prompt=prompt,
        sampling=common_pb2.SamplingOptions(max_tokens=max_tokens),
        chat_json=json.dumps(chat) if chat is not None else "",
    )


def renders(kind: str) -> float:
    return metrics.CHAT_RENDERS.labels(kind)._value.get()


async def test_a_chat_runs_through_the_models_template(template: ChatTemplate) -> None:
    rendered = template.render(CHAT["messages"])
    before = renders("model")
    chunks = await generate(sim(template), request("generic rendering", CHAT, max_tokens=3))
    assert renders("model") == before + 1
    assert chunks[-1].usage.prompt_tokens == -(-len(rendered) // 4)  # the sim's 4-character tokens


async def test_without_a_template_the_generic_rendering_runs_and_is_counted() -> None:
    before = renders("generic")
    chunks = await generate(sim(), request("x" * 40, CHAT, max_tokens=3))
    assert renders("generic") == before + 1
    assert chunks[-1].usage.prompt_tokens == 10


@pytest.mark.parametrize(
    ("chat_json", "words"),
    [("{oops", "not JSON"), ('{"messages": [{"role": "narrator", "content": "x"}]}', "unsupported role")],
)
async def test_a_chat_the_worker_cannot_render_is_invalid_argument(
    template: ChatTemplate, chat_json: str, words: str
) -> None:
    bad = request("p")
    bad.chat_json = chat_json
    with pytest.raises(InvalidArgument, match=words):
        await generate(sim(template), bad)


async def test_a_scripted_sim_replies_the_rule_the_rendered_prompt_matches(template: ChatTemplate) -> None:
    engine = sim(template, SimScript.from_data(SCRIPT))
    chunks = await generate(engine, request("p", CHAT))
    assert "".join(c.text for c in chunks) == CALL
    final = chunks[-1]
    assert final.finish_reason == "stop" and final.usage.completion_tokens == -(-len(CALL) // 4)
    assert len(chunks) > 2  # streamed at the sim's pace, not in one piece

    later = {
        "messages": [
            *CHAT["messages"],
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "lookup_order", "arguments": {}}}
                ],
            },
            {"role": "tool", "tool_call_id": "c", "content": "shipped"},
        ]
    }
    chunks = await generate(sim(template, SimScript.from_data(SCRIPT)), request("p", later))
    assert "".join(c.text for c in chunks) == "Order 7 has shipped."  # the first matching rule wins


async def test_a_scripted_reply_longer_than_max_tokens_is_cut() -> None:
    engine = sim(script=SimScript.from_data([{"reply": "abcdefghij"}]))
    await engine.start()
    try:
        chunks = [c async for c in engine.generate(EngineRequest("r", "any prompt", max_tokens=2))]
        unmatched = sim(script=SimScript.from_data([{"when": "nowhere", "reply": "x"}]))
        await unmatched.start()
        synthetic = [c async for c in unmatched.generate(EngineRequest("s", "any prompt", max_tokens=2))]
        await unmatched.stop()
    finally:
        await engine.stop()
    assert "".join(c.text for c in chunks) == "abcdefgh"
    assert (chunks[-1].finish_reason, chunks[-1].completion_tokens) == ("length", 2)
    assert synthetic[-1].finish_reason == "length" and len("".join(c.text for c in synthetic)) == 8


def test_a_script_file_is_yaml_or_json(tmp_path: Path) -> None:
    (tmp_path / "s.yaml").write_text("- when: hi\n  reply: |-\n    hello\n    there\n- reply: fallback\n")
    script = SimScript.load(tmp_path / "s.yaml")
    assert script.reply("oh hi") == "hello\nthere" and script.reply("other") == "fallback"
    (tmp_path / "s.json").write_text(json.dumps(SCRIPT))
    assert SimScript.load(tmp_path / "s.json").reply("Where is order 7?") == CALL


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ("{}", "list"),
        ("- when: x\n", r"\[0\]\.reply"),
        ("- reply: ''\n", r"\[0\]\.reply"),
        ("- reply: y\n  wen: x\n", r"\[0\]\.wen"),
        ("- [", "not valid YAML"),
    ],
)
def test_a_bad_script_names_what_is_wrong(tmp_path: Path, content: str, words: str) -> None:
    (tmp_path / "bad.yaml").write_text(content)
    with pytest.raises(InvalidArgument, match=words):
        SimScript.load(tmp_path / "bad.yaml")
    with pytest.raises(InvalidArgument, match="No such file"):
        SimScript.load(tmp_path / "missing.yaml")


async def test_the_same_hop_sent_twice_gets_two_engine_request_ids() -> None:
    """The engine request id is the run, the hop and a per-process sequence number: a
    hop retried or re-dispatched to the same worker while the first is still running
    (the same run and hop ids) must not collide in the engine."""
    engine = sim()
    seen: list[str] = []
    generate_of = engine.generate

    def recording(req: EngineRequest):
        seen.append(req.request_id)
        return generate_of(req)

    engine.generate = recording  # type: ignore[method-assign,assignment]
    await engine.start()
    try:
        servicer = ModelWorkerServicer(engine, "w1")
        same = request("the same hop")
        streams = [servicer.Generate(same, None) for _ in range(3)]
        for stream in streams:
            assert (await anext(stream)) is not None
        for stream in streams:
            async for _ in stream:
                pass
    finally:
        await engine.stop()
    assert len(set(seen)) == 3 and all(rid.startswith("r:h:") for rid in seen)
