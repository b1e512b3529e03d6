"""`crossrl plot`: PNG curves from metrics.jsonl."""

from __future__ import annotations

import math
import struct
import sys

import pytest

from trainer.commands.plot import DEFAULT_KEYS, PlotDependencyError, main, plot_run
from trainer.records.metrics import METRICS_FILE, MetricsLogger

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _write_run(run_dir, steps: int) -> None:
    with MetricsLogger(run_dir, total_steps=steps, progress=False, tensorboard=False) as logger:
        for step in range(1, steps + 1):
            logger.log(
                step,
                {
                    "reward/mean": math.tanh(step / 10),
                    "actor/loss": 1.0 / step,
                    "actor/grad_norm": 0.5 + 0.1 * math.sin(step),
                    "batch/token_efficiency": 0.9,
                    # a NaN step is written as null and skipped on the curve
                    "timing/step_s": float("nan") if step == 2 else 2.0,
                },
            )


def test_plot_writes_one_png_per_metric_and_overview(tmp_path):
    _write_run(tmp_path, 30)  # enough points for the moving-mean overlay
    paths = plot_run(tmp_path)
    names = [p.name for p in paths]
    assert names == [k.replace("/", "_") + ".png" for k in DEFAULT_KEYS] + ["overview.png"]
    for path in paths:
        assert path.parent == tmp_path / "plots"
        width, height = _png_size(path)
        assert width >= 300 and height >= 200
        assert path.stat().st_size > 5_000  # a drawn curve, not an empty canvas
    overview_w, _ = _png_size(paths[-1])
    assert overview_w > _png_size(paths[0])[0]  # the grid is wider than one panel


def test_plot_out_dir_and_missing_metric(tmp_path):
    _write_run(tmp_path, 3)
    out = tmp_path / "elsewhere"
    paths = plot_run(tmp_path, out, keys=["reward/mean", "critic/value_loss"])
    # a metric the run never logged gets no PNG, only a "no data" panel in the overview
    assert [p.name for p in paths] == ["reward_mean.png", "overview.png"]
    assert all(p.parent == out for p in paths)


def test_plot_clear_errors_for_missing_or_empty_metrics(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl not found.*does not exist"):
        plot_run(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="metrics.jsonl not found"):
        plot_run(tmp_path)
    (tmp_path / METRICS_FILE).write_text("")
    with pytest.raises(ValueError, match="no steps yet"):
        plot_run(tmp_path)
    (tmp_path / METRICS_FILE).write_text('{"reward/mean": 1}\n')
    with pytest.raises(ValueError, match="no integer 'step'"):
        plot_run(tmp_path)
    assert not (tmp_path / "plots").exists()


def test_plot_without_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    _write_run(tmp_path, 2)
    for name in list(sys.modules):
        if name == "matplotlib" or name.startswith("matplotlib."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(PlotDependencyError, match="pip install matplotlib") as info:
        plot_run(tmp_path)
    assert isinstance(info.value, ValueError)  # `crossrl plot` reports it as bad input


def test_module_main_prints_paths_and_exit_codes(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert "metrics.jsonl not found" in capsys.readouterr().err
    _write_run(tmp_path, 2)
    assert main([str(tmp_path)]) == 0
    printed = capsys.readouterr().out.split()
    assert printed[-1].endswith("overview.png")


def test_plot_compares_runs_on_the_same_panels(tmp_path, capsys):
    from trainer.cli import main as cli

    for name, steps in (("lag0", 30), ("lag1", 25)):
        _write_run(tmp_path / name, steps)
    out = tmp_path / "plots"
    code = cli(
        ["plot", str(tmp_path / "lag0"), "--compare", str(tmp_path / "lag1"), "--out", str(out)]
    )
    assert code == 0
    assert (out / "reward_mean.png").is_file() and (out / "overview.png").is_file()
    paths = plot_run(tmp_path / "lag0", tmp_path / "single", keys=["reward/mean"])
    # two runs' lines make a different picture from one run's
    assert (out / "reward_mean.png").read_bytes() != paths[0].read_bytes()
    # runs whose folders share a name are told apart by their parents'
    from trainer.commands.plot import _labels

    assert _labels([tmp_path / "lag0" / "run", tmp_path / "lag1" / "run"]) == [
        "lag0/run",
        "lag1/run",
    ]
    # a compared run that is missing is named, as the main one would be
    code = cli(["plot", str(tmp_path / "lag0"), "--compare", str(tmp_path / "nope")])
    assert code == 2
    assert "nope" in capsys.readouterr().err
