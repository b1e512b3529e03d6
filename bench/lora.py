"""LoRA RL against full fine-tuning (issue 38): what a step costs and what the push carries,
and whether the default job learns as well.

    python -m bench.lora [--quick] [--json FILE]

Two parts, every run a ``crossrl train`` subprocess (``bench.e2e.run_job``), the two sides of
each comparison alternating (A B A B):

- **cost**, on ``builtin:small`` and on the Qwen2.5-0.5B shape (random weights written once,
  ``rollout.models.write_random_model``): full fine-tuning against LoRA rank 16 (alpha 32, every
  attention and MLP projection), the same short job; per side the median seconds per step
  (steps after the first), the weight sync's seconds per step (``timing/sync_s``), the peak
  host memory of the actor's and the engine's processes (``memory/actor_peak_gb``,
  ``memory/engine_peak_gb``) and the bytes each push carries (the state the actor hands its
  engine, ``WeightPush.push_state``, counted on the model built on the meta device);
- **reward**, the default job (``configs/cpu/tiny.yaml``) against its LoRA variant
  (``configs/cpu/lora.yaml``), 30 steps, seeds 1 and 2: ``reward/mean`` at step 30 and over
  steps 26-30.

Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

__all__ = ["LORA", "format_table", "push_bytes", "run"]

#: The LoRA side of the cost comparison.
LORA = ["model.lora.rank=16", "model.lora.alpha=32"]
#: The short job both sides run: 4 prompts x 4 samples, one turn.
SHORT = [
    "train.batch_size=4",
    "train.mini_batch_size=4",
    "rollout.n=4",
    "rollout.max_turns=1",
    "run.save_every=0",
    "run.resume=never",
]


def push_bytes(overrides: list[str]) -> int:
    """Bytes one weight push of this job carries to its engine: the entries of the actor's
    ``push_state`` (the whole state dict, or a LoRA actor's trainable entries), in
    ``model.dtype``, on the model built on the meta device."""
    import torch

    from rollout.lora import trained_names
    from rollout.models import build_empty_model, parse_dtype
    from trainer.config import load_config
    from trainer.loop.ranks.policy import inject_lora

    cfg = load_config(None, overrides, check_environment=False)
    model = build_empty_model(cfg.model.path, dtype=torch.float32, seed=cfg.seed)
    size = parse_dtype(cfg.model.dtype).itemsize
    lora = cfg.model.lora
    if not lora.enabled:
        return sum(t.numel() for t in model.state_dict().values()) * size
    inject_lora(model, lora)
    trained = trained_names(model)
    return sum(t.numel() for n, t in model.state_dict().items() if n in trained) * size


def _cost(records: list[dict]) -> dict:
    later = records[1:] or records
    return {
        "step_s": statistics.median(r["timing/step_s"] for r in later),
        "sync_s": statistics.median(r.get("timing/sync_s", 0.0) for r in later),
        "actor_peak_gb": max(r.get("memory/actor_peak_gb", 0.0) for r in records),
        "engine_peak_gb": max(r.get("memory/engine_peak_gb", 0.0) for r in records),
    }


def run(quick: bool = False) -> dict:
    """Both parts (module docstring); ``quick``: builtin:small only, 3 steps, the reward part
    at 6 steps and one seed."""
    from bench.e2e import run_job
    from rollout.models import write_random_model

    out: dict = {"cost": {}, "reward": {}}
    with tempfile.TemporaryDirectory(prefix="crossrl-bench-lora-") as tmp:
        root = Path(tmp)
        models = {"builtin:small": ("builtin:small", 6)}
        if not quick:
            path = write_random_model(root / "qwen2.5-0.5b", "qwen2.5-0.5b")
            models["Qwen2.5-0.5B shape"] = (str(path), 3)
        for name, (path, steps) in models.items():
            steps = 3 if quick else steps
            base = [f"model.path={path}", *SHORT, f"train.total_steps={steps}"]
            sides = {"full": base, "lora r16": [*base, *LORA]}
            runs: dict[str, list[dict]] = {side: [] for side in sides}
            for repeat in range(1 if quick or "0.5B" in name else 2):
                order = list(sides) if repeat % 2 == 0 else list(sides)[::-1]
                for side in order:
                    work = root / f"{name}-{side}-{repeat}".replace(" ", "_").replace(":", "_")
                    work.mkdir()
                    runs[side].append(_cost(run_job(sides[side], work)["records"]))
            out["cost"][name] = {
                side: {
                    **{k: statistics.median(r[k] for r in runs[side]) for k in runs[side][0]},
                    "push_bytes": push_bytes(sides[side]),
                }
                for side in sides
            }
        steps, seeds = (6, [1]) if quick else (30, [1, 2])
        configs = {"full": "configs/cpu/tiny.yaml", "lora": "configs/cpu/lora.yaml"}
        tails: dict[str, list[float]] = {k: [] for k in configs}
        lasts: dict[str, list[float]] = {k: [] for k in configs}
        for seed in seeds:
            order = list(configs) if seed % 2 else list(configs)[::-1]
            for side in order:
                work = root / f"reward-{side}-{seed}"
                work.mkdir()
                keys = [
                    f"--config={configs[side]}",
                    f"seed={seed}",
                    f"train.total_steps={steps}",
                    "run.resume=never",
                ]
                records = run_job(keys, work)["records"]
                rewards = [r["reward/mean"] for r in records]
                tails[side].append(statistics.mean(rewards[-5:]))
                lasts[side].append(rewards[-1])
        out["reward"] = {
            side: {
                "last": statistics.mean(lasts[side]),
                "tail": statistics.mean(tails[side]),
                "seeds": seeds,
                "steps": steps,
            }
            for side in configs
        }
    return out


def format_table(result: dict) -> str:
    """The two markdown tables of ``run``'s result."""
    lines = [
        "| model | side | s/step | sync s/step | push bytes | push vs full | actor peak GB "
        "| engine peak GB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for model, sides in result["cost"].items():
        full = sides["full"]["push_bytes"]
        for side, row in sides.items():
            lines.append(
                f"| {model} | {side} | {row['step_s']:.2f} | {row['sync_s']:.3f} | "
                f"{row['push_bytes'] / 1e6:,.2f} MB | {row['push_bytes'] / full:.2%} | "
                f"{row['actor_peak_gb']:.2f} | {row['engine_peak_gb']:.2f} |"
            )
    lines += ["", "| default job | reward at the last step | mean of the last 5 steps |"]
    lines.append("|---|---|---|")
    for side, row in result["reward"].items():
        lines.append(f"| {side} | {row['last']:.3f} | {row['tail']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """CLI: run, print the tables, optionally write the JSON."""
    parser = argparse.ArgumentParser(prog="python -m bench.lora", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="builtin:small, a few steps")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args(argv)
    result = run(args.quick)
    print(format_table(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
