"""A model's shape for the memory budget: its sizes from a ``config.json`` (a builtin model's,
a local directory's) or, for a path that is not on this machine, the published Qwen2.5 shape
its name names. A mixture of experts counts its experts, routers and shared experts
(``trainer.loop.plan.moe_layout``; a model type whose experts it cannot count raises
``ModelShapeError``). Pure: reads files only; no torch."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from trainer.loop.plan.moe_layout import Experts, ModelShapeError, experts_of

__all__ = ["PUBLISHED_SHAPES", "ModelShape", "ModelShapeError", "model_shape"]


def _attention_extras(config: dict, q: int, kv: int, head_dim: int) -> dict:
    """What a model type's attention holds beyond q, k, v and o's weights: the biases of q, k
    and v (``attention_bias``), of o (``o_bias``), and the RMSNorms of queries and keys
    (``qk_norm``: their sizes), as transformers builds them."""
    model_type = config.get("model_type")
    bias = bool(config.get("attention_bias", False))
    if model_type in ("qwen2", "qwen2_moe"):
        qkv = config.get("qkv_bias", True) if model_type == "qwen2_moe" else True
        return {"attention_bias": bool(config.get("attention_bias", qkv)), "o_bias": False}
    if model_type in ("qwen3", "qwen3_moe"):  # every projection's bias; norms per head
        return {"attention_bias": bias, "o_bias": bias, "qk_norm": (head_dim, head_dim)}
    if model_type == "olmoe":  # norms over all heads
        return {"attention_bias": bias, "o_bias": bias, "qk_norm": (q, kv)}
    if model_type == "glm4_moe":
        norm = (head_dim, head_dim) if config.get("use_qk_norm") else (0, 0)
        return {"attention_bias": bias, "o_bias": False, "qk_norm": norm}
    return {"attention_bias": bias, "o_bias": False}


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's sizes (Hugging Face ``config.json`` names) and where they
    came from (``source``, printed with the table). ``experts``: a mixture of experts'
    (``trainer.loop.plan.moe_layout``), None for a dense model; ``config``: its ``config.json``
    (what ``crossrl layout --measure`` builds)."""

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
    o_bias: bool = False
    qk_norm: tuple[int, int] = (0, 0)  # elements of the query and key RMSNorms of a layer
    experts: Experts | None = None
    config: dict | None = field(default=None, compare=False, repr=False)

    @classmethod
    def from_config(cls, config: dict, source: str) -> ModelShape | None:
        """The shape in a ``config.json`` dict, or None when a size is missing or not a
        positive integer (an architecture this estimate does not know). Raises
        ``ModelShapeError`` for a mixture of experts the budget cannot count."""
        keys = (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "vocab_size",
        )
        sizes = {k: config.get(k) for k in keys}
        if not all(isinstance(v, int) and v > 0 for v in sizes.values()):
            experts_of(config, source)  # a nested model with experts is refused, not skipped
            return None
        heads = sizes["num_attention_heads"]
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or sizes["hidden_size"] // heads)
        experts = experts_of(config, source)
        return cls(
            **sizes,
            num_key_value_heads=kv_heads,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            head_dim=head_dim,
            source=source,
            **_attention_extras(config, heads * head_dim, kv_heads * head_dim, head_dim),
            experts=experts,
            config=dict(config) if experts is not None else None,
        )

    @property
    def sparse_layers(self) -> int:
        """Decoder layers holding experts (0 for a dense model)."""
        return self.experts.sparse_layers if self.experts is not None else 0

    def _attention_tensors(self) -> list[tuple[int, int]]:
        """``(rows, elements per row)`` of a layer's attention and its two RMSNorms."""
        h, q = self.hidden_size, self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        out = [(q, h), (kv, h), (kv, h), (h, q), (h, 1), (h, 1)]
        if self.attention_bias:
            out += [(q, 1), (kv, 1), (kv, 1)]
        if self.o_bias:
            out.append((h, 1))
        out += [(n, 1) for n in self.qk_norm if n]
        return out

    def layer_tensors(self, sparse: bool = False) -> list[tuple[int, int]]:
        """``(rows, elements per row)`` of every state-dict entry of a dense decoder layer
        (attention, the gated MLP's gate, up and down, two RMSNorms) or, ``sparse``, of a
        layer with experts: the experts' gate-up ``[E, 2 m, h]`` and down ``[E, h, m]`` (one
        tensor each, as transformers 5 holds them), the router ``[E, h]``, the shared
        experts and their gate. FSDP2 shards each entry's rows (dim 0)."""
        h = self.hidden_size
        if not sparse:
            i = self.intermediate_size
            return self._attention_tensors() + [(i, h), (i, h), (h, i)]
        e = self.experts
        m, s = e.intermediate_size, e.shared_intermediate_size
        mlp = [(e.count, 2 * m * h), (e.count, h * m), (e.count, h)]
        if s:
            mlp += [(s, h), (s, h), (h, s)]
        if e.shared_gate:
            mlp.append((1, h))
        return self._attention_tensors() + mlp

    def tensors(self) -> list[tuple[int, int]]:
        """``(rows, elements per row)`` of every state-dict entry of the causal LM: each
        decoder layer's (``layer_tensors``), the embedding, the final norm and the LM head (an
        entry of its own even when tied)."""
        dense = self.num_hidden_layers - self.sparse_layers
        vocab = (self.vocab_size, self.hidden_size)
        layers = self.layer_tensors() * dense
        if self.sparse_layers:
            layers += self.layer_tensors(sparse=True) * self.sparse_layers
        return layers + [vocab, (self.hidden_size, 1), vocab]

    def _params(self, sparse: bool, ranks: int = 1, ep: int = 1) -> int:
        tensors = self.layer_tensors(sparse)
        own = 0
        if sparse and ep > 1:  # the experts' gate-up and down: each ep rank gathers its own
            (experts, gate_up), (_, down), *rest = tensors[len(self._attention_tensors()) :]
            tensors = [*self._attention_tensors(), *rest]
            own = experts // ep * (gate_up + down)  # FSDP2 shards them by dim 1: no row padding
        return own + sum(_padded(rows, ranks) * per_row for rows, per_row in tensors)

    @property
    def layer_params(self) -> int:
        """Parameters of the largest decoder layer: attention (q, k, v with their biases and
        norms when the architecture has them, o), the gated MLP (gate, up, down) or the
        experts, router and shared experts, and two RMSNorms."""
        return self.padded_layer_params(1)

    def padded_layer_params(self, ranks: int, ep: int = 1) -> int:
        """``layer_params`` as FSDP2 gathers them from ``ranks`` ranks: every tensor's rows
        padded to a multiple of ``ranks`` (``padded_params``); with the experts split over
        ``ep`` ranks (``train.expert_parallel_size``) a sparse layer gathers its share."""
        dense = self._params(False, ranks) if self.sparse_layers < self.num_hidden_layers else 0
        return max(dense, self._params(True, ranks, ep) if self.sparse_layers else 0)

    def padded_params(self, ranks: int) -> int:
        """``num_params`` as FSDP2 shards them over ``ranks`` ranks: it pads each tensor's rows
        (dim 0) to a multiple of ``ranks``, so 60 experts over 8 ranks take 64 experts' memory;
        equal to ``num_params`` when every row count divides (every Qwen2.5 shape at 8 or 16)."""
        total = sum(_padded(rows, ranks) * per_row for rows, per_row in self.tensors())
        head = _padded(self.vocab_size, ranks) * self.hidden_size
        return total - (head if self.tie_word_embeddings else 0)

    @property
    def embedding_params(self) -> int:
        """Parameters of the token embedding (and of an untied LM head), ``vocab x hidden``."""
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        """Parameters of the causal LM: layers, embedding, final norm, LM head unless tied
        (a mixture of experts: every expert of every layer)."""
        total = sum(rows * per_row for rows, per_row in self.tensors())
        return total - (self.embedding_params if self.tie_word_embeddings else 0)

    @property
    def value_model_params(self) -> int:
        """Parameters of the critic built from this shape: the LM head (untied) is replaced by
        a one-output value head with a bias (``trainer.loop.ranks.critic``)."""
        head = 0 if self.tie_word_embeddings else self.embedding_params
        return self.num_params - head + self.hidden_size + 1

    @property
    def largest_tensor_params(self) -> int:
        """Elements of the largest single weight (the embedding at every Qwen2.5 size; the
        experts' gate-up tensor of a mixture of experts, where larger)."""
        return max(rows * per_row for rows, per_row in self.tensors())


def _padded(rows: int, ranks: int) -> int:
    """``rows`` rounded up to a multiple of ``ranks`` (FSDP2's ``torch.chunk`` sharding of dim
    0: ``ceil(rows / ranks)`` rows on every rank, the padding included)."""
    return -(-rows // ranks) * ranks


#: Published shapes of the models the shipped configs train, for a ``model.path`` that
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
    "Qwen3-235B-A22B": {  # its config.json on the Hub (2025-07 revision)
        "hidden_size": 4096,
        "num_hidden_layers": 94,
        "num_attention_heads": 64,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "intermediate_size": 12288,
        "moe_intermediate_size": 1536,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": 151936,
        "tie_word_embeddings": False,
        "model_type": "qwen3_moe",
    },
    "Qwen3-30B-A3B": {  # its config.json on the Hub (2025-07 revision)
        "hidden_size": 2048,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": 151936,
        "tie_word_embeddings": False,
        "model_type": "qwen3_moe",
    },
}
_PUBLISHED_NAME = re.compile(r"(qwen2\.5-(0\.5|1\.5|7)b|qwen3-(30b-a3b|235b-a22b))(?![0-9.])")


def model_shape(path: str) -> ModelShape | None:
    """The shape of the model at ``path`` (``model.path``'s forms): a ``builtin:`` model's
    shipped config.json, else ``<path>/config.json`` when it is here, else the published
    Qwen2.5 or Qwen3-30B-A3B shape its directory name names (``PUBLISHED_SHAPES``); None when
    none applies."""
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
    if match.group(2) is None:
        name = f"Qwen3-{match.group(3).upper()}"
    else:
        name = f"Qwen2.5-{match.group(2).upper()}B"
    return ModelShape.from_config(
        PUBLISHED_SHAPES[name],
        f"crossrl's table of published shapes ({name})\n    (no {file} on this machine)",
    )


def _read_shape(file: Path, source: str) -> ModelShape | None:
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return ModelShape.from_config(config, source) if isinstance(config, dict) else None
