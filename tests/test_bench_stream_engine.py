"""``bench.stream_engine`` serves the same groups' turns serially, batched through the
``VersionedEngine`` per call and through its engine servers, and as one plain call per turn; no time is
asserted."""

from __future__ import annotations

import pytest

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
    assert "| served |" in stream_engine.format_table(result)


def test_modes_left_out_are_not_timed_and_the_ratios_are_those_between_modes_that_ran():
    """``modes`` times only those given (``serial`` at engine scale takes minutes); the same
    engines (``build``) serve even then mixed budgets, as ``--budgets even,mixed`` runs them."""
    built = stream_engine.build("hf", replicas=2, new_tokens=4)
    try:
        results = [
            stream_engine.run(
                groups=4,
                n=2,
                new_tokens=4,
                repeats=1,
                turns=2,
                mixed=mixed,
                built=built,
                modes=("batched", "served", "served-async", "ceiling"),
            )
            for mixed in (False, True)
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
    worst = min(results, key=lambda r: r["served_over_ceiling"])
    shape = "mixed" if worst["mixed"] else "even"
    assert f"served over ceiling: {worst['served_over_ceiling']:.2f} ({shape} budgets)" in (
        stream_engine.least_favourable(results)
    )
    with pytest.raises(ValueError, match=r"modes=\['warp'\]: use some of"):
        stream_engine.run(groups=1, n=1, new_tokens=1, repeats=1, modes=("warp",), built=built)


def test_the_command_refuses_a_bad_mode_a_bad_budget_and_a_model_that_is_not_a_directory(
    tmp_path, capsys
):
    for argv, said in (
        (["--modes", "served,warp"], "--modes served,warp: use some of"),
        (["--budgets", "even,odd"], "--budgets even,odd: a comma list of even, mixed"),
        (["--model", str(tmp_path)], f"--model {tmp_path}: no config.json there"),
    ):
        with pytest.raises(SystemExit) as exit_:
            stream_engine.main(argv)
        assert exit_.value.code == 2 and said in capsys.readouterr().err
