"""Everything about the job's input is checked before Ray starts (issue 18): prompt files,
model directories, the resume target and the run directory fail with exit 2 and one line
naming the file, the line/row/field, the value and the fix. ``crossrl train`` is called
in-process: none of these may get as far as starting Ray (the test would then hang or train)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import ray

from rollout.models import builtin_weights_dir
from rollout.tokenizer import BUILTIN_TOKENIZER_DIR
from trainer.cli import main
from trainer.config import load_config
from trainer.records.checkpoint import begin_checkpoint, commit_checkpoint, save_json

QA = ["rollout.env=qa", "rollout.max_turns=1"]


def _train(tmp_path, capsys, *overrides: str) -> tuple[int, str]:
    code = main(["train", f"run.dir={tmp_path / 'run'}", *overrides])
    err = capsys.readouterr().err.strip()
    assert not ray.is_initialized(), "the check came after Ray started"
    return code, err


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


# ----------------------------------------------------------------------------- prompt files


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (
            b'{"prompt": "1+1", "answer": "2"}\n{"prompt": "2+2", "answer": "4"}\n{"prompt": \n',
            [":3: not valid JSON"],
        ),
        (
            b'{"prompt": "1+1", "answer": "2"}\n{"question": "2+2", "answer": "4"}\n',
            [":2:", 'field "prompt"', "None"],
        ),
        (
            b'{"prompt": "1+1", "answer": "2"}\n{"prompt": "caf\xe9", "answer": "4"}\n',
            [":2:", "not UTF-8", "0xe9"],
        ),
    ],
    ids=["bad-json-line-3", "missing-field", "non-utf8"],
)
def test_prompt_file_is_read_whole_before_start(tmp_path, capsys, content, expected):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes(content)
    code, err = _train(tmp_path, capsys, *QA, f"data.source={prompts}")
    assert code == 2
    line = _one_line(err)
    assert str(prompts) in line and all(part in line for part in expected), line
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- model dirs


@pytest.fixture
def model_dir(tmp_path) -> Path:
    """A loadable local HF model directory: the tiny model's weights and the tokenizer."""
    out = tmp_path / "model"
    shutil.copytree(builtin_weights_dir("builtin:tiny", 1), out)
    for item in BUILTIN_TOKENIZER_DIR.iterdir():
        shutil.copy2(item, out / item.name)
    return out


def _damage_weights_truncated(d: Path) -> None:
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])


def _damage_weights_random(d: Path) -> None:
    (d / "model.safetensors").write_bytes(bytes(range(256)) * 64)


def _damage_config(d: Path) -> None:
    (d / "config.json").write_text('{\n  "model_type": "qwen2",\n  "hidden_size": 64,,\n}\n')


def _no_weights(d: Path) -> None:
    (d / "model.safetensors").unlink()


def _no_tokenizer(d: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (d / name).unlink()


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (_damage_weights_truncated, "model.safetensors is truncated"),
        (_damage_weights_random, "model.safetensors is not a whole safetensors file"),
        (_damage_config, "config.json is not valid JSON (line 3"),
        (_no_weights, "no weights"),
        (_no_tokenizer, "no tokenizer there"),
    ],
    ids=["truncated-safetensors", "random-safetensors", "bad-config-json", "config-only", "no-tok"],
)
def test_model_directory_is_checked_before_start(tmp_path, capsys, model_dir, damage, expected):
    damage(model_dir)
    code, err = _train(tmp_path, capsys, f"model.path={model_dir}")
    assert code == 2
    line = _one_line(err)
    assert f"model.path='{model_dir}'" in line and expected in line, line


def test_a_whole_model_directory_passes(model_dir):
    from trainer.loop.start.preflight import model_dir_problem

    assert model_dir_problem("model.path", model_dir) is None


# ----------------------------------------------------------------------------- run.dir


def test_run_dir_that_is_a_file(tmp_path, capsys):
    (tmp_path / "run").write_text("not a directory\n")
    code, err = _train(tmp_path, capsys)
    assert code == 2
    line = _one_line(err)
    assert "is a file, not a directory" in line and str(tmp_path / "run") in line


def test_run_dir_below_a_file(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    code = main(["train", f"run.dir={tmp_path / 'file' / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and "is a file, not a directory" in _one_line(err)


def test_run_dir_that_cannot_be_written(tmp_path, capsys):
    locked = tmp_path / "ro"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if _writable(locked):
            pytest.skip("running as root: a read-only directory is still writable")
        code = main(["train", f"run.dir={locked / 'run'}"])
        err = capsys.readouterr().err
        assert code == 2 and "cannot create it in" in _one_line(err)
    finally:
        locked.chmod(0o700)


def _writable(directory: Path) -> bool:
    try:
        (directory / ".probe").write_text("")
    except OSError:
        return False
    (directory / ".probe").unlink()
    return True


# ----------------------------------------------------------------------------- resume target


def _committed(run_dir: Path, step: int) -> Path:
    staging = begin_checkpoint(run_dir, step)
    save_json({"step": step}, staging / "trainer_state.json")
    (staging / "actor_model.safetensors").write_bytes(b"\0" * 4096)
    return commit_checkpoint(run_dir, step, staging, keep_last=None)


@pytest.mark.parametrize("resume", ["auto", "latest", "step_2"])
def test_corrupt_checkpoint_fails_before_start_with_advice_that_works(tmp_path, capsys, resume):
    run_dir = tmp_path / "run"
    _committed(run_dir, 1)
    bad = _committed(run_dir, 2)
    weights = bad / "actor_model.safetensors"
    weights.write_bytes(b"\1" + weights.read_bytes()[1:])  # same size, one byte flipped
    code, err = _train(tmp_path, capsys, f"run.resume={resume}")
    assert code == 2
    line = _one_line(err)
    assert "actor_model.safetensors fails its sha256 check" in line
    assert "committed in" in line and "step_1, step_2" in line
    # The advice names forms the config accepts.
    assert load_config(None, [f"run.dir={run_dir}", "run.resume=step_1"]).run.resume == "step_1"
    assert load_config(None, [f"run.dir={run_dir}", "run.resume=latest"]).run.resume == "latest"


def test_truncated_checkpoint_and_missing_step_name_the_file(tmp_path, capsys):
    run_dir = tmp_path / "run"
    ckpt = _committed(run_dir, 1)
    (ckpt / "actor_model.safetensors").write_bytes(b"\0" * 10)
    code, err = _train(tmp_path, capsys, "run.resume=step_1")
    assert code == 2 and "has 10 bytes, manifest says 4096" in _one_line(err)
    code, err = _train(tmp_path, capsys, "run.resume=step_7")
    assert code == 2 and "step_7 does not exist" in _one_line(err)


def test_an_unreadable_manifest_is_named(tmp_path, capsys):
    run_dir = tmp_path / "run"
    ckpt = _committed(run_dir, 1)
    (ckpt / "manifest.json").write_text(json.dumps({"files": 3}))
    code, err = _train(tmp_path, capsys)
    assert code == 2 and "manifest.json is unreadable" in _one_line(err)


# ----------------------------------------------------------------------------- layout


def test_a_layout_the_machine_cannot_hold_fails_before_ray(tmp_path, capsys):
    # 4 ranks on a local Ray of 2 CPUs: trainer.loop.plan.layout refuses it before Ray starts.
    code = main(["train", f"run.dir={tmp_path / 'run'}", "train.dp_size=4", "ray.num_cpus=2"])
    line = _one_line(capsys.readouterr().err)
    assert code == 2
    assert "train.dp_size=4 needs 4 CPU devices" in line and "lower train.dp_size" in line
    assert not ray.is_initialized() and not (tmp_path / "run").exists()
