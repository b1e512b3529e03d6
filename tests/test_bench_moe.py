"""``bench.moe`` times the device's experts kernel against transformers' eager experts on the
same inputs, routed evenly and skewed, and reports the least favourable ratio."""

from __future__ import annotations

from bench import moe


def test_the_experts_benchmark_times_both_sides_on_every_shape(monkeypatch):
    monkeypatch.setattr(
        moe,
        "shapes",
        lambda accelerator, quick: [moe.Shape(64, 32, 16, 8, 2, skewed=s) for s in (False, True)],
    )
    result = moe.run(quick=True)
    assert result["kernel"] == "torch.grouped_mm" and result["rounds"] == 2
    assert [r["shape"].endswith(("even", "skewed")) for r in result["rows"]] == [True, True]
    for row in result["rows"]:
        assert set(row["seconds"]) == {"eager", "kernel"}
        assert row["kernel_over_eager"] == row["seconds"]["kernel"] / row["seconds"]["eager"]
        assert row["max_relative_gap"] < 1e-5  # float32: the same experts either way
    assert result["least_favourable_ratio"] == max(r["kernel_over_eager"] for r in result["rows"])
    assert "least favourable" in moe.format_table(result)
