"""The ``model.lora`` section of the typed config (``trainer.config.schema`` nests it in
``model``): LoRA adapters trained on a frozen base (``trainer.loop.ranks.policy.inject_lora``)."""

from __future__ import annotations

import re

from pydantic import BaseModel, Field, field_validator

from trainer.config.schema_base import SECTION as _SECTION

__all__ = ["LORA_TARGETS", "LoraConfig"]

#: The linear layers of a Llama / Qwen2-style decoder block: attention and MLP.
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LoraConfig(BaseModel):
    """LoRA RL: adapters of rank ``rank`` on the ``target_modules`` of a frozen base."""

    model_config = _SECTION

    rank: int = Field(
        0,
        ge=0,
        le=512,
        description="LoRA rank r (an integer, at most 512: vLLM's largest): every target "
        "module gets adapters A (r x in) and B (out x r) beside its frozen weight, and only "
        "they train (with their optimizer state); the reference is the base with the adapters "
        "off; 0 = full fine-tuning",
    )
    alpha: float = Field(
        32.0,
        gt=0,
        description="LoRA scale numerator: the adapters add (alpha / rank) x B A x to a target "
        "module's output",
    )
    dropout: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="dropout on the adapters' input in training forwards (0 keeps the update's "
        "first forward equal to the old log-probs' pass)",
    )
    target_modules: list[str] = Field(
        default_factory=lambda: list(LORA_TARGETS),
        description="names of the modules that get adapters: a module whose name ends with "
        "one of them (q_proj matches model.layers.0.self_attn.q_proj); linear layers only",
    )
    train_embeddings: bool = Field(
        False,
        description="also train the input embedding and the LM head in full (they are then "
        "pushed to the engines and saved whole, beside the adapters)",
    )

    @field_validator("target_modules")
    @classmethod
    def _names(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError(f"name at least one module, e.g. {LORA_TARGETS}")
        for name in value:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.]*", name):
                raise ValueError(
                    f"{name!r} is not a module name; give names such as q_proj or mlp.down_proj"
                )
            if name.rsplit(".", 1)[-1] in ("lm_head", "embed_tokens"):
                raise ValueError(
                    f"{name!r}: the LM head and the embedding take no adapters here (the "
                    "trainer's log-probs read the head's weight); train them in full with "
                    "model.lora.train_embeddings=true"
                )
        return value

    @property
    def enabled(self) -> bool:
        """Whether the run trains adapters (``rank`` > 0) rather than the whole model."""
        return self.rank > 0

    @property
    def scale(self) -> float:
        """What the adapters' product is multiplied by: ``alpha / rank``."""
        return self.alpha / self.rank
