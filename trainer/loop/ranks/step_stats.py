"""One owner for a training step's update statistics: what each worker reports, how it adds
up over micro-batches, ranks and optimizer steps, and what it becomes in metrics.jsonl and
fingerprint.jsonl.

A worker returns one ``StepStats`` per optimizer step (its rank's share); the controller folds
every rank's report of each step into a total with ``add_update`` and renders it with
``metrics()`` and ``fingerprint()``. Each statistic is declared once, in ``SCHEMAS``, with its
reduction: renaming a metric or changing its denominator touches this file only.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


class Reduce(enum.Enum):
    """How a statistic adds up over a step."""

    PER_LOSS_TOKEN = "summed over micro-batches, ranks and updates; divided by the loss tokens"
    RANK_SUM_UPDATE_MEAN = "each rank holds a share: summed over ranks, mean over updates"
    SHARED_UPDATE_MEAN = "the same on every rank: rank 0's value, mean over updates"
    SHARED_LAST = "the same on every rank: the last update's value"
    SHARED_COUNT = "the same on every rank: rank 0's value, summed over updates"
    RATIO = "summed over micro-batches, ranks and updates; divided by the sum of Stat.per"


@dataclass(frozen=True)
class Stat:
    """One reported statistic: ``key`` as the worker reports it, its reduction, its
    metrics.jsonl name after ``<role>/`` (None: not logged) and its fingerprint field
    (None: not fingerprinted)."""

    key: str
    reduce: Reduce
    metric: str | None = None
    fingerprint: str | None = None
    per: str | None = None  # RATIO: the statistic whose sum divides this one's


_TOKEN, _SHARE = Reduce.PER_LOSS_TOKEN, Reduce.RANK_SUM_UPDATE_MEAN
_SHARED, _LAST, _COUNT = Reduce.SHARED_UPDATE_MEAN, Reduce.SHARED_LAST, Reduce.SHARED_COUNT

#: Every statistic per role. ``loss_tokens`` (the denominator) is not listed: every report
#: carries it.
SCHEMAS: dict[str, tuple[Stat, ...]] = {
    "actor": (  # fingerprinted ones first, in fingerprint.jsonl's order
        Stat("old_logprob", _TOKEN, None, "old_logprob_mean"),
        Stat("new_logprob", _TOKEN, None, "new_logprob_mean"),
        Stat("loss", _SHARE, "loss", "actor_loss"),
        Stat("entropy", _TOKEN, "entropy", "actor_entropy"),
        Stat("approx_kl", _TOKEN, "approx_kl", "actor_approx_kl"),
        Stat("grad_norm", _SHARED, "grad_norm", "actor_grad_norm"),
        Stat("pg_loss", _TOKEN, "pg_loss"),
        Stat("clipped", _TOKEN, "clip_frac"),
        Stat("dual_clipped", _TOKEN),
        Stat("ratio", _TOKEN),
        Stat("kl", _TOKEN, "kl"),
        Stat("lr", _LAST, "lr"),
        Stat("skipped", _COUNT, "skipped_updates"),  # non-finite loss or grad norm
        # algorithm.routing_replay, on the weights that sampled: (loss token, MoE layer)
        # decisions where the actor's own top-k differs from the engine's, per decision
        Stat("routing_flips", Reduce.RATIO, "routing_flip_rate", per="routing_tokens"),
        Stat("routing_tokens", Reduce.RATIO, per="routing_tokens"),
        Stat("router_aux_loss", _SHARE, "router_aux_loss"),  # algorithm.router_aux_loss_coef
    ),
    "critic": (
        Stat("loss", _SHARE),
        Stat("vf_loss", _TOKEN, "vf_loss", "critic_loss"),
        Stat("vf_clipped", _TOKEN),
        Stat("values", _TOKEN),
        Stat("returns", _TOKEN),
        Stat("grad_norm", _SHARED, "grad_norm", "critic_grad_norm"),
        Stat("lr", _LAST),
        Stat("skipped", _COUNT, "skipped_updates"),
    ),
}
#: Statistics whose metric is written even on a step that never reported them (0.0), so
#: metrics.jsonl keeps the same keys every step; the others appear only when reported
#: (``actor/kl`` needs a reference model).
ALWAYS_LOGGED = {
    "loss",
    "pg_loss",
    "clipped",
    "approx_kl",
    "entropy",
    "grad_norm",
    "lr",
    "skipped",
}


@dataclass
class StepStats:
    """A role's update statistics: one rank's report of one optimizer step, or a step's total.

    ``values``: by ``Stat.key``; ``loss_tokens``: loss tokens behind the per-token sums;
    ``updates``: optimizer steps folded in.
    """

    role: str
    values: dict[str, float] = field(default_factory=dict)
    loss_tokens: float = 0.0
    updates: int = 0

    @classmethod
    def of_update(
        cls, role: str, sums: Mapping[str, float], *, grad_norm: float, lr: float
    ) -> StepStats:
        """One rank's report of one optimizer step: its metric sums over its micro-batches
        (``loss_tokens`` among them), the global grad norm and the lr."""
        known = {stat.key for stat in SCHEMAS[role]}
        values = {k: float(v) for k, v in sums.items() if k != "loss_tokens"}
        unknown = set(values) - known
        assert not unknown, f"{role} reported undeclared statistics {sorted(unknown)}"
        values.update(grad_norm=float(grad_norm), lr=float(lr))
        return cls(role, values, float(sums.get("loss_tokens", 0.0)), updates=1)

    def add_update(self, per_rank: Sequence[StepStats]) -> None:
        """Fold in one optimizer step as every rank reported it (rank order)."""
        first = per_rank[0]
        for stat in SCHEMAS[self.role]:
            if stat.key not in first.values:
                continue
            if stat.reduce in (Reduce.SHARED_UPDATE_MEAN, Reduce.SHARED_COUNT):
                self.values[stat.key] = self.values.get(stat.key, 0.0) + first.values[stat.key]
            elif stat.reduce is Reduce.SHARED_LAST:
                self.values[stat.key] = first.values[stat.key]
        for report in per_rank:
            self.loss_tokens += report.loss_tokens
            for stat in SCHEMAS[self.role]:
                if stat.reduce in (
                    Reduce.PER_LOSS_TOKEN,
                    Reduce.RANK_SUM_UPDATE_MEAN,
                    Reduce.RATIO,
                ):
                    if stat.key in report.values:
                        self.values[stat.key] = (
                            self.values.get(stat.key, 0.0) + report.values[stat.key]
                        )
        self.updates += 1

    def value(self, stat: Stat, *, strict_tokens: bool = False) -> float | None:
        """The reduced value of ``stat``; None when it was never reported. Per-token values
        divide by ``max(1, loss_tokens)``, or give None without loss tokens when
        ``strict_tokens``."""
        if stat.key not in self.values:
            return None
        total = self.values[stat.key]
        if stat.reduce is Reduce.PER_LOSS_TOKEN:
            if strict_tokens and self.loss_tokens <= 0:
                return None
            return total / max(1.0, self.loss_tokens)
        if stat.reduce is Reduce.RATIO:
            per = self.values.get(stat.per, 0.0)
            return total / per if per > 0 else None
        if stat.reduce in (Reduce.SHARED_LAST, Reduce.SHARED_COUNT):
            return total
        return total / max(1, self.updates)

    def metrics(self) -> dict[str, float]:
        """``<role>/<metric>`` for every logged statistic."""
        out = {}
        for stat in SCHEMAS[self.role]:
            if stat.metric is None:
                continue
            value = self.value(stat)
            if value is None and stat.key in ALWAYS_LOGGED:
                value = 0.0
            if value is not None:
                out[f"{self.role}/{stat.metric}"] = value
        return out

    def fingerprint(self) -> dict[str, float | None]:
        """The fingerprint fields of this role (None for a statistic never reported, or a
        per-token one without loss tokens)."""
        return {
            stat.fingerprint: self.value(stat, strict_tokens=True)
            for stat in SCHEMAS[self.role]
            if stat.fingerprint is not None
        }
