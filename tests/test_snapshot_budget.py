"""The weight snapshots of engines on devices of their own, budgeted against Ray's object
store (``trainer.loop.plan.snapshot_budget``): the count the schedule implies, their bytes, the
refusal before start-up, what ``crossrl layout`` prints, and, on a local Ray, how many are
really alive in the object store while a lagged run trains."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from trainer.config import load_config
from trainer.loop.plan.model_shape import model_shape
from trainer.loop.plan.snapshot_budget import (
    default_object_store_bytes,
    live_snapshots,
    node_snapshot_bytes,
    snapshot_bytes,
    snapshot_problem,
)

LAGGED = [
    "rollout.engine_devices=1",
    "algorithm.rollout_correction=token",
    "rollout.weight_transport=host",  # snapshots in the object store (the collective takes none)
]


def _cfg(*keys: str):
    return load_config(None, list(keys), check_environment=False)


@pytest.mark.parametrize("lag", [0, 1, 2, 5])
def test_engines_of_their_own_keep_lag_plus_one_snapshots(lag):
    assert live_snapshots(_cfg(*LAGGED, f"train.rollout_lag={lag}")) == lag + 1


def test_colocated_engines_keep_no_snapshot():
    assert live_snapshots(_cfg()) == 0
    assert snapshot_problem(_cfg(), model_shape("builtin:tiny"), 1.0, "a test") is None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_snapshot_holds_every_state_dict_entry_in_the_engine_dtype(dtype):
    import torch

    from rollout.models import build_empty_model, parse_dtype

    model = build_empty_model("builtin:tiny", dtype=torch.float32, seed=1)
    size = parse_dtype(dtype).itemsize
    # the tied LM head is a state-dict entry of its own, so the snapshot carries it twice
    expected = sum(t.numel() for t in model.state_dict().values()) * size
    assert snapshot_bytes(model_shape("builtin:tiny"), dtype) == expected


@pytest.mark.parametrize("dp", [2, 3, 5])
def test_a_node_holds_its_ranks_fsdp2_rows_of_each_snapshot(dp):
    import torch

    from rollout.models import build_empty_model

    # FSDP2 shards dim 0 as torch.chunk does; every rank puts its rows on its own node
    model = build_empty_model("builtin:tiny", dtype=torch.float32, seed=1)
    shape = model_shape("builtin:tiny")
    for ranks in ([0], [dp - 1], list(range(1, dp)), list(range(dp))):
        rows = 0
        for tensor in model.state_dict().values():
            chunks = torch.chunk(tensor, dp, dim=0)
            rows += sum(chunks[r].numel() for r in ranks if r < len(chunks))
        assert node_snapshot_bytes(shape, "bfloat16", ranks, dp) == rows * 2
    assert node_snapshot_bytes(shape, "float32", range(dp), dp) == snapshot_bytes(shape, "float32")


def test_a_cluster_node_is_held_to_its_own_ranks_rows():
    cfg = _cfg(*LAGGED, "train.rollout_lag=1", "train.dp_size=4", "ray.address=auto")
    shape = model_shape("builtin:small")
    whole = snapshot_bytes(shape, "float32")
    # two of four ranks on a node: about half of each of the 2 snapshots, so one whole fits
    assert snapshot_problem(cfg, shape, 1.01 * whole, "a node", [0, 1]) is None
    text = snapshot_problem(cfg, shape, 0.9 * whole, "a node", [0, 1])
    assert "(the rows of its 2 of 4 training ranks)" in text


def test_the_default_object_store_is_rays():
    utils = pytest.importorskip("ray._private.utils")
    for available, shm in [(16e9, 8e9), (64e9, 64e9), (2e12, 1e12), (100e9, 5e9)]:
        # Ray reads /dev/shm itself: compare under the same free space
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(utils, "get_shared_memory_bytes", lambda shm=shm: int(shm))
            expected = utils.resolve_object_store_memory(int(available))
        assert default_object_store_bytes(available, shm) == expected


def test_snapshots_beyond_the_object_store_are_refused_in_one_line(tmp_path):
    from trainer.loop.start.preflight import PreflightError, preflight

    cfg = load_config(
        None,
        [
            *LAGGED,
            "train.rollout_lag=2",
            "model.path=builtin:small",
            "ray.object_store_gb=0.1",
            f"run.dir={tmp_path / 'run'}",
        ],
    )
    with pytest.raises(PreflightError) as err:
        preflight(cfg)
    text = str(err.value)
    assert "\n" not in text
    assert text.startswith("train.rollout_lag=2: ")
    assert "3 weight snapshots alive" in text and "ray.object_store_gb=0.1" in text
    assert "raise ray.object_store_gb to at least 0.23" in text
    assert text.endswith("or lower train.rollout_lag to 0")


def test_a_joined_cluster_is_told_to_start_its_ray_with_a_larger_store():
    cfg = _cfg(*LAGGED, "train.rollout_lag=1", "ray.address=auto")
    text = snapshot_problem(cfg, model_shape("builtin:small"), 0.1e9, "a node")
    assert "ray start --object-store-memory` of at least 0.16 GB" in text


def test_the_layout_prints_the_snapshots_and_their_object_store(capsys):
    from trainer.cli import main

    assert main(["layout", *LAGGED, "train.rollout_lag=2", "ray.object_store_gb=0.5"]) == 0
    out = capsys.readouterr().out
    assert "weight snapshots in Ray's object store: 3 (train.rollout_lag + 1)" in out
    assert "object store: 0.5 GB (ray.object_store_gb=0.5): fits" in out


# ----------------------------------------------------------------------------- measured


class _StoreWatch(threading.Thread):
    """Polls the bytes in use in the local Ray's object store (its ``object_store_memory``
    resource less what is available) every few milliseconds, keeping the largest."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.stop = threading.Event()
        self.samples: list[float] = []

    def run(self) -> None:
        import ray

        total = ray.cluster_resources()["object_store_memory"]
        while not self.stop.wait(0.005):
            self.samples.append(total - ray.available_resources().get("object_store_memory", 0))


@pytest.mark.slow
@pytest.mark.parametrize(("lag", "dp"), [(0, 1), (2, 1), (2, 2)])
def test_a_lagged_run_never_holds_more_snapshots_than_the_budget(tmp_path, lag, dp):
    """Lag 0 and 2, one or two ranks (each puts its own rows), an engine of its own, a slowed environment (the rollouts lag behind the ranks,
    so the queue stays full) and a small object store: the bytes in the store, polled all
    along, never exceed the budget's (lag + 1) snapshots, plus the rollouts' own batches (far
    below one snapshot). Ray frees a snapshot when the last call holding it finishes, not when
    it has loaded it; at lag 0 a reference the pipeline kept to the latest one made it two."""
    import ray

    from trainer.loop.cluster.group import start_ray
    from trainer.loop.plan.layout import LayoutError
    from trainer.loop.start.launch import _check_snapshots
    from trainer.loop.start.run import run_training

    keys = [
        *LAGGED,
        f"train.rollout_lag={lag}",
        f"train.dp_size={dp}",
        "train.batch_size=2",
        "train.mini_batch_size=2",
        "train.total_steps=6",
        "rollout.n=2",
        "run.resume=never",
        "run.deterministic=false",
        "rollout.env=rollout.envs.sleepy:SleepyEnv",
        "rollout.env_kwargs={turns: 2, max_delay_s: 0.2}",
        "rollout.max_turns=2",
        "ray.object_store_gb=0.1",
        f"run.dir={tmp_path / 'run'}",
    ]
    cfg = load_config(None, keys)
    assert not ray.is_initialized()
    start_ray(None, num_cpus=4, object_store_bytes=int(cfg.ray.object_store_gb * 1e9))
    try:
        assert ray.cluster_resources()["object_store_memory"] == pytest.approx(0.1e9)
        node = ray.get_runtime_context().get_node_id()
        one_node = SimpleNamespace(
            rank_slots=tuple((0, r) for r in range(dp)), weight_transport="host"
        )
        _check_snapshots(cfg, one_node, [node])  # fits: no error
        big = cfg.model_copy(deep=True)
        big.model.path = "builtin:small"  # (lag + 1) x 0.076 GB against this 0.1 GB store
        if lag:
            with pytest.raises(LayoutError, match=r"^train\.rollout_lag=2: .*of their node \(Ray"):
                _check_snapshots(big, one_node, [node])
        else:
            _check_snapshots(big, one_node, [node])
        watch = _StoreWatch()
        watch.start()
        assert run_training(cfg) == 0
        watch.stop.set()
        watch.join()
    finally:
        ray.shutdown()
    one = snapshot_bytes(model_shape("builtin:tiny"), cfg.model.dtype)
    budget = live_snapshots(cfg) * one
    # the share of the polls that saw n whole snapshots' worth in the store
    seen = [int(s // one) for s in watch.samples]
    shares = {n: f"{seen.count(n) / len(seen):.0%}" for n in sorted(set(seen))}
    print(
        f"lag {lag}, dp {dp}: snapshot {one} bytes; store use peak {max(watch.samples):.0f} "
        f"bytes; polls by whole snapshots' worth: {shares}"
    )
    assert max(watch.samples) < budget + one  # i.e. at most lag + 1 whole snapshots
