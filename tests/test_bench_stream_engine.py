"""``bench.stream_engine`` serves the same groups' turns serially, batched through the
``VersionedEngine`` per call and through its engine servers, and as one plain call per turn; no time is
asserted."""

from __future__ import annotations

from bench import stream_engine


def test_the_three_modes_generate_the_same_tokens_and_the_batched_calls_merge_groups():
    result = stream_engine.run(groups=4, n=2, new_tokens=3, repeats=1, turns=2)
    assert set(result["tokens_per_s"]) == {"serial", "batched", "served", "ceiling"}
    assert 0 <= result["served_wait_ms"]["median"] <= result["served_wait_ms"]["p99"]
    assert all(rate > 0 for rate in result["tokens_per_s"].values())
    # the groups ask at once: a batched call carries more than one group's n requests
    assert result["requests_per_call"] > 2
    table = stream_engine.format_table(result)
    assert "batched / serial" in table and "4 groups x n 2 x 2 turns x 3 new tokens" in table


def test_mixed_budgets_end_turns_at_different_steps_and_the_served_mode_reports():
    result = stream_engine.run(groups=4, n=2, new_tokens=8, repeats=1, turns=2, mixed=True)
    assert result["mixed"] and result["requests_per_served_batch"] >= 2
    assert "served / ceiling" in stream_engine.format_table(result)
    assert "served turn wait" in stream_engine.format_table(result)
