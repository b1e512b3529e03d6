"""The weight push to engines of their own: seconds and peak host memory per step, by
transport (``rollout.weight_transport``: the collective push, the host-memory snapshot) and
against another checkout (the code before a change), measured side by side.

    python -m bench.snapshot [--before DIR] [--rounds N] [--shape qwen2.5-0.5b] [--steps N]
                             [--nodes 2] [--engine vllm --tp 2 [--colocated]]

A lagged job (``rollout.engine_devices=1``, ``train.rollout_lag=1``) on ``builtin:small``
at ``train.dp_size=2``: each step ends with the push of the new weights to the engine
(``Trainer.snapshot_weights``), which is the ``sync`` phase of a lagged step
(``timing/sync_s``). ``--nodes 2``: on a local two-node Ray cluster (``ray.cluster_utils``),
the two ranks on one node, the engine on the other. Runs alternate between the variants (A B C,
C B A, ...), each a ``crossrl train`` subprocess (``bench.e2e.run_job``); the figures are, per
variant, the median over runs of the median over each run's steps after its first of the sync
seconds, the step seconds, and the peak host memory of each process (rank 0, the other rank,
the engine: ``memory/actor_rank0_peak_gb``, ``memory/actor_others_peak_gb``,
``memory/engine_peak_gb``; a checkout without them reports the largest rank's), and the
seconds the rollout host spent loading the push into the engines before sampling
(``rollout/weight_load_s``: the engine's side, which a host snapshot pays when the engine pulls
it from the ranks' object stores). ``--engine vllm``: the vLLM engine (run with the vLLM
lane's python, ``.venv-vllm``) of its own at ``--tp`` CPUs, one replica at tensor parallel
``--tp``: the push reaches its workers through vLLM's ``update_weights``. ``--colocated``:
the vLLM replica on the two ranks' CPUs instead, at lag 0 (the push, through vLLM's API over
``crossrl_shm``, is the ``sync`` phase; one variant here, ``ipc``, beside ``--before``).
Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

__all__ = ["SNAPSHOT_JOB", "format_table", "measure"]

#: The lagged job whose sync phase is the snapshot push.
SNAPSHOT_JOB = [
    "model.path=builtin:small",
    "train.dp_size=2",
    "rollout.engine_devices=1",
    "train.rollout_lag=1",
    "algorithm.rollout_correction=token",
    "train.batch_size=4",
    "train.mini_batch_size=2",
    "rollout.n=4",
    "run.resume=never",
]
KEYS = (
    "timing/sync_s",
    "rollout/weight_load_s",
    "timing/step_s",
    "memory/actor_rank0_peak_gb",
    "memory/actor_others_peak_gb",
    "memory/engine_peak_gb",
)
#: This checkout's variants: the transport each runs with.
TRANSPORTS = {"collective": "collective", "host": "host"}


def measure(
    workdir: Path,
    before: str | None,
    rounds: int = 2,
    shape: str | None = None,
    steps: int = 6,
    ray_address: str | None = None,
    engine: str = "hf",
    tp: int = 1,
    colocated: bool = False,
) -> dict:
    """Per variant (``collective`` and ``host``: this checkout with that transport;
    ``before``: the checkout at ``before``, as it pushes), the medians of ``KEYS`` (module
    docstring). ``shape``: a ``rollout.models.SHAPES`` name (e.g. ``qwen2.5-0.5b``) whose
    random weights replace ``builtin:small``; ``steps``: per run; ``ray_address``: a cluster
    to run on; ``engine``, ``tp``: the engine of its own and its tensor-parallel CPUs;
    ``colocated``: the vLLM engine on the ranks' CPUs at lag 0 (variant ``ipc``)."""
    from bench.e2e import run_job

    job = [*SNAPSHOT_JOB, f"train.total_steps={steps}"]
    if engine == "vllm":  # one replica on tp CPUs of its own; a small KV cache each
        import os

        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # one NUMA node here
        job += [
            "rollout.engine=vllm",
            f"rollout.engine_devices={0 if colocated else tp}",
            f"rollout.tensor_parallel_size={tp}",
        ]
        job += ["train.rollout_lag=0"] if colocated else []  # colocated engines: lag 0
        if not colocated or tp > 1:  # one replica: a small KV cache of each CPU's share
            job += ["rollout.memory_fraction=0.05"]
    if ray_address is not None:
        job.append(f"ray.address={ray_address}")
    if shape is not None:
        from rollout.models import write_random_model

        job.append(f"model.path={write_random_model(workdir / 'model', shape)}")
    variants = {name: ([f"rollout.weight_transport={t}"], None) for name, t in TRANSPORTS.items()}
    if colocated:
        variants = {"ipc": ([], None)}
    if before:
        variants["before"] = ([], before)
    order = []
    for i in range(rounds):
        names = list(variants)
        order += names if i % 2 == 0 else names[::-1]
    per_run: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    for i, name in enumerate(order):
        where = workdir / f"{name}_{i}"
        where.mkdir(parents=True)
        extra, source = variants[name]
        records = run_job([*job, *extra], where, source=source)["records"][1:]
        for record in records:  # a checkout that reports only the largest rank's peak
            record.setdefault("memory/actor_rank0_peak_gb", record["memory/actor_peak_gb"])
            record.setdefault("memory/actor_others_peak_gb", record["memory/actor_peak_gb"])
            record.setdefault("memory/engine_peak_gb", float("nan"))
            record.setdefault("rollout/weight_load_s", float("nan"))
        per_run[name].append({k: statistics.median(r[k] for r in records) for k in KEYS})
    return {
        name: {k: statistics.median(run[k] for run in runs) for k in KEYS}
        for name, runs in per_run.items()
    }


def format_table(result: dict) -> str:
    """The medians as a markdown table, then each variant's sync seconds over the host
    snapshot's."""
    lines = [
        "| variant | ranks' push s/step | engine's load s/step | step s | rank 0 peak GB | "
        "other rank peak GB | engine peak GB |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in result.items():
        lines.append(
            f"| {name} | {row['timing/sync_s']:.3f} | {row['rollout/weight_load_s']:.3f} | "
            f"{row['timing/step_s']:.3f} | "
            f"{row['memory/actor_rank0_peak_gb']:.2f} | {row['memory/actor_others_peak_gb']:.2f} "
            f"| {row['memory/engine_peak_gb']:.2f} |"
        )

    def push(row) -> float:  # the ranks' side, then the engine's, of one push
        return row["timing/sync_s"] + row["rollout/weight_load_s"]

    base_name = "host" if "host" in result else "before"
    base = result.get(base_name)
    for name in result:
        if base is not None and name != base_name:
            lines.append(
                f"\nranks' push {name} / {base_name}: "
                f"{result[name]['timing/sync_s'] / base['timing/sync_s']:.2f}; "
                f"push + load {name} / {base_name}: {push(result[name]) / push(base):.2f}"
            )
    return "\n".join(lines)


def two_node_cluster():
    """A local Ray cluster of two nodes on this machine (``ray.cluster_utils.Cluster``): 2
    CPUs on the head for the two ranks, 1 on the other node for the engine. Returns it (call
    ``shutdown()``)."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    return cluster


def main() -> None:
    """``python -m bench.snapshot --before DIR``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="another checkout to measure beside this one")
    parser.add_argument("--rounds", type=int, default=2, help="alternations (A B, B A, ...)")
    parser.add_argument("--shape", help="random weights of this shape (e.g. qwen2.5-0.5b)")
    parser.add_argument("--steps", type=int, default=6, help="steps per run")
    parser.add_argument("--nodes", type=int, choices=(1, 2), default=1, help="local Ray nodes")
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf", help="the engine")
    parser.add_argument("--tp", type=int, default=1, help="the vLLM engine's tensor parallel")
    parser.add_argument(
        "--colocated", action="store_true", help="the vLLM engine on the ranks' CPUs, lag 0"
    )
    args = parser.parse_args()
    if args.colocated and args.engine != "vllm":
        parser.error("--colocated measures the vLLM engine's push: add --engine vllm")
    if args.before and args.nodes == 2:  # the cluster's workers would run this checkout
        parser.error("--before needs --nodes 1: a joined cluster runs its own workers' code")
    cluster = two_node_cluster() if args.nodes == 2 else None
    try:
        with tempfile.TemporaryDirectory(prefix="crossrl-snapshot-") as tmp:
            address = cluster.address if cluster is not None else None
            result = measure(
                Path(tmp),
                args.before,
                args.rounds,
                args.shape,
                args.steps,
                address,
                engine=args.engine,
                tp=args.tp,
                colocated=args.colocated,
            )
            print(format_table(result))
    finally:
        if cluster is not None:
            cluster.shutdown()


if __name__ == "__main__":
    main()
