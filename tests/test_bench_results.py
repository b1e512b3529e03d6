"""Benchmarks: the packed and padded layouts compute the same update, results are recorded.

No timing is asserted here (speed lives in bench/ output, see docs/benchmarks.md).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

import batching
import hal
from bench import e2e, gpu, packed, padded, train
from bench.__main__ import main as bench_main


def _rows(n=12, seed=3):
    return train.make_rows(n, vocab_size=102, seed=seed, median_tokens=24, max_tokens=96)


def test_layouts_hold_every_row_once_and_only_pad_the_padded_one():
    rows = _rows()
    lens = sorted(int(r["input_ids"].numel()) for r in rows)
    batch = packed.step_batch(rows)
    mini_rows, micro = packed.plan_micro_batches(batch, budget_tokens=128)
    assert sorted(mini_rows) == list(range(len(rows)))
    packed_mbs = [batch.select(members) for members in micro]
    seg = sorted(int(n) for mb in packed_mbs for n in torch.diff(mb.cu_seqlens))
    assert seg == lens
    assert all(mb.num_tokens <= 128 for mb in packed_mbs)
    assert sum(mb.num_tokens for mb in packed_mbs) == sum(lens)
    # The advantage of a row sits on its response tokens only.
    adv = batch.token_fields["advantages"]
    assert bool((adv[batch.loss_mask == 0] == 0).all())

    padded_mbs = padded.padded_micro_batches(batch, rows_per_micro_batch=5, pad_token_id=3)
    assert [mb.input_ids.shape[0] for mb in padded_mbs] == [5, 5, 2]
    real = sorted(int(n) for mb in padded_mbs for n in mb.attention_mask.sum(1))
    assert real == lens
    for mb in padded_mbs:
        assert mb.input_ids.shape[1] == int(mb.attention_mask.sum(1).max())
        assert bool((mb.input_ids[mb.attention_mask == 0] == 3).all())
        assert float(mb.loss_mask[mb.attention_mask == 0].abs().sum()) == 0.0
    assert padded.padded_normalizers(padded_mbs) == batching.loss_normalizers(batch, mini_rows)


def test_rows_follow_the_requested_length_range_and_mask_only_responses():
    rows = train.make_rows(200, vocab_size=102, seed=0, min_tokens=16, max_tokens=1024)
    for r in rows:
        n = int(r["input_ids"].numel())
        assert 16 <= n <= 1024
        mask = r["loss_mask"]
        assert mask[0] == 0 and mask[-1] == 1  # prompt first, response last
        assert bool((torch.diff(mask) >= 0).all())  # one prompt block, then one response block
        assert int(r["input_ids"].min()) >= 4  # no special ids in the random text


def test_the_trainers_packed_path_and_the_padded_baseline_give_the_same_update():
    hal.register_attention()
    from rollout.models import load_model

    cfg = packed.default_job()
    rows = _rows(10)
    packed_model = load_model("builtin:tiny", attn_implementation=hal.ATTN_IMPLEMENTATION)
    padded_model = load_model("builtin:tiny", attn_implementation="sdpa")
    batch = packed.step_batch(rows)
    mini_rows, micro = packed.plan_micro_batches(batch, budget_tokens=96)
    assert len(micro) > 1  # several packed rows, so row starts inside a packed row are tested
    packed.set_old_logprobs(packed_model, batch, micro, cfg)
    # Move the old log-probs off the current ones: ratios away from 1, some of them clipped,
    # so the loss value (not only its gradient) depends on the new log-probs.
    noise = torch.randn(batch.num_tokens, generator=torch.Generator().manual_seed(0))
    batch.set_token_field("old_logprobs", batch.token_fields["old_logprobs"] + 0.3 * noise)
    padded_mbs = padded.padded_micro_batches(batch, 4, pad_token_id=3)
    losses, logprobs, grads = [], [], []
    for model, mbs, fn, norm in (
        (
            packed_model,
            [batch.select(members) for members in micro],
            packed.packed_loss,
            batching.loss_normalizers(batch, mini_rows),
        ),
        (padded_model, padded_mbs, padded.padded_loss, padded.padded_normalizers(padded_mbs)),
    ):
        total, lp_sum = 0.0, 0.0
        for mb in mbs:
            loss, lp = fn(model, mb, norm, cfg)
            loss.backward()
            total += float(loss.detach())
            lp_sum += float(lp)
        losses.append(total)
        logprobs.append(lp_sum)
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    assert losses[0] == pytest.approx(losses[1], abs=train.LOSS_TOLERANCE)
    assert logprobs[0] == pytest.approx(logprobs[1], rel=1e-6)
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


def test_the_crossrl_cli_imports_bench_only_when_bench_runs():
    # trainer/ sits below bench/ (bench measures the trainer), so the CLI resolves
    # `crossrl bench` inside its handler; building the parser must not load bench.
    code = (
        "import sys, trainer.cli; trainer.cli.build_parser(); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'bench'))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert proc.stdout.strip() == "[]"


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


@pytest.mark.slow
def test_memory_bench_measures_the_four_variants_of_one_update():
    from bench import memory

    res = memory.run(sizes=memory.SMOKE_SIZES)
    assert list(res["variants"]) == ["today", "checkpointing", "lean", "both"]
    for name, v in res["variants"].items():
        assert "error" not in v, f"{name}: {v.get('error')}"
        assert (v["activation_checkpointing"], v["lean_logprobs"]) == memory.VARIANTS[name]
        assert v["tokens"] == memory.SMOKE_SIZES.tokens
        assert v["peak_gb"] >= v["before_gb"] > 0
    # The switches change how the update is computed, not what it computes.
    assert res["same_update"]
    table = memory.format_table(res)
    assert all(name in table for name in memory.VARIANTS)
    assert "FAILED" not in table
