"""``ray.in_process``: a one-rank CPU job runs its workers in the driver's own process, with
the same controller, worker classes and call order as on Ray, and the same numbers; a job
that needs Ray is refused by name when the key insists; a worker's error is reported as a
Ray worker's is."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import ray

from trainer.config import load_config
from trainer.loop.cluster.group import PendingCalls, WorkerFailedError, WorkerGroup, wait_all
from trainer.loop.cluster.local import LocalHandle, LocalRef, fetch, put
from trainer.loop.plan.layout import LayoutError, runs_in_process
from trainer.loop.start.run import run_training

SHORT = ["train.batch_size=4", "train.mini_batch_size=2", "rollout.n=4", "train.total_steps=2"]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["device=cpu"], True),
        (["device=cpu", "ray.in_process=true"], True),
        (["device=cpu", "ray.in_process=false"], False),
        (["device=cpu", "train.dp_size=2"], False),
        (["device=cpu", "ray.address=auto"], False),
    ],
)
def test_auto_runs_one_cpu_rank_in_process(overrides, expected):
    assert runs_in_process(load_config(None, overrides)) is expected


def test_insisting_on_a_job_that_needs_ray_names_what_stops_it():
    cfg = load_config(None, ["device=cpu", "ray.in_process=true", "train.dp_size=2"])
    with pytest.raises(LayoutError, match=r"ray.in_process=true .* train.dp_size=2"):
        runs_in_process(cfg)


def test_cli_refuses_it_before_ray_starts(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "trainer.cli", "train", f"run.dir={tmp_path / 'run'}"]
        + ["device=cpu", "ray.in_process=true", "train.dp_size=2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert "ray.in_process=true" in out.stderr and "train.dp_size=2" in out.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


class _Worker:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def add(self, x: int, y: int) -> int:
        self.calls.append("add")
        return x + y

    def pair(self) -> tuple[str, int]:
        return "127.0.0.1", 1234

    def fail(self) -> None:
        raise ValueError("rows must not be empty")


def test_local_calls_run_in_order_and_resolve_refs_like_ray():
    worker = _Worker()
    handle = LocalHandle(worker)
    first = handle.add.remote(1, 2)
    second = handle.add.remote(first, 10)  # a top-level ref argument is resolved, as in Ray
    host, port = handle.pair.options(num_returns=2).remote()
    assert (fetch(first), fetch(second), fetch(host), fetch(port)) == (3, 13, "127.0.0.1", 1234)
    assert worker.calls == ["add", "add"]
    arrays = fetch(put({"ids": __import__("numpy").arange(3)}))
    assert not arrays["ids"].flags.writeable  # read-only, as Ray's object store hands them out


def test_a_local_worker_error_names_the_worker_and_the_call():
    group = WorkerGroup("actor", [LocalHandle(_Worker())])
    calls = PendingCalls()
    calls.submit(group, "add", 1, 2)
    calls.submit(group, "fail")
    with pytest.raises(
        WorkerFailedError, match=r"actor.fail: worker actor rank 0 raised ValueError"
    ):
        calls.wait()
    with pytest.raises(WorkerFailedError, match="rows must not be empty"):
        wait_all(
            [LocalRef(error=ValueError("rows must not be empty"))], ["x"], timeout_s=1, what="y"
        )


def _fingerprints(run_dir: Path) -> list[str]:
    lines = (run_dir / "fingerprint.jsonl").read_text().splitlines()
    return [json.dumps(json.loads(line), sort_keys=True) for line in lines]


@pytest.mark.slow
def test_in_process_and_ray_runs_agree_bit_for_bit(tmp_path):
    """The same job on Ray and in one process: the same fingerprints (plans, losses, rewards,
    gradient norms, parameter checksums) to the last bit."""
    runs = {}
    for mode in ("true", "false"):
        run_dir = tmp_path / mode
        cfg = load_config(None, [*SHORT, f"run.dir={run_dir}", f"ray.in_process={mode}"])
        assert run_training(cfg) == 0
        runs[mode] = _fingerprints(run_dir)
    assert not ray.is_initialized()  # run_training shut the Ray it started
    assert len(runs["true"]) == 2
    assert runs["true"] == runs["false"]


@pytest.mark.slow
@pytest.mark.smoke
def test_in_process_run_leaves_the_programs_own_process_group_alone(tmp_path):
    """A program that already runs torch.distributed (e.g. a vLLM engine in the same process)
    keeps its group: the run shares a one-rank group it finds and ends only one it made."""
    import torch.distributed as dist

    from trainer.loop.cluster.group import free_port

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        mine = dist.group.WORLD
        cfg = load_config(None, [*SHORT, "train.total_steps=1", f"run.dir={tmp_path / 'run'}"])
        assert run_training(cfg) == 0
        assert dist.is_initialized() and dist.group.WORLD is mine
    finally:
        dist.destroy_process_group()
    cfg = load_config(None, [*SHORT, "train.total_steps=1", f"run.dir={tmp_path / 'again'}"])
    assert run_training(cfg) == 0
    assert not dist.is_initialized()  # the group it made is gone with it
