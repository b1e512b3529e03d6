"""Accelerator benchmark: MFU of the actor update and HF-engine rollout tokens/s.

    python -m bench gpu [--quick]

Runs only where ``hal.get_backend("auto")`` finds an accelerator; on a CPU
it returns ``{"skipped": True, "reason": ...}`` and prints why, never a made-up number.

- ``peak``: the card's measured dense bf16 matmul rate (best of several square matmuls), the
  denominator of MFU. Measured, not the datasheet figure, as the issue asks.
- ``update``: a Qwen2.5-0.5B-shaped model with random bf16 weights and the HAL's varlen
  attention; one actor update (forward + backward over planner micro-batches of packed rows +
  AdamW step) on log-normal rows, as in ``bench.train``. MFU = model FLOPs / seconds / peak,
  with model FLOPs = 3 x forward (6 per matmul parameter per token, lm_head included, plus
  causal attention 6 * sum(len^2) * heads * head_dim per layer).
- ``rollout``: ``rollout.engines.HFEngine`` sampling ``max_new_tokens`` for a batch of random
  prompts with the same model; generated tokens per second.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict, dataclass

import torch

import hal
from rollout.models import SHAPES

__all__ = ["QWEN25_05B", "GpuSizes", "format_table", "measure", "model_flops_per_update", "run"]

#: Qwen2.5-0.5B's architecture (config.json of Qwen/Qwen2.5-0.5B), weights random.
QWEN25_05B = SHAPES["qwen2.5-0.5b"]


@dataclass(frozen=True)
class GpuSizes:
    """How much work each part does. Units: tokens unless said."""

    matmul_n: int = 8192  # side of the square bf16 matmuls that measure the peak
    matmul_iters: int = 20
    rows: int = 256  # rows per actor update
    median_row_tokens: float = 512.0
    max_row_tokens: int = 4096
    # planner micro-batch budget; the fp32 log-softmax of 8k x 152k logits is already 5 GB
    budget_tokens: int = 8192
    update_repeats: int = 5
    rollout_prompts: int = 64
    prompt_tokens: int = 256
    new_tokens: int = 256


SIZES = {False: GpuSizes(), True: GpuSizes(matmul_n=4096, rows=64, update_repeats=3, new_tokens=64)}


def _timed(backend, fn) -> float:
    backend.synchronize()
    start = time.perf_counter()
    fn()
    backend.synchronize()
    return time.perf_counter() - start


def measure_peak(backend, n: int, iters: int) -> dict:
    """Best dense bf16 matmul rate on the backend's device: ``{"tflops": ..., "n": n}``."""
    device = backend.device(0)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    torch.matmul(a, b)  # warm-up: kernel selection, workspace allocation
    best = min(_timed(backend, lambda: torch.matmul(a, b)) for _ in range(iters))
    return {"tflops": 2 * n**3 / best / 1e12, "n": n, "best_s": best}


def _matmul_params(model: torch.nn.Module, config) -> int:
    """Parameters that take part in a matmul per token: every Linear weight in the decoder
    layers plus the lm_head (counted even when tied to the embedding)."""
    layers = sum(
        m.weight.numel()
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and "lm_head" not in name
    )
    return layers + config.vocab_size * config.hidden_size


def model_flops_per_update(matmul_params: int, config, row_lens: list[int]) -> float:
    """Training FLOPs (forward + backward = 3 x forward) of one pass over rows of
    ``row_lens`` tokens: 2 per matmul parameter per token, plus causal attention
    (QK^T and AV, half the square) 2 * len^2 * heads * head_dim per layer."""
    tokens = sum(row_lens)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attn = 2 * sum(n * n for n in row_lens) * config.num_attention_heads * head_dim
    forward = 2 * matmul_params * tokens + config.num_hidden_layers * attn
    return 3.0 * forward


def measure(backend, sizes: GpuSizes, config_dict: dict | None = None, seed: int = 0) -> dict:
    """Peak, actor-update MFU and rollout tokens/s on ``backend``'s device (no accelerator
    check: the caller decides; a CPU backend with a tiny config exercises the code)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from bench.train import make_rows, packed_loss, packed_micro_batches, row_normalizers
    from rollout.engines.base import GenerationRequest, SamplingParams
    from rollout.engines.hf_engine import HFEngine

    device = backend.device(0)
    peak = measure_peak(backend, sizes.matmul_n, sizes.matmul_iters)

    hal.register_attention()
    config = Qwen2Config(
        **{k: v for k, v in (config_dict or QWEN25_05B).items() if k != "architectures"}
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        config, dtype=torch.bfloat16, attn_implementation=hal.ATTN_IMPLEMENTATION
    ).to(device)
    rows = make_rows(
        sizes.rows,
        vocab_size=config.vocab_size,
        seed=seed,
        median_tokens=sizes.median_row_tokens,
        max_tokens=sizes.max_row_tokens,
    )
    lens = [int(r["input_ids"].numel()) for r in rows]
    mbs = packed_micro_batches(rows, sizes.budget_tokens)
    for mb in mbs:
        for name in ("input_ids", "position_ids", "loss_mask", "advantages"):
            setattr(mb, name, getattr(mb, name).to(device))
    normalizers = row_normalizers(rows)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    model.train()

    def update() -> None:
        optimizer.zero_grad(set_to_none=True)
        for mb in mbs:
            packed_loss(model, mb, normalizers).backward()
        optimizer.step()

    update()  # warm-up: kernels, optimizer state
    seconds = [_timed(backend, update) for _ in range(sizes.update_repeats)]
    flops = model_flops_per_update(_matmul_params(model, config), config, lens)
    upd_s = statistics.median(seconds)
    update_res = {
        "params": sum(p.numel() for p in model.parameters()),
        "rows": len(rows),
        "tokens": sum(lens),
        "micro_batches": len(mbs),
        "budget_tokens": sizes.budget_tokens,
        "seconds": seconds,
        "tokens_per_s": sum(lens) / upd_s,
        "model_tflops_per_update": flops / 1e12,
        "achieved_tflops": flops / upd_s / 1e12,
        "mfu": flops / upd_s / 1e12 / peak["tflops"],
        "memory": backend.memory_stats(),
    }
    optimizer.zero_grad(set_to_none=True)
    optimizer.state.clear()  # free the AdamW moments before the rollout part

    model.eval()
    engine = HFEngine(model, pad_token_id=config.pad_token_id, max_batch_size=sizes.rollout_prompts)
    gen = torch.Generator().manual_seed(seed)
    requests = [
        GenerationRequest(
            prompt_ids=torch.randint(
                4, config.vocab_size, (sizes.prompt_tokens,), generator=gen
            ).tolist(),
            seed=seed + i,
        )
        for i in range(sizes.rollout_prompts)
    ]
    # No stop token: every request generates exactly new_tokens, so the count is the work.
    sampling = SamplingParams(max_new_tokens=sizes.new_tokens, temperature=1.0)
    engine.generate(requests[:2], SamplingParams(max_new_tokens=4))  # warm-up
    results = []
    gen_s = _timed(backend, lambda: results.extend(engine.generate(requests, sampling)))
    generated = sum(len(r.token_ids) for r in results)
    rollout_res = {
        "engine": "hf",
        "prompts": len(requests),
        "prompt_tokens": sizes.prompt_tokens,
        "new_tokens": sizes.new_tokens,
        "generated_tokens": generated,
        "seconds": gen_s,
        "tokens_per_s": generated / gen_s,
    }
    return {
        "skipped": False,
        "backend": backend.name,
        "device_names": backend.device_names(),
        "model": "Qwen2.5-0.5B-shaped, random weights, bf16" if config_dict is None else "custom",
        "attention": hal.ATTN_IMPLEMENTATION,
        "sizes": asdict(sizes),
        "peak": peak,
        "update": update_res,
        "rollout": rollout_res,
    }


def run(quick: bool = False) -> dict:
    """The accelerator benchmark on ``hal.get_backend("auto")``; ``{"skipped": True,
    "reason": ...}`` when that is a CPU."""
    backend = hal.get_backend("auto")
    if not backend.is_accelerator:
        return {
            "skipped": True,
            "reason": (
                f"no accelerator: hal.get_backend('auto') picked {backend.name!r} "
                f"(available: {hal.available_backends()}); run `crossrl bench gpu` on a node "
                "with an accelerator"
            ),
        }
    return measure(backend, SIZES[quick])


def format_table(res: dict) -> str:
    """Peak, MFU and rollout rate, or the reason the benchmark was skipped."""
    if res.get("skipped"):
        return f"skipped: {res['reason']}"
    p, u, r = res["peak"], res["update"], res["rollout"]
    return "\n".join(
        [
            f"{res['backend']} {res['device_names'][0]}: {res['model']}, attention {res['attention']}",
            f"measured bf16 matmul peak ({p['n']}^3): {p['tflops']:.1f} TFLOP/s",
            f"actor update: {u['rows']} rows, {u['tokens']:,} tokens, {u['micro_batches']} "
            f"micro-batches <= {u['budget_tokens']} tokens; median {statistics.median(u['seconds']):.3f} s",
            f"  {u['tokens_per_s']:,.0f} tokens/s, {u['achieved_tflops']:.1f} TFLOP/s, "
            f"MFU {u['mfu']:.1%} of the measured peak",
            f"HF engine rollout: {r['prompts']} prompts x {r['prompt_tokens']} tokens, "
            f"{r['new_tokens']} new tokens each: {r['tokens_per_s']:,.0f} generated tokens/s",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller matmuls, rows and rollout")
    print(format_table(run(quick=parser.parse_args().quick)))


if __name__ == "__main__":
    main()
