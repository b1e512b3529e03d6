"""An engine replica lost mid-rollout: its requests are dealt to the survivors, the rollout
finishes, and the controller starts a replacement that the next weight sync fills.

Router failover with fake engines (fast); then, on Ray, a dp=2 run whose replica 1 is killed
during step 2's rollout finishes with the fingerprints of an uninterrupted run, and
``rollout.max_replica_failures=0`` stops at the first loss, naming the key."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest

from rollout.engines import GenerationRequest, GenerationResult, SamplingParams
from rollout.engines.serving.router import ReplicaLostError, ReplicaRouter, deal_prompt


class _Replica:
    """A fake replica: answers each request with its own seed; ``dies_after`` calls, it
    raises ``ReplicaLostError`` for that call and every later one."""

    def __init__(self, dies_after: int | None = None) -> None:
        self.seen: list[int] = []  # the groups it answered
        self.calls = 0
        self.dies_after = dies_after

    def generate(self, requests, sampling):
        self.calls += 1
        if self.dies_after is not None and self.calls > self.dies_after:
            raise ReplicaLostError("engine replica is lost: its process died")
        self.seen += [r.group for r in requests]
        return [GenerationResult([r.seed], [0.0], "length") for r in requests]


def _requests(groups, samples: int = 2) -> list[GenerationRequest]:
    return [
        GenerationRequest([1], seed=100 * g + k, group=g) for g in groups for k in range(samples)
    ]


def test_a_lost_replica_s_requests_are_dealt_over_the_survivors():
    replicas = [_Replica(), _Replica(dies_after=1), _Replica()]
    router = ReplicaRouter(replicas)
    requests = _requests(range(12))
    try:
        for _turn in range(3):  # replica 1 answers turn 0, then dies
            results = router.generate(requests, SamplingParams())
            assert [r.token_ids[0] for r in results] == [r.seed for r in requests]
        assert router.take_lost() == [1]
        assert router.take_lost() == []  # reported once
    finally:
        router.shutdown()
    own = {i: [g for g in range(12) if deal_prompt(g, 3) == i] for i in range(3)}
    assert sorted(set(replicas[1].seen)) == own[1]
    # replica 1's prompts went to the survivors by deal_prompt over the two of them
    survivors = [0, 2]
    for i in survivors:
        moved = [g for g in own[1] if survivors[deal_prompt(g, 2)] == i]
        assert sorted(set(replicas[i].seen)) == sorted(own[i] + moved)
        assert len(replicas[i].seen) == 2 * (3 * len(own[i]) + 2 * len(moved))


def test_every_lane_fails_over_to_the_survivors():
    replicas = [_Replica(), _Replica(dies_after=0)]
    router = ReplicaRouter(replicas)
    lanes = router.lanes()
    requests = _requests([1, 3])  # both dealt to replica 1
    assert {router.lane_of(r.group) for r in requests} == {1}
    for _turn in range(2):
        results = lanes[1].generate(requests, SamplingParams())
        assert [r.token_ids[0] for r in results] == [r.seed for r in requests]
    assert replicas[1].calls == 1  # tried once, then known lost: never called again
    assert replicas[0].seen == [1, 1, 3, 3] * 2  # the lost lane's call, whole, on replica 0
    assert router.take_lost() == [1]
    router.shutdown()


def test_a_survivor_lost_during_a_redeal_is_dealt_around_too():
    replicas = [_Replica(), _Replica(dies_after=0), _Replica(dies_after=0)]
    router = ReplicaRouter(replicas)
    requests = _requests(range(9))
    results = router.generate(requests, SamplingParams())
    assert [r.token_ids[0] for r in results] == [r.seed for r in requests]
    assert sorted(router.take_lost()) == [1, 2]
    assert sorted(set(replicas[0].seen)) == list(range(9))
    router.shutdown()


def test_no_survivor_left_raises():
    router = ReplicaRouter([_Replica(dies_after=0)])
    with pytest.raises(ReplicaLostError, match="every engine replica is lost"):
        router.generate(_requests([0]), SamplingParams())
    router.shutdown()


def test_a_waiting_replica_serves_only_once_told():
    replicas = [_Replica(), _Replica()]
    router = ReplicaRouter(replicas, waiting=[1])
    requests = _requests([0, 1])
    router.generate(requests, SamplingParams())
    assert replicas[1].seen == [] and replicas[0].seen == [0, 0, 1, 1]
    router.serve([1])
    router.generate(requests, SamplingParams())
    assert replicas[1].seen == [1, 1]
    assert router.take_lost() == []  # waiting is not lost
    router.shutdown()


def test_the_agent_loop_finishes_a_rollout_whose_replica_is_lost(tmp_path):
    """The batcher's lanes (waves and continuous) over a real tokenizer and environment."""
    from rollout.agent_loop import run_rollouts
    from rollout.envs import bind_env
    from rollout.tokenizer import load_tokenizer

    tok = load_tokenizer("builtin")
    for deterministic in (True, False):
        replicas = [_TokenReplica(tok), _TokenReplica(tok, dies_after=1)]
        router = ReplicaRouter(replicas)
        try:
            out = run_rollouts(
                router,
                tok,
                bind_env("recall", {}),
                [0, 1, 2, 3],
                n=2,
                max_turns=3,
                step_wise=True,
                merge_stepwise=False,
                max_input_len=200,
                max_new_tokens=4,
                sampling=SamplingParams(max_new_tokens=4),
                seed=1,
                step=1,
                deterministic=deterministic,
            )
        finally:
            router.shutdown()
        assert out.rows and not out.faults
        assert router.take_lost() == [1]


class _TokenReplica(_Replica):
    """A fake replica that answers with real token ids (the request's seed picks them)."""

    def __init__(self, tok, dies_after: int | None = None) -> None:
        super().__init__(dies_after)
        self.eos = tok.eos_token_id

    def generate(self, requests, sampling):
        out = super().generate(requests, sampling)
        return [
            GenerationResult([5 + r.seed % 7, self.eos], [-1.0, -1.0], "stop")
            for r, _ in zip(requests, out)
        ]


# ---------------------------------------------------------------------------- on Ray

SHORT = ["train.batch_size=4", "train.mini_batch_size=2", "rollout.n=4"]
#: dp=2 with the hf engine at tp 1: two colocated replicas; replica 1 is the one killed. The
#: environment waits up to 0.4 s per step (seeded), so a rollout lasts about a second.
DP2 = [
    *SHORT,
    "train.dp_size=2",
    "run.deterministic=true",
    "run.resume=never",
    "rollout.env=rollout.envs.sleepy:SleepyEnv",
    "rollout.env_kwargs.max_delay_s=0.4",
    "rollout.env_kwargs.turns=3",
]
FAULT_STEP = 2
#: seconds after step 2's rollout starts that replica 1 is killed: seeded, and before its
#: last turn (the first two environment steps alone take about 0.6 s or more)
FAULT_DELAY_S = random.Random(37).uniform(0.05, 0.5)


def _cfg(run_dir: Path, *overrides: str):
    from trainer.config import load_config

    return load_config(None, [*DP2, f"run.dir={run_dir}", *overrides])


def _kill_replica_during_rollout(monkeypatch, step: int, delay_s: float) -> list[float]:
    """Make the controller's rollout of ``step`` kill engine replica 1 ``delay_s`` seconds
    after it starts (from a thread, as a crash would come); returns the kill times."""
    import ray

    from trainer.loop.schedule.controller import Trainer

    rollout, killed = Trainer._rollout, []

    def faulty(self, at):
        if at == step:

            def kill():
                time.sleep(delay_s)
                ray.kill(self.replicas[1], no_restart=True)
                killed.append(time.monotonic())

            threading.Thread(target=kill, daemon=True).start()
        return rollout(self, at)

    monkeypatch.setattr(Trainer, "_rollout", faulty)
    return killed


@pytest.mark.slow
def test_a_replica_killed_mid_rollout_is_replaced_and_the_run_repeats(
    local_ray, tmp_path, monkeypatch
):
    from trainer.loop.start.run import run_training
    from trainer.records.jsonl_files import read_jsonl

    straight, faulted = tmp_path / "straight", tmp_path / "faulted"
    assert run_training(_cfg(straight, "train.total_steps=4")) == 0
    killed = _kill_replica_during_rollout(monkeypatch, FAULT_STEP, FAULT_DELAY_S)
    assert run_training(_cfg(faulted, "train.total_steps=4")) == 0
    assert len(killed) == 1

    metrics = read_jsonl(faulted / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    lost = {m["step"]: m["rollout/replicas_lost"] for m in metrics}
    assert lost == {1: 0.0, 2: 1.0, 3: 0.0, 4: 0.0}
    # The replacement took the current weights: every later step trains as the straight run.
    assert read_jsonl(faulted / "fingerprint.jsonl") == read_jsonl(straight / "fingerprint.jsonl")
    # Seconds the fault cost (not asserted: speed lives in bench/).
    times = [m["timing/step_s"] for m in metrics[1:]]  # step 1 also starts up
    others = sorted(t for m, t in zip(metrics[1:], times) if m["step"] != FAULT_STEP)
    lost_s = times[FAULT_STEP - 2] - others[len(others) // 2]
    print(
        f"\nreplica killed {FAULT_DELAY_S:.2f} s into step {FAULT_STEP}'s rollout: step times "
        f"{[round(t, 2) for t in times]} s (steps 2..4), seconds lost {lost_s:.2f}"
    )


@pytest.mark.slow
def test_no_replica_failures_allowed_stops_naming_the_key(local_ray, tmp_path, monkeypatch):
    from trainer.loop.cluster.group import WorkerFailedError
    from trainer.loop.schedule.controller import Trainer
    from trainer.loop.start import launch

    _kill_replica_during_rollout(monkeypatch, 1, FAULT_DELAY_S)
    cfg = _cfg(tmp_path / "run", "train.total_steps=1", "rollout.max_replica_failures=0")
    trainer = Trainer(cfg, Path(cfg.run.dir))
    try:
        launch.start(trainer)
        with pytest.raises(WorkerFailedError, match=r"rollout\.max_replica_failures=0"):
            trainer.train_step(1)
    finally:
        trainer.shutdown()


#: Engines on devices of their own, a step behind (the fixed-lag pipeline): two replicas.
OWN_LAG1 = [
    "rollout.engine_devices=2",
    "train.rollout_lag=1",
    "algorithm.rollout_correction=token",
]


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["host", "collective"])
def test_a_lost_replica_of_the_lagged_pipeline_comes_back_with_current_weights(
    local_ray, tmp_path, monkeypatch, transport
):
    """Host snapshots (``rollout.weight_transport=host``): the replacement joins the rollout
    host's queue and serves only once the next snapshot is loaded into it. The push through
    the engines' transfer API: the transfer group is rebuilt without the dead member and the
    replacement joins it at its first push, with no worker restarted. Either way the run
    repeats the uninterrupted one."""
    import ray

    from trainer.loop.schedule.pipeline import RolloutPipeline
    from trainer.loop.start import launch
    from trainer.loop.start.run import run_training
    from trainer.records.jsonl_files import read_jsonl

    job = [*OWN_LAG1, f"rollout.weight_transport={transport}", "train.total_steps=4"]
    straight, faulted = tmp_path / "straight", tmp_path / "faulted"
    assert run_training(_cfg(straight, *job)) == 0

    trainers, fired = [], []
    start, take = launch.start, RolloutPipeline.take

    def keep(trainer):
        trainers.append(trainer)
        return start(trainer)

    def take_then_kill(self, step):
        out = take(self, step)
        if step == FAULT_STEP - 1 and not fired:  # step 2's rollout starts now, behind step 1's
            fired.append(step)
            victim = trainers[-1].replicas[1]

            def kill():
                time.sleep(FAULT_DELAY_S)
                ray.kill(victim, no_restart=True)

            threading.Thread(target=kill, daemon=True).start()
        return out

    monkeypatch.setattr(launch, "start", keep)
    monkeypatch.setattr(RolloutPipeline, "take", take_then_kill)
    assert run_training(_cfg(faulted, *job)) == 0
    assert fired == [FAULT_STEP - 1]
    metrics = read_jsonl(faulted / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert {m["step"]: m["rollout/replicas_lost"] for m in metrics} == {
        1: 0.0,
        2: 1.0,
        3: 0.0,
        4: 0.0,
    }
    assert len(trainers) == 1  # no worker started again, whichever the transport
    assert not any(m.get("restart/count", 0) > 0 for m in metrics)
    assert read_jsonl(faulted / "fingerprint.jsonl") == read_jsonl(straight / "fingerprint.jsonl")
