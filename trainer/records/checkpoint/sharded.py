"""Sharded model and optimizer state: torch.distributed.checkpoint (DCP) directories.

Every rank writes its own shard in parallel (``__<rank>_0.distcp``) and rank 0 the
``.metadata`` that says which slice of which tensor lives where; nothing is gathered on one
rank. Loading reads, on each rank, the slices its fresh shards cover, so a checkpoint written
at one dp size loads at another. ``read_model_weights`` reads a whole model back in a single
process without a process group (``crossrl export``).

A DCP directory is one piece of a checkpoint: it sits in the staging dir like any other file
and the commit (``store.commit_checkpoint``) hashes every file in it.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch

from trainer.records.checkpoint.layout import LAYOUT
from trainer.records.checkpoint.pieces import CheckpointError, load_safetensors


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def save_sharded(state: dict[str, Any], directory: str | os.PathLike) -> list[str]:
    """``dcp.save`` of ``state`` (DTensors: each rank writes its own shard) into ``directory``.

    A collective: every rank of the process group calls it with its own shards. Returns, on
    every rank, the names of the data files the checkpoint holds (relative to ``directory``),
    so the commit can check each was written.
    """
    import torch.distributed.checkpoint as dcp

    directory = Path(directory)
    metadata = dcp.save(state, storage_writer=dcp.FileSystemWriter(directory, sync_files=True))
    if getattr(metadata, "storage_data", None) is None:
        # torch 2.10-2.12 return a copy without the storage fields (FileSystemWriter.finish
        # replaces the dataclass instead of filling it in; pytorch issue 177887): the first
        # GPU run's end-of-run checkpoint failed on it. Every rank returns after the
        # coordinator wrote ``.metadata``, so read it back.
        metadata = dcp.FileSystemReader(directory).read_metadata()
    return sorted({info.relative_path for info in metadata.storage_data.values()})


def load_sharded(state: dict[str, Any], directory: str | os.PathLike) -> None:
    """``dcp.load`` into ``state`` in place: each rank reads the slices its tensors (DTensor
    shards of the current dp size) cover. A collective. Errors name the directory."""
    import torch.distributed.checkpoint as dcp

    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(
            f"{directory}: directory is missing; the checkpoint is incomplete, resume from "
            "another one"
        )
    try:
        dcp.load(state, storage_reader=dcp.FileSystemReader(directory))
    except Exception as err:  # DCP wraps every rank's failure in a CheckpointException
        raise CheckpointError(
            f"{directory}: cannot load sharded state ({type(err).__name__}: {_first_line(err)}); "
            "the checkpoint does not fit this job's model or is corrupt, resume from another one"
        ) from None


def read_sharded(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP directory, whole, on the CPU, in this process alone (no process
    group). Holds one full copy of the state in host memory."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    directory = Path(directory)
    reader = dcp.FileSystemReader(directory)
    try:
        metadata = reader.read_metadata()
        state = {
            name: torch.empty(meta.size, dtype=meta.properties.dtype)
            for name, meta in metadata.state_dict_metadata.items()
            if isinstance(meta, TensorStorageMetadata)
        }
        with warnings.catch_warnings():  # "no process group: loading in one process" is the point
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=reader, no_dist=True)
    except Exception as err:  # missing .metadata, torn shard files, ...
        raise CheckpointError(
            f"{directory}: cannot read sharded state ({type(err).__name__}: {_first_line(err)}); "
            "the checkpoint is incomplete or corrupt, use another one"
        ) from None
    return state


def read_model_weights(ckpt_dir: str | os.PathLike, role: str = "actor") -> dict[str, torch.Tensor]:
    """The full model weights of ``role`` in a committed checkpoint, ``{parameter name:
    tensor}`` on the CPU (names as in the Hugging Face model: ``model.layers.0...``).

    Single process, no process group. Reads the sharded layout, or the single-file layout of
    checkpoints written before it.
    """
    ckpt = Path(ckpt_dir)
    sharded, legacy = ckpt / LAYOUT.model_dir(role), ckpt / LAYOUT.legacy_model(role)
    if sharded.is_dir():
        return read_sharded(sharded)
    if legacy.is_file():
        return load_safetensors(legacy)
    raise CheckpointError(
        f"checkpoint {ckpt} holds no {role} model ({LAYOUT.model_dir(role)}/ or "
        f"{LAYOUT.legacy_model(role)}); pass a checkpoint of a run that trains the {role}"
    )
