"""The memory budget on an NPU (issue 33): the preflight's device query makes no device context in
the driver (asked in a child process, ``hal.device_total_memory``), and every process's overhead
counts the buffers of the communicators it builds (``hal.communicator_buffer_bytes``: 2 x
HCCL_BUFFSIZE MB per communicator, CANN's default 200). Device-free: fakes stand in for the
driver."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import hal
from hal.device_memory import communicator_buffer_bytes, device_total_memory
from trainer.config import load_config
from trainer.loop.plan.memory_budget import CONTEXT_BYTES, budget_for
from trainer.loop.plan.memory_report import device_memory

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20


def _budget(*overrides: str, communicator_bytes: float | None = None):
    cfg = load_config(
        str(ROOT / "configs" / "npu" / "qwen2.5-7b-grpo.yaml"),
        list(overrides),
        check_environment=False,
    )
    budget = budget_for(cfg, "npu", 64e9, "default")
    if communicator_bytes is not None:
        from trainer.loop.plan.memory_budget import estimate_memory

        budget = estimate_memory(
            cfg,
            budget.shape,
            64e9,
            device="npu",
            critic_shape=budget.critic_shape,
            communicator_bytes=communicator_bytes,
        )
    return cfg, budget


# ----------------------------------------------------------------------------- communicators


def test_an_hccl_communicator_holds_twice_hccl_buffsize(monkeypatch):
    monkeypatch.delenv("HCCL_BUFFSIZE", raising=False)
    assert communicator_buffer_bytes("npu") == 2 * 200 * MIB
    assert communicator_buffer_bytes("npu", {"HCCL_BUFFSIZE": "120"}) == 2 * 120 * MIB
    assert communicator_buffer_bytes("cuda") == 0.0 and communicator_buffer_bytes("cpu") == 0.0
    with pytest.raises(ValueError, match=r"HCCL_BUFFSIZE='lots'.*whole number"):
        communicator_buffer_bytes("npu", {"HCCL_BUFFSIZE": "lots"})


def test_every_training_process_adds_its_communicators_buffers(monkeypatch):
    monkeypatch.delenv("HCCL_BUFFSIZE", raising=False)
    comm = 2 * 200 * MIB
    cfg, counted = _budget("rollout.tensor_parallel_size=1")
    _, without = _budget("rollout.tensor_parallel_size=1", communicator_bytes=0.0)
    training = 1 + (cfg.algorithm.kl_coef > 0) + cfg.critic.enable  # actor, ref, critic
    for phase in counted.phases:
        extra = phase.parts["ctx"] - without.phase(phase.name).parts["ctx"]
        assert extra == pytest.approx(training * comm), phase.name
    # the context count itself is unchanged: one per training process and one for the engine
    assert without.phase("update").parts["ctx"] == pytest.approx((training + 1) * CONTEXT_BYTES)


def test_a_tensor_parallel_engine_adds_one_communicator_per_device(monkeypatch):
    monkeypatch.delenv("HCCL_BUFFSIZE", raising=False)
    comm = 2 * 200 * MIB
    _, tp1 = _budget("rollout.tensor_parallel_size=1")
    _, tp2 = _budget("rollout.tensor_parallel_size=2")
    assert tp2.phase("rollout").parts["ctx"] - tp1.phase("rollout").parts["ctx"] == (
        pytest.approx(comm)
    )


def test_a_smaller_hccl_buffsize_lowers_the_budget(monkeypatch):
    monkeypatch.setenv("HCCL_BUFFSIZE", "50")
    _, small = _budget()
    monkeypatch.delenv("HCCL_BUFFSIZE")
    _, default = _budget()
    assert small.peak.total < default.peak.total


# ----------------------------------------------------------------------------- the query


def test_the_driver_asks_for_the_devices_memory_in_a_child_process(monkeypatch):
    """An in-process ``get_device_properties(0)`` makes a context on die 0 that the driver
    keeps for the whole run; the budget must not make one."""
    in_process = []

    def no_backend(name):
        in_process.append(name)
        raise AssertionError("queried the device in the driver process")

    monkeypatch.setattr(hal, "available_backends", lambda: ["npu", "cpu"])
    monkeypatch.setattr(hal, "get_backend", no_backend)
    monkeypatch.setattr(hal, "device_total_memory", lambda name: 65.5e9)
    assert device_memory("npu") == (65.5e9, "this machine's npu device 0")
    assert in_process == []
    monkeypatch.setattr(hal, "device_total_memory", lambda name: None)
    memory, source = device_memory("npu")
    assert memory == 64e9 and "default" in source


def test_device_total_memory_reads_the_childs_answer():
    calls = []

    def run(argv, **kwargs):
        calls.append(argv)
        return subprocess.CompletedProcess(argv, 0, stdout="warming up\n65536000000\n")

    assert device_total_memory("npu", run=run) == 65536000000.0
    assert calls[0][0] == sys.executable and calls[0][-1] == "npu"

    def failing(argv, **kwargs):
        return subprocess.CompletedProcess(argv, 1, stdout="", stderr="no driver")

    def hanging(argv, **kwargs):
        raise subprocess.TimeoutExpired(argv, kwargs["timeout"])

    assert device_total_memory("npu", run=failing) is None
    assert device_total_memory("npu", run=hanging) is None


def test_a_real_child_without_the_device_says_nothing():
    # the CPU backend's module has no device properties: the child fails, the answer is None
    assert device_total_memory("cpu", timeout_s=120) is None


def test_a_bad_buffer_size_is_one_line_before_start_up(monkeypatch):
    from trainer.loop.start.preflight import PreflightError, _check_memory

    monkeypatch.setenv("HCCL_BUFFSIZE", "lots")
    cfg = load_config("configs/npu/qwen2.5-7b-grpo.yaml", [], check_environment=False)
    with pytest.raises(PreflightError) as info:
        _check_memory(cfg)
    text = str(info.value)
    assert "HCCL_BUFFSIZE='lots'" in text and "\n" not in text
