"""A step's trajectories as the agent loop (``rollout.agent_loop``) builds them, turn by turn,
and what comes out of them: the training rows (one per trajectory or one per turn, consecutive
turns merged where each extends the last), each trajectory's score and the step's
``rollout/*`` metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from batching import Row
from rollout.envs.base import DEFAULT_REWARD_RANGE
from rollout.envs.prompts import PromptItem


@dataclass
class Turn:
    """One generated turn: its prompt and response tokens, loss mask, sampled log-probs and
    policy versions, the env reward after it, and (whole mode) the tokens that follow it."""

    prompt_ids: list[int]
    response_ids: list[int]
    mask: list[int]
    logprobs: list[float]
    reward: float = 0.0
    obs_ids: list[int] = field(default_factory=list)  # whole mode: template + observation after it
    versions: list[int] | None = None  # policy version per response token (-1: not sampled)
    # A mixture's engine routing (``rollout.moe_routing``): int16 [tokens, MoE layers, top_k],
    # expert id + 1, for the tokens of prompt + response from position ``routes_from`` on.
    routes: np.ndarray | None = None
    routes_from: int = 0


@dataclass
class Trajectory:
    """One trajectory of a step: its prompt, sample, environment, turns so far and how it
    ended (done, truncated, or an env / reward fault)."""

    uid: int
    trajectory_id: int
    item: PromptItem
    sample: int
    env: object = None
    messages: list[dict] = field(default_factory=list)
    seq: list[int] = field(default_factory=list)  # whole mode: the running token sequence
    turns: list[Turn] = field(default_factory=list)
    done: bool = False
    truncated: bool = False
    error: str | None = None
    reward_range: tuple[float, float] = DEFAULT_REWARD_RANGE
    reward_error: bool = False  # the fault was the reward function's (rollout.rewards)
    timed_out: bool = False  # the fault was an env call past rollout.env_timeout_s
    reward_extra: dict[str, float] = field(default_factory=dict)  # its extra keys, final turn


def score_of(t: Trajectory) -> float:
    """The trajectory's score: its last turn's reward; 0 after a fault or with no turn."""
    if t.error is not None or not t.turns:
        return 0.0
    return t.turns[-1].reward


def rows_of(t: Trajectory, *, step_wise: bool, merge: bool) -> list[Row]:
    """The training rows of ``t`` (the module docstring of ``rollout.agent_loop``): one per
    trajectory, or one per turn (``step_wise``), consecutive turns merged where each extends
    the last (``merge``); the score on the last trained token of the last row."""
    if not t.turns:
        return []
    score = score_of(t)
    versioned = all(x.versions is not None for x in t.turns)
    if not step_wise:
        resp, mask, lps, vers = [], [], [], []
        for i, turn in enumerate(t.turns):
            resp += turn.response_ids
            mask += turn.mask
            lps += turn.logprobs
            vers += turn.versions if versioned else []
            if i + 1 < len(t.turns):  # the observation between two generated turns, untrained
                resp += turn.obs_ids
                mask += [0] * len(turn.obs_ids)
                lps += [0.0] * len(turn.obs_ids)
                vers += [-1] * len(turn.obs_ids)
        parts = [(t.turns[0].prompt_ids, resp, mask, lps, 0, score, vers)]
    else:
        parts = [
            (x.prompt_ids, x.response_ids, x.mask, x.logprobs, i, x.reward, x.versions or [])
            for i, x in enumerate(t.turns)
        ]
        if merge:
            parts = merge_turns(parts)
    rows = []
    routed = any(x.routes is not None for x in t.turns)
    for k, (prompt, resp, mask, lps, step_index, step_reward, vers) in enumerate(parts):
        last = k == len(parts) - 1
        token_rewards = [0.0] * len(resp)
        if last:
            where = max((i for i, m in enumerate(mask) if m), default=len(resp) - 1)
            token_rewards[where] = score
        rows.append(
            Row(
                prompt_ids=list(prompt),
                response_ids=list(resp),
                response_mask=list(mask),
                response_logprobs=list(lps),
                uid=t.uid,
                trajectory_id=t.trajectory_id,
                step_index=step_index,
                is_last_step=last,
                score=score,
                step_reward=step_reward,
                token_rewards=token_rewards,
                response_versions=list(vers) if versioned else None,
                routed_experts=stitched_routes(t.turns, list(prompt) + list(resp))
                if routed
                else None,
            )
        )
    return rows


def stitched_routes(turns: list[Turn], tokens: list[int]) -> np.ndarray | None:
    """The engine routing of a row of ``tokens`` (``Row.routed_experts``): each position as
    the first turn whose request held that token there routed it (a response token as the
    request that sampled it; a prompt token as the request that first read it, which is also
    what a prefix-cached later request reuses). A turn counts up to where its request (prompt
    + response) stops agreeing with the row; positions no turn routed are 0 (the trainer
    routes them). None when no turn carries routes."""
    given = [x for x in turns if x.routes is not None]
    if not given:
        return None
    out = np.zeros((len(tokens), *given[0].routes.shape[1:]), dtype=given[0].routes.dtype)
    covered = 0
    for x in given:
        seq = x.prompt_ids + x.response_ids
        agree = next((i for i, (a, b) in enumerate(zip(seq, tokens)) if a != b), None)
        end = min(
            x.routes_from + len(x.routes), min(len(seq), len(tokens)) if agree is None else agree
        )
        if end > covered:
            start = max(covered, x.routes_from)
            out[start:end] = x.routes[start - x.routes_from : end - x.routes_from]
            covered = end
    return out


def merge_turns(parts: list[tuple]) -> list[tuple]:
    """Merge consecutive turns when turn i's prompt + response is a token prefix of turn i+1's
    prompt; the gap (template + observation) joins the response with mask 0, logprob 0 and
    version -1. The
    merged row keeps the first turn's step_index and the sum of the merged turns' rewards."""
    merged = [parts[0]]
    for prompt, resp, mask, lps, idx, reward, vers in parts[1:]:
        p0, r0, m0, l0, i0, w0, v0 = merged[-1]
        head = p0 + r0
        if prompt[: len(head)] == head:
            gap = prompt[len(head) :]
            merged[-1] = (
                p0,
                r0 + gap + resp,
                m0 + [0] * len(gap) + mask,
                l0 + [0.0] * len(gap) + lps,
                i0,
                w0 + reward,
                v0 + [-1] * len(gap) + vers,
            )
        else:
            merged.append((prompt, resp, mask, lps, idx, reward, vers))
    return merged


def rollout_metrics(trajs: list[Trajectory], rows: list[Row]) -> dict[str, float]:
    """The step's ``rollout/*`` metrics and the reward function's ``reward/*`` ones."""
    num = len(trajs)
    with_rows = [t for t in trajs if t.turns]
    return {
        "rollout/num_trajectories": float(num),
        "rollout/num_rows": float(len(rows)),
        "rollout/mean_turns": sum(len(t.turns) for t in trajs) / max(num, 1),
        "rollout/truncated_trajectories": float(sum(t.truncated for t in trajs)),
        "rollout/env_errors": float(sum(t.error is not None for t in trajs)),
        "rollout/env_timeout_errors": float(sum(t.timed_out for t in trajs)),
        "rollout/unfinished_trajectories": float(
            sum(
                not t.truncated and t.error is None and bool(t.turns) and not finished(t)
                for t in trajs
            )
        ),
        "rollout/mean_response_length": sum(len(r.response_ids) for r in rows) / max(len(rows), 1),
        "rollout/score_mean": sum(score_of(t) for t in with_rows) / max(len(with_rows), 1),
        **_reward_metrics(trajs),
    }


def _reward_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    """``reward/errors`` (reward-function faults, also in ``rollout/env_errors``) when any env
    scores with a reward function, and ``reward/extra/<key>``: the mean of each extra key a reward
    function returned, over the trajectories that returned it."""
    out: dict[str, float] = {}
    if any(getattr(t.env, "reward_fn", None) is not None for t in trajs):
        out["reward/errors"] = float(sum(t.reward_error for t in trajs))
    totals: dict[str, list[float]] = {}
    for t in trajs:
        for key, value in t.reward_extra.items():
            totals.setdefault(key, []).append(value)
    for key, values in sorted(totals.items()):
        out[f"reward/extra/{key}"] = sum(values) / len(values)
    return out


def finished(t: Trajectory) -> bool:
    """Whether ``t`` ended by its environment's own ``done``, not cut or faulted."""
    return t.done and not t.truncated and t.error is None
