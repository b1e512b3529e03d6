"""What every trainer and engine process on an Ascend A3 die is started with (issue 33): the
engine options that keep the rollout host off vllm-ascend's CPU binding, HCCL port ranges
that keep a die's processes apart, and run.deterministic's switches inside every engine
worker. Device-free: the backends' plain functions, a recording ``collective_rpc``."""

from __future__ import annotations

import pytest

from hal.npu_versions import ENGINE_OPTION_SPELLINGS, vllm_ascend_engine_options

# ---- item 6: no CPU binding of the engine worker (the rollout host at tp 1) ----------------


@pytest.mark.parametrize("version", ["0.26.0rc1", "0.27.1rc1"])
def test_engine_options_turn_vllm_ascend_cpu_binding_off(version):
    """Both spellings carry ``enable_cpu_binding=false`` at the top of ``additional_config``
    (read there by 0.26.0rc1's ``AscendConfig`` and 0.27.1rc1's pydantic model alike)."""
    extra = vllm_ascend_engine_options(version)["additional_config"]
    assert extra["enable_cpu_binding"] is False


def test_every_spelling_row_says_so_for_the_doctor():
    for row in ENGINE_OPTION_SPELLINGS:
        assert row.additional_config["enable_cpu_binding"] is False
        assert "enable_cpu_binding=false" in row.summary


def test_the_npu_backend_passes_it_to_the_engine(monkeypatch):
    import hal.npu

    monkeypatch.setattr(hal.npu, "installed_version", lambda name: "0.26.0rc1")
    options = hal.backend_class("npu")().vllm_engine_options()
    assert options["additional_config"]["enable_cpu_binding"] is False
