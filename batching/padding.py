"""Padding rows: the shortest legal sample, materialised by `StepBatch.select` from index -1.

A padding row (DESIGN.md, "Padding rows") is one prompt token plus one response token, both
`PADDING_TOKEN_ID`, position ids `0, 1` on every position axis, `loss_mask` 0 and every other
token field 0, and a fresh negative `uid` / `trajectory_id`. Real ids are `>= 0`, so a padding
row never shares a GRPO group or a trajectory with a real row; within one batch, the k-th
padding row (in row order) has `uid == trajectory_id == -(k + 1)`, renumbered whenever
`select` or `concat` builds a batch, so padding ids are unique within every batch.

Tensors are CPU tensors; this module never touches a device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from batching.columns import PackedColumns

__all__ = ["PADDING_TOKEN_ID", "renumber_padding", "select_rows"]

#: Token id of both tokens of a padding row. Its `loss_mask` is 0, so the id never reaches
#: a loss; 0 is chosen because it is a valid id for every vocabulary.
PADDING_TOKEN_ID = 0


def select_rows(
    batch: PackedColumns, indices: Sequence[int]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor]:
    """(token fields, row fields, cu_seqlens) of `batch`'s rows `indices` in that order, index
    -1 materialising a padding row; see `StepBatch.select`. Padding ids are not renumbered
    here: call `renumber_padding` on the result's row fields."""
    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    n = batch.num_rows
    if idx.size and (idx.min() < -1 or idx.max() >= n):
        bad = idx[(idx < -1) | (idx >= n)][0]
        raise ValueError(
            f"select index {int(bad)} is out of range for a batch of {n} rows; "
            "use 0..num_rows-1, or -1 for a padding row"
        )
    pad = idx == -1
    src_lens = batch.seq_lens
    out_lens = np.where(pad, 2, src_lens[np.where(pad, 0, idx)] if n else 2)
    out_cu = np.zeros(idx.size + 1, dtype=np.int64)
    np.cumsum(out_lens, out=out_cu[1:])
    out_t = int(out_cu[-1])

    # Token gather: for every output token of a real row, its source token index.
    real_rows = np.flatnonzero(~pad)
    real_lens = out_lens[real_rows]
    src_starts = batch.cu_seqlens.numpy()[idx[real_rows]]
    dst_starts = out_cu[real_rows]
    dst_pos = np.arange(int(real_lens.sum()), dtype=np.int64)
    seg_base = np.repeat(np.cumsum(real_lens) - real_lens, real_lens)
    src_tok = np.repeat(src_starts, real_lens) + (dst_pos - seg_base)
    dst_tok = np.repeat(dst_starts, real_lens) + (dst_pos - seg_base)
    pad_rows = np.flatnonzero(pad)
    pad_start = out_cu[pad_rows]
    all_real = pad_rows.size == 0
    src_tok_t, dst_tok_t = torch.from_numpy(src_tok), torch.from_numpy(dst_tok)

    token_fields = {}
    for name, t in batch.token_fields.items():
        if all_real:
            token_fields[name] = t.index_select(-1, src_tok_t)
            continue
        out = torch.zeros((*t.shape[:-1], out_t), dtype=t.dtype)
        out[..., dst_tok_t] = t.index_select(-1, src_tok_t)
        if name == "position_ids":
            out[..., torch.from_numpy(pad_start + 1)] = 1
        elif name == "input_ids" and PADDING_TOKEN_ID != 0:
            out[..., torch.from_numpy(np.concatenate([pad_start, pad_start + 1]))] = (
                PADDING_TOKEN_ID
            )
        token_fields[name] = out

    real_rows_t = torch.from_numpy(real_rows)
    src_rows_t = torch.from_numpy(idx[real_rows])
    row_fields = {}
    for name, t in batch.row_fields.items():
        if all_real:
            row_fields[name] = t.index_select(0, src_rows_t)
            continue
        out = torch.zeros((idx.size, *t.shape[1:]), dtype=t.dtype)
        out[real_rows_t] = t.index_select(0, src_rows_t)
        row_fields[name] = out
    if not all_real:
        pad_rows_t = torch.from_numpy(pad_rows)
        row_fields["is_padding"][pad_rows_t] = True
        row_fields["is_last_step"][pad_rows_t] = True
        row_fields["prompt_len"][pad_rows_t] = 1
        row_fields["response_len"][pad_rows_t] = 1
    return token_fields, row_fields, torch.from_numpy(out_cu)


def renumber_padding(row_fields: dict[str, torch.Tensor]) -> None:
    """Give the k-th padding row uid = trajectory_id = -(k+1), unique within this batch.

    Replaces the `uid` and `trajectory_id` columns of `row_fields` (never writes into them)."""
    is_pad = row_fields["is_padding"]
    if not bool(is_pad.any()):
        return
    where = torch.nonzero(is_pad, as_tuple=True)[0]
    fresh = -torch.arange(1, where.numel() + 1, dtype=torch.int64)
    for name in ("uid", "trajectory_id"):
        col = row_fields[name].clone()
        col[where] = fresh
        row_fields[name] = col
