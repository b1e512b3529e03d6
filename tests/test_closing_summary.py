"""``crossrl train`` ends with a summary: the steps it ran, the reward's first and last value,
the time, where the run directory is, and the commands to run next."""

from __future__ import annotations

import json
from pathlib import Path

from trainer.cli import main
from trainer.loop.start.run import closing_summary

SHORT = ["train.batch_size=4", "train.mini_batch_size=2", "rollout.n=4", "train.total_steps=2"]


def test_the_summary_names_the_steps_rewards_directory_and_next_commands():
    text = closing_summary(
        "train", Path("runs/x"), first_step=3, total_steps=4, rewards=[0.25, 0.5], wall_s=1.5
    )
    assert "steps 3-4 of 4, 1.5 s of training" in text
    assert "reward/mean 0.250 (step 3) -> 0.500 (step 4)" in text
    assert "run directory: runs/x" in text
    assert "crossrl plot runs/x" in text and "crossrl export runs/x OUT_DIR" in text
    resumed = closing_summary(
        "train", Path("r"), first_step=5, total_steps=4, rewards=[], wall_s=0.0
    )
    assert "nothing left to run" in resumed
    streamed = closing_summary(
        "train",
        Path("r"),
        first_step=1,
        total_steps=2,
        rewards=[0.1, 0.2],
        wall_s=1.0,
        stream={
            "stream/groups_dropped": 3.0,
            "stream/groups_aborted": 1.0,
            "stream/tokens_discarded": 120.0,
            "stream/tokens_generated": 1200.0,
        },
    )
    assert (
        "  stream: 3 groups dropped, 1 aborted, 120 tokens discarded (10.0% of 1,200 generated)"
        in streamed
    )


def test_crossrl_train_ends_with_it(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", *SHORT, f"run.dir={run_dir}"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    rewards = [
        json.loads(line)["reward/mean"]
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    head, seconds = err[-3].split(" s of training; ")
    assert head.startswith("crossrl train: done, steps 1-2 of 2, ")
    assert float(head.rsplit(", ", 1)[1]) > 0
    assert seconds == f"reward/mean {rewards[0]:.3f} (step 1) -> {rewards[1]:.3f} (step 2)"
    assert err[-2] == f"  run directory: {run_dir}"
    assert err[-1] == f"  next: crossrl plot {run_dir}    crossrl export {run_dir} OUT_DIR"
