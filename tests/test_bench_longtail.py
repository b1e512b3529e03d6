"""``bench longtail``: every schedule of the long-tail workload, streaming's among them, in one
table against lag 0 and lag 1; its schedules are valid jobs. No timing is asserted."""

from __future__ import annotations

import pytest

from bench import longtail
from trainer.config import load_config


@pytest.mark.parametrize("name", list(longtail.SCHEDULES))
def test_every_schedule_is_a_valid_job(name):
    cfg = load_config(None, [*longtail.LONGTAIL, *longtail.SCHEDULES[name], "seed=3"])
    assert cfg.rollout.max_turns == 6 and cfg.seed == 3
    assert bool(cfg.train.max_staleness) == name.startswith("stream")


def test_the_table_sets_each_schedule_against_lag_0_and_lag_1(capsys):
    row = dict(rollout_share=0.5, groups_dropped_per_step=0.0, partial_token_share=0.0)
    rows = {
        "lag 0, colocated": {**row, "step_s": 4.0, "reward_tail": 0.2, "reward_tail_std": 0.01},
        "lag 1, engine of its own": {
            **row,
            "step_s": 2.0,
            "reward_tail": 0.2,
            "reward_tail_std": 0,
        },
        "stream s=1, partial": {
            **row,
            "step_s": 1.0,
            "reward_tail": 0.19,
            "reward_tail_std": 0.02,
            "groups_dropped_per_step": 1.5,
            "partial_token_share": 0.1,
        },
    }
    table = longtail.format_table({"steps": 30, "seeds": 4, "rows": rows})
    stream = next(line for line in table.splitlines() if line.startswith("| stream"))
    assert "| 1.00 | 0.25x | 0.50x |" in stream and "| 1.5 | 0.10 |" in stream
    assert "0.190 +- 0.020" in stream and "30 steps x 4 seed(s)" in table
    assert longtail.main(["--schedules", "nope"]) == 2
    assert "nope" in capsys.readouterr().err


def test_schedule_names_with_commas_are_passed_separated_by_semicolons(monkeypatch):
    asked = {}
    monkeypatch.setattr(longtail, "run", lambda quick, **kw: asked.update(kw) or {"rows": {}})
    monkeypatch.setattr(longtail, "format_table", lambda res: "")
    assert longtail.main(["--schedules", "lag 0, colocated; stream s=1, partial"]) == 0
    assert asked["schedules"] == ["lag 0, colocated", "stream s=1, partial"]
