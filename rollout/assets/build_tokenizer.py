"""Regenerate the shipped tiny tokenizer (``rollout/assets/tokenizer/``) deterministically.

Character-level: every printable ASCII character plus newline and tab is one token, so a
randomly initialised model can emit any text, and a prompt's token count equals its length.
Run ``python -m rollout.assets.build_tokenizer`` (or this file) after changing the alphabet;
the output is byte-identical between runs.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models

OUT_DIR = Path(__file__).resolve().parent / "tokenizer"

# Specials first so their ids (0..4) never move when the alphabet changes.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>", "<|unk|>"]
ALPHABET = ["\n", "\t"] + [chr(c) for c in range(32, 127)]

# Qwen-style ChatML. Unlike Qwen no default system message is added: prompts stay short for
# the tiny CPU model. Any role name is rendered as given (user, assistant, system, tool).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build() -> Tokenizer:
    """The tokenizer object: specials then one token per character; vocab of 102 tokens."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + ALPHABET)}
    # BPE without merges = one token per character; unknown characters map to <|unk|>.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<|unk|>"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.decoder = decoders.Fuse()  # characters concatenate, no spaces between tokens
    return tok


def write(out_dir: Path = OUT_DIR) -> Path:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    build().save(str(out_dir / "tokenizer.json"), pretty=True)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 4096,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|pad|>",
        "unk_token": "<|unk|>",
        "additional_special_tokens": ["<|endoftext|>", "<|im_start|>"],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {k: config[k] for k in ("eos_token", "pad_token", "unk_token")}
    special["additional_special_tokens"] = config["additional_special_tokens"]
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return out_dir


if __name__ == "__main__":
    print(f"wrote {write()}")
