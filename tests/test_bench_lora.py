"""``bench.lora``: what a push carries is counted on the actor's own ``push_state`` rule, and
the tables read the result. No timing is asserted."""

from __future__ import annotations

import pytest

pytest.importorskip("peft", reason="LoRA needs peft")

from bench import lora  # noqa: E402


def test_a_lora_push_carries_the_adapters_alone():
    full = lora.push_bytes(["model.path=builtin:small"])
    adapters = lora.push_bytes(["model.path=builtin:small", *lora.LORA])
    with_head = lora.push_bytes(
        ["model.path=builtin:small", *lora.LORA, "model.lora.train_embeddings=true"]
    )
    assert 0 < adapters < 0.2 * full and adapters < with_head < full


def test_the_tables_set_lora_against_full_fine_tuning():
    row = {"step_s": 1.0, "sync_s": 0.1, "actor_peak_gb": 1.0, "engine_peak_gb": 0.5}
    result = {
        "cost": {"m": {"full": {**row, "push_bytes": 1e8}, "lora r16": {**row, "push_bytes": 1e6}}},
        "reward": {"full": {"last": 0.46, "tail": 0.45}, "lora": {"last": 0.44, "tail": 0.45}},
    }
    table = lora.format_table(result)
    assert "| m | lora r16 | 1.00 | 0.100 | 1.00 MB | 1.00% |" in table
    assert "| lora | 0.440 | 0.450 |" in table
