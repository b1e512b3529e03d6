"""``bench.stream_engine`` serves the same groups' turns serially, batched through the
``VersionedEngine`` per call and through its engine servers, and as one plain call per turn; no time is
asserted."""

from __future__ import annotations

import pytest

from bench import stream_engine, stream_engine_table


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
    assert "| served |" in stream_engine.format_table(result)


def test_modes_left_out_are_not_timed_and_the_ratios_are_those_between_modes_that_ran():
    """``modes`` times only those given (``serial`` at engine scale takes minutes); the same
    engines (``build``) serve every shape in turn, as ``--shapes even,mixed,longtail`` runs
    them, and the least favourable ratio names its shape."""
    built = stream_engine.build("hf", replicas=2, new_tokens=4)
    try:
        results = [
            stream_engine.run(
                groups=4,
                n=2,
                new_tokens=4,
                repeats=1,
                turns=3,
                mixed=mixed,
                built=built,
                modes=("batched", "served", "served-async", "ceiling"),
                tool_wait_ms=wait_ms,
            )
            for mixed, wait_ms in ((False, 0.0), (True, 0.0), (True, 5.0))
        ]
    finally:
        built.shutdown()
    for result in results:
        # served-async is vLLM's: left out on the HF engine
        assert set(result["tokens_per_s"]) == {"batched", "served", "ceiling"}
        assert result["replicas"] == 2 and "batched_over_serial" not in result
        assert result["served_over_batched"] == pytest.approx(
            result["tokens_per_s"]["served"] / result["tokens_per_s"]["batched"]
        )
        assert set(result["seconds_per_set"]) == set(result["tokens_per_s"])
    assert [stream_engine_table.shape_of(r) for r in results] == ["even", "mixed", "longtail"]
    assert results[0]["turns_asked"] == 4 * 3 and results[2]["turns_asked"] == sum(
        map(len, stream_engine._tail_plan(4, 3, 5.0))
    )
    worst = min(results, key=lambda r: r["served_over_ceiling"])
    assert (
        f"least favourable served / ceiling: {worst['served_over_ceiling']:.2f} "
        f"({stream_engine_table.shape_of(worst)})"
    ) in stream_engine.least_favourable(results)
    with pytest.raises(ValueError, match=r"modes=\['warp'\]: use some of"):
        stream_engine.run(groups=1, n=1, new_tokens=1, repeats=1, modes=("warp",), built=built)


def test_the_long_tail_plan_draws_as_the_long_tail_environment_and_is_seeded():
    """Each group's turns (1 to ``turns``, most groups few) and the waits after them (median
    near ``tool_wait_ms``, none over 2 s) are the same on every call; no waits and every turn
    when ``tool_wait_ms`` is 0."""
    plan = stream_engine._tail_plan(200, 6, 20.0)
    assert plan == stream_engine._tail_plan(200, 6, 20.0)
    counts = [len(waits) for waits in plan]
    assert min(counts) >= 1 and max(counts) == 6 and sorted(counts)[100] <= 2
    waits = sorted(w for group in plan for w in group)
    assert 0 < waits[0] and waits[-1] <= 2.0
    assert 0.01 < waits[len(waits) // 2] < 0.04  # LogNormal(0, 1.5) x 20 ms: median 20 ms
    assert stream_engine._tail_plan(3, 4, 0.0) == [[0.0] * 4] * 3


def test_the_command_refuses_a_bad_mode_shape_wait_and_a_model_that_is_not_a_directory(
    tmp_path, capsys
):
    for argv, said in (
        (["--modes", "served,warp"], "--modes served,warp: use some of"),
        (["--shapes", "even,odd"], "--shapes even,odd: a comma list of even, mixed, longtail"),
        (["--tool-wait-ms", "0"], "--tool-wait-ms 0.0: give 0 < ms <= 2000"),
        (["--model", str(tmp_path)], f"--model {tmp_path}: no config.json there"),
    ):
        with pytest.raises(SystemExit) as exit_:
            stream_engine.main(argv)
        assert exit_.value.code == 2 and said in capsys.readouterr().err
