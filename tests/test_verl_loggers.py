"""Validation metrics in metrics.jsonl, the progress bar and crossrl plot; run.loggers
(jsonl, tensorboard, wandb offline) and the config errors for missing logger packages."""

from __future__ import annotations

import importlib.util

import pytest

from trainer.config import ConfigError, load_config
from trainer.loop.engines.validation_rollouts import validation_metrics
from trainer.loop.schedule.validation import validation_due
from trainer.records.jsonl_files import read_jsonl
from trainer.records.metrics import METRICS_FILE, MetricsLogger


def test_validation_metrics_by_hand():
    # prompt 0 (gsm8k): samples [1, 0]; prompt 1 (math): [0, 0]; prompt 2 (gsm8k): [0.5, 1]
    scores = [[1.0, 0.0], [0.0, 0.0], [0.5, 1.0]]
    m = validation_metrics(scores, ["gsm8k", "math", "gsm8k"], k=2)
    assert m["val/reward_mean"] == pytest.approx(2.5 / 6)
    assert m["val/pass@2"] == pytest.approx(2 / 3)  # prompts 0 and 2 have a full-marks sample
    assert m["val/best@2"] == pytest.approx(2 / 3)  # (1 + 0 + 1) / 3
    assert m["val/reward_mean/gsm8k"] == pytest.approx(2.5 / 4)
    assert m["val/reward_mean/math"] == 0.0


def test_validation_schedule(tmp_path):
    val = tmp_path / "v.jsonl"
    val.write_text('{"prompt": "q", "answer": "a"}\n')
    cfg = load_config(None, ["train.total_steps=5", "run.val_every=2", f"data.val_source={val}"])
    assert [s for s in range(1, 6) if validation_due(cfg, s)] == [2, 4, 5]  # and the last step
    cfg = load_config(None, ["train.total_steps=5"])
    assert not any(validation_due(cfg, s) for s in range(1, 6))


def test_validation_without_a_val_source_is_a_config_error():
    with pytest.raises(ConfigError, match="data.val_source"):
        load_config(None, ["run.val_every=1"])


def test_step_zero_validation_line_progress_bar_and_plot(tmp_path, capsys):
    with MetricsLogger(tmp_path, total_steps=2, tensorboard=False) as log:
        log.log(0, {"val/reward_mean": 0.25, "val/pass@2": 0.5, "val/reward_mean/gsm8k": 0.25})
        log.log(1, {"reward/mean": 0.1, "throughput/tokens_per_s": 10.0})
        log.log(2, {"reward/mean": 0.2, "val/reward_mean": 0.75, "val/pass@2": 1.0})
        with pytest.raises(ValueError, match="step 0"):
            log.log(0, {"val/reward_mean": 0.1})  # step 0 only before the first step
    assert [r["step"] for r in read_jsonl(tmp_path / METRICS_FILE)] == [0, 1, 2]
    assert "val=0.750" in capsys.readouterr().err
    pytest.importorskip("matplotlib")
    from trainer.commands.plot import plot_run

    names = {p.name for p in plot_run(tmp_path)}
    assert {"val_reward_mean.png", "val_pass@2.png", "val_reward_mean_gsm8k.png"} <= names


def test_loggers_must_keep_jsonl():
    with pytest.raises(ConfigError, match="run.loggers"):
        load_config(None, ["run.loggers=[tensorboard]"])


def test_missing_logger_package_names_the_extra(monkeypatch):
    import trainer.config.checks as checks

    real = checks._module_available
    monkeypatch.setattr(checks, "_module_available", lambda n: n != "wandb" and real(n))
    with pytest.raises(ConfigError, match=r"pip install 'crossrl\[wandb\]'"):
        load_config(None, ["run.loggers=[jsonl,wandb]"])


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="no tensorboard")
def test_tensorboard_logger_writes_events(tmp_path):
    cfg = load_config(None, ["run.loggers=[jsonl,tensorboard]", "train.total_steps=1"])
    with MetricsLogger.for_run(cfg, tmp_path, start_step=0) as log:
        log.log(1, {"reward/mean": 0.5})
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="no wandb")
def test_wandb_logger_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config(None, ["run.loggers=[jsonl,wandb]", "train.total_steps=2"])
    with MetricsLogger.for_run(cfg, tmp_path, start_step=0) as log:
        log.log(1, {"reward/mean": 0.5})
        log.log(2, {"reward/mean": 0.75, "val/reward_mean": 0.1})
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
