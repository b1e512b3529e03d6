"""An engine replica lost mid-rollout: its requests are dealt to the survivors, the rollout
finishes, and the controller starts a replacement that the next weight sync fills.

Router failover with fake engines (fast); then, on Ray, a dp=2 run whose replica 1 is killed
during step 2's rollout finishes with the fingerprints of an uninterrupted run, and
``rollout.max_replica_failures=0`` stops at the first loss, naming the key."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from pathlib import Path

import pytest

from rollout.engines import GenerationRequest, GenerationResult, SamplingParams
from rollout.engines.serving.router import ReplicaLostError, ReplicaRouter, deal_prompt
from trainer.loop.engines.engine_host import EngineHost


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
    from rollout.tokenizer import load_tokenizer

    tok = load_tokenizer("builtin")
    for deterministic in (True, False):
        replicas = [_TokenReplica(tok), _TokenReplica(tok, dies_after=1)]
        router = ReplicaRouter(replicas)
        try:
            out = _recall_rollout(router, tok, deterministic, prompts=4)
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


class _ServedPeer:
    """A peer replica as the rollout host sees one with an engine server in its own process
    (``RemoteEngine.engine_server``; here the server runs in this process over ``inner``, a
    ``_TokenReplica`` unless given). ``direct``: calls the host made to its ``generate``."""

    def __init__(self, tok, dies_after: int | None = None, inner=None) -> None:
        from rollout.engines.serving.server import EngineServer

        self.inner = inner if inner is not None else _TokenReplica(tok, dies_after)
        self.server = EngineServer(self.inner, name="peer-server")
        self.direct = 0
        self.opened = 0

    def engine_server(self, version: int):
        self.opened += 1
        return self.server

    def generate(self, requests, sampling):
        self.direct += 1
        return self.inner.generate(requests, sampling)


def _recall_rollout(router, tok, deterministic: bool, prompts: int = 6):
    """``prompts`` recall prompts x 2 samples, up to 3 turns of 4 tokens, on ``router``."""
    from rollout.agent_loop import run_rollouts
    from rollout.envs import bind_env

    return run_rollouts(
        router,
        tok,
        bind_env("recall", {}),
        list(range(prompts)),
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


@pytest.mark.parametrize("dies_after", [None, 1])
def test_continuous_turns_go_to_a_peer_s_own_server_and_fail_over_counted(dies_after):
    """With continuous admission a peer's turns go to the engine server in its own process,
    each a request of its own, never through a call of the host's (lag runs' peers served
    per call before); once the peer is lost, the requests it held are sent again to the
    replica the router deals their prompt to, counted, and its later turns go there too."""
    from rollout.tokenizer import load_tokenizer

    tok = load_tokenizer("builtin")
    local, peer = _TokenReplica(tok), _ServedPeer(tok, dies_after)
    router = ReplicaRouter([local, peer])
    try:
        out = _recall_rollout(router, tok, deterministic=False)
        reference = _recall_rollout(ReplicaRouter([_TokenReplica(tok)]), tok, True)
    finally:
        router.shutdown()
        peer.server.close()
    assert out.rows and not out.faults
    # the same tokens as one replica sampling every request in waves (seeded per request)
    assert [r.response_ids for r in out.rows] == [r.response_ids for r in reference.rows]
    assert peer.direct == 0 and peer.opened == 1
    peers_prompts = {g for g in range(6) if deal_prompt(g, 2) == 1}
    assert peers_prompts <= set(peer.inner.seen)  # its first turns at least
    if dies_after is None:
        assert set(peer.inner.seen) == peers_prompts and set(local.seen).isdisjoint(peers_prompts)
        assert router.take_lost() == [] and router.take_resubmitted() == 0
    else:
        assert peer.inner.calls > dies_after  # it died while serving
        assert peers_prompts <= set(local.seen)  # the rest of their turns on replica 0
        assert router.take_lost() == [1]
        assert router.take_resubmitted() >= 1  # the requests it held when it died


class _UntilAborted:
    """An engine whose requests decode until aborted (``abort_groups``) or interrupted."""

    interruptible = abortable = True

    def generate(self, requests, sampling, interrupt=None, abort_groups=None):
        wanted = set(range(len(requests)))  # the server numbers them by batch slot
        while not interrupt() and not wanted <= set(abort_groups()):
            time.sleep(0.005)
        return [GenerationResult([1], [0.0], "interrupted") for _ in requests]


# the peer server's thread must survive the aborted requests' end after the rollout's loop
@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_rollout_that_ends_early_aborts_its_requests_on_a_peer_s_server():
    """A rollout cancelled while a peer decodes its turns (a time limit, a failed
    trajectory): closing its batcher aborts them by id on the peer's server, which goes on
    serving others; they would otherwise decode on until their budget."""
    from rollout.engines.serving.batcher import RequestBatcher

    peer = _ServedPeer(None, inner=_UntilAborted())
    router = ReplicaRouter([_Replica(), peer])

    async def cancelled() -> None:
        batcher = RequestBatcher(router, SamplingParams(max_new_tokens=64), waves=False)
        turns = [
            asyncio.ensure_future(batcher.generate(GenerationRequest([1], seed=g, group=g), g))
            for g in (1, 3)  # both dealt to the peer
        ]
        for _ in range(400):
            if peer.server.running() == 2:
                break
            await asyncio.sleep(0.005)
        assert peer.server.running() == 2
        for turn in turns:
            turn.cancel()
        await asyncio.gather(*turns, return_exceptions=True)
        batcher.close()

    try:
        asyncio.run(cancelled())
        deadline = time.monotonic() + 10
        while peer.server.running() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert peer.server.running() == 0 and peer.server.queued() == 0
        assert peer.direct == 0
    finally:
        router.shutdown()
        peer.server.close()


def test_waves_still_call_a_peer_per_wave_and_count_what_the_router_moves():
    """Under ``run.deterministic`` (waves) the peer's share of a wave stays one call of the
    host's, its own server unused; a lost peer's call is dealt again by the router, and
    those requests are counted too."""
    from rollout.tokenizer import load_tokenizer

    tok = load_tokenizer("builtin")
    peer = _ServedPeer(tok, dies_after=1)
    router = ReplicaRouter([_TokenReplica(tok), peer])
    try:
        out = _recall_rollout(router, tok, deterministic=True)
    finally:
        router.shutdown()
        peer.server.close()
    assert out.rows and not out.faults
    assert peer.opened == 0 and peer.direct >= 2
    assert router.take_lost() == [1]
    assert router.take_resubmitted() == 2 * len({g for g in range(6) if deal_prompt(g, 2) == 1})


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


class _SlowTokenReplica(_TokenReplica):
    """``_TokenReplica`` whose every call takes ``CALL_S`` seconds (a peer busy decoding)."""

    CALL_S = 0.15

    def generate(self, requests, sampling):
        time.sleep(self.CALL_S)
        return super().generate(requests, sampling)


class _RayPeer(EngineHost):
    """The shipped ``EngineHost`` over a slow token engine (imported by Ray's worker as
    ``tests.test_replica_failover``)."""

    def setup(self):
        from rollout.tokenizer import load_tokenizer

        self.engine = _SlowTokenReplica(load_tokenizer("builtin"))

    def engine_calls(self) -> int:
        return self.engine.calls


@pytest.mark.slow
def test_a_lag_run_s_peer_serves_each_turn_in_its_own_process_and_its_loss_is_counted(
    local_ray, tmp_path
):
    """A fixed-lag run with continuous admission: its peer replica's actor has the serve and
    control groups, each turn dealt to it is a request to the engine server in its process
    (``EngineHost.serve``, none of the host's ``generate`` calls), and when the actor is
    killed mid-rollout its requests go to replica 0, counted, and the rollout finishes."""
    import ray

    from rollout.tokenizer import load_tokenizer
    from tests.test_replica_failover import _RayPeer  # by a name Ray's workers import
    from trainer.config import load_config
    from trainer.loop.engines.remote_engine import RemoteEngine, peer_actor_options

    cfg = load_config(
        None,
        [*OWN_LAG1, "run.deterministic=false", f"run.dir={tmp_path}"],
    )
    options = peer_actor_options(cfg)
    assert set(options["concurrency_groups"]) == {"control", "serve"}
    tok = load_tokenizer("builtin")
    for kill in (False, True):
        peer = ray.remote(**options)(_RayPeer).options(num_cpus=0).remote(cfg, 1, 1)
        ray.get(peer.setup.remote())
        local = _TokenReplica(tok)
        router = ReplicaRouter([local, RemoteEngine(peer, 1, controllable=True)])
        if kill:
            threading.Timer(0.3, lambda handle=peer: ray.kill(handle, no_restart=True)).start()
        try:
            out = _recall_rollout(router, tok, deterministic=False)
            assert out.rows and not out.faults
            peers_prompts = {g for g in range(6) if deal_prompt(g, 2) == 1}
            if not kill:
                assert ray.get(peer.engine_calls.remote()) >= 1  # its turns, on its server
                batches = ray.get(peer.server_batches.options(concurrency_group="control").remote())
                turns = [row for row in out.rows if row.uid in peers_prompts]  # a row a turn
                assert sum(b.requests for b in batches) == len(turns) > 0
                assert set(local.seen).isdisjoint(peers_prompts)
                assert router.take_lost() == [] and router.take_resubmitted() == 0
            else:
                assert router.take_lost() == [1]
                assert router.take_resubmitted() >= 1  # it died decoding their turns
                assert peers_prompts <= set(local.seen)
        finally:
            router.shutdown()
            ray.kill(peer)


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
