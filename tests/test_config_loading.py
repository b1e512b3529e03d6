"""Reading YAML with includes, overrides, writing a resolved config and reading it back."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from trainer.config import (
    Config,
    ConfigError,
    all_keys,
    default_config_path,
    load_config,
    main_check,
    parse_override,
    read_yaml,
)
from trainer.loop.start.run import write_run_config


def _write(path: Path, data: dict | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def test_include_deep_merges_and_including_file_wins(tmp_path):
    _write(
        tmp_path / "base" / "common.yaml",
        {"train": {"lr": 1e-4, "batch_size": 16, "mini_batch_size": 8}, "seed": 5},
    )
    _write(tmp_path / "base" / "model.yaml", {"model": {"dtype": "bfloat16"}, "seed": 6})
    job = _write(
        tmp_path / "gpu" / "job.yaml",
        "include: [../base/common.yaml, ../base/model.yaml]\ntrain:\n  lr: 3.0e-5\n",
    )
    cfg = load_config(job, check_environment=False)
    assert cfg.train.lr == 3e-5  # the including file wins
    assert cfg.train.batch_size == 16  # siblings in the same section survive
    assert cfg.train.mini_batch_size == 8
    assert cfg.seed == 6  # a later include wins over an earlier one
    assert cfg.model.dtype == "bfloat16"
    assert cfg.train.total_steps == Config().train.total_steps  # unset keys: schema default


def test_nested_and_diamond_includes(tmp_path):
    _write(tmp_path / "root.yaml", {"train": {"total_steps": 7}})
    _write(tmp_path / "a.yaml", "include: root.yaml\nseed: 2\n")
    _write(tmp_path / "b.yaml", "include: root.yaml\nrun: {dir: out}\n")
    top = _write(tmp_path / "top.yaml", "include: [a.yaml, b.yaml]\n")
    cfg = load_config(top, check_environment=False)
    assert (cfg.train.total_steps, cfg.seed, cfg.run.dir) == (7, 2, "out")


def test_include_null_replaces_a_value(tmp_path):
    _write(tmp_path / "base.yaml", {"train": {"max_tokens_per_micro_batch": 4096}})
    job = _write(
        tmp_path / "job.yaml", "include: base.yaml\ntrain:\n  max_tokens_per_micro_batch: null\n"
    )
    assert load_config(job, check_environment=False).train.max_tokens_per_micro_batch is None


@pytest.mark.parametrize(
    "files",
    [
        {"a.yaml": "include: a.yaml\n"},
        {
            "a.yaml": "include: b.yaml\n",
            "b.yaml": "include: sub/c.yaml\n",
            "sub/c.yaml": "include: ../a.yaml\n",
        },
    ],
    ids=["self", "three-files"],
)
def test_include_cycle_is_an_error(tmp_path, files):
    for name, text in files.items():
        _write(tmp_path / name, text)
    with pytest.raises(ConfigError) as info:
        read_yaml(tmp_path / "a.yaml")
    assert info.value.key == "include"
    assert "cycle" in str(info.value)


def test_missing_include_names_the_including_file(tmp_path):
    job = _write(tmp_path / "job.yaml", "include: nope.yaml\n")
    with pytest.raises(ConfigError) as info:
        read_yaml(job)
    assert info.value.key == "include"
    assert "nope.yaml" in str(info.value) and "job.yaml" in str(info.value)


def test_missing_config_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "absent.yaml")
    bad = _write(tmp_path / "bad.yaml", "train: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    listy = _write(tmp_path / "list.yaml", "- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(listy)


@pytest.mark.parametrize(
    ("text", "key", "value"),
    [
        ("train.lr=1e-3", "train.lr", 1e-3),
        ("train.lr=1.5E+2", "train.lr", 150.0),
        ("rollout.step_wise=true", "rollout.step_wise", True),
        ("rollout.step_wise=false", "rollout.step_wise", False),
        ("train.batch_size=3", "train.batch_size", 3),
        ("train.max_tokens_per_micro_batch=null", "train.max_tokens_per_micro_batch", None),
        ("ray.address=", "ray.address", None),
        ("ray.address=10.0.0.1:6379", "ray.address", "10.0.0.1:6379"),
        ("run.dir=runs/a=b", "run.dir", "runs/a=b"),
        ("rollout.env=my_pkg.envs:Maze", "rollout.env", "my_pkg.envs:Maze"),
        ("seed=-4", "seed", -4),
        (" device = cpu", "device", "cpu"),
    ],
)
def test_parse_override_reads_yaml_values(text, key, value):
    got_key, got = parse_override(text)
    assert got_key == key
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize("text", ["train.lr", "=3", "train..lr=1", "include=x.yaml", "1x=2"])
def test_malformed_override_is_an_error(text):
    with pytest.raises(ConfigError):
        parse_override(text)


def test_overrides_apply_after_includes(tmp_path):
    job = _write(tmp_path / "job.yaml", {"train": {"lr": 1e-4}, "ray": {"address": None}})
    cfg = load_config(job, ["train.lr=2e-5", "ray.address=auto", "rollout={n: 6, max_turns: 2}"])
    assert cfg.train.lr == 2e-5
    assert cfg.ray.address == "auto"
    assert (cfg.rollout.n, cfg.rollout.max_turns) == (6, 2)
    assert cfg.rollout.max_new_tokens == Config().rollout.max_new_tokens  # merged, not replaced


def test_override_into_a_value_is_an_error():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["seed.x=1"])
    assert info.value.key == "seed.x"
    assert "not a section" in str(info.value)


def test_exponent_floats_in_yaml_files_are_floats(tmp_path):
    job = _write(tmp_path / "job.yaml", "train:\n  lr: 1e-6\ncritic:\n  lr: 5E-5\n")
    cfg = load_config(job)
    assert cfg.train.lr == 1e-6 and cfg.critic.lr == 5e-5


def test_run_config_yaml_loads_back_as_the_same_config(tmp_path):
    cfg = load_config(
        None,
        [
            "train.lr=3e-4",
            "rollout.n=3",
            "train.max_tokens_per_micro_batch=null",
            "ray.address=head:6379",
            "algorithm.loss_agg=seq-mean-token-sum-norm",
            "algorithm.loss_agg_horizon=32",
            "run.dir=runs/x y",
        ],
    )
    run_dir = tmp_path / "run"
    _write(run_dir / "config.yaml", "stale: true\n")  # a resumed run rewrites its config.yaml
    write_run_config(cfg, run_dir, {"use_deterministic_algorithms": "true"})
    out = run_dir / "config.yaml"
    assert out.read_text().startswith(cfg.to_yaml())
    assert [p.name for p in run_dir.iterdir()] == ["config.yaml"]  # no temp file left
    again = load_config(out)  # the deterministic settings are comments: it still loads
    assert again == cfg
    assert again.flat() == cfg.flat()


def test_default_config_is_the_cpu_tiny_job():
    path = default_config_path()
    assert path.is_file()
    assert path.parts[-3:] == ("configs", "cpu", "tiny.yaml")
    assert load_config(None) == load_config(path)


def test_flat_has_every_schema_key():
    cfg = Config()
    assert list(cfg.flat()) == all_keys()
    assert cfg.get("train.lr") == cfg.train.lr
    with pytest.raises(KeyError):
        cfg.get("train.nope")


def test_main_check_exit_codes(capsys):
    assert main_check(["--no-env-check", "train.lr=2e-4"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["train"]["lr"] == 2e-4
    assert main_check(["rollout.temperature=0"]) == 2
    assert "rollout.temperature" in capsys.readouterr().err
    assert main_check(["--config"]) == 2
