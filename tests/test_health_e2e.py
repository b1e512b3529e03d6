"""Health gates in real runs (issue 18): a broken environment stops the run with exit 1 before
any checkpoint of the step, showing the exception; non-finite training stops it without
committing anything, so the good checkpoints it had stay ``latest`` and whole."""

from __future__ import annotations

import os
import sys
import textwrap

import pytest
import ray

from trainer.config import load_config
from trainer.loop.cluster.group import start_ray
from trainer.loop.start.run import run_training
from trainer.records.checkpoint import find_latest, list_checkpoints
from trainer.records.jsonl_files import read_jsonl

pytestmark = pytest.mark.slow

SHORT = ["train.batch_size=4", "train.mini_batch_size=2", "rollout.n=4"]

ENVS = textwrap.dedent(
    """
    from rollout.envs import RecallEnv


    class StepRaises(RecallEnv):
        def step(self, text):
            raise ZeroDivisionError("the scorer divided by zero")


    class ResetRaises(RecallEnv):
        def reset(self, seed):
            raise KeyError("no such task")
    """
)


@pytest.fixture(scope="module")
def ray_with_envs(tmp_path_factory):
    """One local Ray whose workers can import the test's environment module."""
    folder = tmp_path_factory.mktemp("envs")
    (folder / "health_e2e_envs.py").write_text(ENVS)
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(folder), saved) if p)
    sys.path.insert(0, str(folder))
    started = start_ray(None, num_cpus=8)
    yield
    if started:
        ray.shutdown()
    sys.path.remove(str(folder))
    if saved is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = saved


@pytest.mark.parametrize(
    ("env", "shown"),
    [
        ("StepRaises", "step 0: ZeroDivisionError: the scorer divided by zero"),
        ("ResetRaises", "reset: KeyError: 'no such task'"),
    ],
)
def test_a_broken_environment_stops_the_run_showing_why(
    ray_with_envs, tmp_path, capsys, env, shown
):
    run_dir = tmp_path / "run"
    cfg = load_config(
        None,
        [*SHORT, f"run.dir={run_dir}", f"rollout.env=health_e2e_envs:{env}", "train.total_steps=3"],
    )
    assert run_training(cfg) == 1
    err = capsys.readouterr().err
    assert shown in err and "16 of 16 trajectories" in err and "trajectories 0, 1, 2, 3" in err
    assert find_latest(run_dir) is None and not list_checkpoints(run_dir)
    assert read_jsonl(run_dir / "metrics.jsonl") == []  # step 1 never completed


def test_non_finite_training_stops_and_commits_nothing(ray_with_envs, tmp_path, capsys):
    run_dir = tmp_path / "run"
    # An lr that sends the weights to ~1e30 in the first update: the next losses are nan, their
    # updates are skipped, and the third in a row stops the run. Step 1 had a skipped update,
    # so it is not checkpointed although run.save_every=1.
    wild = [*SHORT, f"run.dir={run_dir}", "train.total_steps=6", "run.save_every=1"]
    assert run_training(load_config(None, [*wild, "train.lr=1e30"])) == 1
    err = capsys.readouterr().err
    assert "step 1: not checkpointed: 1 actor update skipped" in err
    assert "non-finite loss or grad norm" in err and "run.max_nonfinite_steps=3" in err
    assert find_latest(run_dir) is None and not list_checkpoints(run_dir)
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["actor/skipped_updates"] for m in metrics] == [1]
