"""Step statistics: each one declared once with its reduction, rendered into metrics and
fingerprint fields the same way for every dp size."""

from __future__ import annotations

import pytest

from trainer.loop.ranks.step_stats import SCHEMAS, Reduce, StepStats


def _report(role: str, **sums) -> StepStats:
    grad_norm, lr = sums.pop("grad_norm"), sums.pop("lr")
    return StepStats.of_update(role, sums, grad_norm=grad_norm, lr=lr)


def test_every_statistic_reduces_as_declared():
    total = StepStats("actor")
    # two optimizer steps, two ranks each; grad norm and lr are the same on every rank
    for step, lr in ((1, 1e-3), (2, 5e-4)):
        total.add_update(
            [
                _report(
                    "actor",
                    loss=0.25 * step,
                    pg_loss=3.0,
                    entropy=6.0,
                    loss_tokens=3,
                    grad_norm=2.0 * step,
                    lr=lr,
                ),
                _report(
                    "actor",
                    loss=0.75 * step,
                    pg_loss=1.0,
                    entropy=2.0,
                    loss_tokens=1,
                    grad_norm=2.0 * step,
                    lr=lr,
                ),
            ]
        )
    metrics = total.metrics()
    assert metrics["actor/loss"] == pytest.approx((1.0 + 2.0) / 2)  # rank sum, update mean
    assert metrics["actor/pg_loss"] == pytest.approx(8.0 / 8)  # per loss token
    assert metrics["actor/entropy"] == pytest.approx(16.0 / 8)
    assert metrics["actor/grad_norm"] == pytest.approx((2.0 + 4.0) / 2)  # once per update
    assert metrics["actor/lr"] == 5e-4  # the last update's
    assert metrics["actor/clip_frac"] == 0.0  # always logged, never reported
    assert "actor/kl" not in metrics  # logged only when reported (needs a reference model)
    fp = total.fingerprint()
    assert fp["actor_loss"] == metrics["actor/loss"]
    assert fp["actor_grad_norm"] == metrics["actor/grad_norm"]
    assert fp["old_logprob_mean"] is None  # never reported


def test_per_token_fingerprint_needs_loss_tokens():
    total = StepStats("actor")
    total.add_update([_report("actor", old_logprob=0.0, loss_tokens=0, grad_norm=0.0, lr=0.0)])
    assert total.fingerprint()["old_logprob_mean"] is None
    assert "actor/pg_loss" in total.metrics()  # metrics divide by max(1, tokens): 0.0


def test_an_undeclared_statistic_is_a_programming_error():
    with pytest.raises(AssertionError, match="undeclared.*pg_los"):
        _report("actor", pg_los=1.0, grad_norm=0.0, lr=0.0)


def test_schema_names_are_unique_per_role():
    for role, stats in SCHEMAS.items():
        keys = [s.key for s in stats]
        assert len(keys) == len(set(keys)), role
        metrics = [s.metric for s in stats if s.metric]
        assert len(metrics) == len(set(metrics)), role
        assert all(isinstance(s.reduce, Reduce) for s in stats)
