"""``bench.device_budget``: a shipped config's update at its shape cut to the layers one card
holds, run for real and held against the budget. Here on the CPU with a tiny Qwen2 shape (the
peak is then the process's RSS, so no ratio is asserted; on a GPU it is the allocator's)."""

from __future__ import annotations

import json

import pytest
from transformers import Qwen2Config

from bench import device_budget

#: ids up to 1000 appear in the tracker's rows, so the vocabulary is a little larger
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1024,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)


@pytest.fixture
def cfg(tmp_path):
    Qwen2Config(**TINY).save_pretrained(tmp_path / "tiny")
    return device_budget._config(
        None,
        [
            "device=cpu",
            f"model.path={tmp_path / 'tiny'}",
            "rollout.max_input_len=96",
            "rollout.max_new_tokens=32",
            "train.max_tokens_per_micro_batch=256",
        ],
    )


def test_the_pick_is_the_most_layers_whose_update_fits(cfg, tmp_path):
    est = {
        n: device_budget.estimate_update_bytes(
            cfg, device_budget._cut_shape(TINY, n, tmp_path)[1], 80e9
        )
        for n in (2, 3)
    }
    assert est[3] > est[2]
    room = (est[2] + est[3]) / 2 / device_budget.FILL  # 2 layers fit, 3 do not
    assert device_budget.pick_layers(cfg, room, tmp_path) == 2
    with pytest.raises(ValueError, match=r"model.path=.*train.max_tokens_per_micro_batch"):
        device_budget.pick_layers(cfg, est[2] / 100, tmp_path)


def test_one_update_at_the_cut_shape_is_measured_beside_its_estimate(cfg, tmp_path):
    res = device_budget.measure(cfg, 2, tmp_path)
    assert res["layers"] == 2 and res["device"] == "cpu"
    shape = device_budget._cut_shape(TINY, 2, tmp_path)[1]
    assert res["params"] == shape.num_params
    assert res["micro_batch_tokens"] == 256
    assert res["peak_allocated_gb"] > 0
    assert res["estimate_gb"] * 1e9 == pytest.approx(
        device_budget.estimate_update_bytes(cfg, shape, 80e9)
    )
    assert "2 layers" in device_budget.format_result(res)


def test_the_cli_writes_its_result_and_names_a_bad_config(tmp_path, capsys):
    assert device_budget.main(["--config", str(tmp_path / "none.yaml")]) == 2
    assert "none.yaml" in capsys.readouterr().err
    Qwen2Config(**TINY).save_pretrained(tmp_path / "tiny")
    out = tmp_path / "res.json"
    argv = ["--config", "configs/cpu/tiny.yaml", "--layers", "1", "--json", str(out)]
    argv += ["device=cpu", f"model.path={tmp_path / 'tiny'}", "rollout.max_input_len=96"]
    argv += ["rollout.max_new_tokens=32", "train.max_tokens_per_micro_batch=256"]
    assert device_budget.main(argv) == 0
    assert json.loads(out.read_text())["layers"] == 1
