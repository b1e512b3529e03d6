"""vllm-ascend by version: how each release spells the engine options crossrl passes it, and the
software set (vLLM, torch, torch-npu, CANN) each release is made for.

vllm-ascend renames its options between releases, and an option spelled for another release
is lost: 0.26.0rc1 reads ``additional_config`` with ``dict.get`` and silently ignores
``rl_config``, so its sleep would keep the HCCL and ACL graph workspaces while the ranks train;
0.27.1rc1 validates ``additional_config`` with ``extra="forbid"`` and refuses the older
top-level key. So the options are chosen from the installed release, here, by version.

Sources, read from the releases themselves (not from vllm-ascend's main branch):

- 0.26.0rc1: the wheel (``pip download vllm-ascend==0.26.0rc1 --no-deps``):
  ``vllm_ascend/ascend_config.py`` reads ``enable_sleep_mode_extra_cleanup`` and
  ``weight_nz_mode`` at the top of ``additional_config``, ``worker/worker.py`` runs the extra
  cleanup in ``sleep``/``wake_up`` from it; no ``rl_config`` anywhere. It also reads
  ``enable_cpu_binding`` there (default true; ``worker/worker.py`` calls ``bind_cpus`` after
  warm-up when it is set, ``cpu_binding.py`` stops irqbalance). Its ``Requires-Dist``
  pins torch 2.10.0 and torch-npu 2.10.0.post4; its release branch ``releases/v0.26.0rc`` builds
  on vLLM v0.26.0 (``Dockerfile`` ``VLLM_TAG``, ``.github/vllm-release-tag.commit``) and lists
  CANN 9.1.0 (``docs/source/installation.md``).
- 0.23.0rc1: the tag's ``ascend_config.py`` is the first with the top-level key.
- 0.27.1rc1: the sdist's ``ascend_config.py`` has ``RlConfig`` (``rl_config.enabled`` also sets
  ``weight_nz_mode`` to 0) and no top-level key; ``enable_cpu_binding`` stays a top-level
  field (default true, ``worker/worker.py`` binds from it); its ``versioning_policy.md``
  matrix gives the 0.27.1rc1, 0.23.0 and 0.23.0rc1 rows of ``ASCEND_STACKS``.

Versions are parsed with ``packaging`` (always installed: transformers requires it).
"""

from __future__ import annotations

import copy
import importlib.metadata
from collections.abc import Mapping
from dataclasses import dataclass, field

from packaging.version import InvalidVersion, Version

PINNED_VLLM_ASCEND = "0.26.0rc1"
"""The vllm-ascend release constraints-npu.txt installs (tests keep the two in step)."""
INSTALL_HINT = (
    "README, Ascend install: vLLM built with VLLM_TARGET_DEVICE=empty, then "
    "pip install -c constraints-npu.txt -e '.[npu]'"
)
"""Where the tested NPU set's install steps are, for error messages and doctor fixes."""


class VllmAscendVersionError(RuntimeError):
    """The installed vllm-ascend is absent, unparsable, or older than every known spelling."""


@dataclass(frozen=True)
class EngineOptionSpelling:
    """How vllm-ascend releases from ``since`` on spell the options crossrl needs: extra sleep
    cleanup (free HCCL process-group buffers and the ACL graph workspace while the colocated
    trainer runs), ND weights (no FRACTAL_NZ layout, which a weight reload cannot rebuild) and
    no CPU binding: by default (``enable_cpu_binding``, true) each engine worker binds itself
    to its NPU's slice of the host's cores on ARM hosts and, as root, stops irqbalance; at
    tp 1 that worker is crossrl's rollout host, whose agent loop, environments and reward
    workers would share that slice."""

    since: str
    """The first vllm-ascend release that reads this spelling."""
    additional_config: Mapping = field(default_factory=dict)
    """What goes into ``vllm.LLM(additional_config=...)``."""
    summary: str = ""
    """One line for ``crossrl doctor``."""


ENGINE_OPTION_SPELLINGS: tuple[EngineOptionSpelling, ...] = (
    EngineOptionSpelling(
        since="0.23.0rc1",
        additional_config={
            "enable_sleep_mode_extra_cleanup": True,
            "weight_nz_mode": 0,
            "enable_cpu_binding": False,
        },
        summary=(
            "additional_config.enable_sleep_mode_extra_cleanup=true, weight_nz_mode=0, "
            "enable_cpu_binding=false"
        ),
    ),
    EngineOptionSpelling(
        since="0.27.1rc1",
        additional_config={
            "rl_config": {"enabled": True, "sleep_mode_extra_cleanup": True},
            "enable_cpu_binding": False,
        },
        summary=(
            "additional_config.rl_config={enabled, sleep_mode_extra_cleanup} (ND weights), "
            "enable_cpu_binding=false"
        ),
    ),
)
"""Oldest first; a release newer than every row takes the newest spelling."""


@dataclass(frozen=True)
class AscendStack:
    """The versions one vllm-ascend release is made and tested with."""

    vllm_ascend: str
    vllm: str
    torch: str
    torch_npu: str
    cann: str


ASCEND_STACKS: dict[str, AscendStack] = {
    s.vllm_ascend: s
    for s in (
        AscendStack(
            "0.23.0rc1", vllm="0.23.0", torch="2.10.0", torch_npu="2.10.0.post2", cann="9.0.1"
        ),
        AscendStack(
            "0.23.0", vllm="0.23.0", torch="2.10.0", torch_npu="2.10.0.post4", cann="9.1.0"
        ),
        AscendStack(
            "0.26.0rc1", vllm="0.26.0", torch="2.10.0", torch_npu="2.10.0.post4", cann="9.1.0"
        ),
        AscendStack(
            "0.27.1rc1", vllm="0.27.1", torch="2.10.0", torch_npu="2.10.0.post4", cann="9.1.0"
        ),
    )
}
"""Known compatibility sets by vllm-ascend release (sources in the module docstring)."""


def parse_version(version: str, what: str = "vllm-ascend") -> Version:
    """``version`` as a ``packaging`` Version; a one-line error naming it when it is not one."""
    try:
        return Version(version)
    except InvalidVersion:
        raise VllmAscendVersionError(
            f"{what} version {version!r} is not a version number: reinstall {what} from a "
            f"release ({INSTALL_HINT})"
        ) from None


def installed_version(distribution: str = "vllm-ascend") -> str | None:
    """The installed version of ``distribution`` from package metadata (no import), or None."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def engine_option_spelling(vllm_ascend_version: str) -> EngineOptionSpelling:
    """The spelling vllm-ascend ``vllm_ascend_version`` reads: the newest row whose ``since`` it
    has reached. Raises VllmAscendVersionError naming the version and the fix when it predates
    every row (its sleep has no extra cleanup to ask for)."""
    have = parse_version(vllm_ascend_version)
    chosen = None
    for row in ENGINE_OPTION_SPELLINGS:
        if have >= Version(row.since):
            chosen = row
    if chosen is None:
        raise VllmAscendVersionError(
            f"vllm-ascend {vllm_ascend_version} has no sleep extra-cleanup option (it arrived in "
            f"{ENGINE_OPTION_SPELLINGS[0].since}), so its engine would keep HCCL and graph memory "
            f"while the trainer runs: install vllm-ascend {PINNED_VLLM_ASCEND} ({INSTALL_HINT})"
        )
    return chosen


def vllm_ascend_engine_options(vllm_ascend_version: str) -> dict:
    """Extra ``vllm.LLM`` keyword arguments for a colocated RL engine on vllm-ascend
    ``vllm_ascend_version``: ``{"additional_config": {...}}`` in that release's spelling."""
    spelling = engine_option_spelling(vllm_ascend_version)
    return {"additional_config": copy.deepcopy(dict(spelling.additional_config))}


LAYERWISE_RELOAD_SINCE = "0.26.0rc1"
"""The first vllm-ascend release whose own RL weight update runs vLLM's layerwise reload
(0.26.0rc1's wheel: ``worker/worker.py``'s ``start_weight_update`` calls
``initialize_layerwise_reload`` and ``finish_weight_update`` ``finalize_layerwise_reload``). Its
fused-MoE layers transpose ``w13_weight``/``w2_weight`` in ``process_weights_after_loading``
(``ops/fused_moe/fused_moe.py``): new weights loaded straight with ``load_weights`` land in the
HF layout in transposed parameters, so crossrl reloads layerwise there too. 0.27.1rc1's sdist
does the same (``distributed/weight_transfer/hccl_engine.py`` runs the reload,
``ops/fused_moe/routed_experts.py`` transposes). Older releases keep ``load_weights`` (their RL
path, not checked against MoE models)."""


def uses_layerwise_reload(vllm_ascend_version: str | None) -> bool:
    """Whether the engine on vllm-ascend ``vllm_ascend_version`` reloads weights through vLLM's
    layerwise reload (``LAYERWISE_RELOAD_SINCE`` and later; None, vllm-ascend not installed:
    the pinned release's choice) or straight into the model's ``load_weights``."""
    version = PINNED_VLLM_ASCEND if vllm_ascend_version is None else vllm_ascend_version
    return parse_version(version) >= Version(LAYERWISE_RELOAD_SINCE)


def known_stack(vllm_ascend_version: str) -> AscendStack | None:
    """The compatibility set of vllm-ascend ``vllm_ascend_version`` (local labels such as
    ``+gf2f74a16c`` ignored), or None when the release is not in ``ASCEND_STACKS``."""
    have = parse_version(vllm_ascend_version)
    for name, stack in ASCEND_STACKS.items():
        if Version(name) == Version(have.public):
            return stack
    return None
