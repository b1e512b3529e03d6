"""The LM head's log-prob + entropy: crossrl's fused head (``hal.fused_head``, the accelerators'
``lm_head`` kernel) against the reference chunks (``trainer.loop.ranks.forward``), forward and
backward on the same inputs, timed alternately (A B A B) in one process on this machine.

The shape is a small LM's head (hidden 512, vocabulary 32,000, 2,048 tokens; ``--quick``: 8,000
and 512) in float32, the CPU's dtype; chunks as the lean path sizes them (``LEAN_CHUNK_BYTES``).
The figure that counts is the ratio (docs/benchmarks.md).
"""

from __future__ import annotations

import statistics
import time

import torch

#: (tokens, hidden, vocabulary) of the timed head; ``quick``: a smaller one.
SHAPE = (2048, 512, 32000)
QUICK_SHAPE = (512, 512, 8000)
#: Timed rounds per side (after one warm-up each).
ROUNDS = 5


def _inputs(tokens: int, hidden: int, vocab: int):
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, hidden, generator=gen) * 0.5
    head = torch.nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=gen) * 0.02)
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    upstream = torch.randn(2, tokens, generator=gen)
    return h, head, targets, upstream


def _once(kind: str, h, head, targets, upstream, chunk_tokens: int) -> float:
    from hal.fused_head import linear_logprob_entropy
    from trainer.loop.ranks.forward import head_logprobs_entropy

    hidden = h.clone().requires_grad_()
    head.zero_grad()
    start = time.perf_counter()
    if kind == "fused":
        lp, ent = linear_logprob_entropy(
            hidden, head.weight, None, targets, temperature=0.9, chunk_tokens=chunk_tokens
        )
    else:
        lp, ent = head_logprobs_entropy(
            hidden, head, targets, temperature=0.9, chunk_tokens=chunk_tokens
        )
    (upstream[0] * lp + upstream[1] * ent).sum().backward()
    return time.perf_counter() - start


def run(quick: bool = False) -> dict:
    """Median seconds of one forward + backward of each head, and their ratio."""
    from trainer.loop.ranks.forward import LEAN_CHUNK_BYTES

    tokens, hidden, vocab = QUICK_SHAPE if quick else SHAPE
    h, head, targets, upstream = _inputs(tokens, hidden, vocab)
    chunk_tokens = max(1, LEAN_CHUNK_BYTES // (4 * vocab))
    times: dict[str, list[float]] = {"reference": [], "fused": []}
    for kind in times:  # warm-up
        _once(kind, h, head, targets, upstream, chunk_tokens)
    for _ in range(2 if quick else ROUNDS):
        for kind in times:
            times[kind].append(_once(kind, h, head, targets, upstream, chunk_tokens))
    median = {kind: statistics.median(t) for kind, t in times.items()}
    return {
        "shape": {"tokens": tokens, "hidden": hidden, "vocab": vocab, "chunk": chunk_tokens},
        "seconds": median,
        "rounds": len(times["fused"]),
        "fused_over_reference": median["fused"] / median["reference"],
    }


def format_table(result: dict) -> str:
    """One line per head and the ratio."""
    shape = result["shape"]
    lines = [
        f"head {shape['tokens']} tokens x hidden {shape['hidden']} x vocab {shape['vocab']}, "
        f"chunks of {shape['chunk']} tokens, float32, median of {result['rounds']} (A B A B)",
        "| head | s per forward + backward |",
        "|---|---|",
    ]
    for kind, seconds in result["seconds"].items():
        lines.append(f"| {kind} | {seconds:.3f} |")
    lines.append(f"fused / reference: {result['fused_over_reference']:.2f}")
    return "\n".join(lines)
