"""The vllm-ascend engine options are spelled for the installed release (hal/npu_versions.py).

vllm-ascend reads ``additional_config`` with plain lookups up to 0.26.0rc1 (an unknown key is
silently ignored) and refuses unknown keys from 0.27.1rc1: a spelling for the wrong release
either loses the sleep cleanup without a word or stops the engine. Nothing here imports
torch_npu or vllm-ascend; the installed version is faked through package metadata.
"""

from __future__ import annotations

import importlib.metadata

import pytest

import hal
from hal import npu_versions
from hal.npu_versions import (
    ASCEND_STACKS,
    ENGINE_OPTION_SPELLINGS,
    PINNED_VLLM_ASCEND,
    VllmAscendVersionError,
    engine_option_spelling,
    known_stack,
    vllm_ascend_engine_options,
)

TOP_LEVEL = {
    "enable_sleep_mode_extra_cleanup": True,
    "weight_nz_mode": 0,
    "enable_cpu_binding": False,
}
RL_CONFIG = {
    "rl_config": {"enabled": True, "sleep_mode_extra_cleanup": True},
    "enable_cpu_binding": False,
}


@pytest.mark.parametrize(
    ("version", "additional_config"),
    [
        ("0.23.0rc1", TOP_LEVEL),  # the first release with the top-level key
        ("0.23.0.post1", TOP_LEVEL),
        ("0.25.1rc1", TOP_LEVEL),
        ("0.26.0rc1", TOP_LEVEL),  # the pinned release: its wheel knows no rl_config
        ("0.26.0rc1+gf2f74a16c", TOP_LEVEL),  # a local build label changes nothing
        ("0.27.1rc1", RL_CONFIG),  # rl_config arrived; the top-level key is refused
        ("0.30.0rc2", RL_CONFIG),
        ("1.2.0", RL_CONFIG),  # unknown and newer: the newest known spelling
    ],
)
def test_each_release_gets_its_own_spelling(version, additional_config):
    assert vllm_ascend_engine_options(version) == {"additional_config": additional_config}


@pytest.mark.parametrize("version", ["0.22.1rc1", "0.13.0", "0.9.2rc1"])
def test_a_release_without_the_option_is_refused_naming_version_and_fix(version):
    with pytest.raises(VllmAscendVersionError) as err:
        vllm_ascend_engine_options(version)
    message = str(err.value)
    assert "\n" not in message
    assert f"vllm-ascend {version} has no sleep extra-cleanup option" in message
    assert f"arrived in {ENGINE_OPTION_SPELLINGS[0].since}" in message
    assert f"install vllm-ascend {PINNED_VLLM_ASCEND}" in message


def test_an_unparsable_version_is_refused_by_name():
    with pytest.raises(VllmAscendVersionError, match=r"vllm-ascend version 'main' is not a"):
        engine_option_spelling("main")


def test_the_options_are_a_fresh_copy_each_time():
    first = vllm_ascend_engine_options("0.27.1rc1")
    first["additional_config"]["rl_config"]["enabled"] = False
    assert vllm_ascend_engine_options("0.27.1rc1") == {"additional_config": RL_CONFIG}


def test_spellings_are_ordered_and_the_pinned_release_has_a_known_set():
    since = [npu_versions.parse_version(row.since) for row in ENGINE_OPTION_SPELLINGS]
    assert since == sorted(since)
    stack = known_stack(PINNED_VLLM_ASCEND)
    assert (stack.vllm, stack.torch, stack.torch_npu, stack.cann) == (
        "0.26.0",
        "2.10.0",
        "2.10.0.post4",
        "9.1.0",
    )
    assert known_stack("0.26.0rc1+gf2f74a16c") is stack
    assert known_stack("0.26.1") is None
    assert all(name == s.vllm_ascend for name, s in ASCEND_STACKS.items())


def _fake_installed(monkeypatch, versions: dict[str, str]):
    real = importlib.metadata.version

    def version(name):
        if name in versions:
            return versions[name]
        if name.replace("_", "-") in ("vllm-ascend", "vllm", "torch-npu"):
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)


@pytest.mark.parametrize(
    ("installed", "additional_config"), [("0.26.0rc1", TOP_LEVEL), ("0.27.1rc1", RL_CONFIG)]
)
def test_the_npu_backend_reads_the_installed_release(monkeypatch, installed, additional_config):
    """What the rollout host passes to ``vllm.LLM`` on Ascend (without torch_npu here)."""
    _fake_installed(monkeypatch, {"vllm-ascend": installed})
    options = hal.backend_class("npu")().vllm_engine_options()
    assert options == {"additional_config": additional_config}


def test_the_npu_backend_without_vllm_ascend_says_how_to_install_it(monkeypatch):
    _fake_installed(monkeypatch, {})
    with pytest.raises(VllmAscendVersionError) as err:
        hal.backend_class("npu")().vllm_engine_options()
    message = str(err.value)
    assert "needs vllm-ascend, which is not installed" in message
    assert f"vllm-ascend {PINNED_VLLM_ASCEND}" in message and "rollout.engine=hf" in message
