"""The training data model: `Row` (one sequence as the rollout layer emits it) and `StepBatch`
(packed columns).

A `StepBatch` never pads to `[batch, max_len]`. Token fields are concatenated over all rows
with the token axis LAST (so multimodal position ids may be `[3, T]`), row fields have the
row axis FIRST, and `cu_seqlens` (int64 `[R+1]`) holds the token offset of every row.

Padding rows (DESIGN.md, "Padding rows") are materialised by `StepBatch.select` from the
index `-1`: one prompt token plus one response token, both `PADDING_TOKEN_ID`, position ids
`0, 1` on every position axis, `loss_mask` 0 and every other token field 0, and a fresh
negative `uid` / `trajectory_id`. Real ids are `>= 0`, so a padding row never shares a GRPO
group or a trajectory with a real row; within one batch, the k-th padding row (in row order)
has `uid == trajectory_id == -(k + 1)`, renumbered whenever `select` or `concat` builds a
batch, so padding ids are unique within every batch.

Tensors are CPU tensors; this module never touches a device.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "PADDING_TOKEN_ID",
    "REQUIRED_ROW_FIELDS",
    "REQUIRED_TOKEN_FIELDS",
    "Row",
    "StepBatch",
]

#: Token id of both tokens of a padding row. Its `loss_mask` is 0, so the id never reaches
#: a loss; 0 is chosen because it is a valid id for every vocabulary.
PADDING_TOKEN_ID = 0

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

_TOKEN_PREFIX = "token/"
_ROW_PREFIX = "row/"
_CU_KEY = "cu_seqlens"


@dataclass
class Row:
    """One training row as produced by rollout: prompt tokens + response tokens (plain lists).

    `response_mask[i]` is 1 when response token i is trained on (model-generated) and 0 when it
    is not (a tool observation in whole-trajectory mode, or an EOS appended after generation).
    `response_logprobs[i]` is the rollout engine's logprob of response token i (0.0 where the
    mask is 0). `token_rewards`, when given, holds one reward per response token; when None the
    row's reward `step_reward` (+ `score` if `is_last_step`) sits on the last response token
    whose mask is 1 (on the last response token if none is, on the last token if the response
    is empty).
    """

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float]
    uid: int
    trajectory_id: int
    step_index: int = 0
    is_last_step: bool = True
    score: float = 0.0
    step_reward: float = 0.0
    token_rewards: list[float] | None = None


def _validate_row(i: int, row: Row) -> None:
    n_resp = len(row.response_ids)
    if len(row.prompt_ids) + n_resp < 1:
        raise ValueError(
            f"rows[{i}] has 0 tokens (prompt_ids and response_ids both empty); "
            "every row needs at least one token"
        )
    for name in ("response_mask", "response_logprobs"):
        got = len(getattr(row, name))
        if got != n_resp:
            raise ValueError(
                f"rows[{i}].{name} has {got} entries but response_ids has {n_resp}; "
                f"give one {name} entry per response token"
            )
    if row.token_rewards is not None and len(row.token_rewards) != n_resp:
        raise ValueError(
            f"rows[{i}].token_rewards has {len(row.token_rewards)} entries but response_ids "
            f"has {n_resp}; give one reward per response token or None"
        )
    bad = [m for m in row.response_mask if m not in (0, 1)]
    if bad:
        raise ValueError(f"rows[{i}].response_mask contains {bad[0]!r}; use only 0 and 1")
    for name in ("uid", "trajectory_id", "step_index"):
        value = getattr(row, name)
        if int(value) != value or value < 0:
            raise ValueError(
                f"rows[{i}].{name} = {value!r}; it must be an integer >= 0 "
                "(negative ids are reserved for padding rows)"
            )


def _default_reward_position(row: Row) -> int:
    """Index (within the row's tokens) that carries the row's scalar reward."""
    mask = row.response_mask
    for j in range(len(mask) - 1, -1, -1):
        if mask[j]:
            return len(row.prompt_ids) + j
    return len(row.prompt_ids) + len(row.response_ids) - 1


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
        for i, row in enumerate(rows):
            _validate_row(i, row)
        prompt_len = np.array([len(r.prompt_ids) for r in rows], dtype=np.int64)
        response_len = np.array([len(r.response_ids) for r in rows], dtype=np.int64)
        seq_lens = prompt_len + response_len
        cu = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(seq_lens, out=cu[1:])
        num_tokens = int(cu[-1])

        input_ids = np.empty(num_tokens, dtype=np.int64)
        loss_mask = np.zeros(num_tokens, dtype=np.float32)
        logprobs = np.zeros(num_tokens, dtype=np.float32)
        rewards = np.zeros(num_tokens, dtype=np.float32)
        for i, row in enumerate(rows):
            start, mid, end = int(cu[i]), int(cu[i] + prompt_len[i]), int(cu[i + 1])
            input_ids[start:mid] = row.prompt_ids
            input_ids[mid:end] = row.response_ids
            loss_mask[mid:end] = row.response_mask
            logprobs[mid:end] = row.response_logprobs
            if row.token_rewards is not None:
                rewards[mid:end] = row.token_rewards
            else:
                reward = row.step_reward + (row.score if row.is_last_step else 0.0)
                rewards[start + _default_reward_position(row)] = reward
        # Positions restart at 0 for every row: offset of each token from its row's start.
        position_ids = np.arange(num_tokens, dtype=np.int64) - np.repeat(cu[:-1], seq_lens)

        token_fields = {
            "input_ids": torch.from_numpy(input_ids),
            "position_ids": torch.from_numpy(position_ids),
            "loss_mask": torch.from_numpy(loss_mask),
            "rollout_logprobs": torch.from_numpy(logprobs),
            "token_rewards": torch.from_numpy(rewards),
        }
        row_fields = {
            "uid": torch.tensor([int(r.uid) for r in rows], dtype=torch.int64),
            "trajectory_id": torch.tensor([int(r.trajectory_id) for r in rows], dtype=torch.int64),
            "step_index": torch.tensor([int(r.step_index) for r in rows], dtype=torch.int64),
            "is_last_step": torch.tensor([bool(r.is_last_step) for r in rows], dtype=torch.bool),
            "is_padding": torch.zeros(len(rows), dtype=torch.bool),
            "prompt_len": torch.from_numpy(prompt_len),
            "response_len": torch.from_numpy(response_len),
            "score": torch.tensor([float(r.score) for r in rows], dtype=torch.float32),
            "step_reward": torch.tensor([float(r.step_reward) for r in rows], dtype=torch.float32),
        }
        return cls(token_fields, row_fields, torch.from_numpy(cu))

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
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        n = self.num_rows
        if idx.size and (idx.min() < -1 or idx.max() >= n):
            bad = idx[(idx < -1) | (idx >= n)][0]
            raise ValueError(
                f"select index {int(bad)} is out of range for a batch of {n} rows; "
                "use 0..num_rows-1, or -1 for a padding row"
            )
        pad = idx == -1
        src_lens = self.seq_lens
        out_lens = np.where(pad, 2, src_lens[np.where(pad, 0, idx)] if n else 2)
        out_cu = np.zeros(idx.size + 1, dtype=np.int64)
        np.cumsum(out_lens, out=out_cu[1:])
        out_t = int(out_cu[-1])

        # Token gather: for every output token of a real row, its source token index.
        real_rows = np.flatnonzero(~pad)
        real_lens = out_lens[real_rows]
        src_starts = self.cu_seqlens.numpy()[idx[real_rows]]
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
        for name, t in self.token_fields.items():
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
        for name, t in self.row_fields.items():
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
        result = StepBatch(token_fields, row_fields, torch.from_numpy(out_cu))
        result._renumber_padding()
        return result

    def _renumber_padding(self) -> None:
        """Give the k-th padding row uid = trajectory_id = -(k+1), unique within this batch."""
        is_pad = self.row_fields["is_padding"]
        if not bool(is_pad.any()):
            return
        where = torch.nonzero(is_pad, as_tuple=True)[0]
        fresh = -torch.arange(1, where.numel() + 1, dtype=torch.int64)
        for name in ("uid", "trajectory_id"):
            col = self.row_fields[name].clone()
            col[where] = fresh
            self.row_fields[name] = col

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
        result._renumber_padding()
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
        out: dict[str, np.ndarray] = {_CU_KEY: self.cu_seqlens.numpy()}
        for name, t in self.token_fields.items():
            out[_TOKEN_PREFIX + name] = t.detach().cpu().contiguous().numpy()
        for name, t in self.row_fields.items():
            out[_ROW_PREFIX + name] = t.detach().cpu().contiguous().numpy()
        return out

    @classmethod
    def from_numpy(cls, arrays: dict[str, np.ndarray], *, copy: bool = False) -> StepBatch:
        """Inverse of `to_numpy`. Without `copy` the tensors share the arrays' memory (which Ray
        hands out read-only): replace fields with `set_*_field`, never write into them."""
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
        return cls(token_fields, row_fields, wrap(arrays[_CU_KEY]))
