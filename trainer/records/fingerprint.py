"""Parity fingerprints: what a training step records in ``fingerprint.jsonl`` (DESIGN.md,
"Cross-device parity").

A fingerprint is a small JSON object per step. Two kinds of entries:

- exact: the plan digest and the per-mini-batch counts (real rows, real tokens, loss tokens).
  They are integer logic on the host and must be identical between two runs of the same job on
  any devices and any dp size;
- numeric: reward mean, mean old / new log-probability over loss tokens, losses, grad norms and,
  every ``run.fingerprint_every`` steps, a parameter checksum. They must agree within a
  floating-point tolerance chosen by the runs' ``train.param_dtype``.

The controller builds one with ``fingerprint_of_step``; every worker adds its share of the
parameter checksum with ``local_param_stats`` and the controller adds the shares with
``combine_param_stats``. Comparing two runs' fingerprints is ``trainer.commands.parity``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

#: Entries that must be identical (integer logic on the host, no floating point).
EXACT_FIELDS = ("plan_digest", "mini_batch_rows", "mini_batch_tokens", "mini_batch_loss_tokens")

#: Numeric entries in the order a step computes them, so that the first disagreeing field of a
#: step is also the earliest point in the step where the two runs went apart.
NUMERIC_FIELDS = (
    "reward_mean",
    "old_logprob_mean",
    "new_logprob_mean",
    "actor_loss",
    "actor_entropy",
    "actor_approx_kl",
    "actor_grad_norm",
    "critic_loss",
    "critic_grad_norm",
)

CHECKSUM_FIELD = "param_checksum"

#: How many parameters a checksum records one by one (besides the totals over all of them).
TRACKED_PARAMS = 8

#: Elements per float64 chunk when summing a parameter shard: 128 MiB of float64 on an
#: accelerator (few kernel launches); on the CPU 512 KiB, which stays in cache (3.5x faster
#: than large chunks on builtin:small). Chunking moves a sum in its last bits only.
_CHUNK_ELEMENTS = {"cpu": 1 << 16}
_ACCELERATOR_CHUNK_ELEMENTS = 1 << 24


def fingerprint_of_step(
    plan,
    update_fields: Mapping[str, float | None],
    metrics: Mapping[str, Any],
    checksum: Mapping[str, Any] | None,
    mini_batch_counts: Iterable[Iterable[int]] | None = None,
) -> dict[str, Any]:
    """The fingerprint of one training step.

    ``plan``: the step's ``batching.Plan``. ``update_fields``: the training roles'
    ``StepStats.fingerprint()`` fields (log-prob means, losses, grad norms), in order.
    ``metrics``: the step's metrics line (for the reward). ``checksum``:
    ``combine_param_stats`` output, or None on steps without one. ``mini_batch_counts``:
    per mini-batch ``(real rows, loss tokens)`` as the workers' loss normalizers saw them.
    """
    fp: dict[str, Any] = {
        "plan_digest": plan.digest(),
        "mini_batch_rows": [int(mb.num_rows) for mb in plan.mini_batches],
        "mini_batch_tokens": [int(mb.num_tokens) for mb in plan.mini_batches],
    }
    if mini_batch_counts is not None:
        counts = [list(c) for c in mini_batch_counts]
        if [int(c[0]) for c in counts] != fp["mini_batch_rows"]:
            # The workers' normalizer saw other rows than the plan: a bug worth a loud record.
            fp["mini_batch_rows_seen_by_workers"] = [int(c[0]) for c in counts]
        fp["mini_batch_loss_tokens"] = [int(c[1]) for c in counts]
    fp["reward_mean"] = metrics.get("reward/mean")
    fp.update(update_fields)
    if checksum is not None:
        fp[CHECKSUM_FIELD] = dict(checksum)
    return fp


def tracked_parameter_names(names: Iterable[str], max_tracked: int = TRACKED_PARAMS) -> list[str]:
    """The parameters a checksum records one by one: up to ``max_tracked`` weights, evenly
    spaced in sorted-name order (first and last included), so they span the model.

    Biases are left out on purpose: a key-projection bias has a true gradient of 0 (softmax
    ignores a shift shared by all keys), so its update is Adam-amplified float noise that
    differs between any two devices. The totals still include every parameter.
    """
    weights = sorted(n for n in names if n.endswith("weight"))
    if len(weights) <= max_tracked:
        return weights
    picks = {round(i * (len(weights) - 1) / (max_tracked - 1)) for i in range(max_tracked)}
    return [weights[i] for i in sorted(picks)]


def local_param_stats(
    named_parameters: Iterable[tuple[str, Any]], max_tracked: int = TRACKED_PARAMS
) -> dict[str, list[float]]:
    """This rank's share of the parameter checksum, in float64.

    For each tracked parameter ``[sum, sum of |x|]`` and under ``"__all__"``
    ``[sum, sum of |x|, sum of x^2]`` over every parameter, computed on the local shard only
    (an FSDP2 ``DTensor``'s ``to_local()``; a replicated copy counts on one rank only). The
    shares of all ranks add up to the whole model's values: ``combine_param_stats``. Reading
    local shards needs no collective, so the cost is one pass over this rank's weights.
    """
    import torch

    params = list(named_parameters)
    tracked = set(tracked_parameter_names([n for n, _ in params], max_tracked))
    rows = []  # per parameter [sum, sum |x|, sum x^2], float64 on its device
    with torch.no_grad():
        for _, param in params:
            local = _local_share(param)
            stats = torch.zeros(3, dtype=torch.float64, device=param.device)
            if local is not None:
                # Chunks bound the float64 copy (an embedding shard of a 7B model is ~70M
                # elements). x^2 is taken in float32 (1 ulp) and the sums in float64, the one
                # float64 op accelerators are sure to have (|x| is exact either way).
                size = _CHUNK_ELEMENTS.get(local.device.type, _ACCELERATOR_CHUNK_ELEMENTS)
                for chunk in local.detach().reshape(-1).split(size):
                    x = chunk.float()
                    wide = x.to(torch.float64)
                    parts = (wide.sum(), wide.abs().sum(), x.square().to(torch.float64).sum())
                    stats += torch.stack(parts)
            rows.append(stats)
        # One copy to the host for the whole model, not a wait per parameter.
        table = torch.stack(rows).cpu().tolist() if rows else []
    total = [0.0, 0.0, 0.0]
    out: dict[str, list[float]] = {}
    for (name, _), stats in zip(params, table):
        total = [t + v for t, v in zip(total, stats)]  # in parameter order, float64
        if name in tracked:
            out[name] = stats[:2]
    out["__all__"] = total
    return out


def _local_share(param):
    """The part of ``param`` this rank counts: its shard of a sharded ``DTensor``; a copy that is
    replicated over a mesh dimension only on that dimension's coordinate 0; None otherwise."""
    to_local = getattr(param, "to_local", None)
    if to_local is None:
        return param
    coordinate = param.device_mesh.get_coordinate() or []
    for dim, placement in enumerate(param.placements):
        if placement.is_replicate() and dim < len(coordinate) and coordinate[dim] != 0:
            return None
    return to_local()


def combine_param_stats(
    per_rank: Iterable[Mapping[str, list[float]]],
) -> dict[str, dict[str, float]]:
    """Add every rank's ``local_param_stats`` (in rank order, float64) into the checksum:
    ``{name: {"sum", "abs"}, ..., "__all__": {"sum", "abs", "sq"}}``.

    ``abs`` is the scale a sum is compared at (a sum of mixed-sign numbers can be near 0 while
    its rounding error is relative to the sum of magnitudes).
    """
    keys = ("sum", "abs", "sq")
    totals: dict[str, list[float]] = {}
    for part in per_rank:
        for name, values in part.items():
            acc = totals.setdefault(name, [0.0] * len(values))
            for i, v in enumerate(values):
                acc[i] += float(v)
    return {name: dict(zip(keys, values)) for name, values in sorted(totals.items())}
