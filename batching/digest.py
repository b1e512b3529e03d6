"""Plan digests: the exact bytes hashed to fingerprint a plan.

Parity between devices rests on these digests (golden fingerprints live with the tests), so
the bytes fed to the hash are a contract: length-prefixed little-endian int64 arrays after a
versioned tag. Changing them changes every recorded digest.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import numpy as np

__all__ = ["hash_layout", "hash_mini_batch_rows"]


def hash_mini_batch_rows(mini_batch_rows: Iterable[np.ndarray]) -> str:
    """sha256 hex of the real row indices of each mini-batch, in mini-batch order."""
    h = hashlib.sha256(b"crossrl-plan-v1")
    for rows in mini_batch_rows:
        _hash_ints(h, rows)
    return h.hexdigest()


def hash_layout(dp_size: int, micro_batches: Iterable[list[list[list[int]]]]) -> str:
    """sha256 hex of `dp_size` and every mini-batch's `micro_batches[rank][k]` row lists."""
    h = hashlib.sha256(b"crossrl-layout-v1")
    _hash_ints(h, np.array([dp_size], dtype=np.int64))
    for mini_batch in micro_batches:
        for rank in mini_batch:
            for micro in rank:
                _hash_ints(h, np.asarray(micro, dtype=np.int64))
    return h.hexdigest()


def _hash_ints(h: Any, values: np.ndarray) -> None:
    """Feed a length-prefixed little-endian int64 array into a hash (same bytes everywhere)."""
    values = np.ascontiguousarray(values, dtype="<i8")
    h.update(np.array([values.size], dtype="<i8").tobytes())
    h.update(values.tobytes())
