"""Across Ray nodes, on one machine: a local cluster of two Ray nodes (each its own raylet
and object store, with CPUs of its own). With ``rollout.engine_devices=1`` the layout puts
the training rank on one node and the engine on the other; the job starts them there, and
the weights cross from one node's object store to the other's. At lag 0 the engine's
log-probs of step 2 on match the trainer's (the push arrived whole); at lag 1 the job trains.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import ray

from trainer.config import load_config
from trainer.loop.cluster.group import cluster_node_ids
from trainer.loop.schedule.controller import Trainer
from trainer.loop.start import launch
from trainer.loop.start.run import run_training
from trainer.records.jsonl_files import read_jsonl

pytestmark = pytest.mark.slow

JOB = [
    "rollout.engine_devices=1",
    "algorithm.rollout_correction=token",
    "train.batch_size=4",
    "train.mini_batch_size=2",
    "train.total_steps=3",
    "run.resume=never",
]


@pytest.fixture(scope="module")
def two_nodes():
    from ray.cluster_utils import Cluster

    if ray.is_initialized():  # a local Ray left by another module: this one needs a cluster
        ray.shutdown()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="ERROR", include_dashboard=False)
    yield cluster.address
    ray.shutdown()
    cluster.shutdown()


def _node_of(handle) -> str:
    return ray.get(handle.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))


def test_the_layout_puts_rank_and_engine_on_different_nodes(two_nodes, tmp_path):
    cfg = load_config(None, [*JOB, f"ray.address={two_nodes}", f"run.dir={tmp_path}"])
    trainer = Trainer(cfg, Path(tmp_path))
    try:
        launch.start(trainer)
        ids = cluster_node_ids("CPU")
        assert trainer.layout.nodes == (2, 2)
        (rank_node, _), replica = trainer.layout.rank_slots[0], trainer.layout.replicas[0]
        assert rank_node != replica.node
        assert _node_of(trainer.actor.handles[0]) == ids[rank_node]
        assert _node_of(trainer.replicas[0]) == ids[replica.node]
        # An explicit sync loads a snapshot across the nodes at once (weights of no step).
        trainer.sync_weights()
        version = ray.get(trainer.rollout.__ray_call__.remote(lambda host: host.weights_version))
        assert version is None
    finally:
        trainer.shutdown()


@pytest.mark.parametrize("lag", [0, 1])
def test_a_job_trains_with_its_engine_on_another_node(two_nodes, tmp_path, lag):
    cfg = load_config(
        None, [*JOB, f"train.rollout_lag={lag}", f"ray.address={two_nodes}", f"run.dir={tmp_path}"]
    )
    assert run_training(cfg) == 0
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    assert [m["pipeline/policy_version"] for m in metrics] == [
        float(max(0, t - 1 - lag)) for t in (1, 2, 3)
    ]
    assert all(m["actor/grad_norm"] > 0 for m in metrics)
    if lag == 0:  # the engine sampled with exactly the weights the trainer holds
        assert all(m["rollout/logprob_abs_diff"] < 1e-6 for m in metrics)
