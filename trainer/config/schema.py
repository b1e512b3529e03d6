"""The typed job config: one pydantic model per section, every field with its unit.

Only the *shape* of each value is checked here (type, range, allowed words). Checks that
relate two fields, or look at the machine (devices, files, packages), live in
``trainer/config/checks.py`` so that they can name the key that has to change. The ``run``
and ``ray`` sections are in ``trainer/config/schema_run.py``, ``train`` in
``trainer/config/schema_train.py``.

Key names are a contract (see DESIGN.md "Config"): rename nothing without updating the
configs, the docs and every reader.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from hal import BACKEND_NAMES
from rollout.assets import BUILTIN_MODELS
from trainer.config.schema_base import SECTION as _SECTION
from trainer.config.schema_base import first_nonfinite as _first_nonfinite
from trainer.config.schema_lora import LoraConfig
from trainer.config.schema_reward import CriticConfig, RewardConfig
from trainer.config.schema_run import RayConfig, RunConfig
from trainer.config.schema_train import TrainConfig

# Exactly the names hal.get_backend accepts: one name per device, owned by the HAL.
DeviceName = Literal[BACKEND_NAMES]
#: ``rollout.env_concurrency=auto``'s ceiling: environment calls (threads for synchronous
#: environments) at once.
ENV_SLOTS_AUTO_MAX = 1024
ModelDtype = Literal["float32", "bfloat16", "float16"]

_ENV_SPEC = re.compile(r"^(?:[A-Za-z_][\w-]*|[A-Za-z_][\w.]*:[A-Za-z_]\w*)$")


class ModelConfig(BaseModel):
    """What to train."""

    model_config = _SECTION

    path: str = Field(
        "builtin:tiny",
        description="policy weights: builtin:tiny, builtin:small or a local HF model directory "
        "(config.json + safetensors); nothing is downloaded",
    )
    dtype: ModelDtype = Field(
        "float32",
        description="dtype of the rollout engine's weights and of `crossrl export`'s weights "
        "(checkpoints keep the float32 master weights)",
    )
    critic_path: str | None = Field(
        None, description="critic initial weights (same forms as path); null = model.path"
    )
    lora: LoraConfig = Field(
        default_factory=LoraConfig,
        description="LoRA adapters on the frozen policy (rank 0 = full fine-tuning)",
    )

    @field_validator("path", "critic_path")
    @classmethod
    def _known_builtin(cls, value: str | None) -> str | None:
        if value is not None and value.startswith("builtin:"):
            name = value.removeprefix("builtin:")
            if name not in BUILTIN_MODELS:
                allowed = ", ".join(f"builtin:{n}" for n in BUILTIN_MODELS)
                raise ValueError(f"unknown built-in model; allowed: {allowed} or a directory")
        if value is not None and not value.strip():
            raise ValueError("must not be empty")
        return value


class DataConfig(BaseModel):
    """Where prompts come from."""

    model_config = _SECTION

    source: str = Field(
        "env",
        description="env (prompts from the environment's own generator) or a path to a "
        ".jsonl / .parquet file of prompts",
    )

    val_source: str | None = Field(
        None,
        description="a .jsonl / .parquet file of validation prompts (every record once per "
        "validation, in file order); null = no validation",
    )

    @field_validator("source")
    @classmethod
    def _env_or_file(cls, value: str) -> str:
        if value != "env" and not value.endswith((".jsonl", ".parquet")):
            raise ValueError("must be 'env' or a path ending in .jsonl or .parquet")
        return value

    @field_validator("val_source")
    @classmethod
    def _val_file(cls, value: str | None) -> str | None:
        if value is not None and not value.endswith((".jsonl", ".parquet")):
            raise ValueError("must be null or a path ending in .jsonl or .parquet")
        return value


class RolloutConfig(BaseModel):
    """How trajectories are sampled."""

    model_config = _SECTION

    engine: Literal["hf", "vllm"] = Field(
        "hf", description="generation engine: hf (transformers, runs anywhere) or vllm"
    )
    expert_parallel: bool = Field(
        False,
        description="a mixture's vllm engine replica splits its experts over its "
        "rollout.tensor_parallel_size ranks (vLLM's enable_expert_parallel, with the "
        "release's default all-to-all; vllm-ascend picks its own) instead of sharding each "
        "expert across them",
    )
    engine_loop: Literal["async", "steps"] = Field(
        "steps",
        description="how the vllm engine runs (the hf engine always runs crossrl's own step "
        "loop): steps = vLLM's LLMEngine stepped by crossrl's engine server in the replica's "
        "own process; async = vLLM's AsyncLLM, its engine core a loop of its own in a "
        "process of its own (each request taken as it comes, aborted by id, paused for "
        "weight loads), whose import-time warnings reach the console at any "
        "rollout.engine_log_level (docs/vllm.md)",
    )
    env: str = Field(
        "recall", description="environment: a built-in name, or module:Class for your own"
    )
    env_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="keyword arguments for the environment (a prompt file's fields override them)",
    )
    n: int = Field(4, ge=1, description="samples (trajectories) per prompt")
    max_turns: int = Field(3, ge=1, description="model turns per trajectory, at most")
    step_wise: bool = Field(True, description="one training row per turn (else one per trajectory)")
    merge_stepwise: bool = Field(
        False,
        description="merge consecutive step rows of a trajectory into one row when a turn's "
        "prompt+response is a token prefix of the next turn's prompt (needs step_wise)",
    )
    max_input_len: int = Field(
        512, ge=1, description="tokens: longest prompt a turn may send; longer ends the trajectory"
    )
    max_new_tokens: int = Field(
        16,
        ge=2,
        description="tokens per turn's response, at most (the response horizon); one of them "
        "is kept for the end-of-turn token, so at least 2",
    )
    temperature: float = Field(1.0, gt=0, description="sampling temperature (> 0)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling mass; 1.0 = off")
    top_k: int = Field(0, ge=0, description="sample among the k likeliest tokens; 0 = off")
    stop_strings: list[str] = Field(
        default_factory=list,
        description="texts that end a turn (kept in the response; an untrained EOS closes it)",
    )
    memory_fraction: float = Field(
        0.5, gt=0, lt=1, description="fraction of each accelerator's memory the engine may take"
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="devices per engine replica (vllm only; must divide train.dp_size, or "
        "rollout.engine_devices when the engines have devices of their own)",
    )
    engine_devices: int = Field(
        0,
        ge=0,
        description="devices of their own for the engine replicas (rollout.engine_devices / "
        "rollout.tensor_parallel_size replicas, placed on the last nodes); 0 = colocated on "
        "the training ranks' devices, sleeping while they train; train.rollout_lag > 0 needs it",
    )
    device: DeviceName | None = Field(
        None,
        description="device backend of the engine replicas when they have devices of their "
        "own (rollout.engine_devices), e.g. generation on a pool of one accelerator type while "
        "the ranks train on another (the weights go through host memory); null = the "
        "trainer's device",
    )
    weight_transport: Literal["auto", "host", "collective"] = Field(
        "auto",
        description="how new weights reach engines of their own (rollout.engine_devices): "
        "collective = through the engines' weight-transfer API, training rank 0 broadcasting "
        "to every engine worker (vLLM's update_weights); host = a snapshot in Ray's object "
        "store (the only way across device types, rollout.device, and for LoRA adapters); "
        "auto = collective unless rollout.device differs or model.lora is on",
    )
    engine_log_level: Literal["debug", "info", "warning", "error"] = Field(
        "error",
        description="how much of the vllm engine's own logging reaches the console: error = "
        "its errors only; warning adds its warnings; info its start-up report; debug "
        "everything (rollout.engines.vllm.logs)",
    )
    max_sample_batches: int = Field(
        1,
        ge=1,
        description="DAPO dynamic sampling when > 1: groups whose scores are all equal are "
        "dropped and another train.batch_size prompts sampled, up to this many batches per "
        "step; still short, the step is topped up with dropped groups; 1 = off",
    )
    env_timeout_s: float | None = Field(
        120.0,
        gt=0,
        description="seconds each environment reset/step call may take; past it the "
        "trajectory ends as an environment fault (rollout/env_errors); null = no limit",
    )
    env_concurrency: int | Literal["auto"] = Field(
        "auto",
        description="environment calls (reset/step) running at once, at most; synchronous "
        "environments run on this many threads; auto = every episode the run may have in "
        "flight (train.batch_size x rollout.n, times train.max_staleness + 1 when streamed), "
        f"at most {ENV_SLOTS_AUTO_MAX}: a tool that waits on I/O never queues behind others",
    )

    agent_workers: int = Field(
        0,
        ge=0,
        description="processes that run the agent loops (environment calls, reward calls, "
        "chat templates), beside the rollout host, which keeps driving the engines; each "
        "turn comes back to the host's engines, so rows equal those of one process under "
        "run.deterministic; rollout.env_concurrency is shared out among them; 0 = the agent "
        "loops run in the rollout host's own process",
    )

    @field_validator("env_concurrency")
    @classmethod
    def _env_slots(cls, value: int | str) -> int | str:
        if value != "auto" and value < 1:
            raise ValueError("must be >= 1 environment call, or auto")
        return value

    max_replica_failures: int = Field(
        3,
        ge=0,
        description="engine replicas lost (process died) in one run that are replaced, their "
        "unfinished requests dealt to the others; one more stops the run; 0 = the first does",
    )
    val_n: int = Field(1, ge=1, description="validation samples per prompt (k of val/pass@k)")
    val_temperature: float = Field(
        0.0, ge=0, description="validation sampling temperature; 0 = greedy"
    )

    partial_rollout: bool = Field(
        False,
        description="streaming (train.max_staleness): a trajectory still generating when new "
        "weights arrive goes on under them after the engine's current decode step, from its "
        "prefix (KV recomputed; each token keeps the version that sampled it); false = the "
        "weights wait until no group is in flight",
    )

    @field_validator("env_kwargs")
    @classmethod
    def _finite_kwargs(cls, value: dict[str, Any]) -> dict[str, Any]:
        bad = _first_nonfinite(value)
        if bad is not None:
            raise ValueError(f"{bad[0]} is {bad[1]!r}; every number must be finite")
        return value

    @field_validator("env")
    @classmethod
    def _env_spec(cls, value: str) -> str:
        if not _ENV_SPEC.match(value):
            raise ValueError(
                "must be a built-in environment name (e.g. recall) or module.path:ClassName"
            )
        return value


class AlgorithmConfig(BaseModel):
    """Advantages and the policy loss."""

    model_config = _SECTION

    adv_estimator: Literal["grpo", "rloo", "gae", "reinforce_pp", "reinforce_pp_baseline"] = Field(
        "grpo",
        description="advantage estimator (gae needs critic.enable); reinforce_pp_baseline "
        "is REINFORCE++ with the group mean as baseline",
    )
    policy_loss: Literal["ppo", "gspo"] = Field(
        "ppo",
        description="ppo: token-level clipped ratio (with dual clip); gspo: one ratio per "
        "sequence (geometric mean of its token ratios), clipped at the sequence level",
    )
    loss_agg: Literal[
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = Field("token-mean", description="how per-token losses are averaged over a mini-batch")
    loss_agg_horizon: int | None = Field(
        None,
        ge=1,
        description="tokens: the constant divisor of seq-mean-token-sum-norm; null = "
        "rollout.max_new_tokens (must be set when a row can hold several turns)",
    )
    norm_adv_by_std: bool = Field(
        True, description="grpo: divide by the group's reward std (false = Dr. GRPO)"
    )
    gamma: float = Field(1.0, ge=0, le=1, description="discount per token (gae, reinforce_pp)")
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda (gae)")
    clip_ratio_low: float = Field(
        0.2, gt=0, lt=1, description="PPO clip: ratio floor is 1 - clip_ratio_low"
    )
    clip_ratio_high: float = Field(
        0.2, gt=0, description="PPO clip: ratio ceiling is 1 + clip_ratio_high"
    )
    clip_ratio_c: float = Field(
        3.0, gt=1, description="dual-clip bound on the ratio for negative advantages (> 1)"
    )
    kl_coef: float = Field(
        0.0,
        ge=0,
        description="weight of KL(policy || reference); 0 = none. As a reward penalty "
        "(use_kl_loss false) with grpo / rloo / reinforce_pp_baseline, each trajectory's "
        "summed token penalty is added to its score before the group statistics (as verl "
        "does), so the penalty moves the advantages instead of being silently ignored and a "
        "verl config that relies on it trains the same here",
    )
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k3", description="per-token KL estimator (k3 = low-variance)"
    )
    use_kl_loss: bool = Field(
        False, description="KL as a loss term (true) or as a per-token reward penalty (false)"
    )
    entropy_coef: float = Field(0.0, ge=0, description="weight of the entropy bonus; 0 = none")
    cliprange_value: float = Field(
        0.2, gt=0, description="critic value clipping around the old values (gae)"
    )
    rollout_correction: Literal["none", "token", "sequence", "geometric"] = Field(
        "none",
        description="truncated importance weights min(pi_old / pi_rollout, cap) on the policy "
        "loss, for the engine / trainer log-prob mismatch: per token; one per sequence, the "
        "product of its tokens' ratios (their geometric mean where a streamed sequence mixes "
        "policy versions); or geometric: one per sequence, the geometric mean of its tokens' "
        "ratios",
    )
    rollout_correction_cap: float = Field(
        2.0, ge=1, description="upper bound of the rollout-correction weights (>= 1)"
    )
    router_aux_loss_coef: float = Field(
        0.0,
        ge=0,
        description="weight of a mixture's load-balancing loss (Switch's, averaged over MoE "
        "layers); 0 = off, as RL recipes run. Its expert loads are those of the global batch "
        "(every data-parallel rank's real tokens of a micro-batch step: one all-reduce), "
        "padding rows out; logged as actor/router_aux_loss",
    )
    routing_replay: Literal["none", "measure", "rollout"] = Field(
        "none",
        description="mixture-of-experts models: the engine returns each token's experts; "
        "rollout: the actor routes as the engine did (R3) in the old-log-prob pass, the "
        "update and its recompute (the reference routes for itself); measure: the actor "
        "routes itself. Either reports actor/routing_flip_rate, the share of (loss token, "
        "MoE layer) decisions where the actor's own top-k differs from the engine's",
    )


class Config(BaseModel):
    """A whole job. Build it with ``trainer.config.load_config``, which also runs the
    cross-field and environment checks."""

    model_config = _SECTION

    device: DeviceName = Field(
        "auto", description="device backend: auto picks the best accelerator present, else cpu"
    )
    seed: int = Field(1, ge=0, description="seed of everything random in the run")
    model: ModelConfig = Field(default_factory=ModelConfig, description="what to train")
    data: DataConfig = Field(default_factory=DataConfig, description="prompt source")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="sampling")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="RL math")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="rewards")
    critic: CriticConfig = Field(default_factory=CriticConfig, description="value model")
    train: TrainConfig = Field(default_factory=TrainConfig, description="optimisation")
    run: RunConfig = Field(default_factory=RunConfig, description="outputs")
    ray: RayConfig = Field(default_factory=RayConfig, description="cluster")

    def to_yaml(self) -> str:
        """The resolved config as YAML text that ``load_config`` reads back unchanged."""
        import yaml

        return yaml.safe_dump(self.model_dump(mode="python"), sort_keys=False)

    def flat(self) -> dict[str, object]:
        """Every leaf value by its dotted key, e.g. ``{"train.lr": 1e-6, ...}``."""
        out: dict[str, object] = {}
        for name, value in self.model_dump(mode="python").items():
            if not isinstance(value, dict):
                out[name] = value
                continue
            for key, leaf in value.items():
                if f"{name}.{key}" in SUBSECTIONS:  # model.lora.rank, ...
                    out.update({f"{name}.{key}.{k}": v for k, v in leaf.items()})
                else:
                    out[f"{name}.{key}"] = leaf
        return out

    def get(self, key: str) -> object:
        """The value at a dotted key such as ``"train.lr"``; KeyError if there is none."""
        flat = self.flat()
        if key not in flat:
            raise KeyError(key)
        return flat[key]

    def loss_horizon_tokens(self) -> int:
        """Tokens: the divisor of seq-mean-token-sum-norm (``algorithm.loss_agg_horizon``,
        else ``rollout.max_new_tokens``, the longest response a step row can have)."""
        return self.algorithm.loss_agg_horizon or self.rollout.max_new_tokens

    def engine_device(self) -> str:
        """The engine replicas' device backend: ``rollout.device``, else ``device``."""
        return self.rollout.device or self.device

    def env_call_slots(self) -> int:
        """Environment calls that may run at once: ``rollout.env_concurrency``, or for
        ``auto`` the episodes the run may have in flight (prompts x samples, times the
        streamed steps a group may span), at most ``ENV_SLOTS_AUTO_MAX``."""
        roll, train = self.rollout, self.train
        if roll.env_concurrency != "auto":
            return roll.env_concurrency
        spans = 1 if train.max_staleness is None else train.max_staleness + 1
        return min(train.batch_size * roll.n * spans, ENV_SLOTS_AUTO_MAX)

    def optimizer_steps_per_step(self) -> int:
        """Optimizer steps per training step: mini-batches per batch times ppo_epochs."""
        return (self.train.batch_size // self.train.mini_batch_size) * self.train.ppo_epochs


#: Sections inside a section, by dotted name: their keys are ``model.lora.rank`` and so on.
SUBSECTIONS: dict[str, type[BaseModel]] = {"model.lora": LoraConfig}

SECTIONS: dict[str, type[BaseModel]] = {
    "model": ModelConfig,
    "data": DataConfig,
    "rollout": RolloutConfig,
    "algorithm": AlgorithmConfig,
    "reward": RewardConfig,
    "critic": CriticConfig,
    "train": TrainConfig,
    "run": RunConfig,
    "ray": RayConfig,
}

# Keys that describe how a job is laid out on a machine, not what it computes. The
# versions of one job for different device types (configs/<device>/<job>.yaml) may differ
# only in these, which makes their runs comparable step for step
# (tests/test_config_pairs.py holds configs/ to it).
LAYOUT_KEYS: frozenset[str] = frozenset(
    {
        "device",
        "train.dp_size",
        "rollout.memory_fraction",
        "rollout.tensor_parallel_size",
        "rollout.expert_parallel",
        "train.expert_parallel_size",
        "rollout.engine_devices",
        "train.max_tokens_per_micro_batch",
        "train.param_offload",
        "train.optimizer_offload",
    }
)
