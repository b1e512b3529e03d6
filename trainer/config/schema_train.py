"""The ``train`` section of the typed config (``trainer.config.schema`` nests it in
``Config``): batch sizes in prompts and tokens, parallelism, the optimizer, memory switches,
the update's kernels, and how rollouts meet training (lag, staleness)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from trainer.config.schema_base import SECTION as _SECTION

__all__ = ["TrainConfig", "TrainDtype"]

TrainDtype = Literal["float32", "bfloat16"]


class TrainConfig(BaseModel):
    """Batch sizes, parallelism and the optimizer."""

    model_config = _SECTION

    batch_size: int = Field(8, ge=1, description="prompts per training step")
    mini_batch_size: int = Field(
        4, ge=1, description="prompts per mini-batch (one optimizer step); divides batch_size"
    )
    dp_size: int = Field(1, ge=1, description="data-parallel ranks (devices) of the trainer")
    expert_parallel_size: int = Field(
        1,
        ge=1,
        description="ranks (of train.dp_size, which it divides) that split a mixture's "
        "experts by expert: tokens go to their experts' ranks and back by all-to-all; each "
        "expert is sharded over the remaining dp_size / expert_parallel_size ranks; 1 = off",
    )
    max_tokens_per_micro_batch: Annotated[int, Field(ge=2)] | Literal["auto"] | None = Field(
        None,
        description="tokens per micro-batch per rank (a longer row goes alone); "
        "null = one micro-batch per rank; auto = the largest that fits the device by the "
        "memory budget, chosen before start-up (trainer/loop/plan/auto_sizes.py)",
    )
    total_steps: int = Field(30, ge=1, description="training steps (rollout + update)")
    lr: float = Field(1e-6, gt=0, description="actor learning rate (peak)")
    warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear lr warm-up")
    lr_schedule: Literal["constant", "cosine"] = Field(
        "constant", description="lr after warm-up: constant, or cosine down to min_lr_ratio * lr"
    )
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="cosine: final lr as a fraction of lr")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    grad_clip: float | None = Field(
        1.0, gt=0, description="max global grad norm; null = no clipping"
    )
    ppo_epochs: int = Field(1, ge=1, description="passes over each step's batch")
    param_offload: bool = Field(
        False,
        description="keep sharded parameters, their gradients and the optimizer step in host "
        "memory, gathered onto the device per use (FSDP2's CPU-offload policy)",
    )
    optimizer_offload: bool = Field(
        False, description="keep optimizer state in host memory between optimizer steps"
    )
    param_dtype: TrainDtype = Field(
        "float32",
        description="compute dtype of forward/backward (FSDP2 mixed precision); parameters "
        "and optimizer state stay float32",
    )
    reduce_dtype: TrainDtype = Field(
        "float32", description="dtype in which gradients are reduced across ranks"
    )
    activation_checkpointing: bool | Literal["auto"] = Field(
        False,
        description="recompute each decoder layer's activations in backward instead of "
        "keeping them (less memory, about a third more compute); auto = on only where the "
        "memory budget fits no efficient micro-batch without it, chosen before start-up",
    )
    lean_logprobs: bool = Field(
        True,
        description="log-probs and entropy from the hidden states through the LM head a chunk "
        "of tokens at a time, recomputed in backward (no [tokens, vocab] logits kept); false = "
        "from the full logits (more memory, same values)",
    )
    old_logprobs_from_update: bool = Field(
        True,
        description="the step's first mini-batch trains on the weights that sampled it, so "
        "its old log-probs are its update's own forward (detached) instead of a separate "
        "pass (one forward less per step; off by itself with algorithm.rollout_correction "
        "or a KL reward penalty, which need them before the update)",
    )
    rollout_lag: int = Field(
        0,
        ge=0,
        description="training steps between the policy that samples a step and the one that "
        "trains on it: step t is sampled by the weights after step t - 1 - rollout_lag, so "
        "the engines generate ahead while the ranks train (needs rollout.engine_devices and "
        "algorithm.rollout_correction); 0 = synchronous",
    )
    max_staleness: int | None = Field(
        None,
        ge=1,
        description="streaming rollouts: the engines sample groups without step boundaries and "
        "a step trains on train.batch_size finished groups whose oldest token came from a "
        "policy at most this many steps behind, oldest first (older ones are dropped, and "
        "those still sampling are aborted: train.stale_prompts), so runs differ "
        "run to run and every batch is recorded for replay (needs "
        "algorithm.rollout_correction; colocated engines hold the stream while they sleep for "
        "the update); at most train.total_steps - 1 (no group can be older), and its groups "
        "in flight must fit half the rollout host's memory; null = off",
    )
    stale_prompts: Literal["drop", "retry", "keep"] = Field(
        "drop",
        description="streaming: a group that no step can train on within train.max_staleness "
        "any more (a token older than it allows); drop = aborted at once if still sampling "
        "(stream/groups_aborted), dropped if finished (stream/groups_dropped); retry = "
        "aborted, and its prompt sampled again under newer weights before any new one, at most "
        "train.max_prompt_retries times; keep "
        "= trained anyway, its tokens weighed by algorithm.rollout_correction (AReaL's: the "
        "bound limits what starts, not what finishes, so a batch may hold older tokens)",
    )
    max_prompt_retries: int = Field(
        2,
        ge=0,
        description="streaming with train.stale_prompts=retry: how many times one prompt is "
        "sampled again after its group was aborted as too stale (stream/groups_retried); "
        "aborted once more, it is dropped (stream/groups_given_up), so a prompt whose episodes "
        "outlast the bound never holds the engines for ever; 0 = never (as drop)",
    )
    share_prompts: bool = Field(
        True,
        description="rows of a micro-batch with the same prompt (a group's samples) run it "
        "through the model once, their responses attending to it (fewer tokens; the same "
        "values up to float rounding); false = every row carries its own copy",
    )
    kernels: Literal["auto", "reference"] = Field(
        "auto",
        description="the update's kernels (hal.kernels): auto = the device's fused set "
        "(RMSNorm, SwiGLU, RoPE, the LM head's log-prob + entropy and the AdamW step; the CPU "
        "has only the reference; `crossrl devices` shows what each op runs here), each "
        "falling back to the reference if it cannot load or run; reference = the eager "
        "reference everywhere (the CPU's golden)",
    )
    reference_kernels: list[Literal["rms_norm", "swiglu", "rope", "lm_head", "optimizer"]] = Field(
        default_factory=list,
        description="ops that run the eager reference even under train.kernels=auto",
    )
    compile_blocks: bool = Field(
        False,
        description="compile each decoder layer with torch.compile (inductor) before sharding "
        "(hal.kernels op compile); off until measured against the reference on a device; "
        "run.deterministic keeps it off",
    )
