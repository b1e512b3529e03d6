"""Advantage estimators, one readable module each (GRPO, RLOO, REINFORCE++ with and without a
group baseline, GAE), DAPO's dynamic sampling and rollout correction.

``compute_advantages(batch, estimator, ...)`` is the one entry point the trainer
calls; the per-estimator functions work on plain arrays and are what the tests
check by hand.
"""

from trainer.algorithms.advantages import ADV_ESTIMATORS, compute_advantages
from trainer.algorithms.gae import gae_advantages
from trainer.algorithms.grpo import grpo_advantages
from trainer.algorithms.reinforce_pp import (
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
)
from trainer.algorithms.rloo import rloo_advantages

__all__ = [
    "ADV_ESTIMATORS",
    "compute_advantages",
    "gae_advantages",
    "grpo_advantages",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
]
