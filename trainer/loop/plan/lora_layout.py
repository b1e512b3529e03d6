"""What LoRA (``model.lora``) changes in a job's layout, before anything starts: how the
actor's weights reach the engines (``lora_push``), how many parameters train
(``adapter_params``), the lines ``crossrl layout`` prints (``format_lora``), and what a
checkpoint records of the adapters (``lora_record``). Pure: reads the model's shape only, and
``lora_record`` the digest of the base model's files."""

from __future__ import annotations

from typing import Any

from trainer.config.schema import Config
from trainer.loop.plan.model_shape import ModelShape

__all__ = [
    "adapter_params",
    "base_copy_params",
    "format_lora",
    "lora_push",
    "lora_record",
    "pushes_whole_weights",
]


def lora_push(cfg: Config) -> str:
    """How a LoRA actor's weights reach the engines: ``adapters``, what trains alone, loaded in
    place, whatever the engine: the HF engine holds the same adapters on its base; vLLM and
    vllm-ascend serve them as a LoRA adapter and take what trains whole beside them (the
    embedding and LM head with ``model.lora.train_embeddings``) into their base with the
    model's own loader (``rollout.engines.vllm.lora``). Never whole weights with the adapters
    folded in: ``W + (alpha / r) B A`` rounded to a bf16 engine's dtype keeps only part of a
    small update, which ``W x + (alpha / r) B (A x)`` keeps."""
    return "adapters"


def pushes_whole_weights(cfg: Config) -> bool:
    """Whether every weight push overwrites all the engines' weights (so colocated engines may
    discard theirs while they sleep, vLLM's level 2): not when a LoRA run pushes adapters."""
    return not (cfg.model.lora.enabled and lora_push(cfg) == "adapters")


def _linear_sizes(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """``(in, out)`` features of each linear layer of a decoder block, by module name."""
    h, i = shape.hidden_size, shape.intermediate_size
    q, kv = shape.num_attention_heads * shape.head_dim, shape.num_key_value_heads * shape.head_dim
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def adapter_params(cfg: Config, shape: ModelShape) -> int:
    """Parameters that train in a LoRA actor of ``shape``: ``r x (in + out)`` per target
    module of every layer (a target the estimate does not know counts as the largest linear
    layer), plus the embedding and the LM head with ``model.lora.train_embeddings``."""
    lora = cfg.model.lora
    sizes = _linear_sizes(shape)
    largest = max(sum(pair) for pair in sizes.values())
    per_layer = 0
    for target in lora.target_modules:
        leaf = target.rsplit(".", 1)[-1]
        per_layer += lora.rank * (sum(sizes[leaf]) if leaf in sizes else largest)
    total = per_layer * shape.num_hidden_layers
    if lora.train_embeddings:
        total += _embedding_params(shape)
    return total


def _embedding_params(shape: ModelShape) -> int:
    """Parameters of the input embedding and the LM head (one tensor when tied)."""
    embed = shape.vocab_size * shape.hidden_size
    return embed if shape.tie_word_embeddings else 2 * embed


def base_copy_params(cfg: Config, shape: ModelShape) -> int:
    """Parameters of the frozen copy of the base embedding and LM head a LoRA actor keeps for
    its reference (``rollout.lora.base_copies``, fp32 and sharded like the actor's): with
    ``model.lora.train_embeddings`` and a KL term (``algorithm.kl_coef`` > 0), else 0."""
    lora = cfg.model.lora
    if not (lora.enabled and lora.train_embeddings and cfg.algorithm.kl_coef > 0):
        return 0
    return _embedding_params(shape)


def format_lora(cfg: Config, shape: ModelShape | None, total_params: int | None) -> str:
    """The lines ``crossrl layout`` prints for a LoRA job: what trains, the reference, and
    what each weight push carries."""
    lora = cfg.model.lora
    head = (
        f"lora: rank {lora.rank}, alpha {lora.alpha:g} (model.lora) on "
        f"{', '.join(lora.target_modules)}"
        + (", embeddings and LM head trained in full" if lora.train_embeddings else "")
    )
    lines = [head]
    if shape is not None and total_params:
        trained = adapter_params(cfg, shape)
        lines.append(
            f"  trains {trained:,} of {total_params + trained:,} parameters "
            f"({trained / (total_params + trained):.2%}); gradients and optimizer state for "
            "them alone"
        )
    if cfg.algorithm.kl_coef > 0 and lora.train_embeddings:
        copy = f" ({base_copy_params(cfg, shape):,} parameters)" if shape is not None else ""
        lines.append(
            "  reference: the actor with its adapters off and a frozen copy of the base "
            f"embedding and LM head{copy} swapped in (no reference worker)"
        )
    elif cfg.algorithm.kl_coef > 0:
        lines.append(
            "  reference: the actor with its adapters off (no reference worker, no second copy "
            "of the weights)"
        )
    where = (
        "the HF engine holds the same adapters on its base"
        if cfg.rollout.engine == "hf"
        else "vLLM serves them as a LoRA adapter"
    )
    if lora.train_embeddings:
        what = "the adapters, and the embedding and LM head whole"
        where += "; the embedding and LM head go into its base by name"
    else:
        what = "the adapters only"
    lines.append(f"  weight push: {what}, loaded in place ({where})")
    return "\n".join(lines)


def lora_record(cfg: Config) -> dict[str, Any]:
    """A LoRA run's adapters as its checkpoints record them: rank, alpha, targets, whether
    the embeddings train, and the digest of the base model (``rollout.lora.base_digest``)."""
    from rollout.lora import base_digest

    lora = cfg.model.lora
    return {
        "rank": lora.rank,
        "alpha": lora.alpha,
        "target_modules": list(lora.target_modules),
        "train_embeddings": lora.train_embeddings,
        "base_digest": base_digest(cfg.model.path, cfg.seed),
    }
