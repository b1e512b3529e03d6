"""How long the controller waits for each kind of worker call before it calls the worker hung.

One constant for every call is both too long for a hung collective and too short for a large
model, so each limit follows what the call does (its ``budget``):

- ``rollout``: its turn and token budgets and the environment's own limits
  (``rollout.max_turns`` turns, each ``decode_waves`` x ``rollout.max_new_tokens`` decode
  steps plus one environment call (``rollout.env_timeout_s``) and one reward call
  (``reward.timeout_s``) per wave of ``rollout.env_concurrency`` trajectories), times
  ``rollout.max_sample_batches``. ``decode_waves``: how many times a replica's KV cache fills
  with its share of the step's trajectories (the engines say how many sequences theirs
  holds, ``rollout.engines.capacity``; one when an engine decodes every request at once);
- ``validation``: the same over ``data.val_source``'s records x ``rollout.val_n``;
- ``update``: the step's tokens on its busiest rank times its passes (``train.ppo_epochs``,
  and the old and reference log-probs before them);
- ``checkpoint_save`` / ``checkpoint_load``: the training roles' state (fp32 weights and
  AdamW's two moments, 12 bytes a trained parameter; the adapters alone with LoRA) over a
  storage throughput; ``push``: the engine's weights (``model.dtype``) over a transfer
  throughput (also the engines' sleep and wake, which move them); ``setup``: start-up, a
  model read from disk. The throughputs are floors no working system falls under
  (``*_BYTES_PER_S``) until a save or a push has run: then ``MEASURED_SLACK`` times the
  slowest one measured (``CallLimits.observe``).

Each limit is ``run.collective_timeout_s`` + ``run.time_limit_scale`` x the budget x its
growth: a rank stuck inside a collective is reported by the collective itself first (as a
broken collective, naming it), and the call's limit only catches a process stuck outside
one. A call that passed its limit doubles that limit for the run's later attempts
(``CallLimits.grow``, from ``trainer.loop.start.restarts``): a restart never runs into the same
limit again. The model's bytes come from its shape (``trainer.loop.plan.model_shape``); a model
whose shape is unknown gets ``UNKNOWN_MODEL_S`` for its bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from trainer.config import Config

SETUP_S = 1800.0
"""Seconds for start-up beyond reading the model (engines compiling, imports, rendezvous)."""
DECODE_STEP_S = 0.25
"""Seconds one decode step of a rollout may take at most (4 steps a second is a hang)."""
TRAIN_TOKEN_S = 0.01
"""Seconds one token may take in one epoch of an update on one rank (100 tokens a second)."""
UPDATE_BASE_S = 120.0
"""Seconds an update may take beyond its tokens (loading the batch, the optimizer step)."""
UNBOUNDED_ENV_CALL_S = 600.0
"""Seconds allowed per environment call when ``rollout.env_timeout_s`` is null (no limit of
its own)."""
MOVE_BASE_S = 120.0
"""Seconds a checkpoint save or load, or a weight push, may take beyond its bytes."""
STORAGE_BYTES_PER_S = 100e6
"""Bytes a second a checkpoint is written or read at, at the least, for all ranks together:
a network filesystem behind one 1 Gb/s link. A 70B actor's 840 GB: 2.3 hours."""
PUSH_BYTES_PER_S = 100e6
"""Bytes a second the engine's weights move at, at the least (a push through a 1 Gb/s link,
or through host memory)."""
MODEL_READ_BYTES_PER_S = 100e6
"""Bytes a second a model is read from disk at start-up, at the least."""
MEASURED_SLACK = 4.0
"""Times the slowest measured duration (per byte) a later save or push may take."""
UNKNOWN_MODEL_S = 1800.0
"""Seconds for a model's bytes when its shape is unknown (``model_shape`` finds none)."""
GROWTH = 2.0
"""How much a limit grows for later attempts once a call has passed it."""
ADAMW_STATE_BYTES = 12
"""Bytes of checkpointed state per trained parameter: fp32 weight, AdamW's two fp32 moments."""


class Limit(float):
    """Seconds a call may take, naming the kind of call it bounds (``call``, a budget of
    the module docstring): a call that passes it says which limit to grow."""

    call: str

    def __new__(cls, seconds: float, call: str) -> Limit:
        limit = super().__new__(cls, seconds)
        limit.call = call
        return limit

    def __reduce__(self):  # pickled into a worker's call, e.g. a stream's wait
        return (Limit, (float(self), self.call))


@dataclass
class CallLimits:
    """The seconds each kind of call may take, for one run: built from its config, then told
    what the engines hold (``set_engines``), how large the validation set is
    (``set_validation``), how fast saves and pushes went (``observe``) and which limits a
    hang passed (``grow``); one object for all the run's attempts."""

    cfg: Config
    state_bytes: float | None  # a checkpoint's bytes (every training role), None: unknown
    weight_bytes: float | None  # the engine's weights, bytes in model.dtype, None: unknown
    kv_sequences: int | None = None  # sequences one replica decodes at once; None: all
    replicas: int = 1  # engine replicas the trajectories are dealt over
    val_records: int = 0
    growth: dict[str, float] = field(default_factory=dict)
    measured_s_per_byte: dict[str, float] = field(default_factory=dict)

    @classmethod
    def for_config(cls, cfg: Config) -> CallLimits:
        """The limits of job ``cfg`` before anything is measured (see the module docstring)."""
        state, weights = model_bytes(cfg)
        return cls(cfg, state, weights)

    # ------------------------------------------------------------------ the limits
    @property
    def collective_s(self) -> float:
        """``run.collective_timeout_s``: every limit's first part."""
        return self.cfg.run.collective_timeout_s

    def limit(self, call: str, budget_s: float) -> Limit:
        """The limit of a ``call`` whose work may take ``budget_s`` seconds."""
        scale = self.cfg.run.time_limit_scale * self.growth.get(call, 1.0)
        return Limit(self.collective_s + scale * budget_s, call)

    @property
    def rollout_s(self) -> Limit:
        """A step's rollout (all its sample batches)."""
        roll = self.cfg.rollout
        trajectories = self.cfg.train.batch_size * roll.n
        return self.limit("rollout", self._rollout_budget(trajectories, roll.max_sample_batches))

    @property
    def validation_s(self) -> Limit:
        """One validation: every record of ``data.val_source`` ``rollout.val_n`` times."""
        trajectories = max(self.val_records, 1) * self.cfg.rollout.val_n
        return self.limit("validation", self._rollout_budget(trajectories, 1))

    def queued_s(self, rollouts: int) -> Limit:
        """A rollout or validation of engines of their own, queued behind ``rollouts`` - 1
        rollouts sampled ahead (``train.rollout_lag``, a stream) and a validation."""
        return Limit(rollouts * self.rollout_s + self.validation_s - self.collective_s, "rollout")

    def update_s(self, tokens_per_rank: int) -> Limit:
        """A step's update of ``tokens_per_rank`` tokens on the busiest rank (its
        ``ppo_epochs`` passes, the old and reference log-probs before them)."""
        passes = self.cfg.train.ppo_epochs + 2
        return self.limit("update", UPDATE_BASE_S + passes * tokens_per_rank * TRAIN_TOKEN_S)

    @property
    def checkpoint_save_s(self) -> Limit:
        """Writing one role's part of a checkpoint (every rank its shards), bounded by the
        whole checkpoint's bytes."""
        return self.limit("checkpoint_save", self._move_s("checkpoint_save", self.state_bytes))

    @property
    def checkpoint_load_s(self) -> Limit:
        """Reading one role's part of a checkpoint back (a resume): as fast as it was written
        when a save was measured, else the storage floor."""
        return self.limit("checkpoint_load", self._move_s("checkpoint_save", self.state_bytes))

    @property
    def push_s(self) -> Limit:
        """A weight push to the engines, or their sleep or wake (which move the weights)."""
        return self.limit("push", self._move_s("push", self.weight_bytes))

    @property
    def setup_s(self) -> Limit:
        """Start-up (reading the model included) and the small calls around it."""
        read_s = (
            UNKNOWN_MODEL_S
            if self.weight_bytes is None
            else self.weight_bytes / MODEL_READ_BYTES_PER_S
        )
        return self.limit("setup", SETUP_S + read_s)

    # ------------------------------------------------------------------ what the run learns
    def set_engines(self, infos: list[dict]) -> None:
        """The engine replicas' setup answers, one per replica (``kv_sequences``: sequences
        its KV cache holds at once, absent or None when it decodes all it is given at once)."""
        held = [int(info["kv_sequences"]) for info in infos if info.get("kv_sequences")]
        self.replicas = max(len(infos), 1)
        self.kv_sequences = min(held) if held else None

    def decode_waves(self, trajectories: int) -> int:
        """Times a replica's KV cache fills with its share of ``trajectories``."""
        if not self.kv_sequences:
            return 1
        return max(1, math.ceil(math.ceil(trajectories / self.replicas) / self.kv_sequences))

    def set_validation(self, records: int) -> None:
        """``data.val_source`` holds ``records`` records (the rollout host says)."""
        self.val_records = int(records)

    def observe(self, call: str, seconds: float, nbytes: float | None = None) -> None:
        """A ``checkpoint_save`` or ``push`` took ``seconds`` for ``nbytes`` (default: the
        model's estimate); the slowest per byte sets the later limits."""
        nbytes = nbytes if nbytes is not None else self._bytes_of(call)
        if not nbytes or seconds <= 0:
            return
        per_byte = seconds / nbytes
        self.measured_s_per_byte[call] = max(self.measured_s_per_byte.get(call, 0.0), per_byte)

    def grow(self, call: str) -> str:
        """The call ``call`` passed its limit: its later limits are ``GROWTH`` times longer.
        Returns one line that says so."""
        self.growth[call] = self.growth.get(call, 1.0) * GROWTH
        now = "" if call == "update" else f" ({float(getattr(self, f'{call}_s')):.0f} s)"
        return (
            f"the {call} limit is {self.growth[call]:g}x its budget{now} for the attempts "
            "left (run.time_limit_scale scales every limit)"
        )

    # ------------------------------------------------------------------ helpers

    def _bytes_of(self, call: str) -> float | None:
        return self.weight_bytes if call == "push" else self.state_bytes

    def _move_s(self, measured: str, nbytes: float | None) -> float:
        """Seconds to move ``nbytes`` (a save, a load, a push): ``MEASURED_SLACK`` x the
        slowest measured ``measured`` call, or the floor's throughput before one ran."""
        if nbytes is None:
            return MOVE_BASE_S + UNKNOWN_MODEL_S
        per_byte = self.measured_s_per_byte.get(measured)
        floor = PUSH_BYTES_PER_S if measured == "push" else STORAGE_BYTES_PER_S
        seconds = MEASURED_SLACK * per_byte * nbytes if per_byte else nbytes / floor
        return MOVE_BASE_S + seconds

    def _rollout_budget(self, trajectories: int, sample_batches: int) -> float:
        """Seconds for ``trajectories`` trajectories, ``sample_batches`` times over."""
        roll = self.cfg.rollout
        waves = math.ceil(trajectories / self.cfg.env_call_slots())
        env_call_s = roll.env_timeout_s if roll.env_timeout_s is not None else UNBOUNDED_ENV_CALL_S
        decode_s = self.decode_waves(trajectories) * roll.max_new_tokens * DECODE_STEP_S
        turn_s = decode_s + waves * (env_call_s + self.cfg.reward.timeout_s)
        # reset and the final step are environment calls too: one more per trajectory
        return sample_batches * (roll.max_turns * turn_s + waves * env_call_s)


def model_bytes(cfg: Config) -> tuple[float | None, float | None]:
    """Bytes of a checkpoint of job ``cfg`` (every training role's trained parameters,
    ``ADAMW_STATE_BYTES`` each) and of the engine's weights (``model.dtype``); None for
    both when the model's shape is unknown."""
    from trainer.loop.plan.lora_layout import adapter_params
    from trainer.loop.plan.model_shape import model_shape
    from trainer.loop.plan.rank_memory import DTYPE_BYTES

    shape = model_shape(cfg.model.path)
    if shape is None:
        return None, None
    trained = adapter_params(cfg, shape) if cfg.model.lora.enabled else shape.num_params
    if cfg.critic.enable:
        critic = model_shape(cfg.model.critic_path) if cfg.model.critic_path else shape
        trained += (critic or shape).value_model_params
    weights = shape.num_params * DTYPE_BYTES.get(cfg.model.dtype, 4)
    return float(trained * ADAMW_STATE_BYTES), float(weights)
