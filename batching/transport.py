"""numpy (de)serialisation of a `StepBatch` for Ray's object store.

A batch travels as a flat dict of numpy arrays (keys `token/<name>`, `row/<name>`,
`cu_seqlens`), which the object store hands back zero-copy; `StepBatch.from_numpy` wraps
them with `torch.from_numpy` (DESIGN.md, "trainer/").
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from batching.columns import PackedColumns

__all__ = ["arrays_to_fields", "batch_to_arrays"]

_TOKEN_PREFIX = "token/"
_ROW_PREFIX = "row/"
_CU_KEY = "cu_seqlens"


def batch_to_arrays(batch: PackedColumns) -> dict[str, np.ndarray]:
    """Flat dict of numpy arrays of `batch`; see `StepBatch.to_numpy`."""
    out: dict[str, np.ndarray] = {_CU_KEY: batch.cu_seqlens.numpy()}
    for name, t in batch.token_fields.items():
        out[_TOKEN_PREFIX + name] = t.detach().cpu().contiguous().numpy()
    for name, t in batch.row_fields.items():
        out[_ROW_PREFIX + name] = t.detach().cpu().contiguous().numpy()
    return out


def arrays_to_fields(
    arrays: dict[str, np.ndarray], *, copy: bool = False
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor]:
    """(token fields, row fields, cu_seqlens) from a `batch_to_arrays` dict; see
    `StepBatch.from_numpy`."""
    if _CU_KEY not in arrays:
        raise ValueError(f"arrays has no {_CU_KEY!r} key; pass the dict from to_numpy()")

    def wrap(a: np.ndarray) -> torch.Tensor:
        if copy or not a.flags.writeable:
            if copy:
                return torch.from_numpy(np.array(a, copy=True))
            # torch warns on read-only arrays; sharing them is the point (zero-copy).
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                return torch.from_numpy(a)
        return torch.from_numpy(a)

    token_fields, row_fields = {}, {}
    for key, a in arrays.items():
        if key.startswith(_TOKEN_PREFIX):
            token_fields[key[len(_TOKEN_PREFIX) :]] = wrap(a)
        elif key.startswith(_ROW_PREFIX):
            row_fields[key[len(_ROW_PREFIX) :]] = wrap(a)
        elif key != _CU_KEY:
            raise ValueError(
                f"unknown key {key!r}; keys are 'cu_seqlens', 'token/<name>', 'row/<name>'"
            )
    return token_fields, row_fields, wrap(arrays[_CU_KEY])
