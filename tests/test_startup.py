"""Start-up: the clock behind ``timing/startup_*`` and a driver that checks a job before it
imports torch or starts Ray (so a bad config fails in about a second)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from trainer.loop.cluster.startup import (
    Phases,
    StartupClock,
    import_in_background,
    process_start_time,
)


def _python(code: str) -> str:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout


def test_process_start_time_is_when_the_process_started():
    if process_start_time() is None:
        pytest.skip("no /proc/self/stat on this system")
    launched = time.time()
    out = json.loads(
        _python(
            "import json, time; from trainer.loop.cluster.startup import process_start_time; "
            "print(json.dumps([process_start_time(), time.time()]))"
        )
    )
    started, asked = out
    # Clock ticks are 10 ms; the process starts after the launch and before it asks.
    assert launched - 0.05 <= started <= asked


def test_phases_add_up_in_order_and_repeat():
    phases = Phases(origin=100.0)
    phases.done("boot", at=101.5)
    phases.done("model", at=104.0)
    phases.done("boot", at=104.5)  # a repeated phase adds up
    assert phases.seconds == {"boot": 2.0, "model": 2.5}
    assert phases.total_s == 4.5


def test_clock_reports_once_with_worker_phases():
    clock = StartupClock()
    clock.begin(50.0)
    clock.done("config", at=51.0)
    clock.done("ray_init", at=53.0)
    clock.add_worker("actor", {"build": 0.5})
    clock.start_run()  # the CLI's origin is kept for the run it starts
    assert clock.origin == 50.0
    first = clock.metrics()
    assert first == {
        "timing/startup_s": 3.0,
        "timing/startup_config_s": 1.0,
        "timing/startup_ray_init_s": 2.0,
        "timing/startup_actor_build_s": 0.5,
    }
    assert clock.metrics() == {}  # later steps carry no start-up keys
    clock.start_run()  # a second run in one process counts from its own start
    assert clock.origin > 50.0 and clock.seconds == {} and clock.workers == {}


def test_background_import_loads_modules_and_leaves_errors_to_the_caller():
    thread = import_in_background(["json", "no_such_module_for_crossrl"])
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert "json" in sys.modules


def test_config_and_preflight_import_neither_torch_nor_ray_workers(tmp_path):
    out = _python(
        "import sys\n"
        "from trainer.config import load_config\n"
        f"cfg = load_config(None, ['run.dir={tmp_path / 'run'}'])\n"
        "import trainer.loop.start.run\n"
        "from trainer.loop.start.preflight import preflight\n"
        "preflight(cfg)\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    assert out.strip() == "[]"
