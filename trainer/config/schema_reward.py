"""The ``reward`` and ``critic`` sections of the typed config (``trainer.config.schema``
re-exports them)."""

from __future__ import annotations

from pydantic import BaseModel, Field, field_validator

from trainer.config.schema_base import FUNCTION_SPEC as _FUNCTION_SPEC
from trainer.config.schema_base import SECTION as _SECTION

__all__ = ["CriticConfig", "RewardConfig"]


class RewardConfig(BaseModel):
    """Reward functions and reward shaping."""

    model_config = _SECTION

    function: str | None = Field(
        None,
        description="module:function with verl's signature f(data_source, solution_str, "
        "ground_truth, extra_info) -> float or dict with score (other keys become reward/extra/* "
        "metrics), or builtin:gsm8k / builtin:math; the env scores its final turn with it",
    )
    timeout_s: float = Field(
        10.0, gt=0, description="seconds one reward call may take; longer counts as a fault"
    )
    overlong_buffer_len: int = Field(
        0,
        ge=0,
        description="tokens: DAPO overlong shaping; a turn longer than rollout.max_new_tokens - "
        "1 - this loses up to overlong_penalty_factor, linearly; 0 = off",
    )
    overlong_penalty_factor: float = Field(
        1.0, ge=0, description="DAPO overlong shaping: the penalty at the length cap"
    )

    @field_validator("function")
    @classmethod
    def _function_spec(cls, value: str | None) -> str | None:
        if value is not None and not _FUNCTION_SPEC.match(value):
            raise ValueError("must be null, builtin:gsm8k, builtin:math or module.path:function")
        return value


class CriticConfig(BaseModel):
    """The value model (used by gae)."""

    model_config = _SECTION

    enable: bool = Field(False, description="train a critic (required by gae, only gae uses it)")
    lr: float = Field(1e-5, gt=0, description="critic learning rate (peak)")
    warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear lr warm-up")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    grad_clip: float | None = Field(
        1.0, gt=0, description="max global grad norm; null = no clipping"
    )
