"""``crossrl parity``, ``probe`` and ``plot`` read damaged inputs with one line naming the file
and exit 2, never a traceback (issue 18)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from trainer.cli import main

GOLDEN_DIR = Path(__file__).parent / "golden"
GOLDEN = GOLDEN_DIR / "tiny_cpu_fp32"


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err
    return err


# ----------------------------------------------------------------------------- parity


@pytest.fixture
def good_run(tmp_path) -> Path:
    run = tmp_path / "good"
    shutil.copytree(GOLDEN, run)
    return run


def test_parity_on_a_directory_named_fingerprint_jsonl(tmp_path, good_run, capsys):
    bad = tmp_path / "bad"
    (bad / "fingerprint.jsonl").mkdir(parents=True)
    shutil.copy(good_run / "config.yaml", bad / "config.yaml")
    assert main(["parity", str(good_run), str(bad)]) == 2
    err = _one_line(capsys)
    assert str(bad / "fingerprint.jsonl") in err and "cannot be read as a file" in err


def test_parity_on_a_non_utf8_config(tmp_path, good_run, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(good_run, bad)
    (bad / "config.yaml").write_bytes(b"train:\n  param_dtype: float32 # \xff\n")
    assert main(["parity", str(good_run), str(bad)]) == 2
    err = _one_line(capsys)
    assert str(bad / "config.yaml") in err and "not UTF-8" in err and "line 2" in err


def test_parity_on_a_non_utf8_fingerprint_file(tmp_path, good_run, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(good_run, bad)
    (bad / "fingerprint.jsonl").write_bytes(b'{"step": 1}\n{"step": \xfe2}\n')
    assert main(["parity", str(good_run), str(bad)]) == 2
    err = _one_line(capsys)
    assert str(bad / "fingerprint.jsonl") in err and "not UTF-8" in err


# ----------------------------------------------------------------------------- probe


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _random_bytes(path: Path) -> None:
    path.write_bytes(bytes((i * 37 + 11) % 256 for i in range(4096)))


def _directory(path: Path) -> None:
    path.unlink()
    path.mkdir()


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (_truncate, "not an npz archive"),
        (_random_bytes, "not an npz archive"),
        (_directory, "not a file"),
    ],
    ids=["truncated", "random-bytes", "directory"],
)
def test_probe_checks_every_recorded_step_up_front(tmp_path, capsys, damage, expected):
    rollouts = tmp_path / "rollouts"
    shutil.copytree(GOLDEN_DIR / "tiny_rollouts", rollouts)
    damage(rollouts / "step_3.npz")  # the last step: found before step 1 runs
    code = main(
        [
            "probe",
            "--config",
            str(GOLDEN / "config.yaml"),
            "--rollouts",
            str(rollouts),
            "--steps",
            "3",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    assert code == 2
    err = _one_line(capsys)
    assert str(rollouts / "step_3.npz") in err and expected in err
    assert "pickled" not in err
    assert not (tmp_path / "out").exists()


def test_a_damaged_member_inside_a_whole_zip_is_named(tmp_path):
    import zipfile

    from rollout.replay import RecordingError, load_rollout

    path = tmp_path / "step_1.npz"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("row/uid.npy", b"\x93NUMPY garbage")
    with pytest.raises(RecordingError, match=r"step_1\.npz: damaged recording"):
        load_rollout(path)


# ----------------------------------------------------------------------------- plot


def test_plot_on_a_directory_named_metrics_jsonl(tmp_path, capsys):
    (tmp_path / "run" / "metrics.jsonl").mkdir(parents=True)
    assert main(["plot", str(tmp_path / "run")]) == 2
    err = _one_line(capsys)
    assert str(tmp_path / "run" / "metrics.jsonl") in err and "cannot be read as a file" in err


def test_plot_on_a_non_utf8_metrics_file(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_bytes(b'{"step": 1, "reward/mean": 0.\xe95}\n')
    assert main(["plot", str(tmp_path / "run")]) == 2
    err = _one_line(capsys)
    assert "metrics.jsonl" in err and "not UTF-8" in err and "line 1" in err


def test_plot_into_an_out_that_is_a_file(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')
    (tmp_path / "plots").write_text("x")
    assert main(["plot", str(tmp_path / "run"), "--out", str(tmp_path / "plots")]) == 2
    assert "cannot be made a directory" in _one_line(capsys)
