"""The training data model: `StepBatch`, packed columns of rows (`batching.rows.Row` is one
row as the rollout layer emits it).

A `StepBatch` never pads to `[batch, max_len]`. Token fields are concatenated over all rows
with the token axis LAST (so multimodal position ids may be `[3, T]`), row fields have the
row axis FIRST, and `cu_seqlens` (int64 `[R+1]`) holds the token offset of every row.

Padding rows (DESIGN.md, "Padding rows") are materialised by `StepBatch.select` from the
index `-1`; `batching.padding` says what one holds and how padding ids are numbered. Packing
rollout rows lives in `batching.rows`, numpy transport in `batching.transport`.

Tensors are CPU tensors; this module never touches a device.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from batching.padding import renumber_padding, select_rows
from batching.rows import Row, pack_rows
from batching.transport import arrays_to_fields, batch_to_arrays

__all__ = [
    "REQUIRED_ROW_FIELDS",
    "REQUIRED_TOKEN_FIELDS",
    "StepBatch",
]

#: Token fields every `StepBatch` carries, with their dtypes.
REQUIRED_TOKEN_FIELDS: dict[str, torch.dtype] = {
    "input_ids": torch.int64,
    "position_ids": torch.int64,
    "loss_mask": torch.float32,
    "rollout_logprobs": torch.float32,
    "token_rewards": torch.float32,
}

#: Row fields every `StepBatch` carries, with their dtypes.
REQUIRED_ROW_FIELDS: dict[str, torch.dtype] = {
    "uid": torch.int64,
    "trajectory_id": torch.int64,
    "step_index": torch.int64,
    "is_last_step": torch.bool,
    "is_padding": torch.bool,
    "prompt_len": torch.int64,
    "response_len": torch.int64,
    "score": torch.float32,
    "step_reward": torch.float32,
}


class StepBatch:
    """Columnar packed rows.

    Token fields are 1-D over all T tokens (token axis last, so `position_ids` may be `[k, T]`),
    row fields are 1-D over all R rows (row axis first), `cu_seqlens` is int64 `[R+1]`.

    Required token fields: `input_ids` (int64), `position_ids` (int64, `[T]` or `[k, T]`),
    `loss_mask` (float32 0/1), `rollout_logprobs` (float32), `token_rewards` (float32).
    Optional token fields added by the trainer: `old_logprobs`, `ref_logprobs`, `advantages`,
    `returns`, `values` (float32 `[T]`), or any other.
    Required row fields: `uid`, `trajectory_id`, `step_index` (int64), `is_last_step`,
    `is_padding` (bool), `prompt_len`, `response_len` (int64), `score`, `step_reward` (float32).
    """

    def __init__(
        self,
        token_fields: dict[str, torch.Tensor],
        row_fields: dict[str, torch.Tensor],
        cu_seqlens: torch.Tensor,
    ) -> None:
        self.token_fields = dict(token_fields)
        self.row_fields = dict(row_fields)
        self.cu_seqlens = cu_seqlens
        self._validate()

    # ------------------------------------------------------------------ construction

    def _validate(self) -> None:
        cu = self.cu_seqlens
        if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int64 or cu.dim() != 1:
            raise ValueError(f"cu_seqlens must be an int64 1-D tensor, got {cu!r}")
        if cu.numel() < 1 or int(cu[0]) != 0:
            raise ValueError("cu_seqlens must start at 0 and have R+1 entries")
        if cu.numel() > 1 and bool((cu[1:] < cu[:-1]).any()):
            raise ValueError("cu_seqlens must be non-decreasing")
        num_rows, num_tokens = cu.numel() - 1, int(cu[-1])
        for name in REQUIRED_TOKEN_FIELDS:
            if name not in self.token_fields:
                raise ValueError(f"StepBatch is missing required token field {name!r}")
        for name in REQUIRED_ROW_FIELDS:
            if name not in self.row_fields:
                raise ValueError(f"StepBatch is missing required row field {name!r}")
        for name, t in self.token_fields.items():
            if t.dim() < 1 or t.shape[-1] != num_tokens:
                raise ValueError(
                    f"token field {name!r} has shape {tuple(t.shape)}; its last axis must be "
                    f"the token axis of length {num_tokens}"
                )
        for name, t in self.row_fields.items():
            if t.dim() < 1 or t.shape[0] != num_rows:
                raise ValueError(
                    f"row field {name!r} has shape {tuple(t.shape)}; its first axis must be "
                    f"the row axis of length {num_rows}"
                )

    @classmethod
    def from_rows(cls, rows: Sequence[Row]) -> StepBatch:
        """Pack rollout rows into a batch (1-D position ids `0..len-1` per row, no padding rows).

        Prompt tokens get `loss_mask` 0, `rollout_logprobs` 0 and `token_rewards` 0; response
        tokens take theirs from the row (see `Row` for the default reward placement).
        """
        return cls(*pack_rows(rows))

    # ------------------------------------------------------------------ sizes

    @property
    def num_rows(self) -> int:
        """Number of rows (real and padding)."""
        return self.cu_seqlens.numel() - 1

    @property
    def num_tokens(self) -> int:
        """Number of tokens over all rows (real and padding)."""
        return int(self.cu_seqlens[-1])

    @property
    def seq_lens(self) -> np.ndarray:
        """Tokens per row, int64 numpy `[R]`."""
        return np.diff(self.cu_seqlens.numpy())

    @property
    def num_padding_rows(self) -> int:
        """Number of padding rows."""
        return int(self.is_padding.sum())

    def __len__(self) -> int:
        return self.num_rows

    def __repr__(self) -> str:
        return (
            f"StepBatch(rows={self.num_rows}, tokens={self.num_tokens}, "
            f"padding_rows={self.num_padding_rows}, token_fields={sorted(self.token_fields)}, "
            f"row_fields={sorted(self.row_fields)})"
        )

    def row_of_token(self) -> torch.Tensor:
        """Row index of every token, int64 `[T]`."""
        # numpy, not torch.repeat_interleave: the torch op enters an OpenMP parallel region
        # even for tiny inputs, which costs milliseconds on an oversubscribed CPU.
        return torch.from_numpy(np.repeat(np.arange(self.num_rows, dtype=np.int64), self.seq_lens))

    def row_loss_tokens(self) -> torch.Tensor:
        """Tokens with `loss_mask` 1 in each row, int64 `[R]` (0 for padding rows)."""
        mask = self.loss_mask.detach().cpu().numpy()
        csum = np.zeros(mask.size + 1, dtype=np.int64)
        np.cumsum(mask != 0, out=csum[1:])
        cu = self.cu_seqlens.numpy()
        return torch.from_numpy(csum[cu[1:]] - csum[cu[:-1]])

    # ------------------------------------------------------------------ common fields

    @property
    def input_ids(self) -> torch.Tensor:
        return self.token_fields["input_ids"]

    @property
    def position_ids(self) -> torch.Tensor:
        return self.token_fields["position_ids"]

    @property
    def loss_mask(self) -> torch.Tensor:
        return self.token_fields["loss_mask"]

    @property
    def rollout_logprobs(self) -> torch.Tensor:
        return self.token_fields["rollout_logprobs"]

    @property
    def token_rewards(self) -> torch.Tensor:
        return self.token_fields["token_rewards"]

    @property
    def uid(self) -> torch.Tensor:
        return self.row_fields["uid"]

    @property
    def trajectory_id(self) -> torch.Tensor:
        return self.row_fields["trajectory_id"]

    @property
    def step_index(self) -> torch.Tensor:
        return self.row_fields["step_index"]

    @property
    def is_last_step(self) -> torch.Tensor:
        return self.row_fields["is_last_step"]

    @property
    def is_padding(self) -> torch.Tensor:
        return self.row_fields["is_padding"]

    @property
    def prompt_len(self) -> torch.Tensor:
        return self.row_fields["prompt_len"]

    @property
    def response_len(self) -> torch.Tensor:
        return self.row_fields["response_len"]

    @property
    def score(self) -> torch.Tensor:
        return self.row_fields["score"]

    @property
    def step_reward(self) -> torch.Tensor:
        return self.row_fields["step_reward"]

    # ------------------------------------------------------------------ setters

    def set_token_field(self, name: str, tensor: torch.Tensor) -> None:
        """Add or replace a token field; its last axis must have `num_tokens` entries."""
        if not isinstance(tensor, torch.Tensor) or tensor.dim() < 1:
            raise ValueError(f"token field {name!r} must be a tensor with a token axis")
        if tensor.shape[-1] != self.num_tokens:
            raise ValueError(
                f"token field {name!r} has shape {tuple(tensor.shape)}; its last axis must have "
                f"num_tokens = {self.num_tokens} entries"
            )
        self.token_fields[name] = tensor

    def set_row_field(self, name: str, tensor: torch.Tensor) -> None:
        """Add or replace a row field; its first axis must have `num_rows` entries."""
        if not isinstance(tensor, torch.Tensor) or tensor.dim() < 1:
            raise ValueError(f"row field {name!r} must be a tensor with a row axis")
        if tensor.shape[0] != self.num_rows:
            raise ValueError(
                f"row field {name!r} has shape {tuple(tensor.shape)}; its first axis must have "
                f"num_rows = {self.num_rows} entries"
            )
        self.row_fields[name] = tensor

    # ------------------------------------------------------------------ selection

    def select(self, indices: Sequence[int]) -> StepBatch:
        """New batch with the rows `indices` in that order; index -1 materialises a padding row.

        Rows are copied whole (a row is never split). Padding rows get uid = trajectory_id =
        -(k+1) for the k-th padding row of the result (existing padding rows included).
        """
        result = StepBatch(*select_rows(self, indices))
        renumber_padding(result.row_fields)
        return result

    @classmethod
    def concat(cls, batches: Sequence[StepBatch]) -> StepBatch:
        """Rows of all `batches` in order, in one batch. All must carry the same fields
        (names, dtypes and non-token/non-row axes); padding ids are renumbered."""
        if len(batches) == 0:
            raise ValueError("StepBatch.concat needs at least one batch")
        first = batches[0]
        for j, b in enumerate(batches[1:], start=1):
            for kind, mine, theirs in (
                ("token", first.token_fields, b.token_fields),
                ("row", first.row_fields, b.row_fields),
            ):
                if set(mine) != set(theirs):
                    raise ValueError(
                        f"batches[{j}] has {kind} fields {sorted(theirs)} but batches[0] has "
                        f"{sorted(mine)}; set the same fields on every batch before concat"
                    )
                for name, t in mine.items():
                    o = theirs[name]
                    same_axes = (
                        t.shape[:-1] == o.shape[:-1]
                        if kind == "token"
                        else (t.shape[1:] == o.shape[1:])
                    )
                    if o.dtype != t.dtype or not same_axes:
                        raise ValueError(
                            f"{kind} field {name!r} of batches[{j}] is {o.dtype} "
                            f"{tuple(o.shape)} but batches[0] has {t.dtype} {tuple(t.shape)}"
                        )
        token_fields = {
            n: torch.cat([b.token_fields[n] for b in batches], dim=-1) for n in first.token_fields
        }
        row_fields = {
            n: torch.cat([b.row_fields[n] for b in batches], dim=0) for n in first.row_fields
        }
        lens = np.concatenate([b.seq_lens for b in batches])
        cu = np.zeros(lens.size + 1, dtype=np.int64)
        np.cumsum(lens, out=cu[1:])
        result = cls(token_fields, row_fields, torch.from_numpy(cu))
        renumber_padding(result.row_fields)
        return result

    def split(self, sizes: Sequence[int]) -> list[StepBatch]:
        """Consecutive pieces of `sizes[i]` rows each; the sizes must sum to `num_rows`."""
        sizes = [int(s) for s in sizes]
        if any(s < 0 for s in sizes) or sum(sizes) != self.num_rows:
            raise ValueError(
                f"split sizes {sizes} must be >= 0 and sum to num_rows = {self.num_rows}"
            )
        cu = self.cu_seqlens.numpy()
        out, r0 = [], 0
        for s in sizes:
            r1 = r0 + s
            t0, t1 = int(cu[r0]), int(cu[r1])
            out.append(
                StepBatch(
                    {n: t[..., t0:t1] for n, t in self.token_fields.items()},
                    {n: t[r0:r1] for n, t in self.row_fields.items()},
                    torch.from_numpy(cu[r0 : r1 + 1] - t0),
                )
            )
            r0 = r1
        return out

    # ------------------------------------------------------------------ transport

    def to_numpy(self) -> dict[str, np.ndarray]:
        """Flat dict of numpy arrays (keys `token/<name>`, `row/<name>`, `cu_seqlens`) for Ray's
        object store, which hands numpy back zero-copy."""
        return batch_to_arrays(self)

    @classmethod
    def from_numpy(cls, arrays: dict[str, np.ndarray], *, copy: bool = False) -> StepBatch:
        """Inverse of `to_numpy`. Without `copy` the tensors share the arrays' memory (which Ray
        hands out read-only): replace fields with `set_*_field`, never write into them."""
        return cls(*arrays_to_fields(arrays, copy=copy))
