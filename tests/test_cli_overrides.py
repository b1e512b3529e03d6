"""``key.path=value`` overrides may stand before, between and after a subcommand's flags, as in
verl's and SkyRL's CLIs (issue 45 item 14); a token that is neither a flag nor an override is
refused with one line naming it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from trainer.cli import build_parser, main, split_overrides

GOLDEN_DIR = Path(__file__).parent / "golden"
GPU_7B = "configs/gpu/qwen2.5-7b-grpo.yaml"


def _one_line(err: str) -> str:
    err = err.strip()
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err
    return err


def test_layout_takes_an_override_after_the_flags(capsys):
    # The command: model.path before the flags, train.dp_size after them.
    argv = ["layout", "--config", GPU_7B, "model.path=M", "--nodes", "8"]
    code = main([*argv, "--devices-per-node", "8", "train.dp_size=64"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "8 node(s) x 8 devices, 64 of 64 used" in out
    assert "training: 64 ranks (train.dp_size)" in out
    assert "model.path='M'" in out  # the override before the flags holds too


def test_train_takes_overrides_on_both_sides_of_config(monkeypatch, tmp_path):
    import trainer.loop.start.run

    seen = {}
    monkeypatch.setattr(
        trainer.loop.start.run, "run_training", lambda cfg: seen.update(cfg=cfg) or 0
    )
    code = main(
        [
            "train",
            f"run.dir={tmp_path / 'run'}",
            "train.lr=0.5",
            "--config",
            "configs/cpu/tiny.yaml",
            "train.total_steps=7",
            "train.lr=0.25",  # the later of a repeated key wins, as typed
        ]
    )
    assert code == 0
    cfg = seen["cfg"]
    assert (cfg.train.total_steps, cfg.train.lr) == (7, 0.25)
    assert cfg.run.dir == str(tmp_path / "run")


def test_probe_takes_overrides_between_its_flags(monkeypatch, tmp_path):
    import trainer.commands.probe

    rollouts = tmp_path / "rollouts"
    shutil.copytree(GOLDEN_DIR / "tiny_rollouts", rollouts)
    seen = {}
    monkeypatch.setattr(
        trainer.commands.probe, "run_probe", lambda cfg, _r: seen.update(cfg=cfg) or 0
    )
    code = main(
        [
            "probe",
            "train.lr=0.125",
            "--config",
            str(GOLDEN_DIR / "tiny_cpu_fp32" / "config.yaml"),
            "--rollouts",
            str(rollouts),
            "train.mini_batch_size=1",
            "--steps",
            "2",
            "--out",
            str(tmp_path / "out"),
            "train.dp_size=2",
        ]
    )
    assert code == 0
    cfg = seen["cfg"]
    assert (cfg.train.lr, cfg.train.mini_batch_size, cfg.train.dp_size) == (0.125, 1, 2)
    assert cfg.train.total_steps == 2  # --steps still read as a flag


def test_doctor_reads_an_override_after_its_flag(capsys):
    # A bad value placed after --no-smoke reaches the config check (before: "unrecognized").
    assert main(["doctor", "device=cpu", "--no-smoke", "rollout.engine=bogus"]) == 2
    err = _one_line(capsys.readouterr().err)
    assert "config error" in err and "rollout.engine" in err and "bogus" in err


@pytest.mark.parametrize("command", ["train", "layout", "doctor"])
def test_an_unknown_flag_among_overrides_is_one_line(command, capsys):
    assert main([command, "train.lr=0.1", "--bogus", "train.total_steps=2"]) == 2
    err = _one_line(capsys.readouterr().err)
    assert f"crossrl {command}: unrecognized argument '--bogus'" in err
    assert "--config" in err and "key.path=value" in err


def test_a_bare_word_among_overrides_is_one_line_naming_it(capsys):
    assert main(["layout", "--nodes", "1", "dp_size64", "train.dp_size=2"]) == 2
    err = _one_line(capsys.readouterr().err)
    assert "'dp_size64'" in err and "key.path=value" in err


def test_split_keeps_flag_values_and_never_feeds_an_optional_flag():
    layout = build_parser().get_default("subcommands")["layout"]
    flags, overrides = split_overrides(
        layout,
        ["--conf", "a=b.yaml", "--measure", "train.dp_size=2", "--nodes=2", "x.y=1", "--", "z"],
    )
    # --conf abbreviates --config and takes its value even when it holds '='; --measure's
    # LAYERS is optional and never an override; tokens after -- stay positional.
    assert flags == ["--conf", "a=b.yaml", "--measure", "--nodes=2", "--", "z"]
    assert overrides == ["train.dp_size=2", "x.y=1"]
