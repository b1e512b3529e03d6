"""DAPO dynamic sampling (Yu et al. 2025): keep only prompt groups whose samples disagree.

A group whose trajectories all scored the same has zero advantage under a group baseline
(GRPO, RLOO, REINFORCE++ with baseline): it costs a training step's compute and teaches
nothing. With ``rollout.max_sample_batches`` > 1 the rollout host samples ``train.batch_size``
prompts, drops such groups, and samples the next ``train.batch_size`` prompts of the stream
until ``train.batch_size`` groups are kept or ``max_sample_batches`` batches were drawn. A step
still short is topped up with the earliest dropped groups (zero advantage, so no signal, but
every step keeps the same number of groups, mini-batches and optimizer steps; verl stops the
run instead). Extra groups beyond ``train.batch_size`` are cut in sampling order.

Prompt consumption stays deterministic: every drawn batch consumes its prompts in stream order,
and the count (``prompts_consumed``) is saved in checkpoints so a resumed run goes on from it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from batching import Row


@dataclasses.dataclass
class GroupSelection:
    """Groups of rows chosen for a step, plus what was dropped (for metrics)."""

    kept: list[list[Row]] = dataclasses.field(default_factory=list)
    dropped: list[list[Row]] = dataclasses.field(default_factory=list)

    def add(self, rows: Sequence[Row]) -> None:
        """Split one sampled batch's rows into kept and dropped groups (sampling order)."""
        for group in split_groups(rows):
            (self.dropped if all_scores_equal(group) else self.kept).append(group)

    def final(self, num_groups: int) -> tuple[list[Row], dict[str, float]]:
        """Exactly ``num_groups`` groups (kept first, topped up with dropped ones, when there
        are that many), renumbered ``uid = 0..``, ``trajectory_id = uid * n + sample``; and
        the ``dynamic_sampling/*`` metrics."""
        topped = max(0, num_groups - len(self.kept))
        groups = self.kept[:num_groups] + self.dropped[:topped]
        scores = [_scores(g) for g in self.dropped]
        flat = [s for group in scores for s in group]
        metrics = {
            "dynamic_sampling/kept_groups": float(min(len(self.kept), num_groups)),
            "dynamic_sampling/dropped_groups": float(len(self.dropped)),
            "dynamic_sampling/topped_up_groups": float(min(topped, len(self.dropped))),
            "dynamic_sampling/dropped_score_mean": sum(flat) / len(flat) if flat else 0.0,
        }
        return renumber(groups), metrics


def split_groups(rows: Sequence[Row]) -> list[list[Row]]:
    """Rows grouped by ``uid``, groups in order of first appearance, rows in order."""
    groups: dict[int, list[Row]] = {}
    for row in rows:
        groups.setdefault(row.uid, []).append(row)
    return list(groups.values())


def _scores(group: Sequence[Row]) -> list[float]:
    return [r.score for r in group if r.is_last_step]


def all_scores_equal(group: Sequence[Row]) -> bool:
    """True when every trajectory of the group has the same outcome score (std 0)."""
    scores = _scores(group)
    return len(set(scores)) <= 1


def renumber(groups: Sequence[Sequence[Row]]) -> list[Row]:
    """The groups' rows with ``uid`` = group position and trajectory ids kept distinct:
    ``trajectory_id = uid * n + sample``, ``n`` the largest group's sample count."""
    n = max((len({r.trajectory_id for r in g}) for g in groups), default=1)
    out: list[Row] = []
    for uid, group in enumerate(groups):
        samples = sorted({r.trajectory_id for r in group})
        for row in group:
            sample = samples.index(row.trajectory_id)
            out.append(dataclasses.replace(row, uid=uid, trajectory_id=uid * n + sample))
    return out
