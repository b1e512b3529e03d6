"""A mixture's experts, forward and backward: the device's experts kernel (``hal.kernels``
``moe_experts``) against transformers' own experts (eager: one expert at a time), timed
alternately (A B A B) in one process on this machine.

One experts layer of Qwen3-30B-A3B's shape, cut in tokens (hidden 2048, expert width 768, 128
experts, top-8; 4,096 and 16,384 tokens) on an accelerator, in bf16 (what training computes
in); on the CPU a smaller cut (hidden 256, width 96, 32 experts, top-4; 1,024 and 4,096
tokens) in float32, where the kernel is torch's ``F.grouped_mm`` (the CPU's kernel set runs
transformers' experts: no fused kernel is chosen there). Each size runs twice: tokens routed
evenly, and skewed (half of the tokens' slots on an eighth of the experts: a router early in
training). ``--quick``: the smaller size of each. The ratio that counts is kernel / eager
(below 1: the kernel is faster); the least favourable shape is reported beside the median,
and each shape's largest gap between the two sides' outputs (relative to the largest output).
On an accelerator each side also reports its model FLOP rate (``3 x 2 x slots x 3 x H x I``
per forward + backward) against the card's dense bf16 matmul rate (``bench.gpu``).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

#: Timed rounds per side and shape (after one warm-up each).
ROUNDS = 5


@dataclass(frozen=True)
class Shape:
    """One experts layer: ``tokens`` routed to ``top_k`` of ``experts`` experts of width
    ``inter`` over ``hidden``; ``skewed``: half of the slots on an eighth of the experts."""

    tokens: int
    hidden: int
    inter: int
    experts: int
    top_k: int
    skewed: bool = False

    def label(self) -> str:
        """How the tables name it."""
        routing = "skewed" if self.skewed else "even"
        return (
            f"{self.tokens} tok, H {self.hidden}, I {self.inter}, E {self.experts}, "
            f"top-{self.top_k}, {routing}"
        )

    def flops(self) -> float:
        """Model FLOPs of one forward + backward (3 x the forward's three GEMMs per slot)."""
        return 3 * 2 * self.tokens * self.top_k * 3 * self.hidden * self.inter


def shapes(accelerator: bool, quick: bool) -> list[Shape]:
    """The timed shapes (module docstring)."""
    dims = (2048, 768, 128, 8) if accelerator else (256, 96, 32, 4)
    counts = (4096, 16384) if accelerator else (1024, 4096)
    counts = counts[:1] if quick else counts
    return [Shape(t, *dims, skewed=s) for t in counts for s in (False, True)]


def _experts(shape: Shape, device, dtype) -> torch.nn.Module:
    """transformers' Qwen3-MoE experts module of ``shape``, weights drawn from a seed."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(
        hidden_size=shape.hidden,
        moe_intermediate_size=shape.inter,
        num_experts=shape.experts,
        num_experts_per_tok=shape.top_k,
    )
    config._experts_implementation = "eager"
    module = Qwen3MoeExperts(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return module.to(device, dtype)


def _routing(shape: Shape, device, dtype):
    """Hidden states, each token's top-k experts (distinct) and their weights."""
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(shape.tokens, shape.hidden, generator=gen)
    scores = torch.rand(shape.tokens, shape.experts, generator=gen)
    if shape.skewed:  # half the tokens prefer the first eighth of the experts
        favoured = max(shape.top_k, shape.experts // 8)
        scores[: shape.tokens // 2, :favoured] += 1.0
    weights, index = scores.topk(shape.top_k, dim=-1)
    weights = torch.softmax(weights, dim=-1)
    upstream = torch.randn(shape.tokens, shape.hidden, generator=gen)
    return [t.to(device) for t in (hidden.to(dtype), index, weights.to(dtype), upstream.to(dtype))]


def _once(backend, call, module, hidden, index, weights, upstream) -> float:
    """Seconds of one forward + backward of ``call``."""
    module.zero_grad(set_to_none=True)
    hidden = hidden.clone().requires_grad_(True)
    backend.synchronize()
    start = time.perf_counter()
    out = call(module, hidden, index, weights)
    (out * upstream).sum().backward()
    backend.synchronize()
    return time.perf_counter() - start


def _kernel(backend):
    """The device's experts kernel (``KernelSet``'s call), or torch's ``F.grouped_mm`` on a
    device whose set chooses none (the CPU); its name."""
    from hal import moe_experts
    from hal.kernels import REFERENCE, choose_kernels

    kernels = choose_kernels(backend.kernel_providers)
    if kernels.chosen["moe_experts"] != REFERENCE:
        return kernels.calls["moe_experts"], kernels.chosen["moe_experts"]
    return moe_experts.torch_experts(torch.nn.functional.grouped_mm), "torch.grouped_mm"


def _peak_tflops(backend) -> float | None:
    """The card's dense bf16 matmul rate (``bench.gpu.measure_peak``), None on the CPU."""
    if not backend.is_accelerator:
        return None
    from bench.gpu import measure_peak

    return measure_peak(backend, 8192, 5)["tflops"]


def run(quick: bool = False) -> dict:
    """Median seconds of one forward + backward per side and shape, the ratios, the least
    favourable one, and (on an accelerator) each side's share of the card's matmul rate."""
    import hal

    backend = hal.get_backend("auto")
    device = backend.device(0)
    dtype = torch.bfloat16 if backend.is_accelerator else torch.float32
    kernel, kernel_name = _kernel(backend)
    eager = lambda module, *args: module(*args)  # noqa: E731 - transformers' own forward
    peak = _peak_tflops(backend)
    rows = []
    for shape in shapes(backend.is_accelerator, quick):
        module = _experts(shape, device, dtype)
        inputs = _routing(shape, device, dtype)
        sides = {"eager": eager, "kernel": kernel}
        with torch.no_grad():  # the same work on both sides: their outputs agree
            outs = [call(module, *inputs[:3]).float() for call in sides.values()]
        gap = (outs[0] - outs[1]).abs().max().item() / max(outs[0].abs().max().item(), 1e-30)
        times: dict[str, list[float]] = {side: [] for side in sides}
        for call in sides.values():  # warm-up
            _once(backend, call, module, *inputs)
        for _ in range(2 if quick else ROUNDS):
            for side, call in sides.items():
                times[side].append(_once(backend, call, module, *inputs))
        median = {side: statistics.median(t) for side, t in times.items()}
        row = {
            "shape": shape.label(),
            "seconds": median,
            "kernel_over_eager": median["kernel"] / median["eager"],
            "max_relative_gap": gap,
            "tokens_per_s": {side: shape.tokens / s for side, s in median.items()},
        }
        if peak:
            row["mfu"] = {side: shape.flops() / s / 1e12 / peak for side, s in median.items()}
        rows.append(row)
        del module, inputs, outs
    ratios = [r["kernel_over_eager"] for r in rows]
    return {
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "kernel": kernel_name,
        "rounds": 2 if quick else ROUNDS,
        "peak_tflops": peak,
        "rows": rows,
        "median_ratio": statistics.median(ratios),
        "least_favourable": max(rows, key=lambda r: r["kernel_over_eager"])["shape"],
        "least_favourable_ratio": max(ratios),
    }


def format_table(result: dict) -> str:
    """One line per shape, then the median and least favourable ratio."""
    mfu = result["peak_tflops"] is not None
    lines = [
        f"experts on {result['device']} in {result['dtype']}: {result['kernel']} against "
        f"transformers' eager experts, forward + backward, median of {result['rounds']} (A B A B)",
        "| shape | eager s | kernel s | kernel / eager | kernel tok/s |"
        + (" eager MFU | kernel MFU |" if mfu else ""),
        "|---|---|---|---|---|" + ("---|---|" if mfu else ""),
    ]
    for row in result["rows"]:
        line = (
            f"| {row['shape']} | {row['seconds']['eager']:.4f} | {row['seconds']['kernel']:.4f} "
            f"| {row['kernel_over_eager']:.2f} | {row['tokens_per_s']['kernel']:,.0f} |"
        )
        if mfu:
            line += f" {row['mfu']['eager']:.1%} | {row['mfu']['kernel']:.1%} |"
        lines.append(line)
    lines.append(
        f"kernel / eager: median {result['median_ratio']:.2f}, least favourable "
        f"{result['least_favourable_ratio']:.2f} ({result['least_favourable']})"
    )
    return "\n".join(lines)
