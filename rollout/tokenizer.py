"""Tokenizer loading and chat-template helpers.

``load_tokenizer("builtin")`` gives the tiny character-level tokenizer shipped in
``rollout/assets/tokenizer`` (102 tokens, ChatML template, eos ``<|im_end|>``); any other value is a
local HF tokenizer directory (usually the model directory). Nothing is ever downloaded.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

BUILTIN_TOKENIZER_DIR = Path(__file__).resolve().parent / "assets" / "tokenizer"


def is_builtin(path_or_name: str) -> bool:
    """True for ``builtin`` and ``builtin:<model>`` names (shipped assets, no files needed)."""
    return str(path_or_name) == "builtin" or str(path_or_name).startswith("builtin:")


def load_tokenizer(path_or_name: str | Path = "builtin") -> PreTrainedTokenizerBase:
    """Load a tokenizer offline.

    ``builtin`` or ``builtin:<model>`` (e.g. ``builtin:tiny``) -> the shipped tokenizer; otherwise a
    local directory holding ``tokenizer.json``/``tokenizer_config.json``. The returned tokenizer pads
    on the left and always has a pad token (eos when the directory defines none).
    """
    name = str(path_or_name)
    if is_builtin(name):
        directory = BUILTIN_TOKENIZER_DIR
    else:
        directory = Path(name).expanduser()
        if not directory.is_dir():
            raise ValueError(
                f"tokenizer path {name!r} is not a directory; pass a local HF tokenizer/model "
                "directory or 'builtin' for the shipped tiny tokenizer (nothing is downloaded)"
            )
    if _declares_plain_fast_tokenizer(directory):
        # transformers 5 picks the tokenizer class from config.json's model_type when one sits
        # beside it (a qwen2 model gets Qwen2Tokenizer, whose pre-tokenizer drops spaces and
        # newlines of a plain tokenizer.json): honour the directory's own declaration.
        tok = PreTrainedTokenizerFast.from_pretrained(str(directory), local_files_only=True)
    else:
        tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def _declares_plain_fast_tokenizer(directory: Path) -> bool:
    """True when ``tokenizer_config.json`` names the generic fast tokenizer class
    (``PreTrainedTokenizerFast``, transformers 5's ``TokenizersBackend``)."""
    config = directory / "tokenizer_config.json"
    if not config.is_file():
        return False
    try:
        declared = json.loads(config.read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        return False  # AutoTokenizer reports a damaged file better than we can
    return declared in ("PreTrainedTokenizerFast", "TokenizersBackend")


def chat_token_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[dict],
    *,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Token ids of ``messages`` rendered with the tokenizer's chat template.

    Works across transformers versions (v5 returns a BatchEncoding by default, v4 a list).
    """
    out = tokenizer.apply_chat_template(
        list(messages),
        add_generation_prompt=add_generation_prompt,
        tokenize=True,
        return_dict=False,
    )
    if hasattr(out, "keys"):  # a BatchEncoding despite return_dict=False (older versions)
        out = out["input_ids"]
    return [int(t) for t in out]


def eos_token_ids(tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """Token ids that end an assistant turn: the tokenizer's eos (``<|im_end|>`` for ChatML)."""
    ids = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id and im_end not in ids:
        ids.append(im_end)
    return tuple(ids)
