"""`crossrl doctor`: the table on this machine, and the checks behind it without a device."""

from __future__ import annotations

import configparser
import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import hal
from hal import cann, doctor_facts
from hal.cann import cann_check, cann_version
from hal.doctor_facts import (
    ABSENT,
    FAIL,
    NOT_PRESENT,
    OK,
    WARN,
    Check,
    ascend_stack_checks,
    env_checks,
    flash_attn_check,
    probe_imports,
    rollout_engine_checks,
    torch_npu_pairing,
    vllm_ascend_nz_check,
    vllm_ascend_options_check,
    vllm_ascend_pairing,
)
from trainer.cli import main
from trainer.commands import doctor

ROOT = Path(__file__).resolve().parent.parent


def _by_name(rows: list[Check]) -> dict[str, Check]:
    return {r.name: r for r in rows}


# ---- the whole command on this machine --------------------------------------------------------


def test_doctor_passes_on_this_machine_with_the_default_job():
    rows, code = doctor.run_doctor(None, [], smoke=True)
    table = doctor.format_rows(rows)
    assert code == 0, table
    found = _by_name(rows)
    for name in ("python", "torch", "transformers", "ray"):
        assert found[name].status == OK, table
    for name in ("smoke: attention", "smoke: all_reduce", "smoke: generate"):
        assert found[name].status == OK, table
    # the default job runs on the cpu: accelerator stacks are listed, never failures
    for name in ("cuda", "npu"):
        assert found[name].status == NOT_PRESENT, table
        if name not in hal.available_backends():
            assert found[name].detail.startswith("not present"), table
    assert found["ray cluster"].detail.endswith("local Ray (started by crossrl train)")
    assert table.splitlines()[-1].endswith("0 FAIL - ready")


def test_cli_doctor_no_smoke_in_a_fresh_process():
    done = subprocess.run(
        [sys.executable, "-m", "trainer.cli", "doctor", "--no-smoke"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "torch " in done.stdout and "device " in done.stdout
    assert "smoke:" not in done.stdout


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["doctor", "--config", "no/such/job.yaml"], "no/such/job.yaml"),
        (["doctor", "--no-smoke", "train.dp_size=many"], "train.dp_size"),
    ],
)
def test_bad_config_exits_2_naming_it(argv, named, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("crossrl doctor: config error:") and named in err


def test_an_absent_device_is_a_row_not_a_config_error():
    absent = next((d for d in ("npu", "cuda") if d not in hal.available_backends()), None)
    if absent is None:
        pytest.skip("both accelerators are present here")
    rows, code = doctor.run_doctor(None, [f"device={absent}"], smoke=False)
    assert code == 1
    assert _by_name(rows)["device"].status == FAIL
    assert _by_name(rows)["device"].fix


# ---- versions ---------------------------------------------------------------------------------


def test_minimum_versions_follow_setup_cfg():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    requires = {}
    for line in cfg["options"]["install_requires"].splitlines():
        line = line.split("#")[0].strip()
        if not line:
            continue
        req = Requirement(line)  # e.g. torch>=2.6,<2.14: the minimum is the >= bound
        requires[req.name] = next(s.version for s in req.specifier if s.operator == ">=")
    assert cfg["options"]["python_requires"] == f">={doctor.MINIMUM_VERSIONS['python']}"
    for name in ("torch", "transformers", "ray"):
        assert requires[name] == doctor.MINIMUM_VERSIONS[name]


@pytest.mark.parametrize(
    ("found", "status"),
    [("2.13.0+cpu", OK), ("2.6.0", OK), ("2.5.1", FAIL), ("2.10", OK), (None, FAIL)],
)
def test_version_check_against_the_minimum(found, status):
    row = doctor.version_check("torch", found, "2.6")
    assert row.status == status
    assert (row.fix == "pip install 'torch>=2.6'") == (status == FAIL)


@pytest.mark.parametrize(
    ("torch_version", "torch_npu_version", "status"),
    [
        ("2.6.0", "2.6.0.post3", OK),
        ("2.6.0+cpu", "2.6.0", OK),
        ("2.6.0", "2.5.1", FAIL),
        ("2.5.0", "2.5.1", WARN),
        ("2.6.0", "nightly", WARN),
    ],
)
def test_torch_npu_pairs_with_its_torch(torch_version, torch_npu_version, status):
    row = torch_npu_pairing(torch_version, torch_npu_version)
    assert row.status == status, row
    if status == FAIL:
        assert row.fix.startswith("pip install torch==2.5.1")


@pytest.mark.parametrize(
    ("vllm_version", "vllm_ascend_version", "status"),
    [("0.9.2", "0.9.2rc1", OK), ("0.9.1", "0.9.2rc1", OK), ("0.10.0", "0.9.1", FAIL)],
)
def test_vllm_ascend_pairs_with_its_vllm_minor(vllm_version, vllm_ascend_version, status):
    row = vllm_ascend_pairing(vllm_version, vllm_ascend_version)
    assert row.status == status, row
    if status == FAIL:
        assert "vllm==0.9.*" in row.fix


PINNED_SET = {
    "vllm": "0.26.0+empty",
    "torch": "2.10.0+cpu",
    "torch-npu": "2.10.0.post4",
    "CANN": "9.1.0",
}
"""vllm-ascend 0.26.0rc1's set as installed: vLLM built with VLLM_TARGET_DEVICE=empty."""


@pytest.mark.parametrize(
    ("member", "found", "status", "in_fix"),
    [
        (
            "vllm",
            "0.25.1",
            FAIL,
            "VLLM_TARGET_DEVICE=empty pip install --no-binary vllm 'vllm==0.26.0'",
        ),
        ("vllm", "0.23.0", FAIL, "or vllm-ascend 0.23.0 (made for vllm 0.23.0)"),
        ("vllm", "0.26.1", WARN, "'vllm==0.26.0'"),
        ("vllm", None, FAIL, "'vllm==0.26.0'"),
        ("torch", "2.11.0", FAIL, "pip install torch==2.10.0"),
        (
            "torch-npu",
            "2.10.0.post2",
            WARN,
            "or vllm-ascend 0.23.0rc1 (made for torch-npu 2.10.0.post2)",
        ),
        ("CANN", "9.0.1", FAIL, "install CANN 9.1.0 and NNAL 9.1.0"),
        ("CANN", None, WARN, "install CANN 9.1.0"),
    ],
)
def test_the_vllm_ascend_set_is_checked_member_by_member(member, found, status, in_fix):
    rows = _by_name(ascend_stack_checks("0.26.0rc1", {**PINNED_SET, member: found}))
    assert [r.status for r in rows.values()].count(OK) == 3, rows
    row = rows[f"{member} for vllm-ascend"]
    assert row.status == status, row
    assert in_fix in row.fix
    if found is not None:  # both versions named
        assert f"{member} {found} installed" in row.detail
    want = {"vllm": "0.26.0", "torch": "2.10.0", "torch-npu": "2.10.0.post4", "CANN": "9.1.0"}
    assert f"vllm-ascend 0.26.0rc1 is released with {member} {want[member]}" in row.detail


def test_the_pinned_set_passes_and_an_unknown_release_falls_back_to_the_minor_rule():
    assert all(r.status == OK for r in ascend_stack_checks("0.26.0rc1", PINNED_SET))
    rows = ascend_stack_checks("0.24.0rc1", {"vllm": "0.26.0"})
    assert rows[0].status == WARN and "not in crossrl's table" in rows[0].detail
    assert "vllm-ascend 0.26.0rc1" in rows[0].fix
    assert rows[1].name == "vllm-ascend pair" and rows[1].status == FAIL


@pytest.mark.parametrize(
    ("version", "status", "spelled"),
    [
        ("0.26.0rc1", OK, "enable_sleep_mode_extra_cleanup"),
        ("0.27.1rc1", OK, "rl_config"),
        ("0.22.1rc1", FAIL, "no sleep extra-cleanup option"),
    ],
)
def test_doctor_names_the_engine_options_spelling(version, status, spelled):
    row = vllm_ascend_options_check(version)
    assert row.status == status and spelled in row.detail, row
    if status == FAIL:
        assert "vllm-ascend 0.26.0rc1" in row.fix and "VLLM_TARGET_DEVICE=empty" in row.fix


def test_npu_vllm_rows_check_the_installed_set(monkeypatch, tmp_path):
    """The rows ``crossrl doctor`` prints for an npu job with rollout.engine=vllm: the versions
    come from the import probe, package metadata and CANN's install info (faked here)."""
    (tmp_path / "aarch64-linux").mkdir()
    (tmp_path / "aarch64-linux" / "ascend_toolkit_install.info").write_text("version=9.1.0\n")
    monkeypatch.setenv("ASCEND_HOME_PATH", str(tmp_path))
    monkeypatch.setattr(
        doctor_facts,
        "probe_imports",
        lambda modules: {"vllm": (True, "0.25.1"), "vllm_ascend": (True, "0.26.0rc1")},
    )
    monkeypatch.setattr(
        doctor_facts, "dist_version", lambda name: "2.10.0.post4" if name == "torch_npu" else None
    )
    rows = _by_name(rollout_engine_checks("npu", "vllm", torch_version="2.10.0"))
    vllm = rows["vllm for vllm-ascend"]
    assert vllm.status == FAIL
    assert (
        "vllm 0.25.1 installed; vllm-ascend 0.26.0rc1 is released with vllm 0.26.0" in vllm.detail
    )
    assert rows["torch for vllm-ascend"].status == OK
    assert rows["torch-npu for vllm-ascend"].status == OK
    assert (
        rows["CANN for vllm-ascend"].status == OK and "9.1.0" in rows["CANN for vllm-ascend"].detail
    )
    assert rows["vllm-ascend options"].status == OK


def test_cann_version_read_from_its_install_info(monkeypatch, tmp_path):
    monkeypatch.setattr(cann, "CANN_DEFAULT_HOMES", (tmp_path / "absent",))
    (tmp_path / "x86_64-linux").mkdir()
    (tmp_path / "x86_64-linux" / "ascend_toolkit_install.info").write_text("version=9.1.0\n")
    assert cann_version({"ASCEND_TOOLKIT_HOME": str(tmp_path)}) == "9.1.0"
    assert cann_version({"ASCEND_TOOLKIT_HOME": str(tmp_path / "gone")}) is None
    assert cann_version({}) is None


def test_probe_imports_reports_versions_and_errors_from_a_child_process():
    found = probe_imports(["json", "crossrl_no_such_module"])
    assert found["json"][0] is True
    assert found["crossrl_no_such_module"] == (
        False,
        "ModuleNotFoundError: No module named 'crossrl_no_such_module'",
    )


# ---- env settings -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("device", "var", "value", "status"),
    [
        ("npu", "HCCL_CONNECT_TIMEOUT", "120", OK),
        ("npu", "HCCL_CONNECT_TIMEOUT", "7200", OK),
        ("npu", "HCCL_CONNECT_TIMEOUT", "119", FAIL),
        ("npu", "HCCL_CONNECT_TIMEOUT", "2h", FAIL),
        # CANN 9.1.0 on A2/A3: [0, 2^31-1], 0 = never (the old [68, 17340] refused 0 and 67)
        ("npu", "HCCL_EXEC_TIMEOUT", "0", OK),
        ("npu", "HCCL_EXEC_TIMEOUT", "67", OK),
        ("npu", "HCCL_EXEC_TIMEOUT", "1091", OK),
        ("npu", "HCCL_EXEC_TIMEOUT", "1092", OK),
        ("npu", "HCCL_EXEC_TIMEOUT", "17341", OK),
        ("npu", "HCCL_EXEC_TIMEOUT", str(2**31 - 1), OK),
        ("npu", "HCCL_EXEC_TIMEOUT", str(2**31), FAIL),
        ("npu", "HCCL_EXEC_TIMEOUT", "-1", FAIL),
        ("npu", "HCCL_EXEC_TIMEOUT", "1.5", FAIL),
        ("npu", "HCCL_EXEC_TIMEOUT", "ten", FAIL),
        ("npu", "HCCL_EXEC_TIMEOUT", None, OK),
        ("cuda", "NCCL_DEBUG", "warn", OK),
        ("cuda", "NCCL_DEBUG", "LOUD", FAIL),
        ("cuda", "NCCL_IB_DISABLE", "1", OK),
        ("cuda", "NCCL_IB_DISABLE", "2", FAIL),
    ],
)
def test_collective_env_settings_in_range(monkeypatch, device, var, value, status):
    if value is None:
        monkeypatch.delenv(var, raising=False)
    else:
        monkeypatch.setenv(var, value)
    row = _by_name(env_checks(device, os.environ))[var]
    assert row.status == status, row
    if status == FAIL:
        assert var in row.fix


@pytest.mark.parametrize(
    ("value", "mode", "status"),
    [("1091", "AIV", OK), ("1092", "AIV", WARN), ("1092", "aiv", WARN), ("1092", "AI_CPU", OK)],
)
def test_aiv_mode_clamps_the_exec_timeout_to_1091(monkeypatch, value, mode, status):
    monkeypatch.setenv("HCCL_EXEC_TIMEOUT", value)
    monkeypatch.setenv("HCCL_OP_EXPANSION_MODE", mode)
    row = _by_name(env_checks("npu", os.environ))["HCCL_EXEC_TIMEOUT"]
    assert row.status == status, row
    if status == WARN:
        assert "1091" in row.detail and "HCCL_OP_EXPANSION_MODE" in row.fix


@pytest.mark.parametrize(
    "options",
    [
        {"additional_config": {"enable_sleep_mode_extra_cleanup": True, "weight_nz_mode": 0}},
        {"additional_config": {"rl_config": {"enabled": True, "sleep_mode_extra_cleanup": True}}},
    ],
)
def test_no_nz_warning_when_the_engine_options_turn_nz_off(options):
    row = vllm_ascend_nz_check({}, options)
    assert row.status == OK, row
    assert vllm_ascend_nz_check({}, {"additional_config": {}}).status == WARN


def test_the_npu_rows_read_the_nz_setting_from_crossrls_engine_options(monkeypatch):
    """rollout_engine_checks on npu: vllm-ascend 0.26.0rc1 importable, NZ unset -> no WARN."""
    monkeypatch.delenv("VLLM_ASCEND_ENABLE_NZ", raising=False)
    found = {"vllm": (True, "0.26.0"), "vllm_ascend": (True, "0.26.0rc1")}
    monkeypatch.setattr(doctor_facts, "probe_imports", lambda modules: found)
    row = _by_name(rollout_engine_checks("npu", "vllm", "2.10.0"))["VLLM_ASCEND_ENABLE_NZ"]
    assert row.status == OK, row


@pytest.mark.parametrize(("value", "status"), [("0", OK), ("1", WARN), (None, WARN)])
def test_vllm_ascend_nz_must_be_off_for_weight_reload(value, status):
    row = vllm_ascend_nz_check({} if value is None else {"VLLM_ASCEND_ENABLE_NZ": value})
    assert row.status == status
    assert (row.fix == "export VLLM_ASCEND_ENABLE_NZ=0") == (status == WARN)


def test_cann_found_through_env_or_reported_missing(monkeypatch, tmp_path):
    monkeypatch.setattr(cann, "CANN_DEFAULT_HOMES", (tmp_path / "absent",))
    (tmp_path / "aarch64-linux").mkdir()
    info = tmp_path / "aarch64-linux" / "ascend_toolkit_install.info"
    info.write_text("version=9.1.0\n")
    row = cann_check({"ASCEND_HOME_PATH": str(tmp_path)})
    assert row.status == OK and "9.1.0" in row.detail
    # Another CANN than the tested set's: a warning naming both and the fix.
    info.write_text("version=8.1.RC1\n")
    row = cann_check({"ASCEND_HOME_PATH": str(tmp_path)})
    assert row.status == WARN and "8.1.RC1" in row.detail and "9.1.0" in row.detail
    assert "CANN 9.1.0" in row.fix
    assert cann_check({"ASCEND_TOOLKIT_HOME": str(tmp_path / "gone")}).status == FAIL
    missing = cann_check({})
    assert missing.status == FAIL and "/usr/local/Ascend/cann/set_env.sh" in missing.fix


def test_cann_found_at_the_default_path_of_8_5_and_of_before(monkeypatch, tmp_path):
    new, old = tmp_path / "cann", tmp_path / "ascend-toolkit" / "latest"
    monkeypatch.setattr(cann, "CANN_DEFAULT_HOMES", (new, old))
    (old / "x86_64-linux").mkdir(parents=True)
    (old / "x86_64-linux" / "ascend_toolkit_install.info").write_text("version=8.0.0\n")
    row = cann_check({})
    assert row.status == WARN and str(old) in row.detail and "env is not set" in row.detail
    assert cann_version({}) == "8.0.0"
    (new / "aarch64-linux").mkdir(parents=True)
    (new / "aarch64-linux" / "ascend_toolkit_install.info").write_text("version=9.1.0\n")
    row = cann_check({})  # CANN 8.5's layout wins where both are present
    assert str(new) in row.detail and "9.1.0" in row.detail
    assert cann_version({}) == "9.1.0"


# ---- flash-attn -------------------------------------------------------------------------------


def test_broken_flash_attn_warns_with_the_fix(monkeypatch):
    monkeypatch.setattr(doctor_facts, "dist_version", lambda name: "2.7.4")
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # installed but cannot be imported
    row = flash_attn_check()
    assert row.status == WARN
    assert "broken" in row.detail
    assert row.fix == "pip uninstall flash-attn or rebuild it against this torch"


def test_absent_flash_attn_is_not_a_failure(monkeypatch):
    monkeypatch.setattr(doctor_facts, "dist_version", lambda name: None)
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # find_spec then says: not there
    row = flash_attn_check()
    assert (row.status, row.detail) == (ABSENT, "absent (SDPA/torch varlen used)")


# ---- devices and Ray --------------------------------------------------------------------------


class _TwoGpus:
    is_accelerator = True

    def device_count(self) -> int:
        return 2


def test_fewer_local_devices_than_dp_size_warns(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    row = doctor.visible_devices_check(_TwoGpus(), "cuda", dp_size=8)
    assert row.status == WARN and "CUDA_VISIBLE_DEVICES=0,1" in row.detail
    assert "lower train.dp_size" in row.fix
    assert doctor.visible_devices_check(_TwoGpus(), "cuda", dp_size=2).status == OK


def test_unreachable_ray_address_fails_without_hanging():
    row = doctor.ray_check("127.0.0.1:1", "CPU", 1, timeout_s=3.0)
    assert row.status == FAIL and "ray.address=127.0.0.1:1" in row.detail
    assert "ray.address" in row.fix


def test_format_rows_puts_the_fix_under_a_failure():
    text = doctor.format_rows([Check("a", OK, "fine"), Check("bb", FAIL, "broken", "do this")])
    lines = text.splitlines()
    assert lines[2].startswith("bb  ") and "FAIL" in lines[2]
    assert lines[3].strip() == "fix: do this"
    assert lines[-1] == "2 checks: 1 ok, 0 WARN, 1 FAIL"
