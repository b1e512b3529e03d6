"""The fixed-lag pipeline's promises that need no cluster: which weights sample which step
(decided by the step number), the schedule the pipeline queues on a stand-in rollout host
that runs calls in submission order as a Ray actor does, the config checks that refuse a lag
without its prerequisites, and the layout of engines on devices of their own."""

from __future__ import annotations

import pytest

from trainer.config import ConfigError, load_config
from trainer.loop.cluster.local import LocalHandle, LocalRef
from trainer.loop.plan.layout import LayoutError, plan_layout, runs_in_process
from trainer.loop.plan.layout_text import format_layout
from trainer.loop.schedule.pipeline import RolloutPipeline, read_ahead, sampled_by

LAGGED = ["rollout.engine_devices=1", "algorithm.rollout_correction=token"]


class RecordingHost:
    """A rollout host that holds one set of weights and records, per rollout, the version it
    sampled with; ``LocalHandle`` runs each call when submitted, in order, as Ray runs one
    actor's calls."""

    def __init__(self) -> None:
        self.version = 0
        self.sampled: dict[int, int] = {}
        self.order: list[int] = []

    def rollout(self, step, record_dir=None, weights=None):
        if weights is not None:
            self.version = weights[0]
        self.sampled[step] = self.version
        self.order.append(step)
        meta = {"metrics": {}, "prompts_consumed": 8 * step, "policy_version": self.version}
        return meta, [LocalRef(f"batch {step}")]  # the batch by reference, as put() gives

    def validate(self, step, weights=None):
        if weights is not None:
            self.version = weights[0]
        self.order.append(f"val {step}")
        return {"val/reward_mean": 0.5, "val/version": float(self.version)}


def _run_schedule(
    lag: int, total: int, first: int = 1, horizon: int | None = None
) -> tuple[RecordingHost, list[dict], RolloutPipeline]:
    host = RecordingHost()
    pipe = RolloutPipeline(LocalHandle(host), lag, total, None, horizon=horizon)
    pipe.start(first, None if first == 1 else [first - 1, "refs", "specs"])
    taken = []
    for step in range(first, total + 1):
        meta, _ = pipe.take(step)
        taken.append(meta)
        pipe.after_update(step, [f"weights after {step}", "specs"])
    assert not pipe.ready  # every step's rollout was trained on
    return host, taken, pipe


def test_the_step_number_says_which_weights_sample_a_step():
    assert [sampled_by(t, 0) for t in range(1, 6)] == [0, 1, 2, 3, 4]
    assert [sampled_by(t, 1) for t in range(1, 6)] == [0, 0, 1, 2, 3]
    assert [sampled_by(t, 2) for t in range(1, 6)] == [0, 0, 0, 1, 2]


@pytest.mark.parametrize("lag", [0, 1, 2, 3])
def test_the_pipeline_samples_every_step_with_the_weights_its_number_names(lag):
    host, taken, pipe = _run_schedule(lag, total=7)
    # One rollout per step, in step order, and the lag's steps past the end for the last
    # checkpoint (a run resumed from it with more steps trains on them).
    assert host.order == list(range(1, 8 + lag))
    assert host.sampled == {t: sampled_by(t, lag) for t in range(1, 8 + lag)}
    assert sorted(pipe.queued) == list(range(8, 8 + lag))
    for step, meta in enumerate(taken, start=1):
        assert meta["metrics"]["pipeline/rollout_lag"] == lag
        assert meta["metrics"]["pipeline/policy_version"] == sampled_by(step, lag)


def test_a_resumed_pipeline_keeps_the_schedule():
    # Resumed after step 3 with lag 2: steps 4 and 5 come from the checkpoint (sampled by
    # the weights after steps 1 and 2); the host samples 6 with the weights after step 3.
    host = RecordingHost()
    pipe = RolloutPipeline(LocalHandle(host), 2, 8, None)
    for step in (4, 5):
        pipe.ready[step] = ({"metrics": {}, "policy_version": step - 3}, [f"saved {step}"])
    pipe.start(4, [3, "refs", "specs"])
    assert host.order == [6]
    for step in range(4, 9):
        meta, batch = pipe.take(step)
        assert meta["policy_version"] == sampled_by(step, 2)
        pipe.after_update(step, ["refs", "specs"])
    assert host.order == [6, 7, 8, 9, 10]  # and the two past the end, for the last checkpoint
    assert host.sampled == {6: 3, 7: 4, 8: 5, 9: 6, 10: 7}


def test_a_replay_samples_nothing_past_the_end():
    host, _, pipe = _run_schedule(2, total=5, horizon=5)
    assert host.order == [1, 2, 3, 4, 5] and not pipe.queued


def test_a_checkpoint_keeps_the_lags_rollouts_also_past_the_end():
    # Lag 2, 4 steps: the checkpoint of step 4 keeps steps 5 and 6, sampled by the weights
    # after steps 2 and 3, as an uninterrupted longer run samples them.
    host, _, pipe = _run_schedule(2, total=4)
    ahead = pipe.ahead(4)
    assert sorted(ahead) == [5, 6]
    kept = read_ahead(ahead)
    assert {s: meta["policy_version"] for s, (meta, _) in kept.items()} == {5: 2, 6: 3}
    assert kept[5][1] == "batch 5"  # the batch itself, read from its reference
    # Mid-run, a rollout already waited for is kept as well as a queued one.
    host = RecordingHost()
    pipe = RolloutPipeline(LocalHandle(host), 2, 8, None)
    pipe.start(1)
    pipe.take(1)
    pipe._wait({2})
    pipe.after_update(1, ["w1", "specs"])
    assert sorted(pipe.ahead(1)) == [2, 3]
    assert {s: m["policy_version"] for s, (m, _) in read_ahead(pipe.ahead(1)).items()} == {
        2: 0,
        3: 0,
    }


@pytest.mark.parametrize("lag", [1, 2])
def test_a_validation_waits_for_no_rollout_sampled_after_its_weights(lag):
    # Validating the weights after step 2 is queued before the rollout those weights sample
    # (step 3 + lag): the host loads them once, for both, and the controller reading the
    # validation waits only for the rollouts queued before it.
    host = RecordingHost()
    pipe = RolloutPipeline(LocalHandle(host), lag, 6, None)
    pipe.start(1, validate=True)
    for step in (1, 2):
        pipe.take(step)
        pipe.after_update(step, [f"weights after {step}", "specs"], validate=step == 2)
    order = host.order
    assert order[0] == "val 0"
    assert order.index("val 2") == order.index(3 + lag) - 1
    assert order.index("val 2") > order.index(2 + lag)
    assert pipe.validation(2).result()["val/version"] == 2.0
    assert pipe.validation(0).result()["val/version"] == 0.0


def test_a_lag_needs_engine_devices_of_their_own():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["train.rollout_lag=1", "algorithm.rollout_correction=token"])
    text = str(info.value)
    assert "train.rollout_lag" in text and "rollout.engine_devices" in text


def test_a_lag_needs_importance_weights():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["train.rollout_lag=1", "rollout.engine_devices=1"])
    text = str(info.value)
    assert "train.rollout_lag" in text and "algorithm.rollout_correction=token" in text


def test_engine_devices_come_in_whole_replicas():
    with pytest.raises(ConfigError) as info:
        load_config(
            None,
            [
                "rollout.engine=vllm",
                "rollout.tensor_parallel_size=2",
                "rollout.engine_devices=3",
            ],
            check_environment=False,
        )
    assert "rollout.engine_devices" in str(info.value)


def test_engines_of_their_own_sit_on_the_last_nodes():
    cfg = load_config(None, ["train.dp_size=2", "train.rollout_lag=1", *LAGGED])
    layout = plan_layout(cfg, [2, 2], "CPU", device="cpu")
    assert layout.separate and layout.devices_used == 3
    assert layout.rank_slots == ((0, 0), (0, 1))
    assert [(r.node, r.devices, r.ranks) for r in layout.replicas] == [(1, (1,), ())]
    text = format_layout(layout)
    assert "devices of their own (rollout.engine_devices)" in text
    assert "engine replica 0 (tp rank 0 of 1)" in text.split("node 1:")[1]
    assert not runs_in_process(cfg, "cpu")  # the engine runs beside the ranks


def test_engine_replicas_never_span_nodes():
    cfg = load_config(
        None,
        [
            "rollout.engine=vllm",
            "rollout.tensor_parallel_size=2",
            "rollout.engine_devices=4",
            "train.dp_size=2",
        ],
        check_environment=False,
    )
    layout = plan_layout(cfg, [4, 4], "GPU", device="cuda")
    assert [(r.node, r.devices) for r in layout.replicas] == [(1, (2, 3)), (1, (0, 1))]
    with pytest.raises(LayoutError) as info:
        plan_layout(cfg, [3, 3], "GPU", device="cuda")  # 2 + 4 devices, but no whole pair left
    assert "rollout.engine_devices=4" in str(info.value)
    with pytest.raises(LayoutError) as info:
        plan_layout(cfg, [2, 2], "GPU", device="cuda")
    assert "need 6" in str(info.value)


def test_engines_of_another_device_type_fill_their_own_nodes():
    cfg = load_config(
        None,
        [
            "device=cuda",
            "rollout.engine=vllm",
            "rollout.tensor_parallel_size=2",
            "train.dp_size=8",
            "rollout.engine_devices=8",
            "rollout.device=npu",
        ],
        check_environment=False,
    )
    assert cfg.engine_device() == "npu"
    # node 0: 8 GPUs; node 1: 16 NPU dies (an A3 half-node), in one cluster's node order
    layout = plan_layout(
        cfg,
        [8, 0],
        "GPU",
        device="cuda",
        engine_nodes=[0, 16],
        engine_resource="NPU",
        engine_device="npu",
    )
    assert layout.other_engine_device and layout.engine_resource == "NPU"
    assert layout.rank_slots == tuple((0, d) for d in range(8))
    assert [(r.node, r.devices) for r in layout.replicas] == [
        (1, (14, 15)),
        (1, (12, 13)),
        (1, (10, 11)),
        (1, (8, 9)),
    ]
    text = format_layout(layout)
    assert "engines on npu (Ray resource NPU): 8 of 16 used" in text
    assert "npu device 15: engine replica 0 (tp rank 1 of 2)" in text
    with pytest.raises(LayoutError) as info:  # no NPU in the cluster
        plan_layout(
            cfg, [8, 0], "GPU", engine_nodes=[0, 0], engine_resource="NPU", engine_device="npu"
        )
    assert "rollout.engine_devices=8" in str(info.value) and "NPU" in str(info.value)


def test_the_engine_spawner_takes_the_engines_backend():
    from hal.cpu import CpuBackend
    from hal.npu import NpuBackend
    from trainer.loop.start.spawn import Spawner

    cfg = load_config(
        None, ["rollout.engine_devices=2", "rollout.device=npu"], check_environment=False
    )
    layout = plan_layout(
        cfg,
        [2, 0],
        "CPU",
        device="cpu",
        engine_nodes=[0, 2],
        engine_resource="NPU",
        engine_device="npu",
    )
    spawner = Spawner(cfg, layout, None, CpuBackend(), in_process=False)
    assert isinstance(spawner.engine_backend(), NpuBackend)  # its class: no NPU asked here
    same = plan_layout(load_config(None, LAGGED), [4], "CPU", device="cpu")
    assert Spawner(cfg, same, None, CpuBackend(), in_process=False).engine_backend().name == "cpu"


def test_another_engine_device_needs_engine_devices_of_their_own():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["device=cpu", "rollout.device=npu"], check_environment=False)
    text = str(info.value)
    assert "rollout.device" in text and "rollout.engine_devices" in text


def test_a_local_ray_has_room_for_the_engines_own_cpus():
    from trainer.loop.plan.layout import layout_for_cli, local_ray_cpus

    cfg = load_config(None, ["rollout.engine_devices=4", *LAGGED[1:], "train.rollout_lag=1"])
    assert local_ray_cpus(cfg) >= cfg.train.dp_size + 4
    layout = layout_for_cli(cfg)  # the CPU default: a local Ray's CPUs
    assert len(layout.replicas) == 4 and layout.devices_used == 5
