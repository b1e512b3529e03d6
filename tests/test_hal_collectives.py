"""What each device's backend says about its collectives failing (issue 45 items 7 and 9):
the environment that turns a stuck collective into a failed one (HCCL's timeouts just under
the process group's, as torch_npu 2.10.0.post4 wants, and its heartbeat monitor), and the
words its library uses for a broken collective, which the restart path reads."""

from __future__ import annotations

import pytest

import hal

#: What torch_npu raises when HCCL reports a timed-out operator (HCCL_CHECK_ERROR's words):
#: a plain RuntimeError, no torch.distributed class.
HCCL_TIMEOUT = (
    "save_pieces:build/CMakeFiles/torch_npu.dir/compiler_depend.ts:2060 HCCL function error: "
    "HcclAllGather(inputPtr, outputPtr, numel, dataType, comm, stream), error code is 9\n"
    "[ERROR] 2026-11-28-00:00:00 (PID:4242, Device:1, RankID:1) ERR02200 DIST call hccl api "
    "failed.\nEI0002: The wait execution of the Notify register times out."
)


def test_collective_timeout_reaches_each_device_librarys_watchdog():
    assert hal.backend_class("cpu")().collective_timeout_env(90) == {}
    cuda = hal.backend_class("cuda")().collective_timeout_env(90, environ={})
    assert cuda == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    npu = hal.backend_class("npu")()
    env = npu.collective_timeout_env(90.5, environ={})
    assert env["HCCL_ASYNC_ERROR_HANDLING"] == "1" and env["TORCH_HCCL_ENABLE_MONITORING"] == "1"
    mine = {"HCCL_EXEC_TIMEOUT": "0"}  # the user's own value wins
    assert "HCCL_EXEC_TIMEOUT" not in npu.collective_timeout_env(90, environ=mine)


@pytest.mark.parametrize("group_s", [3.0, 20.0, 90.5, 600.0, 1800.0, 7200.0, 86400.0])
def test_hccl_exec_timeout_stays_under_the_process_group_s(group_s):
    """torch_npu 2.10.0.post4's ProcessGroupHCCL warns "The watchdog timeout <group> ms ... is
    less than or equal to HCCL execution timeout <exec> ms! The plog may not be recorded."
    when the group's timeout is not above HCCL_EXEC_TIMEOUT: every group of the job then
    warned, and HCCL never got to record the failed operator. Its heartbeat monitor, off by
    default, is on."""
    from hal.npu import HCCL_OP_WAIT_OFFSET_S

    env = hal.backend_class("npu")().collective_timeout_env(group_s, environ={})
    exec_s = int(env["HCCL_EXEC_TIMEOUT"])
    assert 1 <= exec_s and exec_s * 1000 < group_s * 1000  # torch_npu's own comparison, in ms
    if group_s >= 120:  # the event wait after it comes before the group's timeout too
        assert exec_s + HCCL_OP_WAIT_OFFSET_S < group_s
    assert 120 <= int(env["HCCL_CONNECT_TIMEOUT"]) <= 7200  # CANN's range
    assert env["TORCH_HCCL_ENABLE_MONITORING"] == "1"
    assert int(env["TORCH_HCCL_HEARTBEAT_TIMEOUT_SEC"]) >= group_s


def test_each_backend_owns_its_library_s_words():
    npu, cuda, cpu = (hal.backend_class(n) for n in ("npu", "cuda", "cpu"))
    assert npu.is_collective_error(RuntimeError(HCCL_TIMEOUT))
    assert not cuda.is_collective_error(RuntimeError(HCCL_TIMEOUT))
    assert cuda.is_collective_error(RuntimeError("... ncclRemoteError: A call failed ..."))
    gloo = "[../gloo/transport/tcp/pair.cc:537] Read error [10.0.0.2]:5000: Connection reset"
    assert cpu.is_collective_error(RuntimeError(gloo)) and not npu.is_collective_error(
        RuntimeError(gloo)
    )
    assert hal.is_collective_error(RuntimeError(gloo))
