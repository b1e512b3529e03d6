"""How the trainer's ranks split a model (``train.expert_parallel_size``): the checks that
relate it to the other keys, run with the static checks (``trainer.config.checks``)."""

from __future__ import annotations

from trainer.config.errors import Problem, problem
from trainer.config.schema import Config


def expert_parallel_problems(cfg: Config) -> list[Problem]:
    """``train.expert_parallel_size``: a divisor of ``train.dp_size``. It goes with LoRA
    adapters (on the layers other than the experts: ``rollout.lora.target_problem``) and
    FSDP2's CPU offload (``train.param_offload``); ``tests/test_expert_parallel.py``."""
    tr, ep = cfg.train, cfg.train.expert_parallel_size
    if ep == 1:
        return []
    if tr.dp_size % ep:
        return [
            problem(
                "train.expert_parallel_size",
                ep,
                f"must divide train.dp_size ({tr.dp_size}): the experts split over groups of "
                f"{ep} ranks; use a divisor of {tr.dp_size}",
            )
        ]
    return []
