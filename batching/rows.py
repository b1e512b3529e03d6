"""Rollout rows: `Row` (one sequence as the rollout layer emits it), its validation, and
packing a list of rows into `StepBatch` columns (`StepBatch.from_rows`).

Tensors are CPU tensors; this module never touches a device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["Row", "pack_rows"]


@dataclass
class Row:
    """One training row as produced by rollout: prompt tokens + response tokens (plain lists).

    `response_mask[i]` is 1 when response token i is trained on (model-generated) and 0 when it
    is not (a tool observation in whole-trajectory mode, or an EOS appended after generation).
    `response_logprobs[i]` is the rollout engine's logprob of response token i (0.0 where the
    mask is 0). `token_rewards`, when given, holds one reward per response token; when None the
    row's reward `step_reward` (+ `score` if `is_last_step`) sits on the last response token
    whose mask is 1 (on the last response token if none is, on the last token if the response
    is empty). `response_versions`, when given (streamed rollouts), holds the policy version
    that sampled each response token (-1 where none did: observations, appended EOS).
    `routed_experts`, when given (a mixture whose engine returned its routing), holds int
    ``[prompt + response tokens, MoE layers, top_k]``: each token's experts as the engine
    routed it, stored as expert id + 1 (0 where the engine gave none: the trainer routes that
    token itself).
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
    response_versions: list[int] | None = None
    routed_experts: np.ndarray | None = None


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
    if row.response_versions is not None and len(row.response_versions) != n_resp:
        raise ValueError(
            f"rows[{i}].response_versions has {len(row.response_versions)} entries but "
            f"response_ids has {n_resp}; give one version per response token or None"
        )
    routes = row.routed_experts
    if routes is not None:
        tokens = len(row.prompt_ids) + n_resp
        if np.ndim(routes) != 3 or len(routes) != tokens:
            raise ValueError(
                f"rows[{i}].routed_experts has shape {np.shape(routes)} but the row has {tokens} "
                "tokens; give [tokens, MoE layers, top_k] (expert id + 1, 0 = none) or None"
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


def pack_rows(
    rows: Sequence[Row],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor]:
    """(token fields, row fields, cu_seqlens) of `rows` packed in order; see
    `StepBatch.from_rows`. Raises ValueError naming the first malformed row."""
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
    if any(r.response_versions is not None for r in rows):  # streamed: who sampled each token
        versions = np.full(num_tokens, -1, dtype=np.int64)
        for i, row in enumerate(rows):
            if row.response_versions is not None:
                versions[int(cu[i] + prompt_len[i]) : int(cu[i + 1])] = row.response_versions
        token_fields["policy_version"] = torch.from_numpy(versions)
    routed = [r.routed_experts for r in rows if r.routed_experts is not None]
    if routed:  # a mixture's engine routing: [L, K, T], token axis last; 0 = none
        shapes = {tuple(np.shape(r)[1:]) for r in routed}
        if len(shapes) > 1:
            raise ValueError(
                f"rows' routed_experts disagree on [MoE layers, top_k]: {sorted(shapes)}; every "
                "row of a batch comes from one model"
            )
        layers, top_k = shapes.pop()
        routes = np.zeros((num_tokens, layers, top_k), dtype=np.int16)
        for i, row in enumerate(rows):
            if row.routed_experts is not None:
                routes[int(cu[i]) : int(cu[i + 1])] = row.routed_experts
        token_fields["routed_experts"] = torch.from_numpy(
            np.ascontiguousarray(routes.transpose(1, 2, 0))
        )
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
    return token_fields, row_fields, torch.from_numpy(cu)
