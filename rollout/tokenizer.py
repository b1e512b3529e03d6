"""Tokenizer loading and chat-template helpers.

``load_tokenizer("builtin")`` gives the tiny character-level tokenizer shipped in
``rollout/assets/tokenizer`` (102 tokens, ChatML template, eos ``<|im_end|>``); any other value is a
local HF tokenizer directory (usually the model directory). Nothing is ever downloaded.
"""

from __future__ import annotations

import json
import shutil
import string
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rollout.files import atomic_write_text

if TYPE_CHECKING:  # transformers is imported where a tokenizer is loaded, not by who imports
    from transformers import PreTrainedTokenizerBase  # the agent loop only to name its types

BUILTIN_TOKENIZER_DIR = Path(__file__).resolve().parent / "assets" / "tokenizer"

#: The files a Hugging Face tokenizer directory may hold; ``save_tokenizer`` copies those present.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)

#: A multi-turn chat with every printable ASCII character, runs of spaces, tabs and newlines
#: (the shipped vocabulary's characters): what ``save_tokenizer`` checks a written tokenizer
#: against.
PROBE_MESSAGES = (
    {"role": "system", "content": "Answer briefly.\n\tUse tools if needed."},
    {"role": "user", "content": string.ascii_letters + string.digits + string.punctuation},
    {"role": "assistant", "content": "ok:  x = 20 + 3\n\n  y = x * 2"},
    {"role": "user", "content": "again, with   three spaces\n"},
)


def is_builtin(path_or_name: str) -> bool:
    """True for ``builtin`` and ``builtin:<model>`` names (shipped assets, no files needed)."""
    return str(path_or_name) == "builtin" or str(path_or_name).startswith("builtin:")


def load_tokenizer(path_or_name: str | Path = "builtin") -> PreTrainedTokenizerBase:
    """Load a tokenizer offline.

    ``builtin`` or ``builtin:<model>`` (e.g. ``builtin:tiny``) -> the shipped tokenizer; otherwise a
    local directory holding ``tokenizer.json``/``tokenizer_config.json``. The returned tokenizer pads
    on the left and always has a pad token (eos when the directory defines none).
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

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


def tokenizer_dir(model_path: str | Path) -> Path:
    """Where the tokenizer of ``model.path`` lives: the shipped one for ``builtin:<model>``,
    else the model directory itself."""
    return BUILTIN_TOKENIZER_DIR if is_builtin(str(model_path)) else Path(model_path).expanduser()


def save_tokenizer(model_path: str | Path, out_dir: str | Path) -> Path:
    """Write the tokenizer of ``model_path`` into the model directory ``out_dir`` (which holds
    the model's ``config.json`` already), such that ``AutoTokenizer.from_pretrained(out_dir)``
    and ``load_tokenizer(out_dir)`` both tokenize and decode ``PROBE_MESSAGES`` exactly like
    ``load_tokenizer(model_path)``.

    The files are copied as they are. Where that is not enough (transformers 5 ignores a
    directory's ``tokenizer_class`` for some model types: beside a qwen2 ``config.json`` it
    builds Qwen2Tokenizer, whose byte-level pre-tokenizer drops the spaces and newlines of a
    plain character-level vocabulary like the shipped one), the BPE vocabulary is rewritten in
    byte-level form, token ids unchanged, so that every loader builds the same tokenizer.
    Raises ValueError naming the directory when no form loads alike.
    """
    from transformers import AutoTokenizer

    source, out = tokenizer_dir(model_path), Path(out_dir)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, out / name)
    reference = load_tokenizer(model_path)
    want = chat_token_ids(reference, PROBE_MESSAGES)
    if _loads_alike(out, want, reference.decode(want)):
        return out
    if _rewrite_byte_level(out) and _loads_alike(out, want, reference.decode(want)):
        return out
    raise ValueError(
        f"tokenizer of {model_path}: written into {out}, AutoTokenizer loads it as "
        f"{type(AutoTokenizer.from_pretrained(str(out), local_files_only=True)).__name__}, "
        "which tokenizes differently; give the model a tokenizer of its model type's class"
    )


def _loads_alike(directory: Path, want: list[int], text: str) -> bool:
    """Whether AutoTokenizer and ``load_tokenizer`` on ``directory`` both give ``want`` for
    ``PROBE_MESSAGES`` and decode it back to ``text``."""
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    for tok in (auto, load_tokenizer(directory)):
        ids = chat_token_ids(tok, PROBE_MESSAGES)
        if ids != want or tok.decode(ids) != text:
            return False
    return True


def _rewrite_byte_level(directory: Path) -> bool:
    """Rewrite a plain BPE ``tokenizer.json`` (no normalizer, no pre-tokenizer: tokens are raw
    text) in GPT-2 byte-level form: each token's UTF-8 bytes spelled with the byte-level
    alphabet (space -> ``Ġ``, newline -> ``Ċ``), same ids, byte-level pre-tokenizer and
    decoder. Then name, in ``tokenizer_config.json``, the class AutoTokenizer now builds, so
    ``load_tokenizer`` builds it too. Returns False (nothing written) for any other tokenizer."""
    from transformers import AutoTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    path = directory / "tokenizer.json"
    if not path.is_file():
        return False
    data = json.loads(path.read_text(encoding="utf-8"))
    model = data.get("model") or {}
    if model.get("type") != "BPE" or data.get("normalizer") or data.get("pre_tokenizer"):
        return False
    alphabet = bytes_to_unicode()
    special = {t["content"] for t in data.get("added_tokens", [])}

    def spell(token: str) -> str:
        return token if token in special else "".join(alphabet[b] for b in token.encode())

    model["vocab"] = {spell(tok): idx for tok, idx in model["vocab"].items()}
    model["merges"] = [
        " ".join(spell(part) for part in pair.split(" ", 1))
        if isinstance(pair, str)
        else [spell(part) for part in pair]
        for pair in model.get("merges", [])
    ]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False}
    data["pre_tokenizer"] = {**byte_level, "use_regex": False}
    data["decoder"] = {**byte_level, "use_regex": False}
    atomic_write_text(path, json.dumps(data, ensure_ascii=False, indent=2) + "\n")
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    config["tokenizer_class"] = type(
        AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    ).__name__
    atomic_write_text(config_path, json.dumps(config, ensure_ascii=False, indent=2) + "\n")
    return True


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
