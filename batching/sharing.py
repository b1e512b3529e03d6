"""Shared prompts: lay a packed micro-batch out so that a prompt several rows share is run once.

A GRPO group's n samples start with the same prompt. In the usual packed row each sample
carries its own copy, so the model runs the prompt n times and gets n equal results. The
shared layout keeps one copy (a *root* segment) and, per sample, only the tokens after the
prompt (a *continuation* segment whose tokens attend to the root first; ``hal.packed_forward``'s
``parents``). The model then sees ``P + n * R`` tokens instead of ``n * (P + R)``.

Everything here is integer bookkeeping on the host (numpy), the same on every machine. The
trainer reads its results back in the usual layout: ``PromptSharing.eval_hidden`` /
``eval_targets`` say which hidden state predicts which token, ``eval_of_token`` where each
token of the usual layout finds its value.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["PromptSharing", "share_prompts"]


@dataclass(frozen=True)
class PromptSharing:
    """The shared layout of one packed micro-batch of ``T`` tokens, ``T_s`` of them kept.

    - ``token_index`` ``[T_s]``: the token (of the usual layout) at each shared position; the
      shared row's input ids and position ids are the usual ones taken at these indices.
    - ``offsets`` ``[S + 1]`` and ``parents`` ``[S]``: the shared row's segments, in tokens,
      and per segment the root segment it continues, or -1.
    - ``eval_hidden`` / ``eval_targets`` ``[E]``: the distinct (shared position, next token)
      pairs a causal LM is scored on: position ``eval_hidden[e]``'s output predicts token
      ``eval_targets[e]``. A prompt's positions count once however many rows share it.
    - ``eval_of_token`` ``[T]``: for each token of the usual layout, the pair ``e`` whose
      prediction it is (the pair of the token before it in its row); 0 at a row's first
      token, which nothing predicts (``row_starts``).
    """

    token_index: np.ndarray
    offsets: list[int]
    parents: list[int]
    eval_hidden: np.ndarray
    eval_targets: np.ndarray
    eval_of_token: np.ndarray
    row_starts: np.ndarray

    @property
    def num_tokens(self) -> int:
        """Tokens of the shared row (``T_s``)."""
        return int(self.token_index.shape[0])


def share_prompts(
    input_ids: np.ndarray, cu_seqlens: np.ndarray, prompt_lens: np.ndarray
) -> PromptSharing | None:
    """The shared layout of a packed micro-batch, or None when no two rows share a prompt.

    ``input_ids`` ``[T]``; ``cu_seqlens`` ``[R + 1]`` row offsets in tokens; ``prompt_lens``
    ``[R]`` each row's prompt tokens (at least 1 and fewer than the row's tokens). Rows whose
    prompts are equal token for token share one root; their roots sit where the first of them
    was, the rows keep their order.
    """
    input_ids = np.asarray(input_ids)
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    prompt_lens = np.asarray(prompt_lens, dtype=np.int64)
    rows = len(cu) - 1
    keys = [input_ids[cu[r] : cu[r] + prompt_lens[r]].tobytes() for r in range(rows)]
    counts: dict[bytes, int] = {}
    for key in keys:
        counts[key] = counts.get(key, 0) + 1
    if not any(c > 1 for c in counts.values()):
        return None
    pieces: list[np.ndarray] = []  # usual-layout token indices, segment by segment
    parents: list[int] = []
    source = np.empty(int(cu[-1]), dtype=np.int64)  # shared position of each usual token
    root_of: dict[bytes, tuple[int, int]] = {}  # prompt -> (root segment, its first position)
    kept = 0
    for r, key in enumerate(keys):
        start, end, mid = int(cu[r]), int(cu[r + 1]), int(cu[r] + prompt_lens[r])
        if counts[key] < 2:
            pieces.append(np.arange(start, end))
            parents.append(-1)
            source[start:end] = np.arange(kept, kept + end - start)
            kept += end - start
            continue
        if key not in root_of:
            root_of[key] = (len(parents), kept)
            pieces.append(np.arange(start, mid))
            parents.append(-1)
            kept += mid - start
        root, root_first = root_of[key]
        source[start:mid] = np.arange(root_first, root_first + mid - start)
        pieces.append(np.arange(mid, end))
        parents.append(root)
        source[mid:end] = np.arange(kept, kept + end - mid)
        kept += end - mid
    lengths = [len(p) for p in pieces]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64).tolist()
    # Token t is predicted by the output at token t - 1 of its row, wherever that now sits.
    row_starts = np.zeros(int(cu[-1]), dtype=bool)
    row_starts[cu[:-1]] = True
    predictor = np.zeros_like(source)
    predictor[1:] = source[:-1]
    pairs = np.stack([predictor, input_ids.astype(np.int64)], axis=1)[~row_starts]
    unique, inverse = np.unique(pairs, axis=0, return_inverse=True)
    eval_of_token = np.zeros(int(cu[-1]), dtype=np.int64)
    eval_of_token[~row_starts] = inverse.reshape(-1)
    return PromptSharing(
        token_index=np.concatenate(pieces),
        offsets=offsets,
        parents=parents,
        eval_hidden=unique[:, 0].copy(),
        eval_targets=unique[:, 1].copy(),
        eval_of_token=eval_of_token,
        row_starts=row_starts,
    )
