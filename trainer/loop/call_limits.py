"""How long the controller waits for each kind of worker call before it calls the worker hung.

One constant for every call is both too long for a hung collective and too short for a long
agent episode, so each limit follows what the call does:

- a rollout: its turn and token budgets and the environment's own limits (``rollout.max_turns``
  turns, each at most ``rollout.max_new_tokens`` decode steps plus one environment call
  (``rollout.env_timeout_s``) and one reward call (``reward.timeout_s``) per wave of
  ``rollout.env_concurrency`` trajectories), times ``rollout.max_sample_batches``;
- an update: the step's tokens on its busiest rank times its passes (``train.ppo_epochs``, and
  the old and reference log-probs before them);
- start-up, weight syncs, checkpoints, validation: ``SETUP_S`` (loading a large model from a
  slow disk).

Each limit adds ``run.collective_timeout_s``: a rank stuck inside a collective is reported by
the collective itself first (as a broken collective, naming it), and the call's limit only
catches a process stuck outside one. The floors below are throughputs no working device falls
under; slower than that is a hang.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainer.config import Config

SETUP_S = 1800.0
"""Seconds for start-up, weight syncs, checkpoints and validation (calls with no budget)."""
DECODE_STEP_S = 0.25
"""Seconds one decode step of a rollout may take at most (4 steps a second is a hang)."""
TRAIN_TOKEN_S = 0.01
"""Seconds one token may take in one epoch of an update on one rank (100 tokens a second)."""
UPDATE_BASE_S = 120.0
"""Seconds an update may take beyond its tokens (loading the batch, the optimizer step)."""
UNBOUNDED_ENV_CALL_S = 600.0
"""Seconds allowed per environment call when ``rollout.env_timeout_s`` is null (no limit of
its own)."""


@dataclass(frozen=True)
class CallLimits:
    """The seconds each kind of call may take, for one job's config."""

    collective_s: float
    rollout_s: float
    setup_s: float
    ppo_epochs: int

    @classmethod
    def for_config(cls, cfg: Config) -> CallLimits:
        """The limits of job ``cfg`` (see the module docstring)."""
        roll = cfg.rollout
        trajectories = cfg.train.batch_size * roll.n
        waves = math.ceil(trajectories / roll.env_concurrency)
        env_call_s = roll.env_timeout_s if roll.env_timeout_s is not None else UNBOUNDED_ENV_CALL_S
        turn_s = roll.max_new_tokens * DECODE_STEP_S + waves * (env_call_s + cfg.reward.timeout_s)
        # reset and the final step are environment calls too: one more per trajectory
        rollout_s = roll.max_sample_batches * (roll.max_turns * turn_s + waves * env_call_s)
        collective_s = cfg.run.collective_timeout_s
        return cls(
            collective_s=collective_s,
            rollout_s=collective_s + rollout_s,
            setup_s=collective_s + SETUP_S,
            ppo_epochs=cfg.train.ppo_epochs,
        )

    def update_s(self, tokens_per_rank: int) -> float:
        """Seconds for a step's update of ``tokens_per_rank`` tokens on the busiest rank (its
        ``ppo_epochs`` passes, the old and reference log-probs before them)."""
        passes = self.ppo_epochs + 2
        return self.collective_s + UPDATE_BASE_S + passes * tokens_per_rank * TRAIN_TOKEN_S
