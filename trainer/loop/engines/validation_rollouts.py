"""Validation rollouts: ``data.val_source`` rolled out on the rollout host (when:
``trainer.loop.schedule.validation``).

Every record of the validation file is rolled out ``rollout.val_n`` times, greedily when
``rollout.val_temperature`` is 0 (top-k 1), with the training environment and reward function
and no reward shaping. Metrics:

- ``val/reward_mean``: mean score over all validation trajectories;
- ``val/reward_mean/<data_source>``: the same per record ``data_source`` (records without one
  count as ``unknown``);
- ``val/pass@k`` (k = ``rollout.val_n``): fraction of prompts with at least one sample at full
  marks (score >= 1); ``val/best@k``: mean over prompts of the best sample's score;
- ``val/env_errors``, ``val/response_length_mean``.

Validation never changes the training stream: its requests are seeded from their own stream
(``stable_seed(seed, VAL_STREAM, step, ...)``), every engine request samples from its own seed,
and the training prompt order does not depend on it. It runs on the rollout host after the
step's weight sync, so it scores the weights the step produced. Beside a stream
(``train.max_staleness``) its engine calls take turns with the stream's, and its requests are
counted under none of the stream's prompts (``rollout.streaming.VersionedEngine.untracked``):
its records' indices are the same numbers as the stream's prompt ordinals.
"""

from __future__ import annotations

from collections.abc import Sequence

from rollout.seeding import stable_seed
from trainer.config.schema import Config

#: Tag that separates validation's sampling seeds from training's.
VAL_STREAM = 0x7A1


def validation_metrics(
    scores: Sequence[Sequence[float]], data_sources: Sequence[str | None], k: int
) -> dict[str, float]:
    """``val/*`` metrics from ``scores[prompt][sample]`` and each prompt's data source."""
    flat = [s for per_prompt in scores for s in per_prompt]
    out = {
        "val/reward_mean": sum(flat) / max(len(flat), 1),
        f"val/pass@{k}": sum(max(p) >= 1.0 for p in scores) / max(len(scores), 1),
        f"val/best@{k}": sum(max(p) for p in scores) / max(len(scores), 1),
    }
    by_source: dict[str, list[float]] = {}
    for source, per_prompt in zip(data_sources, scores):
        by_source.setdefault(source or "unknown", []).extend(per_prompt)
    for source, values in sorted(by_source.items()):
        out[f"val/reward_mean/{source}"] = sum(values) / len(values)
    return out


def run_validation(
    engine, tokenizer, env_factory, items, cfg: Config, step: int, agent_workers=None
) -> dict:
    """Roll out every validation prompt ``rollout.val_n`` times and return ``val/*`` metrics.

    ``items``: the validation ``PromptItem``s (``PromptSource.all_records()``); ``step``: the
    training step just finished (0 before training), which only seeds the sampling;
    ``agent_workers``: where the agent loops run (``run_config_rollouts``).
    """
    from rollout.engines import SamplingParams
    from trainer.loop.engines.sampling import run_config_rollouts

    roll = cfg.rollout
    greedy = roll.val_temperature == 0
    sampling = SamplingParams(
        max_new_tokens=roll.max_new_tokens,
        temperature=1.0 if greedy else roll.val_temperature,
        top_p=1.0 if greedy else roll.top_p,
        top_k=1 if greedy else roll.top_k,
    )
    k = roll.val_n
    out = run_config_rollouts(
        engine,
        tokenizer,
        env_factory,
        items,
        cfg,
        n=k,
        sampling=sampling,
        seed=stable_seed(cfg.seed, VAL_STREAM),
        step=step,
        agent_workers=agent_workers,
    )
    # A trajectory without rows (its env failed at reset) scores 0, like a failed one.
    scores = [[0.0] * k for _ in items]
    for row in out.rows:
        if row.is_last_step:
            scores[row.uid][row.trajectory_id - row.uid * k] = float(row.score)
    metrics = validation_metrics(scores, [i.env_kwargs.get("data_source") for i in items], k)
    metrics["val/env_errors"] = out.metrics["rollout/env_errors"]
    metrics["val/response_length_mean"] = out.metrics["rollout/mean_response_length"]
    return metrics
