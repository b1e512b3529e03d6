"""Weight reload on Ascend by vllm-ascend release (issue 33): from 0.26.0rc1 on its own RL path
runs vLLM's layerwise reload and its fused-MoE layers transpose their weights after loading, so
crossrl's engine reloads layerwise there too (a straight ``load_weights`` would leave MoE
weights in the HF layout inside transposed parameters). Device-free: the installed release is
faked."""

from __future__ import annotations

import pytest

import hal.npu
from hal.npu_versions import PINNED_VLLM_ASCEND, uses_layerwise_reload


@pytest.mark.parametrize(
    "version, layerwise",
    [
        ("0.23.0rc1", False),
        ("0.23.0", False),
        ("0.26.0rc1", True),
        ("0.26.0rc1+gf2f74a16c", True),
        ("0.27.1rc1", True),
        (None, True),  # not installed: the pinned release's choice
    ],
)
def test_the_reload_is_chosen_by_vllm_ascend_release(version, layerwise):
    assert uses_layerwise_reload(version) is layerwise


def test_the_pinned_release_reloads_layerwise(monkeypatch):
    assert uses_layerwise_reload(PINNED_VLLM_ASCEND)
    monkeypatch.setattr(hal.npu, "installed_version", lambda name: PINNED_VLLM_ASCEND)
    backend = object.__new__(hal.npu.NpuBackend)  # no NPU needed for a version choice
    assert backend.vllm_layerwise_reload is True
    monkeypatch.setattr(hal.npu, "installed_version", lambda name: "0.23.0")
    assert backend.vllm_layerwise_reload is False
