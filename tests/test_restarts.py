"""A run that outlives its workers: a training rank or the rollout host killed (kill -9) at a
seeded moment, or a rank hung so its peer waits inside a collective, and the run restarts its
workers, resumes from its last checkpoint and finishes with the fingerprints of an
uninterrupted run; the bounds (``run.max_restarts``) and the call limits that turn hangs into
faults."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

import hal
from bench.faults import FAULT_JOB, FAULTS, Fault
from trainer.config import load_config
from trainer.loop.cluster.faults import fault_kind
from trainer.loop.cluster.group import WorkerFailedError
from trainer.loop.plan import call_limits
from trainer.loop.plan.call_limits import CallLimits
from trainer.loop.start.restarts import Restart, Restarts
from trainer.loop.start.run import closing_summary

SHORT = ["train.batch_size=4", "train.mini_batch_size=2", "rollout.n=4"]


def _cfg(run_dir: Path, *overrides: str):
    return load_config(None, [*SHORT, f"run.dir={run_dir}", *overrides])


# ---- what restarts, and how often -----------------------------------------------------------


class Wrapped(RuntimeError):
    """Stands for Ray's RayTaskError, which keeps the worker's error as ``cause``."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


def test_kinds_of_worker_failure_and_which_restart():
    from torch.distributed import DistBackendError

    assert fault_kind(ValueError("bad reward")) == "raised"
    assert fault_kind(Wrapped(DistBackendError("gloo timed out"))) == "collective"
    gloo = "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:129] Timed out "
    assert fault_kind(Wrapped(RuntimeError(gloo + "waiting 20000ms for send"))) == "collective"
    peer_gone = (
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
        "[127.0.0.1]:44466: Connection reset by peer"
    )
    assert fault_kind(RuntimeError(peer_gone)) == "collective"
    assert fault_kind(RuntimeError("Timed out waiting for my env")) == "raised"
    assert WorkerFailedError("x", kind="died").restartable
    assert WorkerFailedError("x", kind="hung").restartable
    assert WorkerFailedError("x", kind="collective").restartable
    assert not WorkerFailedError("x").restartable  # a worker's own error would repeat


def test_restarts_are_bounded_and_the_refusal_names_the_key(tmp_path):
    restarts = Restarts(1, tmp_path)
    restarts.current_step = 3
    died = WorkerFailedError("actor.train_mini_batch: worker actor rank 1 died", kind="died")
    first = restarts.take(died)
    assert first is not None and first.number == 1 and first.failed_step == 3
    assert restarts.take(died) is None
    assert "run.max_restarts=1" in restarts.refused(died)
    assert "repeat" in restarts.refused(WorkerFailedError("raised ValueError"))
    assert Restarts(0, tmp_path).take(died) is None  # 0: today's stop


def test_a_restart_resumes_from_the_checkpoint_this_run_committed(tmp_path):
    from trainer.records.checkpoint.store import _write_latest

    cfg = _cfg(tmp_path, "run.resume=never")
    restarts = Restarts(2, tmp_path)
    assert restarts.config(cfg) is cfg  # nothing committed yet: start where the run started
    step = tmp_path / "checkpoints" / "step_2"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text("{}")
    _write_latest(tmp_path / "checkpoints", "step_2")
    again = restarts.config(cfg)
    assert again.run.resume == str(step) and again.train == cfg.train
    assert cfg.run.resume == "never"  # the run's own config is unchanged


def test_a_restart_is_recorded_on_the_next_line_and_in_the_summary(tmp_path):
    restart = Restart(1, failed_step=5, error="worker actor rank 1 died", resumed_step=2)
    assert restart.steps_redone == 2
    restart.down_s = 12.5
    assert restart.metrics()["restart/steps_redone"] == 2.0
    text = closing_summary(
        "train",
        tmp_path,
        first_step=3,
        total_steps=6,
        rewards=[0.1, 0.2, 0.3, 0.4],
        wall_s=9.0,
        restarts=[restart.summary()],
    )
    assert (
        "restart 1: at step 5 (a process died: worker actor rank 1 died); resumed from step 2"
        in text
    )
    assert "2 step(s) redone" in text


# ---- hangs become faults --------------------------------------------------------------------


def test_call_limits_follow_the_budgets(tmp_path):
    base = CallLimits.for_config(_cfg(tmp_path))
    longer = CallLimits.for_config(_cfg(tmp_path, "rollout.max_turns=6"))
    slow_env = CallLimits.for_config(_cfg(tmp_path, "rollout.env_timeout_s=600"))
    assert longer.rollout_s > base.rollout_s and slow_env.rollout_s > base.rollout_s
    assert base.update_s(100_000) > base.update_s(1_000)
    quick = CallLimits.for_config(_cfg(tmp_path, "run.collective_timeout_s=30"))
    # every limit sits above the collective timeout: a collective names the hang first
    assert quick.update_s(1) > 30 and quick.rollout_s > 30 and quick.setup_s > 30
    assert quick.update_s(1) < call_limits.SETUP_S  # a small update is not given half an hour


# ---- faults in a real run (dp 2, deterministic) ---------------------------------------------

FAULT_RUN = [*FAULT_JOB, "train.total_steps=4", "run.save_every=2"]


@pytest.fixture(scope="module")
def straight(local_ray, tmp_path_factory):
    """The uninterrupted run the faulted ones must equal."""
    from trainer.loop.start.run import run_training

    run_dir = tmp_path_factory.mktemp("straight") / "run"
    started = time.monotonic()
    assert run_training(_cfg(run_dir, *FAULT_RUN)) == 0
    return run_dir, time.monotonic() - started


def _fingerprints(run_dir: Path) -> list[dict]:
    from trainer.records.jsonl_files import read_jsonl

    return read_jsonl(run_dir / "fingerprint.jsonl")


#: A lost engine replica restarts nothing: tests/test_replica_failover.py covers it.
RESTARTED = [name for name in FAULTS if name != "replica-killed"]


@pytest.mark.slow
@pytest.mark.parametrize("name", RESTARTED)
def test_a_lost_or_hung_worker_is_restarted_and_the_run_is_exact(
    straight, monkeypatch, tmp_path, capsys, name
):
    """A training rank killed mid-update, the rollout host killed mid-rollout, a rank hung
    (``bench.faults.FAULTS`` less the lost replica), each in step 3."""
    from trainer.loop.start.run import run_training
    from trainer.records.jsonl_files import read_jsonl

    target, phase, extra = FAULTS[name]
    fault = Fault(monkeypatch.setattr, step=3, phase=phase, target=target, seed=3)
    run_dir = tmp_path / "run"
    started = time.monotonic()
    assert run_training(_cfg(run_dir, *FAULT_RUN, *extra)) == 0
    wall_s = time.monotonic() - started
    assert fault.fired.is_set()
    err = capsys.readouterr().err
    assert "restarting the workers (1 of run.max_restarts=2)" in err
    # the seeded moment may fall in step 3 or, the steps being short, in step 4
    assert re.search(r"restart 1: at step [34] \(.*\); resumed from step 2", err), err
    if target == "hang":
        assert "collective" in err.lower() or "timed out" in err.lower(), err
    assert _fingerprints(run_dir) == _fingerprints(straight[0])
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert metrics[2]["restart/count"] == 1 and metrics[2]["restart/steps_redone"] in (0, 1)
    print(f"{name}: {wall_s - straight[1]:.1f} s lost ({metrics[2]['restart/down_s']:.1f} s down)")


@pytest.mark.slow
def test_max_restarts_0_stops_at_the_first_lost_worker(local_ray, monkeypatch, tmp_path, capsys):
    from trainer.loop.start.run import run_training

    Fault(monkeypatch.setattr, step=1, phase="_update", target="actor rank 1", seed=0)
    cfg = _cfg(tmp_path / "run", *FAULT_RUN, "run.max_restarts=0")
    assert run_training(cfg) == 1
    err = capsys.readouterr().err
    assert "worker actor rank 1 died" in err and "run.max_restarts=0" in err


LAGGED = ["rollout.engine_devices=1", "train.rollout_lag=1", "algorithm.rollout_correction=token"]


@pytest.mark.slow
def test_a_lagged_run_restarts_with_the_rollouts_its_checkpoint_kept(
    local_ray, monkeypatch, tmp_path, capsys
):
    """Engines of their own at lag 1: the restart resumes the checkpoint's pending rollout
    (sampled before it with older weights) and the run repeats the uninterrupted one."""
    from trainer.loop.start.run import run_training

    straight, faulted = tmp_path / "straight", tmp_path / "faulted"
    assert run_training(_cfg(straight, *FAULT_RUN, *LAGGED)) == 0
    Fault(monkeypatch.setattr, step=3, phase="_update", target="actor rank 1", seed=3)
    assert run_training(_cfg(faulted, *FAULT_RUN, *LAGGED)) == 0
    err = capsys.readouterr().err
    assert "restarting the workers (1 of run.max_restarts=2)" in err
    assert re.search(r"restart 1: at step [34] \(.*\); resumed from step 2", err), err
    assert _fingerprints(faulted) == _fingerprints(straight)


def test_a_reservation_on_a_lost_node_is_planned_again_without_it(monkeypatch, tmp_path):
    """``launch._reserve``: the first reservation names a node Ray still lists but that no
    longer answers; it fails after its try, the probe finds the node gone, and the layout is
    planned again on the nodes left (no Ray: the cluster's answers are faked)."""
    from types import SimpleNamespace

    from trainer.loop.cluster import group
    from trainer.loop.start import launch

    nodes = {"a": 1, "lost": 1, "c": 1}
    tries: list[list[str]] = []

    def live(down):
        return [n for n in nodes if n not in down]

    def make_placement(resource, layout, *, timeout_s, node_ids):
        tries.append(list(node_ids))
        if "lost" in node_ids[: layout.devices_used]:
            raise WorkerFailedError(f"could not reserve ... within {timeout_s:.0f} s")
        return "placement"

    monkeypatch.setattr(group, "cluster_nodes", lambda r, down=(): [nodes[n] for n in live(down)])
    monkeypatch.setattr(group, "cluster_node_ids", lambda r, down=(): live(down))
    monkeypatch.setattr(group, "make_placement", make_placement)
    monkeypatch.setattr(group, "unresponsive_nodes", lambda timeout_s: {"lost"})
    job = SimpleNamespace(cfg=_cfg(tmp_path, "train.dp_size=2"), in_process=False)
    backend = hal.backend_class("cpu")()
    launch._reserve(job, backend)
    assert job.placement == "placement"
    assert tries == [["a", "lost", "c"], ["a", "c"]]
    assert tuple(job.layout.nodes) == (1, 1)


def test_rendezvous_ports_stay_out_of_the_ephemeral_range():
    """A restart starts every process group again: its rank 0's port is picked where no
    ``bind(0)`` of another process can take it before the rendezvous binds it."""
    from trainer.loop.cluster.group import RENDEZVOUS_PORTS, free_port

    ports = {free_port() for _ in range(20)}
    assert all(port in RENDEZVOUS_PORTS for port in ports)
    assert RENDEZVOUS_PORTS.stop <= 32768 and RENDEZVOUS_PORTS.start >= 20000


def test_the_faults_bench_refuses_an_unknown_fault_and_a_bad_key_in_one_line(capsys):
    """``python -m bench.faults``: a fault it does not have and a config key that is wrong are
    refused before anything starts, each naming what to give instead."""
    from bench import faults

    for argv, said in (
        (["--faults", "rank-killed,meteor"], "--faults rank-killed,meteor: a comma list of"),
        (["--keys", "train.dp_siz=1"], "--keys: train.dp_siz: unknown key"),
    ):
        with pytest.raises(SystemExit) as exit_:
            faults.main(argv)
        assert exit_.value.code == 2 and said in capsys.readouterr().err


@pytest.mark.slow
def test_the_only_rank_killed_at_dp_1_is_restarted_and_the_run_is_exact(local_ray):
    """What the GPU tiers' tier 3 runs on its one device (``bench.faults --faults rank-killed
    --keys 'device=auto train.dp_size=1'``): the last rank, here the only one, killed
    mid-update; the run restarts its workers (in Ray, never the driver's own process) and ends
    with the uninterrupted run's fingerprints."""
    from bench import faults

    result = faults.run(quick=True, faults=("rank-killed",), keys=("train.dp_size=1",))
    assert result["dp_size"] == 1
    (row,) = result["rows"]
    assert row["fault"] == "rank-killed" and row["status"] == 0
    assert row["steps_redone"] is not None and row["identical"]
