"""When validation runs: ``data.val_source`` is rolled out every ``run.val_every`` steps and at
the last step (``validation_due``), on the rollout host after the step's weight sync, so it
scores the weights the step produced. The rollouts themselves and their ``val/*`` metrics:
``trainer.loop.engines.validation_rollouts``.
"""

from __future__ import annotations

from trainer.config.schema import Config


def validation_due(cfg: Config, step: int) -> bool:
    """Whether training step ``step`` (1-based) ends with a validation: every
    ``run.val_every`` steps and at the last step (when ``run.val_every`` > 0)."""
    every = cfg.run.val_every
    return bool(every) and (step % every == 0 or step == cfg.train.total_steps)
