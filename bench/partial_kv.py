"""What continuing a partial rollout costs: the KV cache recomputed after a weight load
(issue 36), against one call that never stops (what keeping the old weights' cache would cost).

    python -m bench.partial_kv [--rows 8] [--new-tokens 128] [--every 16] [--repeats 3]

A streamed run with ``rollout.partial_rollout=true`` loads new weights between two decode
steps of the call in flight (``rollout.streaming.VersionedEngine``): the engine ends the call,
and the requests still running go on from their prefix, which is prefilled again under the new
weights. Here the HF engine on ``builtin:small`` (one CPU thread) samples ``rows`` requests of
one prompt for ``new-tokens`` tokens, once without a load and once with a load every ``every``
decode steps (of the same weights, so that what differs is the stop and the prefill again
alone), alternating, ``repeats`` times each. The figures: median seconds of each, their ratio,
and the tokens prefilled again. Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

__all__ = ["format_table", "run"]


def _timed_call(engine, versioned, requests, sampling, every: int) -> tuple[float, int]:
    """Seconds of one generate call (through ``versioned``, loading the same weights every
    ``every`` forwards when ``every`` > 0) and the loads that landed."""
    forwards = [0]
    hook = engine.model.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    done = threading.Event()
    loads = [0]

    def loader():
        mark = every
        while not done.is_set():
            if forwards[0] >= mark:
                versioned.load(lambda: None, versioned.version + 1)
                loads[0] += 1
                mark = forwards[0] + every
            time.sleep(0.0005)

    thread = threading.Thread(target=loader, daemon=True)
    if every:
        thread.start()
    started = time.perf_counter()
    try:
        versioned.generate(requests, sampling)
    finally:
        elapsed = time.perf_counter() - started
        done.set()
        hook.remove()
        if every:
            thread.join(5)
    return elapsed, loads[0]


def run(rows: int = 8, new_tokens: int = 128, every: int = 16, repeats: int = 3) -> dict:
    """Median seconds of a call with and without loads every ``every`` decode steps."""
    import torch

    from rollout.engines import GenerationRequest, SamplingParams, make_engine
    from rollout.models import load_model
    from rollout.streaming import VersionedEngine
    from rollout.tokenizer import load_tokenizer

    torch.set_num_threads(1)
    tok = load_tokenizer("builtin")
    engine = make_engine("hf", load_model("builtin:small", seed=0), tok)
    prompt = tok.encode("Compute 1234 * 5678 and explain every step of the multiplication.")
    requests = [GenerationRequest(prompt_ids=prompt, seed=7 + i, group=0) for i in range(rows)]
    # no stop token: every row runs the whole length, so each load finds all of them running
    sampling = SamplingParams(max_new_tokens=new_tokens)
    times: dict[str, list[float]] = {"whole": [], "continued": []}
    loads = []
    _timed_call(engine, VersionedEngine(engine), requests, sampling, 0)  # warm-up
    for _ in range(repeats):
        for name in ("whole", "continued"):
            versioned = VersionedEngine(engine, partial=name == "continued")
            seconds, landed = _timed_call(
                engine, versioned, requests, sampling, every if name == "continued" else 0
            )
            times[name].append(seconds)
            if name == "continued":
                loads.append(landed)
    whole, continued = (statistics.median(times[k]) for k in ("whole", "continued"))
    interruptions = statistics.median(loads)
    # each continuation prefills the prompt and the tokens so far: rows x (prompt + k x every)
    refilled = sum(
        rows * (len(prompt) + k * every)
        for k in range(1, int(interruptions) + 1)
        if k * every < new_tokens
    )
    return {
        "rows": rows,
        "new_tokens": new_tokens,
        "every": every,
        "repeats": repeats,
        "whole_s": whole,
        "continued_s": continued,
        "ratio": continued / whole,
        "loads": interruptions,
        "tokens_prefilled_again": refilled,
        "tokens_sampled": rows * new_tokens,
    }


def format_table(result: dict) -> str:
    """The markdown table of ``run``'s result."""
    return "\n".join(
        [
            f"HF engine, builtin:small, {result['rows']} rows x {result['new_tokens']} new "
            f"tokens, a load every {result['every']} decode steps, median of "
            f"{result['repeats']}:",
            "",
            "| call | seconds | ratio | loads | tokens prefilled again |",
            "|---|---|---|---|---|",
            f"| whole (no load; what keeping the KV cache would cost) | {result['whole_s']:.2f} "
            "| 1.00x | 0 | 0 |",
            f"| continued (KV recomputed after each load) | {result['continued_s']:.2f} | "
            f"{result['ratio']:.2f}x | {result['loads']:g} | "
            f"{result['tokens_prefilled_again']:,} of {result['tokens_sampled']:,} sampled |",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    """CLI: run and print the table (and the JSON with ``--json``)."""
    parser = argparse.ArgumentParser(prog="python -m bench.partial_kv", description=__doc__)
    parser.add_argument("--rows", type=int, default=8, help="requests in the call")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens each samples")
    parser.add_argument("--every", type=int, default=16, help="decode steps between loads")
    parser.add_argument("--repeats", type=int, default=3, help="calls of each kind")
    parser.add_argument("--json", action="store_true", help="print the result as JSON too")
    args = parser.parse_args(argv)
    for name in ("rows", "new_tokens", "every", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
    result = run(args.rows, args.new_tokens, args.every, args.repeats)
    print(format_table(result))
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
