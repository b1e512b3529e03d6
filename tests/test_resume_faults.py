"""Faults of the run directory and of a resume end in one line naming the file or key and the
fix, exit 2 when found before start-up and 1 after, never a traceback (issue 26)."""

from __future__ import annotations

from pathlib import Path

from trainer.cli import main

SHORT = ["train.batch_size=4", "train.mini_batch_size=2", "rollout.n=4"]


def _train(capsys, run_dir: Path, *extra: str) -> tuple[int, str]:
    code = main(["train", *SHORT, f"run.dir={run_dir}", *extra])
    return code, capsys.readouterr().err


def test_a_malformed_metrics_line_is_refused_before_the_resume(tmp_path, capsys):
    run = tmp_path / "run"
    assert _train(capsys, run, "train.total_steps=1")[0] == 0
    metrics = run / "metrics.jsonl"
    metrics.write_text("not json\n" + metrics.read_text())
    code, err = _train(capsys, run, "train.total_steps=2")
    assert code == 2 and "Traceback" not in err
    assert f"{metrics}:1: malformed line" in err and "run.resume=never" in err


def test_resuming_with_a_model_of_other_shapes_is_refused_by_name(tmp_path, capsys):
    run = tmp_path / "run"
    assert _train(capsys, run, "train.total_steps=1")[0] == 0
    code, err = _train(capsys, run, "train.total_steps=2", "model.path=builtin:small")
    assert code == 2 and "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith("crossrl train: model.path=builtin:small: ") and "shape" in line


def test_a_checkpoint_that_cannot_be_written_ends_the_run_in_one_line(
    tmp_path, capsys, monkeypatch
):
    import trainer.loop.schedule.controller as controller

    step = controller.Trainer.train_step

    def then_block_the_checkpoints(self, n):
        out = step(self, n)
        (Path(self.run_dir) / "checkpoints").write_text("a file where the directory goes")
        return out

    monkeypatch.setattr(controller.Trainer, "train_step", then_block_the_checkpoints)
    code, err = _train(capsys, tmp_path / "run", "train.total_steps=1", "run.resume=never")
    assert code == 1 and "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert "cannot write a checkpoint under" in line and "checkpoints" in line
