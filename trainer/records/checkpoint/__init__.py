"""Atomic, verifiable checkpoints in ``<run.dir>/checkpoints/``.

Layout (a contract, see DESIGN.md "Run directory"; every name comes from ``LAYOUT``)::

    checkpoints/
      .tmp_step_<N>_<uuid>/   staging: workers write their pieces here
      step_<N>/               a whole checkpoint: pieces + manifest.json
        <role>_model/, <role>_optim/   torch.distributed.checkpoint dirs: every rank its shard
                                       (__<rank>_0.distcp), rank 0 the .metadata
        <role>_scheduler.pt            rank 0 of a role
        <role>_rng_rank<r>.pt          every rank
        trainer_state.json, controller_rng.pt   the controller
      latest                  text file "step_<N>": the newest whole checkpoint

Commit protocol. Several processes write one checkpoint (every rank its shard of the model
and optimizer and its RNG, the controller ``trainer_state.json``), so no single file write
can be the commit point. Instead:

1. ``begin_checkpoint`` makes a fresh staging dir; workers write into it (files with the
   atomic savers in ``pieces.py``, so a piece is either whole or absent; shards with
   ``dcp.save``, which returns only once every rank's shard is written).
2. Once every writer has returned, the controller calls ``commit_checkpoint``: it fsyncs every
   file, writes ``manifest.json`` (size + sha256 per file), renames the staging dir to
   ``step_<N>`` and only then rewrites ``latest``.

``latest`` is the single commit point: a crash at any moment leaves it naming the previous
whole checkpoint. A ``step_<N>`` newer than ``latest`` (crash between rename and ``latest``)
is ignored and replaced when the resumed run saves that step again; stale ``.tmp_*`` dirs are
ignored and deleted by a later commit.

Multi-node: the run dir must be on a filesystem every writer sees (shared storage), since
workers write straight into the staging dir.

``latest`` is a text file rather than a symlink so the layout works on every filesystem
(object-store mounts and some network filesystems lack symlinks).

Model and optimizer shards are keyed by parameter name, so a checkpoint written at one dp size
resumes at another (``sharded.py``); ``read_model_weights`` reads a role's whole model in one
process, without a process group (``crossrl export``). Checkpoints in the older single-file
layout (``LAYOUT.legacy_model``/``legacy_optim``) still load.

Who owns what: ``layout.py`` the names, ``pieces.py`` saving/loading one piece (tensors,
objects, JSON, RNG state), ``sharded.py`` the sharded model/optimizer state, ``store.py``
staging, commit, ``latest``, verify and resume.
Atomic file writes themselves live in ``rollout/files.py``.
"""

import importlib

#: Where each public name lives; imported on first use (PEP 562), so that resolving a resume
#: target (``store``, before Ray starts) does not import torch (``sharded``).
_EXPORTS = {
    "trainer.records.checkpoint.layout": ("LAYOUT", "CheckpointLayout"),
    "trainer.records.checkpoint.pieces": (
        "CheckpointError",
        "load_json",
        "load_safetensors",
        "load_torch",
        "rng_state",
        "save_json",
        "save_safetensors",
        "save_torch",
        "set_rng_state",
    ),
    "trainer.records.checkpoint.sharded": (
        "load_sharded",
        "read_model_weights",
        "read_sharded",
        "save_sharded",
    ),
    "trainer.records.checkpoint.store": (
        "begin_checkpoint",
        "checkpoint_step",
        "commit_checkpoint",
        "find_latest",
        "list_checkpoints",
        "resolve_resume",
        "step_dir_name",
        "verify_checkpoint",
    ),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'trainer.records.checkpoint' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "LAYOUT",
    "CheckpointError",
    "CheckpointLayout",
    "begin_checkpoint",
    "checkpoint_step",
    "commit_checkpoint",
    "find_latest",
    "list_checkpoints",
    "load_json",
    "load_safetensors",
    "load_sharded",
    "load_torch",
    "read_model_weights",
    "read_sharded",
    "resolve_resume",
    "rng_state",
    "save_json",
    "save_safetensors",
    "save_sharded",
    "save_torch",
    "set_rng_state",
    "step_dir_name",
    "verify_checkpoint",
]
