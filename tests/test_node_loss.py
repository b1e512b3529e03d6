"""A node lost as an update starts, on a local three-node Ray cluster (``ray.cluster_utils.
Cluster``, one CPU a node, so the dp-2 job spans two nodes): the run restarts on the two nodes
left (the layout planned again without the node that no longer answers) and finishes with the
fingerprints of an uninterrupted run on the same cluster."""

from __future__ import annotations

import pytest
import ray

from bench.faults import FAULT_JOB
from trainer.config import load_config
from trainer.records.jsonl_files import read_jsonl

pytestmark = pytest.mark.slow

JOB = [*FAULT_JOB, "train.total_steps=4", "run.save_every=2", "ray.address=auto"]


@pytest.fixture
def three_nodes(monkeypatch):
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    workers = [cluster.add_node(num_cpus=1) for _ in range(2)]
    cluster.wait_for_nodes()
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    ray.init(address=cluster.address)
    yield cluster, workers
    ray.shutdown()
    cluster.shutdown()


def _node_of(handle) -> str:
    return ray.get(
        handle.__ray_call__.remote(lambda worker: ray.get_runtime_context().get_node_id())
    )


def test_a_lost_node_is_restarted_on_the_nodes_left(three_nodes, monkeypatch, tmp_path, capsys):
    from trainer.loop.schedule.controller import Trainer
    from trainer.loop.start.run import run_training

    cluster, workers = three_nodes
    straight = tmp_path / "straight"
    assert run_training(load_config(None, [*JOB, f"run.dir={straight}"])) == 0

    original = Trainer._update
    lost = []

    def update(trainer, plan, step):
        if step == 3 and not lost:  # a worker node holding a training rank, as the update starts
            nodes = {_node_of(handle) for handle in trainer.actor.handles}
            victim = next(w for w in workers if w.node_id in nodes)
            lost.append(victim)
            cluster.remove_node(victim, allow_graceful=False)  # its raylet and workers killed
        return original(trainer, plan, step)

    monkeypatch.setattr(Trainer, "_update", update)
    faulted = tmp_path / "faulted"
    assert run_training(load_config(None, [*JOB, f"run.dir={faulted}"])) == 0
    err = capsys.readouterr().err
    assert "restarting the workers (1 of run.max_restarts=2)" in err
    assert read_jsonl(faulted / "fingerprint.jsonl") == read_jsonl(straight / "fingerprint.jsonl")
    line = next(m for m in read_jsonl(faulted / "metrics.jsonl") if "restart/count" in m)
    print(f"node lost: {line['restart/down_s']:.1f} s down")
