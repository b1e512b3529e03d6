"""Every option works with every other: a pairwise matrix of short training runs.

The options that change the code path are the factors below. ``pairwise_runs`` builds a small
set of runs in which every pair of values of every two factors meets at least once (a
covering array, greedy and deterministic), and each run trains the default job for one step
(two for ``ppo_epochs=2`` and dynamic sampling are in the same step) through the CLI's own
entry point. A run passes when it exits 0 with finite metrics, or when it is refused before
start-up with exit 2 and one line that names a key; anything else (a traceback, a crash at the
first weight push, a non-finite loss) fails it.

Derived, not free: ``critic.enable`` follows ``algorithm.adv_estimator`` (gae needs a critic,
nothing else uses one), so the critic meets every other value through ``gae``.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from pathlib import Path

import pytest

#: factor -> its values; each value is the overrides it stands for.
FACTORS: dict[str, dict[str, list[str]]] = {
    "dtype": {
        "fp32": ["train.param_dtype=float32", "train.reduce_dtype=float32"],
        "bf16": ["train.param_dtype=bfloat16"],
    },
    "dp": {"1": ["train.dp_size=1"], "2": ["train.dp_size=2"]},
    "in_process": {"auto": ["ray.in_process=auto"], "false": ["ray.in_process=false"]},
    "estimator": {
        "grpo": ["algorithm.adv_estimator=grpo"],
        "rloo": ["algorithm.adv_estimator=rloo"],
        "reinforce_pp": ["algorithm.adv_estimator=reinforce_pp"],
        "gae+critic": ["algorithm.adv_estimator=gae", "critic.enable=true"],
    },
    "policy_loss": {"ppo": ["algorithm.policy_loss=ppo"], "gspo": ["algorithm.policy_loss=gspo"]},
    "loss_agg": {
        "token-mean": ["algorithm.loss_agg=token-mean"],
        "seq-mean-token-sum": ["algorithm.loss_agg=seq-mean-token-sum"],
        "seq-mean-token-mean": ["algorithm.loss_agg=seq-mean-token-mean"],
        # its divisor, which a multi-turn trajectory row needs set (refused otherwise)
        "seq-mean-token-sum-norm": [
            "algorithm.loss_agg=seq-mean-token-sum-norm",
            "algorithm.loss_agg_horizon=16",
        ],
    },
    "share_prompts": {"on": ["train.share_prompts=true"], "off": ["train.share_prompts=false"]},
    "old_from_update": {
        "on": ["train.old_logprobs_from_update=true"],
        "off": ["train.old_logprobs_from_update=false"],
    },
    "step_wise": {"rows": ["rollout.step_wise=true"], "trajectory": ["rollout.step_wise=false"]},
    "epochs": {"1": ["train.ppo_epochs=1"], "2": ["train.ppo_epochs=2"]},
    "kl": {
        "none": ["algorithm.kl_coef=0.0"],
        "loss": ["algorithm.kl_coef=0.01", "algorithm.use_kl_loss=true"],
        "reward": ["algorithm.kl_coef=0.01", "algorithm.use_kl_loss=false"],
    },
    "checkpointing": {
        "off": ["train.activation_checkpointing=false"],
        "on": ["train.activation_checkpointing=true"],
    },
    "lean_logprobs": {"on": ["train.lean_logprobs=true"], "off": ["train.lean_logprobs=false"]},
    "deterministic": {"on": ["run.deterministic=true"], "off": ["run.deterministic=false"]},
    "env": {
        "builtin": ["rollout.env=recall"],
        # a user's subclass of a built-in that overrides step with a blocking tool call
        "user-subclass": [
            "rollout.env=rollout.envs.sleepy:SleepyEnv",
            "rollout.env_kwargs.max_delay_s=0.01",
            "rollout.env_kwargs.turns=3",
        ],
        "async": [
            "rollout.env=rollout.envs.sleepy:AsyncSleepyEnv",
            "rollout.env_kwargs.max_delay_s=0.01",
            "rollout.env_kwargs.turns=3",
        ],
    },
    "rollout_correction": {
        "none": ["algorithm.rollout_correction=none"],
        "token": ["algorithm.rollout_correction=token"],
        "sequence": ["algorithm.rollout_correction=sequence"],
    },
    "dynamic_sampling": {
        "off": ["rollout.max_sample_batches=1"],
        "on": ["rollout.max_sample_batches=2"],
    },
    "micro_batch": {
        "whole": ["train.max_tokens_per_micro_batch=null"],
        "small": ["train.max_tokens_per_micro_batch=96"],
    },
    "entropy": {"off": ["algorithm.entropy_coef=0.0"], "on": ["algorithm.entropy_coef=0.01"]},
    # LoRA adapters on the frozen actor (the reference: its adapters off)
    "lora": {"off": ["model.lora.rank=0"], "on": ["model.lora.rank=4", "model.lora.alpha=8"]},
    # engines on a device of their own, synchronous, a step behind (a lag without
    # rollout_correction is refused by name) or streaming, their weights pushed through the
    # collective (the default) or host-memory snapshots; or colocated engines, streaming
    "pipeline": {
        "colocated": ["rollout.engine_devices=0", "train.rollout_lag=0"],
        "own-lag0": ["rollout.engine_devices=1", "train.rollout_lag=0"],
        "own-lag1": ["rollout.engine_devices=1", "train.rollout_lag=1"],
        "own-lag1-host": [
            "rollout.engine_devices=1",
            "train.rollout_lag=1",
            "rollout.weight_transport=host",
        ],
        # streaming (train.max_staleness) with partial rollouts; refused by name without
        # rollout_correction or with dynamic sampling
        "own-stream1": [
            "rollout.engine_devices=1",
            "train.rollout_lag=0",
            "train.max_staleness=1",
            "rollout.partial_rollout=true",
        ],
        # streaming on colocated engines, whole groups: the stream holds while they sleep
        # (max_staleness 1: a one-step run refuses a bound above total_steps - 1 by name)
        "colocated-stream1-whole": [
            "rollout.engine_devices=0",
            "train.rollout_lag=0",
            "train.max_staleness=1",
            "rollout.partial_rollout=false",
        ],
    },
}

#: The default job, cut to one short step: 4 prompts x 4 samples, 2 mini-batches.
BASE = [
    "train.batch_size=4",
    "train.mini_batch_size=2",
    "rollout.n=4",
    "rollout.max_turns=2",
    "train.total_steps=1",
    "run.resume=never",
    "run.save_every=0",
]


def pairwise_runs(factors: dict[str, list[str]], *, seed: int = 0, tries: int = 30) -> list[dict]:
    """Runs (factor -> value) in which every pair of values of two factors appears at least
    once; greedy: each new run is the best of ``tries`` candidates, each built factor by factor
    (the most-valued factors first), every factor taking the value that covers the most pairs
    still missing with the values chosen so far. Seeded: the same runs every time."""
    rnd = random.Random(seed)
    names = sorted(factors, key=lambda n: -len(factors[n]))
    missing = {
        _pair(a, va, b, vb)
        for a, b in itertools.combinations(names, 2)
        for va in factors[a]
        for vb in factors[b]
    }
    runs: list[dict] = []
    while missing:
        best, best_gain = None, -1
        for _ in range(tries):
            # Start from a missing pair, so every run covers at least one.
            a, va, b, vb = sorted(missing)[rnd.randrange(len(missing))]
            run = {a: va, b: vb}
            for name in names:
                if name in run:
                    continue
                values = list(factors[name])
                rnd.shuffle(values)
                run[name] = max(
                    values,
                    key=lambda v, name=name: sum(
                        _pair(name, v, other, run[other]) in missing for other in run
                    ),
                )
            gain = sum(
                _pair(x, run[x], y, run[y]) in missing for x, y in itertools.combinations(names, 2)
            )
            if gain > best_gain:
                best, best_gain = run, gain
        runs.append(best)
        missing -= {_pair(x, best[x], y, best[y]) for x, y in itertools.combinations(names, 2)}
    return runs


def _pair(a: str, va: str, b: str, vb: str) -> tuple:
    """One pair of values, the factor names in sorted order (the same pair either way)."""
    return (a, va, b, vb) if a < b else (b, vb, a, va)


RUNS = pairwise_runs({name: list(values) for name, values in FACTORS.items()})


def _overrides(run: dict) -> list[str]:
    return [o for name in FACTORS for o in FACTORS[name][run[name]]]


def test_the_matrix_covers_every_pair_of_values():
    covered = {
        _pair(a, run[a], b, run[b])
        for run in RUNS
        for a, b in itertools.combinations(sorted(FACTORS), 2)
    }
    for a, b in itertools.combinations(sorted(FACTORS), 2):
        for va in FACTORS[a]:
            for vb in FACTORS[b]:
                assert _pair(a, va, b, vb) in covered, (a, va, b, vb)
    # Far fewer runs than all combinations, and not more than a CI budget allows.
    assert len(RUNS) <= 30
    assert RUNS == pairwise_runs({n: list(v) for n, v in FACTORS.items()})  # deterministic


@pytest.fixture(scope="module")
def ray_once():
    """One local Ray for every run that needs it (dp 2, ``ray.in_process=false``)."""
    import ray

    from trainer.loop.cluster.group import start_ray

    started = start_ray(None, num_cpus=8)
    yield
    if started:
        ray.shutdown()


def _finite(value) -> bool:
    return not isinstance(value, float) or math.isfinite(value)


@pytest.mark.slow
@pytest.mark.parametrize("run", RUNS, ids=[f"run{i:02d}" for i in range(len(RUNS))])
def test_every_pair_of_options_trains_or_is_refused_by_name(run, ray_once, tmp_path, capsys):
    from trainer.cli import main

    run_dir = tmp_path / "run"
    args = ["train", *BASE, *_overrides(run), f"run.dir={run_dir}"]
    code = main(args)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    if code == 2:  # refused before start-up: one line naming a key, nothing written
        lines = [line for line in err.splitlines() if line.startswith("crossrl")]
        assert lines and "=" in lines[-1] or "." in lines[-1], err
        assert not (run_dir / "metrics.jsonl").exists()
        return
    assert code == 0, err
    metrics = [
        json.loads(line) for line in Path(run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert [m["step"] for m in metrics] == [1]
    (step,) = metrics
    bad = {k: v for k, v in step.items() if not _finite(v)}
    assert not bad, bad
    assert "actor/loss" in step and "actor/grad_norm" in step
    if run["estimator"] == "gae+critic":
        assert "critic/vf_loss" in step
