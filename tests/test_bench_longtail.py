"""``bench longtail``: every schedule of the long-tail workload on every shape of tail, with
and without the tools' latency, in one table against lag 0, lag 1 and the run's own
latency-free twin; its runs are valid jobs. No timing is asserted."""

from __future__ import annotations

import pytest

from bench import longtail
from trainer.config import load_config


@pytest.mark.parametrize("shape", list(longtail.SHAPES))
@pytest.mark.parametrize("name", list(longtail.SCHEDULES))
def test_every_run_is_a_valid_job(shape, name):
    for latency in (True, False):
        cfg = load_config(None, [*longtail.job_keys(shape, name, latency), "seed=3"])
        assert cfg.seed == 3 and bool(cfg.train.max_staleness) == name.startswith("stream")
        env = cfg.rollout.env_kwargs
        assert cfg.rollout.max_turns == env.get("max_turns", 6)
        assert (env.get("max_delay_s") == 0) == (not latency)


def _row(step_s: float, **extra) -> dict:
    base = dict(rollout_share=0.5, groups_dropped_per_step=0.0, partial_token_share=0.0)
    return {**base, "step_s": step_s, "reward_tail": 0.2, "reward_tail_std": 0.01, **extra}


def test_the_table_sets_each_run_against_lag_0_lag_1_and_itself_without_latency(capsys):
    rows = {
        "few": {
            "lag 0, colocated": _row(4.0, free_step_s=2.0),
            "lag 1, engine of its own": _row(2.0),
            "stream s=1, partial": _row(1.0, free_step_s=0.8, groups_dropped_per_step=1.5),
        },
        "many": {
            "lag 0, colocated": _row(6.0),
            "stream s=1, partial": _row(3.0, free_step_s=1.5),
        },
    }
    table = longtail.format_table({"steps": 30, "seeds": 4, "rows": rows})
    few = next(line for line in table.splitlines() if line.startswith("| few | stream"))
    assert "| 1.00 | 0.25x | 0.50x | 1.25x |" in few and "| 1.5 |" in few
    many = next(line for line in table.splitlines() if line.startswith("| many | stream"))
    assert "| 3.00 | 0.50x | - | 2.00x |" in many
    assert "least favourable stream vs itself without latency: 2.00x (many" in table
    assert "least favourable stream vs lag 0: 0.50x (many" in table
    assert longtail.main(["--schedules", "nope"]) == 2
    assert "nope" in capsys.readouterr().err
    assert longtail.main(["--shapes", "flat"]) == 2
    assert "flat" in capsys.readouterr().err


def test_names_with_commas_are_passed_separated_by_semicolons(monkeypatch):
    asked = {}
    monkeypatch.setattr(longtail, "run", lambda quick, **kw: asked.update(kw) or {"rows": {}})
    monkeypatch.setattr(longtail, "format_table", lambda res: "")
    argv = [
        "--schedules",
        "lag 0, colocated; stream s=1, partial",
        "--shapes",
        "many turns, up to 12",
    ]
    assert longtail.main([*argv, "--no-latency-free"]) == 0
    assert asked["schedules"] == ["lag 0, colocated", "stream s=1, partial"]
    assert asked["shapes"] == ["many turns, up to 12"] and asked["latency_free"] is False
