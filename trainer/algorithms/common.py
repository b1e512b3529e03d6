"""Shared arithmetic for the advantage estimators: group statistics, whitening,
and the reverse discounted sum that GAE and REINFORCE++ both run.

Everything here works on float64 numpy arrays on the controller's CPU. float64
and fixed summation orders (np.bincount, a column loop) keep the result the same
bit for bit on every machine, which the cross-device parity check relies on.
"""

from __future__ import annotations

import numpy as np


def group_index(group_ids: np.ndarray) -> tuple[np.ndarray, int]:
    """Map arbitrary group ids (one per trajectory) to dense indices 0..G-1.

    Returns ``(index[N], G)``; trajectories with equal ids share an index.
    """
    _, inverse = np.unique(np.asarray(group_ids), return_inverse=True)
    inverse = inverse.reshape(-1)
    return inverse, int(inverse.max()) + 1 if inverse.size else 0


def group_mean_std(values: np.ndarray, index: np.ndarray, num_groups: int):
    """Per-group count, mean and unbiased (Bessel, n-1) std of ``values``.

    Returns three arrays of length ``num_groups``. The std of a group of one is
    NaN-free 0 (callers decide what a singleton group means).
    """
    count = np.bincount(index, minlength=num_groups).astype(np.float64)
    total = np.bincount(index, weights=values, minlength=num_groups)
    mean = total / np.maximum(count, 1.0)
    # Two-pass variance: subtracting the mean first avoids the cancellation that
    # E[x^2] - E[x]^2 suffers when scores are large and nearly equal.
    sq_dev = np.bincount(index, weights=(values - mean[index]) ** 2, minlength=num_groups)
    var = sq_dev / np.maximum(count - 1.0, 1.0)
    return count, mean, np.sqrt(var)


def whiten(values: np.ndarray, eps: float = 1e-8) -> np.ndarray:
    """Shift to mean 0 and scale to unit (unbiased) variance over all entries.

    With fewer than two entries there is no spread to scale by, so the values are
    only centred (a single token then gets advantage 0).
    """
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        return values.copy()
    centred = values - values.mean()
    if values.size < 2:
        return centred
    var = np.sum(centred**2) / (values.size - 1)
    return centred / np.sqrt(var + eps)


def reverse_discounted_cumsum(x: np.ndarray, lengths: np.ndarray, factor: float) -> np.ndarray:
    """``y_t = x_t + factor * y_{t+1}`` within each sequence, ``y`` after the end = 0.

    ``x`` is the concatenation of sequences whose lengths (tokens) are
    ``lengths``; the result has the same layout. The loop runs over token
    positions counted from each sequence's end (at most max(lengths) steps) and
    handles all sequences at once, so memory stays O(tokens) instead of a
    [sequences, max_len] matrix.
    """
    x = np.asarray(x, dtype=np.float64)
    lengths = np.asarray(lengths, dtype=np.int64)
    if x.size != int(lengths.sum()):
        raise ValueError(f"lengths sum to {int(lengths.sum())} but x has {x.size} tokens")
    if x.size == 0:
        return x.copy()
    seq = np.repeat(np.arange(lengths.size), lengths)
    starts = np.cumsum(lengths) - lengths
    pos_from_end = (starts + lengths - 1)[seq] - np.arange(x.size)
    # Group token indices by their distance from the end: a stable sort keeps
    # the column loop's order fixed, hence the float result deterministic.
    order = np.argsort(pos_from_end, kind="stable")
    bounds = np.searchsorted(pos_from_end[order], np.arange(int(lengths.max()) + 1))
    y = np.empty_like(x)
    running = np.zeros(lengths.size, dtype=np.float64)
    for k in range(int(lengths.max())):
        idx = order[bounds[k] : bounds[k + 1]]
        s = seq[idx]
        running[s] = x[idx] + factor * running[s]
        y[idx] = running[s]
    return y
