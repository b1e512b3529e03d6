"""The columns of a packed batch, as the modules below ``StepBatch`` see it.

``batching.padding`` and ``batching.transport`` read a batch's columns; ``StepBatch``
(``batching.data``) is built from what they return. They name this protocol rather than
``StepBatch`` itself, so the data model sits above them and nothing imports in a circle.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

__all__ = ["PackedColumns"]


class PackedColumns(Protocol):
    """A packed batch: per-token and per-row tensors and the rows' token offsets."""

    token_fields: dict[str, torch.Tensor]  # [T] each
    row_fields: dict[str, torch.Tensor]  # [R] each
    cu_seqlens: torch.Tensor  # [R + 1] token offsets

    @property
    def num_rows(self) -> int:
        """Rows, real and padding."""
        ...

    @property
    def seq_lens(self) -> np.ndarray:
        """Tokens of each row, ``[R]``."""
        ...
