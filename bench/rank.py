"""One training rank: the plain module against FSDP2 at world size 1, in one process.

    python -m bench.rank [--model builtin:tiny|builtin:small] [--repeats N] [--threads N]

Two actors (``PolicyWorker``) of the ``bench peer`` job's sizes (``bench.peer_task.JOBS``:
16 prompts x 8 samples of up to 4 tokens on builtin:tiny, 32 x 8 x 16 on builtin:small, two
mini-batches of one micro-batch each) start from the same weights in one process: one as the
trainer ships it at dp 1 (the plain module, ``WorkerSpec.sharded`` false), one forced under
FSDP2 (``ShardedSpec``). Each repeat runs a step's actor work on both, interleaved: the old
log-prob pass over both mini-batches, then the two optimizer steps. Reported per side: the
median wall and thread CPU seconds of each phase (thread CPU time is what one thread spent,
so load from other processes moves it less than wall time), and the largest difference of any
parameter between the two after the last repeat (0.0: the same numbers). Nothing here asserts
a time.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass

import torch

from batching import Row, StepBatch, plan_minibatches
from bench.peer_task import JOBS, PeerJob
from trainer.config import load_config
from trainer.loop.cluster.group import free_port
from trainer.loop.ranks.policy import PolicyWorker
from trainer.loop.ranks.spec import WorkerSpec

__all__ = ["ShardedSpec", "format_table", "run"]

SIDES = ("fsdp2", "plain")


@dataclass(frozen=True)
class ShardedSpec(WorkerSpec):
    """A ``WorkerSpec`` whose model goes under FSDP2 even at one rank (the layout before)."""

    @property
    def sharded(self) -> bool:
        """Always: the comparison's FSDP2 side."""
        return True


def _batch(model: str, seed: int = 0) -> tuple[StepBatch, PeerJob]:
    """Rows of one step of the peer job on ``model``: random prompt and response tokens."""
    job = next(j for j in JOBS.values() if j.model == model)
    rnd = random.Random(seed)
    rows = []
    for uid in range(job.prompts_per_step):
        prompt = [rnd.randrange(3, 100) for _ in range(rnd.randint(12, 20))]
        for s in range(job.samples_per_prompt):
            resp = [rnd.randrange(3, 100) for _ in range(rnd.randint(1, job.max_new_tokens))]
            rows.append(
                Row(
                    prompt_ids=prompt,
                    response_ids=resp,
                    response_mask=[1] * len(resp),
                    response_logprobs=[-2.0] * len(resp),
                    uid=uid,
                    trajectory_id=uid * job.samples_per_prompt + s,
                    step_index=0,
                    is_last_step=True,
                    score=float(s % 2),
                )
            )
    return StepBatch.from_rows(rows), job


def _step(worker: PolicyWorker, arrays: dict, plan) -> tuple[float, float, float, float]:
    """One step's actor work; (old log-probs wall, cpu, update wall, cpu) in seconds."""
    worker.load_batch([arrays])
    cpu0, wall0 = time.thread_time(), time.perf_counter()
    old = [worker.compute_logprobs(mini.micro_batches[0]) for mini in plan.mini_batches]
    cpu1, wall1 = time.thread_time(), time.perf_counter()
    worker.set_token_field("old_logprobs", old)
    worker.compute_advantages()
    cpu2, wall2 = time.thread_time(), time.perf_counter()
    for mini in plan.mini_batches:
        worker.train_mini_batch(mini.micro_batches[0], mini.rows.tolist())
    cpu3, wall3 = time.thread_time(), time.perf_counter()
    worker.offload_states()
    return wall1 - wall0, cpu1 - cpu0, wall3 - wall2, cpu3 - cpu2


def run(model: str = "builtin:tiny", repeats: int = 10, threads: int = 1) -> dict:
    """Both sides, ``repeats`` timed steps each after 2 untimed; see the module docstring."""
    torch.set_num_threads(threads)
    batch, job = _batch(model)
    cfg = load_config(
        None,
        [
            "device=cpu",
            f"model.path={model}",
            "train.dp_size=1",
            f"train.lr={job.lr}",
            "train.max_tokens_per_micro_batch=null",
            "run.deterministic=false",
        ],
    )
    workers = {}
    for side, spec_type in zip(SIDES, (ShardedSpec, WorkerSpec)):
        # The second one-rank worker of a process shares the first one's process group (hal).
        worker = PolicyWorker(spec_type(role="actor", rank=0, cfg=cfg, threads=threads))
        worker.setup("127.0.0.1", free_port())
        workers[side] = worker
    plan = plan_minibatches(
        batch.row_fields["trajectory_id"].numpy(),
        batch.seq_lens,
        mini_batch_size=job.prompts_per_mini_batch,
        dp_size=1,
        group_ids=batch.row_fields["uid"].numpy(),
    )
    arrays = batch.to_numpy()
    times: dict[str, list] = {side: [] for side in SIDES}
    for i in range(repeats + 2):
        order = SIDES if i % 2 else SIDES[::-1]
        for side in order:
            measured = _step(workers[side], arrays, plan)
            if i >= 2:
                times[side].append(measured)
    states = {side: w.full_state_dict() for side, w in workers.items()}
    diff = max(
        float((states["fsdp2"][k] - states["plain"][k]).abs().max()) for k in states["plain"]
    )
    for worker in workers.values():  # the one that made the process group ends it
        worker.shutdown()
    keys = ("old_logprobs_wall_s", "old_logprobs_cpu_s", "update_wall_s", "update_cpu_s")
    return {
        "model": model,
        "repeats": repeats,
        "threads": threads,
        "max_param_diff": diff,
        "sides": {
            side: {k: statistics.median(t[j] for t in times[side]) for j, k in enumerate(keys)}
            for side in SIDES
        },
    }


def format_table(res: dict) -> str:
    """The result as a small table: per phase, median ms of each side and plain/fsdp2."""
    lines = [
        f"{res['model']}: {res['repeats']} interleaved steps per side, {res['threads']} thread(s); "
        f"largest parameter difference after them: {res['max_param_diff']:g}",
        f"{'median ms':24s}{'fsdp2':>10s}{'plain':>10s}{'plain/fsdp2':>13s}",
    ]
    a, b = res["sides"]["fsdp2"], res["sides"]["plain"]
    for key in a:
        lines.append(f"{key:24s}{a[key] * 1e3:10.1f}{b[key] * 1e3:10.1f}{b[key] / a[key]:12.2f}x")
    return "\n".join(lines)


def main() -> None:
    """``python -m bench.rank``: print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="builtin:tiny", choices=["builtin:tiny", "builtin:small"]
    )
    parser.add_argument("--repeats", type=int, default=10, help="timed steps per side")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args()
    print(format_table(run(args.model, args.repeats, args.threads)))


if __name__ == "__main__":
    main()
