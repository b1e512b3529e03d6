"""The TRL side of ``bench peer``: TRL's GRPOTrainer on the job ``bench.peer_task`` defines,
timed from inside, as a child process.

    python -m bench.peer_trl --job default --steps 20 --data prompts.jsonl \\
        --model-dir DIR --tokenizer-dir DIR --workdir DIR --out result.json

One training step here is one generation cycle (``steps_per_generation`` optimizer steps), as
one crossrl step is one rollout and its mini-batches. Timed per step: the whole step (from the
first optimizer step's ``on_step_begin`` to the log after the last), and inside it
``_generate_and_score_completions`` (rollout + old log-probs + rewards), the
``_generate_single_turn`` call (sampling alone) and the no-grad
``_get_per_token_logps_and_entropies`` calls (old log-probs). Mean reward per step comes from
the reward function's own calls. Only this module (and tests) import TRL.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

_STARTED = time.time()  # wall clock: the parent compares it with the launch time


def _timed(record: list, fn, *, tag=None):
    """``fn`` wrapped to append ``(start, end, tag())`` (wall seconds) to ``record``."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.time()
        try:
            return fn(*args, **kwargs)
        finally:
            record.append((t0, time.time(), tag() if tag else None))

    return wrapper


def _within(events: list, start: float, end: float) -> list:
    return [e for e in events if start <= e[0] < end]


def run(args: argparse.Namespace) -> dict:
    """Train with TRL and return the per-step timings, rewards and what was set."""
    import torch

    torch.set_num_threads(args.threads)

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from bench.peer_task import JOBS, read_prompts, trl_config_kwargs, trl_recall_reward

    job = JOBS[args.job]
    rows = read_prompts(args.data)
    dataset = Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
            for r in rows
        ]
    )
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        args.model_dir, dtype=torch.float32, local_files_only=True
    )
    rewards: list[tuple[float, float, float]] = []  # (time, mean score, rows)

    @functools.wraps(trl_recall_reward)
    def recall_reward(prompts, completions, answer, **kwargs):
        scores = trl_recall_reward(prompts, completions, answer, **kwargs)
        rewards.append((time.time(), sum(scores) / len(scores), len(scores)))
        return scores

    kwargs = trl_config_kwargs(job, steps=args.steps, output_dir=Path(args.workdir) / "trl-out")
    config = GRPOConfig(**kwargs)
    steps_per_generation = config.steps_per_generation
    starts: list[float] = []
    ends: dict[int, float] = {}

    class StepClock(TrainerCallback):
        """Start of each generation cycle; end at the log after its last optimizer step."""

        def on_step_begin(self, args, state, control, **kw):
            if state.global_step % steps_per_generation == 0:
                starts.append(time.time())

        def on_log(self, args, state, control, **kw):
            step = state.global_step
            if step % steps_per_generation == 0 and step not in ends:
                ends[step] = time.time()

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[recall_reward],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepClock()],
    )
    gen_score: list = []
    generate: list = []
    logps: list = []
    trainer._generate_and_score_completions = _timed(
        gen_score, trainer._generate_and_score_completions
    )
    trainer._generate_single_turn = _timed(generate, trainer._generate_single_turn)
    trainer._get_per_token_logps_and_entropies = _timed(
        logps, trainer._get_per_token_logps_and_entropies, tag=torch.is_grad_enabled
    )
    prompt_tokens = sorted(
        {
            len(
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": r["prompt"]}],
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=True,
                )["input_ids"]
            )
            for r in rows
        }
    )
    trainer.train()

    steps = []
    for k, start in enumerate(starts):
        end = ends.get((k + 1) * steps_per_generation)
        if end is None:
            continue
        gs = sum(e[1] - e[0] for e in _within(gen_score, start, end))
        old = sum(e[1] - e[0] for e in _within(logps, start, end) if not e[2])
        sampled = sum(e[1] - e[0] for e in _within(generate, start, end))
        scored = _within([(t, t, m) for t, m, _ in rewards], start, end)
        steps.append(
            {
                "step": k + 1,
                "start": start,
                "end": end,
                "step_s": end - start,
                "rollout_s": gs - old,
                "generate_s": sampled,
                "old_logprobs_s": old,
                "update_s": (end - start) - gs,
                "reward_mean": scored[0][2] if scored else None,
            }
        )
    return {
        "process_started": _STARTED,
        "steps": steps,
        "prompt_tokens": prompt_tokens,
        "torch_threads": torch.get_num_threads(),
        "eos_token_ids": list(trainer.eos_token_ids),
        "pad_token_id": tokenizer.pad_token_id,
        "generation_batch_size": config.generation_batch_size,
        "config": {k: v for k, v in kwargs.items() if k != "output_dir"},
    }


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, train, write the result JSON (atomically)."""
    parser = argparse.ArgumentParser(prog="python -m bench.peer_trl", description=__doc__)
    parser.add_argument("--job", required=True)
    parser.add_argument("--steps", type=int, required=True, help="training steps (generations)")
    parser.add_argument("--data", required=True, help="prompt jsonl (bench.peer_task)")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--tokenizer-dir", required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--out", required=True, help="result JSON")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    from rollout.files import atomic_write_text

    result = run(args)
    atomic_write_text(Path(args.out), json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
