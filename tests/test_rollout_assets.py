"""Shipped tokenizer and builtin model assets: offline, deterministic, cached."""

from __future__ import annotations

import filecmp

import pytest
import torch

from rollout.assets import build_tokenizer
from rollout.files import is_temp_name
from rollout.models import load_model
from rollout.tokenizer import BUILTIN_TOKENIZER_DIR, chat_token_ids, load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("builtin")


def test_tokenizer_is_small_and_chatml(tok):
    assert 100 <= len(tok) <= 130
    assert tok.eos_token == "<|im_end|>"
    assert tok.pad_token_id is not None and tok.pad_token_id != tok.eos_token_id
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert tok.convert_tokens_to_ids(special) != tok.unk_token_id


def test_text_round_trip(tok):
    text = "What is 12+30? Answer: 42.\n\tok"
    assert tok.decode(tok.encode(text)) == text


def test_chat_template_round_trip(tok):
    messages = [
        {"role": "user", "content": "say 42"},
        {"role": "assistant", "content": "42"},
        {"role": "user", "content": "first?"},
    ]
    ids = chat_token_ids(tok, messages, add_generation_prompt=True)
    text = tok.decode(ids)
    for m in messages:
        assert f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    # The generation prompt is an extension of the history without it.
    bare = chat_token_ids(tok, messages, add_generation_prompt=False)
    assert ids[: len(bare)] == bare and len(ids) > len(bare)


def test_build_tokenizer_is_deterministic(tmp_path):
    build_tokenizer.write(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert filecmp.cmp(tmp_path / name, BUILTIN_TOKENIZER_DIR / name, shallow=False), name


def test_builtin_model_cache_gives_identical_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("CROSSRL_CACHE", str(tmp_path))
    first = load_model("builtin:tiny", seed=7)
    assert list(tmp_path.rglob("*.safetensors")), "weights were not cached"
    left = [p for p in tmp_path.rglob("*") if is_temp_name(p.name)]
    assert not left, "a temporary directory was left behind"
    second = load_model("builtin:tiny", seed=7)
    other = load_model("builtin:tiny", seed=8)
    a, b, c = first.state_dict(), second.state_dict(), other.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    assert first.config.vocab_size == len(load_tokenizer("builtin"))


def test_builtin_model_dtype_and_local_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CROSSRL_CACHE", str(tmp_path / "cache"))
    model = load_model("builtin:tiny", seed=1, dtype="bf16")
    assert model.dtype == torch.bfloat16
    model.save_pretrained(str(tmp_path / "saved"))
    again = load_model(tmp_path / "saved", dtype=torch.float32)
    assert again.dtype == torch.float32
    assert torch.equal(
        again.state_dict()["model.norm.weight"], model.state_dict()["model.norm.weight"].float()
    )


@pytest.mark.parametrize("bad", ["builtin:huge", "/nonexistent/model/dir"])
def test_bad_model_path_names_the_value(bad):
    with pytest.raises(ValueError, match="model.path"):
        load_model(bad)


def test_bad_dtype_names_the_value():
    with pytest.raises(ValueError, match="float64x"):
        load_model("builtin:tiny", dtype="float64x")


def test_bad_tokenizer_path():
    with pytest.raises(ValueError, match="/nonexistent/tok"):
        load_tokenizer("/nonexistent/tok")


TINY_SHAPE = {
    "model_type": "qwen2",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 4096,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}


def test_random_model_directory_loads_with_the_shipped_tokenizer_intact(tmp_path):
    """A random-weight stand-in (what GPU bring-up trains) is a model.path like any other, and
    its qwen2 config.json does not make transformers swap in a tokenizer that drops spaces."""
    from rollout.models import write_random_model

    out = write_random_model(tmp_path / "m", TINY_SHAPE, seed=3)
    model = load_model(out)
    assert model.config.vocab_size == 4096 and model.config.num_hidden_layers == 2
    again = write_random_model(tmp_path / "m2", TINY_SHAPE, seed=3)
    torch.testing.assert_close(load_model(again).state_dict(), model.state_dict())
    messages = [
        {"role": "user", "content": "add 12 and 30\nthen say it"},
        {"role": "assistant", "content": "<calc>12 + 30</calc>"},
        {"role": "user", "content": "42 ok"},
    ]
    ours, shipped = load_tokenizer(out), load_tokenizer("builtin")
    assert chat_token_ids(ours, messages) == chat_token_ids(shipped, messages)
    assert ours.decode(chat_token_ids(ours, messages)) == shipped.decode(
        chat_token_ids(shipped, messages)
    )


def test_random_model_never_overwrites(tmp_path):
    from rollout.models import main, write_random_model

    (tmp_path / "taken").mkdir()
    with pytest.raises(ValueError, match="exists"):
        write_random_model(tmp_path / "taken", TINY_SHAPE)
    with pytest.raises(ValueError, match="unknown"):
        write_random_model(tmp_path / "new", "qwen9-1t")
    assert main(["random", "qwen2.5-0.5b", str(tmp_path / "taken")]) == 2
