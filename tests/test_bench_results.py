"""Benchmarks: the packed and padded layouts compute the same update, results are recorded.

No timing is asserted here (speed lives in bench/ output, see docs/benchmarks.md).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

import hal
from bench import e2e, gpu, train
from bench.__main__ import main as bench_main


def _rows(n=12, seed=3):
    return train.make_rows(n, vocab_size=102, seed=seed, median_tokens=24, max_tokens=96)


def test_layouts_hold_every_row_once_and_only_pad_the_padded_one():
    rows = _rows()
    lens = sorted(int(r["input_ids"].numel()) for r in rows)
    packed = train.packed_micro_batches(rows, budget_tokens=128)
    seg = sorted(int(n) for mb in packed for n in torch.diff(mb.cu_seqlens))
    assert seg == lens
    assert all(mb.computed_tokens <= 128 for mb in packed)
    assert sum(mb.computed_tokens for mb in packed) == sum(lens)

    padded = train.padded_micro_batches(rows, rows_per_micro_batch=5, pad_token_id=3)
    assert [mb.input_ids.shape[0] for mb in padded] == [5, 5, 2]
    real = sorted(int(n) for mb in padded for n in mb.attention_mask.sum(1))
    assert real == lens
    for mb in padded:
        assert mb.input_ids.shape[1] == int(mb.attention_mask.sum(1).max())
        assert bool((mb.input_ids[mb.attention_mask == 0] == 3).all())
        assert float(mb.loss_mask[mb.attention_mask == 0].abs().sum()) == 0.0


def test_rows_follow_the_requested_length_range_and_mask_only_responses():
    rows = train.make_rows(200, vocab_size=102, seed=0, min_tokens=16, max_tokens=1024)
    for r in rows:
        n = int(r["input_ids"].numel())
        assert 16 <= n <= 1024
        mask = r["loss_mask"]
        assert mask[0] == 0 and mask[-1] == 1  # prompt first, response last
        assert bool((torch.diff(mask) >= 0).all())  # one prompt block, then one response block
        assert int(r["input_ids"].min()) >= 4  # no special ids in the random text


def test_packed_and_padded_updates_give_the_same_loss_and_gradients():
    hal.register_attention()
    from rollout.models import load_model

    rows = _rows(10)
    norm = train.row_normalizers(rows)
    packed_model = load_model("builtin:tiny", attn_implementation=hal.ATTN_IMPLEMENTATION)
    padded_model = load_model("builtin:tiny", attn_implementation="sdpa")
    losses, grads = [], []
    for model, mbs, fn in (
        (packed_model, train.packed_micro_batches(rows, 96), train.packed_loss),
        (padded_model, train.padded_micro_batches(rows, 4, pad_token_id=3), train.padded_loss),
    ):
        total = 0.0
        for mb in mbs:
            loss = fn(model, mb, norm)
            loss.backward()
            total += float(loss.detach())
        losses.append(total)
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    assert losses[0] == pytest.approx(losses[1], abs=train.LOSS_TOLERANCE)
    assert torch.allclose(grads[0], grads[1], atol=1e-6, rtol=1e-4)
    assert float(grads[0].norm()) > 0


def test_compare_reports_identical_losses_and_same_real_tokens():
    res = train.compare("builtin:tiny", 6, 2)
    assert res["loss"]["identical"]
    assert len(res["packed"]["seconds"]) == len(res["padded"]["seconds"]) == 2
    assert res["packed"]["token_efficiency"] == 1.0
    assert res["padded"]["computed_tokens"] >= res["real_tokens"]
    assert res["speedup"]["median"] > 0


def _record(step, **sections):
    rec = {"step": step, "timing/step_s": sum(sections.values())}
    rec.update({f"timing/{k}_s": v for k, v in sections.items()})
    rec["throughput/tokens_per_s"] = 100.0 / rec["timing/step_s"]
    return rec


def test_e2e_summary_drops_the_warm_up_step_and_splits_time():
    records = [
        _record(1, rollout=9.0, prepare=1.0, update=5.0, sync=1.0),
        _record(2, rollout=1.0, prepare=0.5, update=2.0, sync=0.5),
        _record(3, rollout=3.0, prepare=0.5, update=2.0, sync=0.5),
        _record(4, rollout=2.0, prepare=0.5, update=4.0, sync=0.5),
    ]
    s = e2e.summarise_metrics(records)
    assert s["steps"] == 3  # steady steps: the first is warm-up
    assert s["first_step_s"] == 16.0
    assert s["step_s"] == 6.0  # median of 4, 6, 7
    assert s["sections"]["rollout"]["median_s"] == 2.0
    assert s["sections"]["rollout"]["share"] == pytest.approx(6.0 / 17.0)
    assert math.fsum(v["share"] for v in s["sections"].values()) == pytest.approx(1.0)


def test_e2e_summary_pools_runs_and_drops_each_runs_first_step():
    run_a = [_record(1, update=10.0), _record(2, update=1.0), _record(3, update=2.0)]
    run_b = [_record(1, update=20.0), _record(2, update=3.0)]
    s = e2e.summarise_runs([run_a, run_b])
    assert s["runs"] == 2 and s["steps"] == 3
    assert s["step_s"] == 2.0  # median of 1, 2, 3
    assert s["first_step_s"] == 15.0  # median of 10, 20
    assert s["sections"]["update"]["share"] == pytest.approx(1.0)


def test_e2e_summary_rejects_a_run_without_timings():
    with pytest.raises(ValueError, match="timing/step_s"):
        e2e.summarise_metrics([{"step": 1}])


def test_bench_cli_rejects_an_unknown_benchmark(capsys):
    assert bench_main(["speed"]) == 2
    err = capsys.readouterr().err
    assert "'speed'" in err and "planner" in err


def test_bench_cli_writes_results_with_the_machine(tmp_path):
    out = tmp_path / "res.json"
    assert bench_main(["stepwise", "--quick", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["quick"] is True
    assert data["machine"]["torch"] == torch.__version__
    assert data["machine"]["logical_cores"] >= 1
    entry = data["benchmarks"]["stepwise"]
    assert set(entry["result"]) == {"search_r1", "swe"}
    assert list(data["benchmarks"]) == ["stepwise"]


@pytest.mark.skipif(
    hal.get_backend("auto").is_accelerator, reason="an accelerator is present: gpu runs for real"
)
def test_gpu_bench_skips_without_an_accelerator():
    res = gpu.run(quick=True)
    assert res["skipped"] is True
    assert "no accelerator" in res["reason"]
    assert gpu.format_table(res).startswith("skipped:")
