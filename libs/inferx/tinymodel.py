"""A tiny Llama-shaped model directory for development and tests.

The directory holds a `config.json`, a byte-level BPE tokenizer trained on a small
built-in English corpus (so the files are the same on every machine), and a README.
It holds NO weights: vLLM runs it with `load_format="dummy"`, which fills the
parameters with random values. Output text is therefore gibberish, but token counts,
streaming, batching, prefix caching and scheduling all behave as with a real model.

    python -m inferx.tinymodel DIR      # what `make model` runs

Only the `tokenizers` package is needed to build it (no torch, no transformers).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

UNK, BOS, EOS = "<unk>", "<s>", "</s>"
SPECIAL_TOKENS = [UNK, BOS, EOS]  # ids 0, 1, 2, as in Llama

# Files make_tiny_model() writes; config.json is the marker that the model exists.
MODEL_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "README.md",
)

# The chat template (Jinja, in tokenizer_config.json): Qwen2.5's ChatML with Hermes-style
# tool calling. Tool specs go into the system turn inside <tools></tools>; the model
# calls tools with <tool_call>{"name": ..., "arguments": {...}}</tool_call>; tool results
# come back in a user turn inside <tool_response></tool_response>. The turn marks are
# plain text to this tiny tokenizer (several tokens each), which is all a model with
# random weights needs; the template writes the BOS itself, as Llama's do. A chat's
# rendering with the generation prompt is a prefix of the rendering of the same chat
# continued (assistant reply, tool results, ...), so an agent loop's calls extend each
# other and hit the prefix cache.
CHAT_TEMPLATE = """\
{{- bos_token }}
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- (messages[0].content or '') + '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments ' }}
    {{- 'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n' }}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + (messages[0].content or '') + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role in ('user', 'system') or (message.role == 'assistant' and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
            {%- if tool_call.arguments is string %}
                {{- tool_call.arguments }}
            {%- else %}
                {{- tool_call.arguments | tojson }}
            {%- endif %}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + (message.content or '') + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('unsupported role ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

CORPUS = """\
The customer placed an order for two pairs of running shoes and a rain jacket. The order
number is 48213 and it was paid by card. The agent checked the order status: the items
were packed in the warehouse this morning and will be handed to the carrier today.

Shipping usually takes three to five business days. Express shipping takes one or two
days and costs more. When the carrier scans the parcel, the customer receives an email
with a tracking number. If the tracking page shows no update for a week, the agent opens
an investigation with the carrier and tells the customer what happens next.

A refund is issued when an item is returned in its original condition within thirty
days. The agent verifies the return, looks up the original payment, and sends the refund
to the same card. Refunds appear on the statement within five to ten days. Shipping
costs are refunded only when the item arrived damaged or the wrong item was sent.

The support team uses a chain of agents. The first agent reads the message and decides
what the customer wants: a question about an order, a change of address, a return, or a
refund. The second agent looks up the order and the shipping history. The third agent
writes a short, friendly answer and checks it against the store policy before it is
sent. Each agent passes its notes to the next one, so the answer is fast and correct.

Please note that the store cannot change the address after the parcel has shipped. The
customer may ask the carrier to hold the parcel at a pickup point instead. For orders
that have not shipped yet, the agent can update the address, cancel the order, or split
it into two shipments. Every change is recorded in the order history with the time and
the name of the agent who made it.

Thank you for your patience. We are sorry that your order was delayed. Your refund of
59.90 dollars has been approved and will be sent today. If you have any other questions
about your order, shipping, returns or refunds, reply to this email and an agent will
help you as soon as possible.
"""

README = """\
# tiny-llama (random dummy weights)

A tiny Llama-shaped model made by `python -m inferx.tinymodel` for development and tests.

- **The weights are random.** There are no weight files here: vLLM loads this directory
  with `load_format="dummy"` and fills every parameter with random values, so the text
  it generates is meaningless (and may stop early when EOS is sampled).
- Shape: hidden_size={hidden_size}, layers={num_layers}, attention heads={num_heads}
  (head_dim={head_dim}), vocab_size={vocab_size}, max_position_embeddings={max_pos}.
- The tokenizer is a byte-level BPE trained on a small built-in English corpus (orders,
  shipping, refunds, support agents), so it is the same on every machine and
  round-trips any text.
- `tokenizer_config.json` carries a chat template (`chat_template`): Qwen2.5's ChatML
  with Hermes-style tool calling (tools in `<tools>`, calls as
  `<tool_call>{{"name": ..., "arguments": {{...}}}}</tool_call>`, results in
  `<tool_response>`). Its turn marks are plain text to this tokenizer.

Use it to exercise streaming, batching, prefix caching and scheduling, never to judge
output quality.
"""


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    # Like Llama: prepend BOS to every encoded sequence.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, tok.token_to_id(BOS))],
    )
    return tok


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def make_tiny_model(
    path: Path,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    vocab_size: int = 512,
    max_position_embeddings: int = 4096,
) -> Path:
    """Write a Llama-shaped model directory (config + tokenizer, no weights) at `path`.

    Existing files there are overwritten. Returns `path`. The defaults give head_dim 64,
    which vLLM's CPU attention kernel accepts (head_dim 16 is rejected).
    """
    path = Path(path)
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size {hidden_size} is not a multiple of num_heads {num_heads}")
    # 3 special tokens + 256 byte symbols must fit, with room for some merges.
    if vocab_size < 300:
        raise ValueError(f"vocab_size {vocab_size} is too small (need >= 300)")
    head_dim = hidden_size // num_heads

    tok = _train_tokenizer(vocab_size)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    assert ids == {UNK: 0, BOS: 1, EOS: 2}, ids

    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "vocab_size": tok.get_vocab_size(),
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "initializer_range": 0.02,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": ids[BOS],
        "eos_token_id": ids[EOS],
        "torch_dtype": "bfloat16",
    }
    _write_json(path / "config.json", config)
    tok.save(str(path / "tokenizer.json"))
    _write_json(
        path / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": EOS,
            "unk_token": UNK,
            "add_bos_token": True,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": max_position_embeddings,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    _write_json(path / "special_tokens_map.json", {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK})
    (path / "README.md").write_text(
        README.format(
            hidden_size=hidden_size,
            num_layers=num_layers,
            num_heads=num_heads,
            head_dim=head_dim,
            vocab_size=tok.get_vocab_size(),
            max_pos=max_position_embeddings,
        ),
        encoding="utf-8",
    )
    return path


def add_chat_template(path: Path) -> bool:
    """Give a tiny model made before it had one the chat template (the tokenizer is
    unchanged); True when it was added."""
    config_path = Path(path) / "tokenizer_config.json"
    if not config_path.is_file():
        return False
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if config.get("chat_template") or (Path(path) / "chat_template.jinja").exists():
        return False
    config["chat_template"] = CHAT_TEMPLATE
    _write_json(config_path, config)
    return True


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m inferx.tinymodel",
        description="Write a tiny Llama-shaped model directory (config + tokenizer; random "
        "weights are made by vLLM with load_format=dummy).",
    )
    parser.add_argument("dir", type=Path, help="directory to create")
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--num-heads", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--max-position-embeddings", type=int, default=4096)
    args = parser.parse_args(argv)

    if (args.dir / "config.json").exists():
        if add_chat_template(args.dir):
            print(f"{args.dir}: a model already exists there; added the chat template it lacked")
        else:
            print(f"{args.dir}: a model already exists there (config.json found); left as is")
        return 0
    out = make_tiny_model(
        args.dir,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        vocab_size=args.vocab_size,
        max_position_embeddings=args.max_position_embeddings,
    )
    print(f"wrote tiny model (random dummy weights) to {out}:")
    for name in MODEL_FILES:
        print(f"  {out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
