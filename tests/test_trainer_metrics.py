"""metrics.jsonl / fingerprint.jsonl writing, resume truncation, timing summaries."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from trainer.records.jsonl_files import MetricsFileError, read_jsonl
from trainer.records.metrics import (
    FINGERPRINT_FILE,
    METRICS_FILE,
    REQUIRED_KEYS,
    FingerprintLogger,
    MetricsLogger,
)
from trainer.records.timings import StepTimer, summarize_timings


def _step_metrics(step: int) -> dict:
    return {
        "reward/mean": 0.1 * step,
        "batch/num_rows": 16,
        "batch/num_padding_rows": 1,
        "batch/token_efficiency": 0.9,
        "batch/dp_imbalance": 1.05,
        "batch/max_seq_len": 300,
        "actor/loss": 1.0 / step,
        "actor/grad_norm": 0.5,
        "timing/step_s": 2.0,
        "throughput/tokens_per_s": 1234.5,
    }


def _logger(run_dir, **kwargs) -> MetricsLogger:
    kwargs.setdefault("progress", False)
    return MetricsLogger(run_dir, total_steps=10, **kwargs)


def test_log_appends_one_json_line_per_step(tmp_path):
    with _logger(tmp_path) as logger:
        for step in (1, 2, 3):
            logger.log(step, _step_metrics(step))
    records = read_jsonl(tmp_path / METRICS_FILE)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert set(REQUIRED_KEYS) <= set(records[0])
    assert records[2]["actor/loss"] == 1 / 3  # floats round-trip exactly
    # each line is readable the moment log() returns (flushed), before close
    logger = _logger(tmp_path, start_step=3)
    logger.log(4, _step_metrics(4))
    assert read_jsonl(tmp_path / METRICS_FILE)[-1]["step"] == 4
    logger.close()


def test_numpy_and_torch_scalars_are_converted(tmp_path):
    with _logger(tmp_path) as logger:
        record = logger.log(
            1,
            {
                "a": np.float32(0.5),
                "b": np.int64(7),
                "c": torch.tensor(2.5),
                "d": torch.tensor([3]),
                "e": True,
                "f": None,
            },
        )
    line = read_jsonl(tmp_path / METRICS_FILE)[0]
    assert line == record == {"step": 1, "a": 0.5, "b": 7, "c": 2.5, "d": 3, "e": 1, "f": None}
    assert isinstance(line["b"], int) and isinstance(line["a"], float)


def test_nan_and_inf_written_as_null_with_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING), _logger(tmp_path) as logger:
        logger.log(1, {"actor/loss": float("nan"), "actor/grad_norm": torch.tensor(float("inf"))})
    raw = (tmp_path / METRICS_FILE).read_text()
    assert "NaN" not in raw and "Infinity" not in raw  # strict JSON
    assert json.loads(raw) == {"step": 1, "actor/loss": None, "actor/grad_norm": None}
    assert "actor/loss" in caplog.text and "actor/grad_norm" in caplog.text


@pytest.mark.parametrize(
    ("value", "match"),
    [("fast", "'speed'.*str"), (torch.ones(3), r"shape \(3,\)"), ([1.0], "list")],
)
def test_non_scalar_values_rejected_naming_key(tmp_path, value, match):
    with _logger(tmp_path) as logger, pytest.raises(ValueError, match=match):
        logger.log(1, {"speed": value})
    assert read_jsonl(tmp_path / METRICS_FILE) == []  # nothing half-written


def test_steps_must_increase(tmp_path):
    with _logger(tmp_path) as logger:
        logger.log(1, {})
        with pytest.raises(ValueError, match="not after the last step"):
            logger.log(1, {})
        with pytest.raises(ValueError, match="step must be an int"):
            logger.log(2.0, {})


def test_resume_truncates_lines_after_checkpoint(tmp_path):
    with _logger(tmp_path) as logger:
        for step in range(1, 6):
            logger.log(step, _step_metrics(step))
    # crash after step 5; the newest checkpoint is step_3
    with _logger(tmp_path, start_step=3) as logger:
        assert [r["step"] for r in read_jsonl(tmp_path / METRICS_FILE)] == [1, 2, 3]
        with pytest.raises(ValueError, match="not after"):
            logger.log(3, {})
        logger.log(4, {"reward/mean": 42.0})
    records = read_jsonl(tmp_path / METRICS_FILE)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[-1]["reward/mean"] == 42.0
    # a fresh run (start_step=0) in the same dir starts the file over
    _logger(tmp_path).close()
    assert read_jsonl(tmp_path / METRICS_FILE) == []


def test_resume_drops_torn_last_line(tmp_path, caplog):
    path = tmp_path / METRICS_FILE
    path.write_text('{"step":1,"x":1}\n{"step":2,"x":2}\n{"step":3,"x"')
    with pytest.raises(MetricsFileError, match=r"metrics.jsonl:3"):
        read_jsonl(path)
    with caplog.at_level(logging.WARNING), _logger(tmp_path, start_step=2) as logger:
        logger.log(3, {"x": 3})
    assert [r["x"] for r in read_jsonl(path)] == [1, 2, 3]
    assert "torn" in caplog.text


def test_read_jsonl_names_file_and_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step":1}\nnot json\n{"step":3}\n')
    with pytest.raises(MetricsFileError, match=r"m\.jsonl:2: malformed"):
        read_jsonl(path)
    path.write_text('{"step":1}\n[1, 2]\n')
    with pytest.raises(MetricsFileError, match=r"m\.jsonl:2: .*not an object"):
        read_jsonl(path)
    with pytest.raises(FileNotFoundError, match="absent.jsonl"):
        read_jsonl(tmp_path / "absent.jsonl")


def test_malformed_middle_line_blocks_resume(tmp_path):
    (tmp_path / METRICS_FILE).write_text('{"step":1}\ngarbage\n{"step":3}\n')
    with pytest.raises(MetricsFileError, match=":2:"):
        _logger(tmp_path, start_step=1)
    with pytest.raises(ValueError, match="start_step"):
        _logger(tmp_path, start_step=-1)


def test_progress_bar_and_tensorboard_optional(tmp_path, capsys):
    with MetricsLogger(tmp_path, total_steps=3, tensorboard=True, progress=True) as logger:
        for step in (1, 2, 3):
            logger.log(step, _step_metrics(step))
    err = capsys.readouterr().err
    assert "3/3" in err and "reward=" in err and "tok/s=" in err
    assert len(read_jsonl(tmp_path / METRICS_FILE)) == 3


def test_fingerprint_logger_nested_values_and_truncation(tmp_path):
    with FingerprintLogger(tmp_path) as fp:
        for step in (1, 2, 3):
            fp.log(
                step,
                {
                    "plan_digest": f"sha-{step}",
                    "logprob_sum": torch.tensor([1.5, float("nan")]),
                    "param_checksum": {"w": np.float64(step)},
                },
            )
    records = read_jsonl(tmp_path / FINGERPRINT_FILE)
    assert records[0] == {
        "step": 1,
        "plan_digest": "sha-1",
        "logprob_sum": [1.5, None],
        "param_checksum": {"w": 1.0},
    }
    with FingerprintLogger(tmp_path, start_step=1) as fp:
        fp.log(2, {"plan_digest": "again"})
    assert [r["plan_digest"] for r in read_jsonl(tmp_path / FINGERPRINT_FILE)] == ["sha-1", "again"]


def test_summarize_timings_keys_and_shares():
    out = summarize_timings({"rollout": 3.0, "update": 1.0})
    assert out["timing/rollout_s"] == 3.0
    assert out["timing/rollout_share"] == pytest.approx(0.75)
    assert out["timing/update_share"] == pytest.approx(0.25)

    out = summarize_timings({"rollout": 3.0, "update": 1.0}, total_s=5.0)
    assert out["timing/step_s"] == 5.0
    assert out["timing/other_s"] == pytest.approx(1.0)
    shares = [v for k, v in out.items() if k.endswith("_share")]
    assert sum(shares) == pytest.approx(1.0)
    assert summarize_timings({"a": 0.0})["timing/a_share"] == 0.0

    with pytest.raises(ValueError, match="'rollout'"):
        summarize_timings({"rollout": -1.0})
    with pytest.raises(ValueError, match="reserved"):
        summarize_timings({"step": 1.0}, total_s=2.0)
    with pytest.raises(ValueError, match="without '/'"):
        summarize_timings({"a/b": 1.0})


def test_step_timer_sections_add_up():
    timer = StepTimer()
    for _ in range(2):
        with timer.section("rollout"):
            pass
    out = timer.metrics()
    assert out["timing/rollout_s"] >= 0
    assert out["timing/step_s"] >= out["timing/rollout_s"]
    assert out["timing/rollout_share"] + out["timing/other_share"] == pytest.approx(1.0)


class _FakeWriter:
    """Stands in for torch.utils.tensorboard.SummaryWriter (tensorboard is optional)."""

    instances: list[_FakeWriter] = []

    def __init__(self, log_dir, purge_step=None):
        self.log_dir, self.purge_step, self.scalars, self.closed = log_dir, purge_step, [], False
        _FakeWriter.instances.append(self)

    def add_scalar(self, key, value, step):
        self.scalars.append((key, value, step))

    def flush(self):
        pass

    def close(self):
        self.closed = True


def test_tensorboard_mirrors_scalars_and_purges_on_resume(tmp_path, monkeypatch):
    import types

    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = _FakeWriter
    monkeypatch.setitem(__import__("sys").modules, "torch.utils.tensorboard", fake)
    _FakeWriter.instances.clear()
    with _logger(tmp_path, start_step=4) as logger:
        logger.log(5, {"reward/mean": 0.5, "actor/loss": float("nan")})
    writer = _FakeWriter.instances[0]
    assert writer.purge_step == 5  # events after the checkpoint are dropped
    assert writer.scalars == [("reward/mean", 0.5, 5)]  # null values are not plotted
    assert writer.closed
    _logger(tmp_path, tensorboard=False).close()
    assert len(_FakeWriter.instances) == 1
