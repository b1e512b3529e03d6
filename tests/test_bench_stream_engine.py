"""``bench.stream_engine`` serves the same groups' turns serially, batched through the
``VersionedEngine`` with and without joins, and as one plain call per turn; no time is
asserted."""

from __future__ import annotations

from bench import stream_engine


def test_the_three_modes_generate_the_same_tokens_and_the_batched_calls_merge_groups():
    result = stream_engine.run(groups=4, n=2, new_tokens=3, repeats=1, turns=2)
    assert set(result["tokens_per_s"]) == {"serial", "batched", "joined", "ceiling"}
    assert all(rate > 0 for rate in result["tokens_per_s"].values())
    # the groups ask at once: a batched call carries more than one group's n requests
    assert result["requests_per_call"] > 2
    table = stream_engine.format_table(result)
    assert "batched / serial" in table and "4 groups x n 2 x 2 turns x 3 new tokens" in table


def test_mixed_budgets_end_turns_at_different_steps_and_the_joined_mode_reports():
    result = stream_engine.run(groups=4, n=2, new_tokens=8, repeats=1, turns=2, mixed=True)
    assert result["mixed"] and result["requests_per_joined_call"] >= 2
    assert "joined / ceiling" in stream_engine.format_table(result)
