"""Config input that used to pass silently or end in a traceback: non-finite numbers, duplicate
YAML keys, a config file that is not UTF-8 (issue 18). Each fails in the first second with one
line naming the key or file, the value and the fix; the CLI exits 2."""

from __future__ import annotations

import pytest

from trainer.cli import main
from trainer.config import ConfigError, load_config


@pytest.mark.parametrize(
    ("override", "key", "shown"),
    [
        ("train.lr=.inf", "train.lr", "inf"),
        ("train.lr=.nan", "train.lr", "nan"),
        ("algorithm.kl_coef=.inf", "algorithm.kl_coef", "inf"),
        ("rollout.temperature=.inf", "rollout.temperature", "inf"),
        ("train.grad_clip=.inf", "train.grad_clip", "inf"),
        ("ray.placement_timeout_s=.inf", "ray.placement_timeout_s", "inf"),
        ("rollout.env_kwargs={scale: [1.0, .nan]}", "rollout.env_kwargs", "scale.1 is nan"),
    ],
)
def test_non_finite_numbers_are_rejected(override, key, shown):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert info.value.key == key
    message = str(info.value)
    assert "\n" not in message and shown in message and "finite" in message


def test_non_finite_lr_exits_2_before_anything_runs(tmp_path, capsys):
    assert main(["train", "train.lr=.inf", f"run.dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "train.lr: got inf" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("train:\n  lr: 1.0e-3\n  batch_size: 8\n  lr: 2.0e-3\n", "line 4"),
        ("train: {lr: 1.0e-3, lr: 2.0e-3}\n", "line 1"),
    ],
    ids=["block", "flow"],
)
def test_duplicate_yaml_keys_are_named_with_their_line(tmp_path, text, line):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path, [])
    message = str(info.value)
    assert "'lr' appears twice" in message and str(path) in message
    assert message.startswith(f"{path}: {line}: ")


def test_non_utf8_config_file_is_one_line(tmp_path, capsys):
    path = tmp_path / "job.yaml"
    path.write_bytes(b"train:\n  lr: 1.0e-3\n# caf\xe9\n")
    assert main(["train", "--config", str(path), f"run.dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert str(path) in err and "not UTF-8" in err and "line 3" in err and "0xe9" in err


def test_non_utf8_included_file_is_named(tmp_path):
    (tmp_path / "base.yaml").write_bytes(b"seed: 3 # \xff\n")
    job = tmp_path / "job.yaml"
    job.write_text("include: base.yaml\n")
    with pytest.raises(ConfigError, match=r"base\.yaml: not UTF-8 text \(byte 0xff on line 1\)"):
        load_config(job, [])
