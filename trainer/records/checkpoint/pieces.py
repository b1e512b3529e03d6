"""Checkpoint pieces: saving and loading tensors, objects, JSON and RNG state, atomically.

Every save goes through ``rollout.files`` (temp file, fsync, rename), so a piece in a staging
dir is either whole or absent. Every load turns a missing or corrupt file into a
``CheckpointError`` that names the file and the way out.
"""

from __future__ import annotations

import json
import logging
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from rollout.files import atomic_path, atomic_write_text

if TYPE_CHECKING:  # torch is imported where a tensor is saved or loaded: resolving a resume
    import torch  # target before Ray starts does not pay for it

log = logging.getLogger("trainer.records.checkpoint")


class CheckpointError(ValueError):
    """A checkpoint (or a file in it) is missing, incomplete or corrupt.

    The message names the checkpoint dir or file, what is wrong and how to go on.
    """


def save_json(obj: Any, path: str | os.PathLike) -> Path:
    """Write ``obj`` as pretty JSON atomically (e.g. ``trainer_state.json``)."""
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def load_json(path: str | os.PathLike) -> Any:
    """Read a JSON file; a missing or malformed file raises CheckpointError naming it."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(
            f"{path}: file is missing; the checkpoint is incomplete, resume from another one"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(
            f"{path}: cannot read JSON ({err}); the file is corrupt, resume from another checkpoint"
        ) from None


# --------------------------------------------------------------------------- tensors / objects


def save_safetensors(
    state_dict: dict[str, torch.Tensor],
    path: str | os.PathLike,
    metadata: dict[str, str] | None = None,
) -> Path:
    """Save a flat ``{name: tensor}`` dict as safetensors, atomically.

    Tensors are detached, moved to CPU and made contiguous. Tensors that share storage (tied
    embeddings) or are views into a larger buffer are cloned, since safetensors refuses
    shared storage; loading gives independent copies, and re-tying is the model's job.
    Sharded (DTensor) parameters must be gathered to full tensors by the caller first.
    """
    import torch
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    seen_storages: set[int] = set()
    for name, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                f"save_safetensors: state_dict[{name!r}] is a {type(value).__name__}, not a "
                "tensor; save non-tensor state with save_torch or save_json instead"
            )
        t = value.detach().to("cpu")
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        whole = t.is_contiguous() and t.storage_offset() == 0
        whole = whole and t.numel() * t.element_size() == storage.nbytes()
        if not whole or (ptr in seen_storages and t.numel() > 0):
            t = t.clone(memory_format=torch.contiguous_format)
        else:
            seen_storages.add(ptr)
        tensors[name] = t
    with atomic_path(path) as tmp:
        save_file(tensors, tmp, metadata=metadata)
    return Path(path)


def load_safetensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Load a safetensors file onto the CPU; errors are CheckpointErrors naming the file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(
            f"{path}: file is missing; the checkpoint is incomplete, resume from another one"
        )
    try:
        return load_file(path, device="cpu")
    except (SafetensorError, OSError, RuntimeError, ValueError) as err:
        raise CheckpointError(
            f"{path}: not a readable safetensors file ({err}); the file is corrupt, "
            "resume from another checkpoint"
        ) from None


def save_torch(obj: Any, path: str | os.PathLike) -> Path:
    """``torch.save`` atomically. Keep ``obj`` to tensors, dicts, lists, tuples, numbers,
    strings and None so ``load_torch`` (``weights_only=True``) can read it back."""
    import torch

    with atomic_path(path) as tmp:
        torch.save(obj, tmp)
    return Path(path)


def load_torch(path: str | os.PathLike) -> Any:
    """``torch.load(weights_only=True)`` onto the CPU; errors name the file (no deep traceback)."""
    import torch

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(
            f"{path}: file is missing; the checkpoint is incomplete, resume from another one"
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises many types (UnpicklingError, RuntimeError, EOFError)
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(
            f"{path}: cannot load ({type(err).__name__}: {first_line}); the file is corrupt or "
            "holds objects other than tensors/containers, resume from another checkpoint"
        ) from None


# --------------------------------------------------------------------------- RNG state


def rng_state(device_get_state: Callable[[], Any] | None = None) -> dict[str, Any]:
    """Capture Python ``random``, numpy's global RNG and torch's CPU generator.

    ``device_get_state`` (from the HAL backend) returns the accelerator generator state;
    it is stored under ``"device"``. Everything is plain lists/ints/tensors so the dict
    survives ``save_torch`` -> ``load_torch`` with ``weights_only=True``.
    """
    import torch

    version, internal, gauss_next = random.getstate()
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss_next": gauss_next},
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64).copy()),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
    }
    if device_get_state is not None:
        state["device"] = device_get_state()
    return state


def set_rng_state(
    state: dict[str, Any], device_set_state: Callable[[Any], None] | None = None
) -> None:
    """Restore what ``rng_state`` captured; ``device_set_state`` restores ``state["device"]``.

    A device state without a setter (a run resumed on another device type) is skipped with a
    warning: host draws still reproduce, device sampling will not.
    """
    import torch

    for key in ("python", "numpy", "torch"):
        if key not in state:
            raise CheckpointError(
                f"rng state has no {key!r} entry (keys: {sorted(state)}); it was not made by "
                "rng_state(), resume from another checkpoint"
            )
    py = state["python"]
    random.setstate((int(py["version"]), tuple(int(x) for x in py["state"]), py["gauss_next"]))
    npst = state["numpy"]
    keys = npst["keys"]
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
    np.random.set_state(
        (
            npst["kind"],
            keys.astype(np.uint32),
            int(npst["pos"]),
            int(npst["has_gauss"]),
            float(npst["cached_gaussian"]),
        )
    )
    torch.set_rng_state(state["torch"])
    if "device" in state:
        if device_set_state is None:
            log.warning("rng state holds a device generator but no setter was given: skipped")
        else:
            device_set_state(state["device"])
