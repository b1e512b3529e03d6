"""``bench.head`` runs the shipped fused head and the reference chunks on the same inputs."""

from __future__ import annotations

from bench import head


def test_the_head_benchmark_times_both_heads_side_by_side(monkeypatch):
    monkeypatch.setattr(head, "QUICK_SHAPE", (40, 16, 300))
    result = head.run(quick=True)
    assert set(result["seconds"]) == {"reference", "fused"} and result["rounds"] == 2
    assert result["shape"] == {"tokens": 40, "hidden": 16, "vocab": 300, "chunk": 111848}
    ratio = result["seconds"]["fused"] / result["seconds"]["reference"]
    assert result["fused_over_reference"] == ratio
    assert "fused / reference" in head.format_table(result)
