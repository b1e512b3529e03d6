"""A model's shape for the memory budget: its sizes from a ``config.json`` (a builtin model's,
a local directory's) or, for a path that is not on this machine, the published Qwen2.5 shape
its name names. Pure: reads files only; no torch."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PUBLISHED_SHAPES", "ModelShape", "model_shape"]


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's sizes (Hugging Face ``config.json`` names) and where they
    came from (``source``, printed with the table)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    head_dim: int
    attention_bias: bool
    source: str

    @classmethod
    def from_config(cls, config: dict, source: str) -> ModelShape | None:
        """The shape in a ``config.json`` dict, or None when a size is missing or not a
        positive integer (an architecture this estimate does not know)."""
        keys = (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "vocab_size",
        )
        sizes = {k: config.get(k) for k in keys}
        if not all(isinstance(v, int) and v > 0 for v in sizes.values()):
            return None
        heads = sizes["num_attention_heads"]
        kv_heads = config.get("num_key_value_heads") or heads
        head_dim = config.get("head_dim") or sizes["hidden_size"] // heads
        bias = config.get("attention_bias", config.get("model_type") == "qwen2")
        return cls(
            **sizes,
            num_key_value_heads=int(kv_heads),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            head_dim=int(head_dim),
            attention_bias=bool(bias),
            source=source,
        )

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer: attention (q, k, v with their biases when the
        architecture has them, o), the gated MLP (gate, up, down) and two RMSNorms."""
        h, q = self.hidden_size, self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        bias = (q + 2 * kv) if self.attention_bias else 0
        return h * (q + 2 * kv) + bias + q * h + 3 * h * self.intermediate_size + 2 * h

    @property
    def embedding_params(self) -> int:
        """Parameters of the token embedding (and of an untied LM head), ``vocab x hidden``."""
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        """Parameters of the causal LM: layers, embedding, final norm, LM head unless tied."""
        head = 0 if self.tie_word_embeddings else self.embedding_params
        return (
            self.num_hidden_layers * self.layer_params
            + self.embedding_params
            + head
            + (self.hidden_size)
        )

    @property
    def value_model_params(self) -> int:
        """Parameters of the critic built from this shape: the LM head (untied) is replaced by
        a one-output value head with a bias (``trainer.loop.workers.critic``)."""
        head = 0 if self.tie_word_embeddings else self.embedding_params
        return self.num_params - head + self.hidden_size + 1

    @property
    def largest_tensor_params(self) -> int:
        """Elements of the largest single weight (the embedding at every Qwen2.5 size)."""
        h = self.hidden_size
        return max(self.embedding_params, h * self.intermediate_size, h * h)


#: Published shapes of the Qwen2.5 sizes the shipped configs train, for a ``model.path`` that
#: is not on this machine (a cluster's /models/... read on a laptop); matched by name.
PUBLISHED_SHAPES: dict[str, dict] = {
    "Qwen2.5-0.5B": {
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "intermediate_size": 4864,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "model_type": "qwen2",
    },
    "Qwen2.5-1.5B": {
        "hidden_size": 1536,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "intermediate_size": 8960,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "model_type": "qwen2",
    },
    "Qwen2.5-7B": {
        "hidden_size": 3584,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "intermediate_size": 18944,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
        "model_type": "qwen2",
    },
}
_PUBLISHED_NAME = re.compile(r"qwen2\.5-(0\.5|1\.5|7)b(?![0-9.])")


def model_shape(path: str) -> ModelShape | None:
    """The shape of the model at ``path`` (``model.path``'s forms): a ``builtin:`` model's
    shipped config.json, else ``<path>/config.json`` when it is here, else the published
    Qwen2.5 shape its directory name names (``PUBLISHED_SHAPES``); None when none applies."""
    if path.startswith("builtin:"):
        from rollout.assets import BUILTIN_MODELS_DIR

        name = path.removeprefix("builtin:")
        file = BUILTIN_MODELS_DIR / name / "config.json"
        return _read_shape(file, f"{path}'s config.json")
    file = Path(path).expanduser() / "config.json"
    if file.is_file():
        return _read_shape(file, str(file))
    match = _PUBLISHED_NAME.search(Path(path).name.lower())
    if match is None:
        return None
    name = f"Qwen2.5-{match.group(1).upper()}B"
    return ModelShape.from_config(
        PUBLISHED_SHAPES[name],
        f"crossrl's table of published shapes, by the name {name}\n    (no {file} on this machine)",
    )


def _read_shape(file: Path, source: str) -> ModelShape | None:
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return ModelShape.from_config(config, source) if isinstance(config, dict) else None
