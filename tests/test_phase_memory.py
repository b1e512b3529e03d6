"""Each phase's device-wide peak (``trainer.loop.schedule.phase_memory``): sampled through the
controller's step timer, written per step as ``memory/device_<phase>_gb``, and held against
``crossrl layout``'s budget by ``bench.phase_budget``. The CPU has no device-wide reading, so
the job here reads a fake device whose use the test sets per phase."""

from __future__ import annotations

import functools
import json
import threading

import pytest

import hal
from bench import phase_budget
from hal.device_memory import _visible_indices, device_used_reader
from trainer.config import load_config
from trainer.loop.schedule.phase_memory import PhaseMemory, measured
from trainer.loop.start.run import run_training
from trainer.records.timings import StepTimer

SHORT = ["train.batch_size=4", "train.mini_batch_size=2", "rollout.n=4", "train.total_steps=2"]


class _Device:
    """A device whose bytes in use are whatever the test sets."""

    def __init__(self) -> None:
        self.used = 0
        self.reads = 0
        self.lock = threading.Lock()

    def read(self) -> int:
        with self.lock:
            self.reads += 1
            return self.used


def test_each_phase_keeps_its_own_peak_and_a_short_phase_still_reads():
    device = _Device()
    memory = PhaseMemory(device.read, interval_s=0.001)
    try:
        timer = StepTimer(watch=functools.partial(measured, memory))
        with timer.section("rollout"):
            device.used = 7_000_000_000
            while device.reads < 5:  # the thread samples while the phase runs
                pass
            device.used = 3_000_000_000
        device.used = 2_000_000_000
        with timer.section("update"):  # shorter than the interval: read at its start and end
            pass
        assert memory.metrics() == {
            "memory/device_rollout_gb": 7.0,
            "memory/device_update_gb": 2.0,
        }
        assert memory.metrics() == {}  # each step starts afresh
        assert set(timer.sections) == {"rollout", "update"}  # the timer still times them
    finally:
        memory.stop()


def test_no_reading_where_the_device_has_none():
    assert device_used_reader("cpu") is None
    assert device_used_reader("npu") is None
    assert PhaseMemory.for_device("cpu") is None
    # the physical devices a process sees, as NVML numbers them
    assert _visible_indices({}, 3) == [0, 1, 2]
    assert _visible_indices({"CUDA_VISIBLE_DEVICES": "2,0"}, 4) == [2, 0]
    assert _visible_indices({"CUDA_VISIBLE_DEVICES": "GPU-1a2b,5"}, 4) == []


def test_a_run_records_every_phases_peak_and_the_budget_table_reads_them(
    tmp_path, monkeypatch, capsys
):
    device = _Device()
    device.used = 1_500_000_000
    monkeypatch.setattr(hal, "device_used_reader", lambda name: device.read)
    run_dir = tmp_path / "run"
    cfg = load_config(None, [*SHORT, "device=cpu", f"run.dir={run_dir}"])
    assert run_training(cfg) == 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        for phase in ("rollout", "prepare", "update", "sync", "push"):
            assert record[f"memory/device_{phase}_gb"] == pytest.approx(1.5)
    res = phase_budget.compare(run_dir)
    assert [p["phase"] for p in res["phases"]] == ["rollout", "update", "weight push"]
    for p in res["phases"]:
        assert p["measured_gb"] == pytest.approx(1.5) and p["estimate_gb"] > 0
        assert p["ratio"] == pytest.approx(p["estimate_gb"] / 1.5)
    assert phase_budget.main([str(run_dir)]) == 0
    assert "| weight push | push |" in capsys.readouterr().out


def test_the_push_inside_sync_reads_after_the_ranks_release_their_memory():
    """The sync section starts with the update's cache still held; the push phase, nested in
    it, starts once the ranks have released it: its peak is the push's own."""
    device = _Device()
    memory = PhaseMemory(device.read, interval_s=60.0)  # readings at phase edges only
    try:
        timer = StepTimer(watch=functools.partial(measured, memory))
        with timer.section("sync"):
            device.used = 40_000_000_000  # the update's cache, until the ranks release it
            memory.enter("offload")
            memory.leave("offload")
            device.used = 30_000_000_000
            with measured(memory, "push"):
                device.used = 33_000_000_000  # staging beside the engine's woken weights
        with measured(None, "push"):  # no reading here: nothing recorded, nothing raised
            pass
        peaks = memory.metrics()
        assert peaks["memory/device_sync_gb"] == 40.0
        assert peaks["memory/device_push_gb"] == 33.0
    finally:
        memory.stop()


def test_the_budget_table_names_a_directory_that_is_no_run(tmp_path, capsys):
    assert phase_budget.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "metrics.jsonl" in err and str(tmp_path) in err
