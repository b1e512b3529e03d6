"""What an Atlas A3 node needs that versions do not show: the chip vllm-ascend was built for
(checked by the doctor and before the engine starts), the driver, NNAL, triton-ascend, HCCL's
port ranges, and the two NPU probes (skipped with the reason where no NPU exists)."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import hal
from hal import cann, doctor_facts, npu_checks
from hal.doctor_facts import FAIL, NOT_PRESENT, OK, WARN
from hal.npu_checks import (
    A3_SOC_VERSION,
    HDK_FOR_CANN,
    EngineBuildMismatchError,
    chip_type,
    engine_build_check,
    engine_build_mismatch,
    hdk_check,
    nnal_check,
    parse_build_info,
    parse_hdk_version,
    port_range_checks,
    triton_ascend_check,
    vllm_ascend_build_type,
    vllm_ascend_image,
)
from hal.npu_versions import ASCEND_STACKS, PINNED_VLLM_ASCEND

JOB = ["train.dp_size=1", "rollout.engine=vllm", "run.deterministic=false"]


def fake_vllm_ascend(root, device_type: str | None = "A2", text: str | None = None) -> None:
    """A vllm-ascend installation in `root` (a sys.path entry): dist-info plus _build_info.py,
    the files the 0.26.0rc1 wheel ships."""
    info = root / "vllm_ascend-0.26.0rc1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-ascend\nVersion: 0.26.0rc1\n")
    package = root / "vllm_ascend"
    package.mkdir()
    records = ["vllm_ascend/__init__.py,,"]
    (package / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    if device_type is not None or text is not None:
        body = (
            text
            if text is not None
            else f"# Auto-generated file\n__device_type__ = '{device_type}'\n"
        )
        (package / "_build_info.py").write_text(body)
        records.append("vllm_ascend/_build_info.py,,")
    (info / "RECORD").write_text("\n".join(records) + "\n")


@pytest.fixture
def site(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


# ---- the build's device type against the chip -------------------------------------------------


@pytest.mark.parametrize(
    ("text", "device_type"),
    [
        ("# Auto-generated file\n__device_type__ = 'A2'\n", "A2"),  # the 0.26.0rc1 wheel
        ('__device_type__ = "A3"\n', "A3"),
        ("__soc_version__ = 'ascend310p3'\n", "_310P"),  # older builds: from the SoC
        ("__soc_version__ = 'ASCEND910_9391'\n", "A2"),  # as vllm-ascend reads it: not 310P
        ("", "A2"),
    ],
)
def test_build_info_read_as_vllm_ascend_reads_it(text, device_type):
    assert parse_build_info(text) == device_type


def test_build_type_read_from_the_distribution_without_importing_it(site):
    fake_vllm_ascend(site, "A2")
    assert vllm_ascend_build_type() == "A2"
    assert "vllm_ascend" not in sys.modules


def test_build_type_none_without_vllm_ascend_or_its_build_info(site):
    assert vllm_ascend_build_type("no-such-distribution") is None
    fake_vllm_ascend(site, None)
    assert vllm_ascend_build_type() is None


@pytest.mark.parametrize(
    ("soc", "device_type"),
    [
        (220, "A2"),
        (225, "A2"),
        (250, "A3"),
        (255, "A3"),
        (200, "_310P"),
        (260, "A5"),
        (226, None),
        ("Ascend910B3", "A2"),
        ("Ascend910_9391", "A3"),
        ("ascend910_9362", "A3"),
        ("Ascend310P3", "_310P"),
        ("Ascend950DT_9582", "A5"),
        ("x86_64", None),
    ],
)
def test_chip_type_mirrors_vllm_ascends_check(soc, device_type):
    assert chip_type(soc) == device_type


def test_mismatch_is_one_line_naming_both_and_the_a3_build():
    line = engine_build_mismatch("A2", "A3")
    assert "\n" not in line
    assert "built for A2" in line and "this chip is A3" in line
    assert f"SOC_VERSION={A3_SOC_VERSION}" in line and "a checkout of v0.26.0rc1" in line
    assert "quay.io/ascend/vllm-ascend:v0.26.0rc1-a3" in line  # or vllm-ascend's A3 image
    assert engine_build_mismatch("A3", "A3") is None
    assert engine_build_mismatch("A2", None) is None


def test_doctor_row_fails_on_an_a2_build_on_an_a3_chip():
    row = engine_build_check("A2", "A3", "Ascend910_9391")
    assert row.status == FAIL
    assert "A2" in row.detail and "A3" in row.detail
    assert row.fix.startswith("build it for A3") and A3_SOC_VERSION in row.fix
    assert engine_build_check("A3", "A3", "Ascend910_9391").status == OK
    assert engine_build_check("A2", None, "no NPU: x", npu=False).status == NOT_PRESENT
    assert engine_build_check("A2", None, "unreadable").status == WARN


def test_npu_backend_fails_fast_on_a_build_for_another_chip(site, monkeypatch):
    import hal.npu

    fake_vllm_ascend(site, "A2")
    backend = hal.backend_class("npu")()
    fake = SimpleNamespace(npu=SimpleNamespace(get_soc_version=lambda: 253))  # an A3 die
    monkeypatch.setattr(hal.npu, "import_torch_npu", lambda: fake)
    with pytest.raises(EngineBuildMismatchError, match="built for A2 .* this chip is A3"):
        backend.check_engine_build()
    fake.npu.get_soc_version = lambda: 223  # an A2 chip: the A2 build is right
    backend.check_engine_build()


def test_other_backends_have_no_engine_build_to_check():
    assert hal.backend_class("cpu")().check_engine_build() is None


def test_engine_host_checks_the_build_before_starting_the_engine(site, monkeypatch):
    """EngineHost.setup on an A3 node with the A2 wheel: the one-line error, no engine."""
    import hal.npu
    import rollout.engines
    from trainer.config import load_config
    from trainer.loop.engines.engine_host import EngineHost

    fake_vllm_ascend(site, "A2")
    backend = hal.backend_class("npu")()
    fake = SimpleNamespace(npu=SimpleNamespace(get_soc_version=lambda: 250))
    monkeypatch.setattr(hal.npu, "import_torch_npu", lambda: fake)
    monkeypatch.setattr(hal, "get_backend", lambda name="auto": backend)
    started = []
    monkeypatch.setattr(rollout.engines, "make_engine", lambda *a, **kw: started.append(kw))
    cfg = load_config(None, JOB, check_environment=False)
    with pytest.raises(EngineBuildMismatchError, match=A3_SOC_VERSION):
        EngineHost(cfg).setup()
    assert started == []


# ---- driver, NNAL, triton-ascend, port ranges -------------------------------------------------


@pytest.mark.parametrize(
    ("text", "cann", "status"),
    [
        ("Version=25.0.rc1\nascendhal_version=7.35.23\n", "9.0.0", OK),
        ("Version=25.0.0\n", "8.5.2", OK),
        ("Version=25.0.0\n", "9.1.0", FAIL),  # CANN 9.1's release notes: not on 25.0.X
        ("Version=25.0.rc1\n", None, FAIL),  # None: the tested set's CANN, 9.1.0
        ("Version=25.2.0\n", "9.1.0", OK),
        ("Version=25.5.1\n", None, OK),
        ("Version=26.0.rc1\n", "9.1.0", OK),
        ("Version=24.1.rc3\n", "9.0.0", FAIL),
        ("Version=24.1.0\n", "9.1.0", FAIL),
        ("Version=garbage\n", None, WARN),
    ],
)
def test_hdk_must_be_one_the_cann_runs_on(tmp_path, text, cann, status):
    info = tmp_path / "version.info"
    info.write_text(text)
    row = hdk_check(info, cann)
    assert row.status == status, row
    if status != OK:
        on_91 = (cann or ASCEND_STACKS[PINNED_VLLM_ASCEND].cann).startswith("9.1")
        assert ("26.0.RC1" if on_91 else "25.0.RC1") in row.fix, row.fix


def test_the_doctor_refuses_hdk_25_0_under_cann_9_1(tmp_path, monkeypatch, no_default_cann):
    """a3_checks reads the toolkit's CANN version and holds the driver to it."""
    driver = tmp_path / "version.info"
    driver.write_text("Version=25.0.0\n")
    monkeypatch.setattr(npu_checks, "DRIVER_VERSION_FILE", driver)
    rows = {}
    for version in ("9.1.0", "9.0.0"):
        home = fake_toolkit(tmp_path / version, "ascend910_93", version=version)
        found = npu_checks.a3_checks(
            {"ASCEND_TOOLKIT_HOME": str(home)}, no_npu_reason="no NPU here", device_count=0
        )
        rows[version] = next(r for r in found if r.name == "Ascend HDK")
    assert rows["9.1.0"].status == FAIL and "CANN 9.1.0" in rows["9.1.0"].detail
    assert "25.2" in rows["9.1.0"].detail and "26.0.RC1" in rows["9.1.0"].fix
    assert rows["9.0.0"].status == OK


def test_hdk_versions_order_rcs_before_the_release():
    assert parse_hdk_version("Version=25.0.rc1") < parse_hdk_version("Version=25.0.0")
    assert parse_hdk_version("Version=24.1.0") < parse_hdk_version("Version=25.0.rc1")


def test_missing_driver_fails_with_the_fix(tmp_path):
    row = hdk_check(tmp_path / "absent")
    assert row.status == FAIL and "HDK" in row.fix


def test_nnal_found_through_its_env_or_reported(tmp_path):
    assert nnal_check({"ATB_HOME_PATH": "/x/atb"}).status == OK
    script = tmp_path / "set_env.sh"
    assert nnal_check({}, script).status == FAIL
    script.write_text("")
    row = nnal_check({}, script)
    assert row.status == WARN and row.fix == f"source {script}"


def test_triton_ascend_at_the_version_vllm_ascend_pins():
    assert triton_ascend_check("3.2.2").status == OK
    assert triton_ascend_check("3.2.0").status == WARN
    assert "triton-ascend==3.2.2" in triton_ascend_check(None).fix


def test_port_ranges_reported_never_failed():
    unset = port_range_checks({})
    assert [r.status for r in unset] == [OK, OK]
    assert all("crossrl sets" in r.detail for r in unset)
    mine = port_range_checks({"HCCL_HOST_SOCKET_PORT_RANGE": "50000-50063"})
    assert mine[0].status == OK and "set by the user" in mine[0].detail


# ---- the NPU probes ---------------------------------------------------------------------------


def test_npu_probes_skipped_with_the_reason_without_an_npu():
    rows = {
        r.name: r for r in npu_checks.a3_checks({}, no_npu_reason="no NPU here", device_count=None)
    }
    for name in npu_checks.PROBE_NAMES:
        assert rows[name].status == NOT_PRESENT
        assert rows[name].detail == "skipped: no NPU here"


def test_hccl_probe_needs_two_devices():
    row = npu_checks.hccl_two_die_check(1, None)
    assert row.status == NOT_PRESENT and "needs 2" in row.detail


def test_a_probe_reports_the_childs_last_error_line():
    row = npu_checks.run_probe("p", "raise SystemExit('boom')", [], "the fix", 60)
    assert row.status == FAIL and row.detail == "boom" and row.fix == "the fix"
    assert npu_checks.run_probe("p", "print('ok')", [], "", 60).status == OK


SPAWNING = """
import multiprocessing as mp

def child(q):
    q.put(41 + 1)

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start()
    assert q.get(timeout=60) == 42
    p.join()
    print("ok")
"""


def test_a_probe_may_spawn_processes_with_functions_of_its_own():
    """The NPU probes spawn ranks whose target lives in the probe script: it must run from a
    file (under ``python -c`` the spawned child cannot find the function)."""
    row = npu_checks.run_probe("spawn", SPAWNING, [], "", 120)
    assert row.status == OK, row


@pytest.mark.skipif(
    "npu" not in hal.available_backends(), reason="needs an Ascend NPU and torch_npu"
)
def test_npu_probes_pass_on_an_npu():
    assert npu_checks.ipc_one_die_check(None).status == OK
    count = hal.get_backend("npu").device_count()
    if count >= 2:
        assert npu_checks.hccl_two_die_check(count, None).status == OK


def test_doctor_on_the_cpu_lists_the_npu_probes_as_skipped():
    rows = doctor_facts.device_checks("cpu", rollout_engine="hf", torch_version="2.10.0")
    found = {r.name: r for r in rows}
    for name in npu_checks.PROBE_NAMES:
        assert found[name].status == NOT_PRESENT
        assert found[name].detail.startswith("skipped: device=cpu")


def test_cli_doctor_lists_the_npu_probes_with_their_reason():
    done = subprocess.run(
        [sys.executable, "-m", "trainer.cli", "doctor", "--no-smoke"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for name in npu_checks.PROBE_NAMES:
        line = next(ln for ln in done.stdout.splitlines() if ln.startswith(name))
        assert "skipped:" in line


# ---- the chip's ops package -------------------------------------------------------------------


def fake_toolkit(root, *kernel_dirs: str, version: str = "9.1.0"):
    """A CANN toolkit in `root`: its install info, and under ``opp`` the kernel directories
    named (each holding one operator's folder; ``ops_oam`` alone is what the toolkit ships)."""
    (root / "x86_64-linux").mkdir(parents=True)
    (root / "x86_64-linux" / "ascend_toolkit_install.info").write_text(f"version={version}\n")
    kernels = root / "opp" / cann.OPP_KERNELS
    for name in kernel_dirs:
        (kernels / name / ("ops_oam" if name == "toolkit-only" else "add")).mkdir(parents=True)
    if not kernel_dirs:
        (kernels / "ascend910_93" / "ops_oam").mkdir(parents=True)
    return root


@pytest.fixture
def no_default_cann(monkeypatch, tmp_path):
    monkeypatch.setattr(cann, "CANN_DEFAULT_HOMES", (tmp_path / "absent",))


def test_ops_package_missing_on_an_a3_names_the_package_for_the_toolkits_version(
    tmp_path, no_default_cann
):
    home = fake_toolkit(tmp_path / "cann", version="9.0.0")  # the toolkit's ops_oam alone
    row = cann.ops_package_check({"ASCEND_TOOLKIT_HOME": str(home)}, "A3")
    assert row.status == FAIL
    assert "no A3 kernels" in row.detail and "ascend910_93" in row.detail
    run_file = f"Ascend-cann-A3-ops_9.0.0_linux-{platform.machine()}.run"
    assert f"./{run_file} --install" in row.fix  # Huawei's run file, at the toolkit's version
    assert "pip install" not in row.fix  # no ops package of the chip's is on PyPI
    assert (
        cann.ops_run_file("A2", "9.1.0", "aarch64")
        == "Ascend-cann-910b-ops_9.1.0_linux-aarch64.run"
    )


def test_ops_package_of_the_other_chip_is_named(tmp_path, no_default_cann):
    home = fake_toolkit(tmp_path / "cann", "ascend910b")
    row = cann.ops_package_check({"ASCEND_HOME_PATH": str(home)}, "A3")
    assert row.status == FAIL and "only A2's" in row.detail
    assert cann.ops_package_check({"ASCEND_HOME_PATH": str(home)}, "A2").status == OK


def test_ops_package_found_through_the_operator_root_env(tmp_path, no_default_cann):
    """``ASCEND_OPP_PATH`` (set by CANN's set_env.sh) wins over ``<toolkit>/opp``."""
    home = fake_toolkit(tmp_path / "cann")  # toolkit only
    elsewhere = fake_toolkit(tmp_path / "pip-installed", "ascend910_93") / "opp"
    env = {"ASCEND_TOOLKIT_HOME": str(home)}
    assert cann.ops_package_check(env, "A3").status == FAIL
    row = cann.ops_package_check({**env, "ASCEND_OPP_PATH": str(elsewhere)}, "A3")
    assert row.status == OK and str(elsewhere) in row.detail


def test_ops_package_without_a_toolkit_or_a_chip(tmp_path, no_default_cann):
    assert cann.ops_package_check({}, "A3").status == FAIL
    home = fake_toolkit(tmp_path / "cann", "ascend910b", "ascend910_93")
    row = cann.ops_package_check({"ASCEND_TOOLKIT_HOME": str(home)}, None)
    assert row.status == WARN and "kernels for: A2, A3" in row.detail
    skipped = cann.ops_package_check({}, None, "no NPU here")
    assert skipped.status == NOT_PRESENT and skipped.detail == "skipped: no NPU here"


def test_a3_checks_read_the_chip_once_for_the_ops_package_and_the_build(
    site, tmp_path, no_default_cann, monkeypatch
):
    fake_vllm_ascend(site, "A2")
    home = fake_toolkit(tmp_path / "cann", "ascend910b")
    probes = []
    monkeypatch.setattr(
        npu_checks, "probe_soc", lambda: probes.append(1) or (250, "Ascend910_9391")
    )
    rows = {
        r.name: r
        for r in npu_checks.a3_checks(
            {"ASCEND_TOOLKIT_HOME": str(home)},
            no_npu_reason=None,
            device_count=2,
            device_probes=False,
        )
    }
    assert probes == [1]
    assert rows["CANN ops package"].status == FAIL  # A2's kernels on an A3 chip
    assert rows["vllm-ascend build"].status == FAIL  # an A2 build on an A3 chip


def test_doctor_on_the_cpu_lists_the_ops_package_as_skipped():
    rows = doctor_facts.device_checks("cpu", rollout_engine="hf", torch_version="2.10.0")
    row = next(r for r in rows if r.name == "CANN ops package")
    assert row.status == NOT_PRESENT and row.detail.startswith("skipped: device=cpu")


# ---- the README installs what the doctor checks --------------------------------------------


def _readme_a3_section() -> str:
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    start = text.index("## Running on an Ascend A3 node")
    return text[start : text.index("\n## ", start + 1)]


def test_the_readmes_a3_install_builds_what_runs_on_an_a3():
    """The README's A3 section builds vllm-ascend for the A3 chip (or takes its A3 image), names
    the driver CANN 9.1 runs on and the A3 ops package's run file: what the doctor checks."""
    section = _readme_a3_section()
    cann_version = ASCEND_STACKS[PINNED_VLLM_ASCEND].cann
    assert f"SOC_VERSION={npu_checks.SOC_VERSION_FOR['A3']} pip install" in section
    assert f"--branch v{PINNED_VLLM_ASCEND} --recurse-submodules" in section
    assert vllm_ascend_image("A3") in section
    assert f"HDK {HDK_FOR_CANN[cann_version[:3]][2]}" in section
    assert f"./{cann.ops_run_file('A3', cann_version, '$(uname -m)')} --install" in section
    assert "crossrl doctor" in section and "built for A3, chip A3" in section
