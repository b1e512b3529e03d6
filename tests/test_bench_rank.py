"""``python -m bench.rank``: one training rank as shipped (the plain module) against FSDP2 at
world size 1, on the same weights and rows; the two must train to the same numbers."""

from __future__ import annotations

from bench.rank import ShardedSpec, format_table, run
from trainer.config import load_config
from trainer.loop.ranks.spec import WorkerSpec


def test_plain_rank_trains_to_fsdp2s_numbers_bit_for_bit():
    res = run("builtin:tiny", repeats=1)
    # Three steps of two optimizer steps each on both sides: not one bit apart.
    assert res["max_param_diff"] == 0.0
    table = format_table(res)
    assert "largest parameter difference after them: 0" in table
    for key in ("old_logprobs_wall_s", "update_cpu_s"):
        assert key in table and all(res["sides"][s][key] > 0 for s in ("fsdp2", "plain"))


def test_the_bench_compares_the_shipped_layout_with_fsdp2():
    cfg = load_config(None, ["device=cpu", "model.path=builtin:tiny", "train.dp_size=1"])
    assert not WorkerSpec(role="actor", rank=0, cfg=cfg).sharded  # as the trainer runs dp 1
    assert ShardedSpec(role="actor", rank=0, cfg=cfg).sharded
