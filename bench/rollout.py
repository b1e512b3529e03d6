"""Multi-turn rollout wall time: the asynchronous agent loop vs the lockstep loop it replaced.

    python -m bench rollout [--quick]

Workload (issue 14): 16 prompts x n 8 x 4 turns on ``builtin:tiny`` with the HF engine, in the
``sleepy`` environment (``rollout/envs/sleepy.py``): every step waits a seeded random 0-200 ms,
like a tool call. Three ways to run the same rollout, interleaved and in a rotating order per
repeat, all in this process:

- ``lockstep`` (baseline): every live trajectory's turn in one ``generate`` call, then every
  environment steps one after another: what ``run_rollouts`` did before issue 14, here
  ``run_rollouts`` with lockstep engine calls (``deterministic=True``) and one env call at a
  time (``env_concurrency=1``), see ``lockstep_rollouts``.
- ``async``: the shipped default for agent jobs: continuous batching, 64 env calls at once.
- ``async_waves``: ``run.deterministic=true``: lockstep engine calls (bit-for-bit repeatable
  logprobs), environment steps concurrent.

Reports the median wall seconds per mode, each mode's ratio to ``lockstep`` (target for
``async``: at most 0.5x), the engine calls and seconds inside ``generate``, and whether every
mode sampled the same tokens.
"""

from __future__ import annotations

import statistics
import time

__all__ = ["format_table", "lockstep_rollouts", "run"]

MODES = ("lockstep", "async", "async_waves")


def lockstep_rollouts(engine, tokenizer, env_factory, prompts, **settings):
    """The pre-async loop's schedule: ``run_rollouts`` with one engine call per turn holding every
    live trajectory (waves) and one environment call at a time (serial steps)."""
    from rollout.agent_loop import run_rollouts

    settings = {**settings, "deterministic": True, "env_concurrency": 1}
    return run_rollouts(engine, tokenizer, env_factory, prompts, **settings)


class _TimedEngine:
    """Forwards ``generate`` to an engine and counts the calls and the seconds inside them."""

    def __init__(self, engine) -> None:
        self.engine, self.calls, self.seconds = engine, 0, 0.0

    def generate(self, requests, sampling):
        start = time.perf_counter()
        try:
            return self.engine.generate(requests, sampling)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1


def run(quick: bool = False, repeats: int | None = None) -> dict:
    """Median wall seconds per mode over interleaved repeats; ratios to ``lockstep``."""
    import functools

    import torch

    from bench.machine import cpu_load
    from rollout.agent_loop import run_rollouts
    from rollout.engines import SamplingParams, make_engine
    from rollout.envs.prompts import PromptItem
    from rollout.envs.sleepy import SleepyEnv
    from rollout.tokenizer import load_tokenizer

    prompts, n, turns, max_delay_s = (4, 4, 4, 0.2) if quick else (16, 8, 4, 0.2)
    repeats = repeats or (1 if quick else 2)
    max_new_tokens = 8
    tokenizer = load_tokenizer("builtin")
    engine = make_engine("hf", "builtin:tiny", tokenizer, seed=0)
    env_factory = functools.partial(SleepyEnv, turns=turns, max_delay_s=max_delay_s)
    items = [PromptItem(index=i, seed=1000 + i) for i in range(prompts)]
    settings = dict(
        n=n,
        max_turns=turns,
        step_wise=True,
        merge_stepwise=False,
        max_input_len=256,
        max_new_tokens=max_new_tokens,
        sampling=SamplingParams(max_new_tokens=max_new_tokens),
        seed=1,
        step=1,
    )
    runners = {
        "lockstep": lambda eng: lockstep_rollouts(eng, tokenizer, env_factory, items, **settings),
        "async": lambda eng: run_rollouts(
            eng, tokenizer, env_factory, items, **settings, deterministic=False, env_concurrency=64
        ),
        "async_waves": lambda eng: run_rollouts(
            eng, tokenizer, env_factory, items, **settings, deterministic=True, env_concurrency=64
        ),
    }
    # Warm-up (2 prompts): the first calls pay for allocation and kernel choice.
    run_rollouts(engine, tokenizer, env_factory, items[:2], **settings, deterministic=False)
    samples: dict[str, list[dict]] = {m: [] for m in MODES}
    tokens: dict[str, list] = {}
    for r in range(repeats):
        order = MODES[r % len(MODES) :] + MODES[: r % len(MODES)]
        for mode in order:
            timed = _TimedEngine(engine)
            load = cpu_load()
            start = time.perf_counter()
            out = runners[mode](timed)
            wall = time.perf_counter() - start
            samples[mode].append(
                {
                    "wall_s": wall,
                    "generate_s": timed.seconds,
                    "generate_calls": timed.calls,
                    "load_1m": load["1min"] if load else None,
                }
            )
            tokens.setdefault(mode, [r.prompt_ids + r.response_ids for r in out.rows])
    base = statistics.median(s["wall_s"] for s in samples["lockstep"])
    result: dict = {
        "workload": {
            "prompts": prompts,
            "n": n,
            "turns": turns,
            "max_delay_s": max_delay_s,
            "max_new_tokens": max_new_tokens,
            "model": "builtin:tiny",
            "engine": "hf",
            "torch_threads": torch.get_num_threads(),
        },
        "repeats": repeats,
        "same_tokens": all(tokens[m] == tokens["lockstep"] for m in MODES),
        "modes": {},
    }
    for mode in MODES:
        walls = [s["wall_s"] for s in samples[mode]]
        result["modes"][mode] = {
            "wall_s": statistics.median(walls),
            "wall_s_all": walls,
            "vs_lockstep": statistics.median(walls) / base,
            "generate_s": statistics.median(s["generate_s"] for s in samples[mode]),
            "generate_calls": samples[mode][0]["generate_calls"],
            "load_1m": [s["load_1m"] for s in samples[mode]],
        }
    return result


def format_table(results: dict) -> str:
    """Wall seconds, ratio to lockstep, engine calls and seconds per mode."""
    w = results["workload"]
    lines = [
        f"{w['prompts']} prompts x n {w['n']} x {w['turns']} turns, env step 0-"
        f"{w['max_delay_s'] * 1000:.0f} ms, {w['model']} ({w['engine']}, "
        f"{w['torch_threads']} torch threads), median of {results['repeats']} interleaved "
        f"repeats; same tokens in every mode: {results['same_tokens']}",
        f"{'mode':12} {'wall_s':>8} {'x lockstep':>11} {'gen_calls':>10} {'gen_s':>7} "
        f"{'load_1m':>12}",
    ]
    for mode, r in results["modes"].items():
        load = "/".join(f"{x:.1f}" for x in r["load_1m"] if x is not None) or "-"
        lines.append(
            f"{mode:12} {r['wall_s']:8.2f} {r['vs_lockstep']:11.3f} {r['generate_calls']:10d} "
            f"{r['generate_s']:7.2f} {load:>12}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(format_table(run()))
