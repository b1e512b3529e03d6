"""Checkpoints: atomic commit, crash safety, corruption detection, state round trips."""

from __future__ import annotations

import json
import os
import queue as queue_module
import random
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from trainer.records.checkpoint import (
    LAYOUT,
    CheckpointError,
    begin_checkpoint,
    commit_checkpoint,
    find_latest,
    list_checkpoints,
    load_json,
    load_safetensors,
    load_torch,
    read_model_weights,
    read_sharded,
    resolve_resume,
    rng_state,
    save_json,
    save_safetensors,
    save_sharded,
    save_torch,
    set_rng_state,
    verify_checkpoint,
)

REPO = Path(__file__).resolve().parents[1]
POSIX_ONLY = pytest.mark.skipif(os.name != "posix", reason="needs POSIX signals (SIGKILL)")
ROLE = "actor"


def _model_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(8, 4, generator=g), "b": torch.randn(4, generator=g)}


MODEL_SHARD = f"{LAYOUT.model_dir(ROLE)}/__0_0.distcp"  # rank 0's shard of the model


def _written_files(ranks: int) -> list[str]:
    """Every file of a checkpoint of one trainable role over ``ranks`` data-parallel ranks
    (the sharded dirs written by one process here: one shard each)."""
    return [
        MODEL_SHARD,
        f"{LAYOUT.model_dir(ROLE)}/.metadata",
        f"{LAYOUT.optim_dir(ROLE)}/__0_0.distcp",
        f"{LAYOUT.optim_dir(ROLE)}/.metadata",
        LAYOUT.scheduler(ROLE),
        *(LAYOUT.rng(ROLE, r) for r in range(ranks)),
        LAYOUT.trainer_state,
        LAYOUT.controller_rng,
    ]


def _write_checkpoint(run_dir: Path, step: int, *, ranks: int = 2, keep_last: int | None = 2):
    """What the controller and the workers write (``Trainer.save_checkpoint`` and
    ``FSDPWorker.save_pieces``): stage every piece, then commit."""
    staging = begin_checkpoint(run_dir, step)
    save_sharded(_model_state(step), staging / LAYOUT.model_dir(ROLE))
    save_sharded({"exp_avg": torch.full((3,), float(step))}, staging / LAYOUT.optim_dir(ROLE))
    save_torch({"last_epoch": step}, staging / LAYOUT.scheduler(ROLE))
    for rank in range(ranks):
        save_torch(rng_state(), staging / LAYOUT.rng(ROLE, rank))
    save_json({"step": step, "prompts_consumed": step * 4}, staging / LAYOUT.trainer_state)
    save_torch(rng_state(), staging / LAYOUT.controller_rng)
    expect = _written_files(ranks)
    return commit_checkpoint(run_dir, step, staging, keep_last=keep_last, expect_files=expect)


def _assert_whole(ckpt: Path, step: int) -> None:
    verify_checkpoint(ckpt)
    assert load_json(ckpt / LAYOUT.trainer_state)["step"] == step
    loaded = read_model_weights(ckpt, ROLE)
    for name, tensor in _model_state(step).items():
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0)
    assert read_sharded(ckpt / LAYOUT.optim_dir(ROLE))["exp_avg"][0].item() == step
    assert load_torch(ckpt / LAYOUT.scheduler(ROLE))["last_epoch"] == step
    assert "torch" in load_torch(ckpt / LAYOUT.rng(ROLE, 1))


# ------------------------------------------------------------------ layout


def test_layout_names_are_what_existing_checkpoints_hold():
    """Runs saved before must resume: these names are an on-disk contract."""
    assert LAYOUT.model_dir("actor") == "actor_model"
    assert LAYOUT.optim_dir("critic") == "critic_optim"
    assert LAYOUT.legacy_model("actor") == "actor_model.safetensors"
    assert LAYOUT.legacy_optim("critic") == "critic_optim.pt"
    assert LAYOUT.scheduler("actor") == "actor_scheduler.pt"
    assert LAYOUT.rng("actor", 3) == "actor_rng_rank3.pt"
    assert (LAYOUT.trainer_state, LAYOUT.controller_rng) == (
        "trainer_state.json",
        "controller_rng.pt",
    )
    assert (LAYOUT.checkpoints_dir, LAYOUT.latest, LAYOUT.manifest) == (
        "checkpoints",
        "latest",
        "manifest.json",
    )


# ------------------------------------------------------------------ commit protocol


def test_commit_makes_verified_checkpoint_and_latest(tmp_path):
    assert find_latest(tmp_path) is None
    ckpt = _write_checkpoint(tmp_path, 3)
    assert ckpt == tmp_path / "checkpoints" / "step_3"
    assert (tmp_path / "checkpoints" / LAYOUT.latest).read_text().strip() == "step_3"
    assert find_latest(tmp_path) == ckpt
    manifest = verify_checkpoint(ckpt)
    assert set(manifest["files"]) == set(_written_files(2))
    for rel, info in manifest["files"].items():
        assert info["size"] == (ckpt / rel).stat().st_size
    _assert_whole(ckpt, 3)
    # nothing but the committed dir and `latest` is left behind
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [LAYOUT.latest, "step_3"]


def test_keep_last_prunes_old_checkpoints(tmp_path):
    for step in (1, 2, 3, 4):
        _write_checkpoint(tmp_path, step, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_3", "step_4"]
    assert find_latest(tmp_path).name == "step_4"
    for step in (5, 6):
        _write_checkpoint(tmp_path, step, keep_last=None)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_3", "step_4", "step_5", "step_6"]


def test_recommit_same_step_replaces_it(tmp_path):
    _write_checkpoint(tmp_path, 2)
    staging = begin_checkpoint(tmp_path, 2)
    save_json({"step": 2, "prompts_consumed": 999}, staging / LAYOUT.trainer_state)
    ckpt = commit_checkpoint(tmp_path, 2, staging)
    verify_checkpoint(ckpt)
    assert load_json(ckpt / LAYOUT.trainer_state)["prompts_consumed"] == 999
    assert not (ckpt / LAYOUT.model_dir(ROLE)).exists()  # the old dir was replaced, not merged


def test_commit_rejects_bad_input(tmp_path):
    staging = begin_checkpoint(tmp_path, 1)
    with pytest.raises(CheckpointError, match="nothing was written"):
        commit_checkpoint(tmp_path, 1, staging)
    save_json({"step": 1}, staging / LAYOUT.trainer_state)
    with pytest.raises(CheckpointError, match=re.escape(LAYOUT.rng(ROLE, 0))):
        commit_checkpoint(tmp_path, 1, staging, expect_files=[LAYOUT.rng(ROLE, 0)])
    with pytest.raises(ValueError, match="not made for step 2"):
        commit_checkpoint(tmp_path, 2, staging)
    with pytest.raises(ValueError, match="begin_checkpoint"):
        commit_checkpoint(tmp_path, 1, tmp_path)
    with pytest.raises(ValueError, match="keep_last"):
        commit_checkpoint(tmp_path, 1, staging, keep_last=0)
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        begin_checkpoint(tmp_path, -1)
    assert find_latest(tmp_path) is None


def test_stale_staging_dirs_ignored_then_cleaned(tmp_path):
    _write_checkpoint(tmp_path, 1)
    stale = begin_checkpoint(tmp_path, 2)
    (stale / "partial.bin").write_bytes(b"x" * 100)
    future = begin_checkpoint(tmp_path, 9)  # may belong to a writer still running
    assert find_latest(tmp_path).name == "step_1"
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_1"]
    _write_checkpoint(tmp_path, 2)
    assert not stale.exists()
    assert future.exists()


# ------------------------------------------------------------------ crashes


def _run_child(code: str, *args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


@POSIX_ONLY
def test_writer_killed_mid_write_leaves_previous_checkpoint(tmp_path):
    _write_checkpoint(tmp_path, 1)
    staging = begin_checkpoint(tmp_path, 2)
    (staging / MODEL_SHARD).parent.mkdir()
    child = _run_child(
        """
        import sys
        with open(sys.argv[1], "wb") as fh:
            chunk = b"\\xab" * (1 << 20)
            fh.write(chunk)
            fh.flush()
            print("started", flush=True)
            while True:  # a model too big to finish before the kill
                fh.write(chunk)
        """,
        str(staging / MODEL_SHARD),
    )
    assert child.stdout.readline().strip() == "started"
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    child.stdout.close()
    assert child.returncode == -signal.SIGKILL
    assert (staging / MODEL_SHARD).stat().st_size > 0  # the torn piece is really there

    latest = find_latest(tmp_path)
    assert latest.name == "step_1"
    _assert_whole(latest, 1)
    # the resumed run saves step 2 again; the torn staging dir is cleaned up
    _write_checkpoint(tmp_path, 2)
    assert not staging.exists()
    _assert_whole(find_latest(tmp_path), 2)


@POSIX_ONLY
def test_kill_after_rename_before_latest_keeps_previous_checkpoint(tmp_path):
    _write_checkpoint(tmp_path, 1)
    staging = begin_checkpoint(tmp_path, 2)
    save_sharded(_model_state(2), staging / LAYOUT.model_dir(ROLE))
    save_json({"step": 2, "prompts_consumed": 8}, staging / LAYOUT.trainer_state)
    child = _run_child(
        """
        import os, signal, sys
        import trainer.records.checkpoint.store as store

        def die(*args, **kwargs):  # the process dies exactly between rename and `latest`
            os.kill(os.getpid(), signal.SIGKILL)

        store._write_latest = die
        store.commit_checkpoint(sys.argv[1], 2, sys.argv[2])
        """,
        str(tmp_path),
        str(staging),
    )
    child.wait(timeout=120)
    child.stdout.close()
    assert child.returncode == -signal.SIGKILL
    assert (tmp_path / "checkpoints" / "step_2" / LAYOUT.manifest).is_file()  # renamed...

    latest = find_latest(tmp_path)  # ...but never committed
    assert latest.name == "step_1"
    _assert_whole(latest, 1)
    assert resolve_resume(tmp_path, "auto") == latest

    _write_checkpoint(tmp_path, 2)  # the resumed run redoes step 2 and replaces the orphan
    _assert_whole(find_latest(tmp_path), 2)


def test_latest_naming_missing_dir_falls_back_to_older_whole_one(tmp_path):
    _write_checkpoint(tmp_path, 1)
    _write_checkpoint(tmp_path, 2)
    # a crash while replacing step_2: the old dir was moved aside, the new one not yet in
    (tmp_path / "checkpoints" / "step_2").rename(tmp_path / "checkpoints" / ".tmp_replaced_x")
    assert find_latest(tmp_path).name == "step_1"


# ------------------------------------------------------------------ corruption


def _corrupt_truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _corrupt_flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("how", "expect"),
    [(_corrupt_truncate, "bytes"), (_corrupt_flip, "sha256"), (Path.unlink, "missing")],
)
@pytest.mark.parametrize("victim", [MODEL_SHARD, LAYOUT.rng(ROLE, 1)])
def test_corrupted_file_named_in_error(tmp_path, how, expect, victim):
    ckpt = _write_checkpoint(tmp_path, 5)
    how(ckpt / victim)
    with pytest.raises(CheckpointError) as info:
        verify_checkpoint(ckpt)
    msg = str(info.value)
    assert victim in msg and str(ckpt) in msg and expect in msg
    assert "run.resume" in msg  # the fix is in the message
    with pytest.raises(CheckpointError):
        resolve_resume(tmp_path, "latest")


def test_missing_or_bad_manifest(tmp_path):
    ckpt = _write_checkpoint(tmp_path, 1)
    (ckpt / LAYOUT.manifest).write_text("{not json")
    with pytest.raises(CheckpointError, match="manifest.json is unreadable"):
        verify_checkpoint(ckpt)
    (ckpt / LAYOUT.manifest).unlink()
    with pytest.raises(CheckpointError, match="never committed"):
        verify_checkpoint(ckpt)


def test_loaders_wrap_errors_naming_file(tmp_path):
    garbage = tmp_path / LAYOUT.scheduler(ROLE)
    garbage.write_bytes(b"\x00not a torch file")
    with pytest.raises(CheckpointError, match=LAYOUT.scheduler(ROLE)):
        load_torch(garbage)
    bad_st = tmp_path / LAYOUT.legacy_model(ROLE)
    bad_st.write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match=LAYOUT.legacy_model(ROLE)):
        load_safetensors(bad_st)
    with pytest.raises(CheckpointError, match="missing"):
        load_torch(tmp_path / "absent.pt")
    with pytest.raises(CheckpointError, match=LAYOUT.trainer_state):
        (tmp_path / LAYOUT.trainer_state).write_text("[1,")
        load_json(tmp_path / LAYOUT.trainer_state)


def test_load_torch_refuses_arbitrary_objects(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"obj": Path("x")}, path)  # not loadable with weights_only=True
    with pytest.raises(CheckpointError, match="evil.pt"):
        load_torch(path)


def test_latest_with_garbage_names_file(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / LAYOUT.latest).write_text("../../etc")
    with pytest.raises(CheckpointError, match="expected 'step_<N>'"):
        find_latest(tmp_path)


# ------------------------------------------------------------------ state round trips


def test_safetensors_tied_and_noncontiguous_weights(tmp_path):
    emb = torch.randn(6, 4)
    base = torch.randn(4, 8)
    state = {
        "embed.weight": emb,
        "lm_head.weight": emb,  # tied
        "proj.weight": base.t(),  # non-contiguous view
        "half": torch.randn(3, dtype=torch.bfloat16),
        "slice": base[1],  # a view into a larger buffer
    }
    path = save_safetensors(state, tmp_path / LAYOUT.legacy_model(ROLE))
    loaded = load_safetensors(path)
    assert set(loaded) == set(state)
    for name, tensor in state.items():
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0)
        assert loaded[name].dtype == tensor.dtype
    loaded["embed.weight"][0, 0] += 1  # independent copies after loading
    assert loaded["lm_head.weight"][0, 0] == emb[0, 0]
    with pytest.raises(ValueError, match=r"state_dict\['step'\]"):
        save_safetensors({"step": 3}, tmp_path / "x.safetensors")


def test_optimizer_state_round_trip_with_weights_only(tmp_path):
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    save_torch(opt.state_dict(), tmp_path / "optim.pt")
    loaded = load_torch(tmp_path / "optim.pt")
    fresh = torch.optim.AdamW(torch.nn.Linear(4, 3).parameters(), lr=1e-3)
    fresh.load_state_dict(loaded)
    for key in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(
            fresh.state_dict()["state"][0][key], opt.state_dict()["state"][0][key]
        )


def test_resume_with_a_changed_lr_trains_with_it_at_the_saved_schedule_position(tmp_path):
    from trainer.loop.ranks.optim import build_optimizer, lr_factor, reapply_hyperparameters

    sched = dict(warmup_steps=4, total_steps=20, schedule="cosine", min_lr_ratio=0.1)
    model = torch.nn.Linear(4, 3)
    opt, scheduler = build_optimizer(model.parameters(), lr=1e-3, weight_decay=0.0, **sched)
    for _ in range(6):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        scheduler.step()
    save_torch(opt.state_dict(), tmp_path / "optim.pt")
    save_torch(scheduler.state_dict(), tmp_path / "scheduler.pt")

    # resumed with train.lr=2e-3 and train.weight_decay=0.1
    fresh, fresh_scheduler = build_optimizer(
        torch.nn.Linear(4, 3).parameters(), lr=2e-3, weight_decay=0.1, **sched
    )
    fresh.load_state_dict(load_torch(tmp_path / "optim.pt"))
    fresh_scheduler.load_state_dict(load_torch(tmp_path / "scheduler.pt"))
    assert fresh.param_groups[0]["lr"] == pytest.approx(1e-3 * lr_factor(6, **sched))  # stale
    reapply_hyperparameters(fresh, fresh_scheduler, lr=2e-3, weight_decay=0.1)

    want = 2e-3 * lr_factor(6, **sched)
    assert fresh.param_groups[0]["lr"] == pytest.approx(want)
    assert fresh.param_groups[0]["weight_decay"] == 0.1
    assert fresh_scheduler.get_last_lr() == [pytest.approx(want)]
    fresh_scheduler.step()  # the schedule goes on from step 6 with the new base lr
    assert fresh.param_groups[0]["lr"] == pytest.approx(2e-3 * lr_factor(7, **sched))
    torch.testing.assert_close(  # the moments are the checkpoint's
        fresh.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"]
    )


def _draws() -> tuple:
    return (
        [random.random() for _ in range(3)],
        random.gauss(0, 1),
        np.random.rand(3).tolist(),
        np.random.normal(),
        torch.rand(3).tolist(),
    )


def test_rng_round_trip_reproduces_draws(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0, 1)  # leave a cached gaussian in the state
    np.random.normal()
    device = {"state": torch.tensor([7, 8, 9], dtype=torch.uint8)}
    restored_device = []
    save_torch(rng_state(lambda: device["state"]), tmp_path / LAYOUT.rng(ROLE, 0))
    expected = _draws()
    _draws()  # move every generator on
    set_rng_state(load_torch(tmp_path / LAYOUT.rng(ROLE, 0)), restored_device.append)
    assert _draws() == expected
    assert restored_device[0].tolist() == [7, 8, 9]


def test_rng_state_without_device_setter_still_restores_host(tmp_path, caplog):
    state = rng_state(lambda: torch.zeros(2))
    expected = _draws()
    set_rng_state(state)
    assert _draws() == expected
    assert "no setter" in caplog.text
    with pytest.raises(CheckpointError, match="'numpy'"):
        set_rng_state({"python": state["python"], "torch": state["torch"]})


def test_resolve_resume_forms(tmp_path):
    assert resolve_resume(tmp_path, None) is None
    assert resolve_resume(tmp_path, "auto") is None  # nothing saved yet: start fresh
    _write_checkpoint(tmp_path, 1)
    _write_checkpoint(tmp_path, 2)
    assert resolve_resume(tmp_path, "auto").name == "step_2"
    assert resolve_resume(tmp_path, 1).name == "step_1"
    assert resolve_resume(tmp_path, "step_1").name == "step_1"
    assert resolve_resume(tmp_path, str(tmp_path / "checkpoints" / "step_2")).name == "step_2"
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_resume(tmp_path, 7)
    with pytest.raises(ValueError, match="run.resume"):
        resolve_resume(tmp_path, 1.5)


def test_manifest_is_json_with_sizes_and_hashes(tmp_path):
    ckpt = _write_checkpoint(tmp_path, 4)
    manifest = json.loads((ckpt / LAYOUT.manifest).read_text())
    assert manifest["step"] == 4
    assert all(len(info["sha256"]) == 64 for info in manifest["files"].values())


def test_resume_from_older_step_drops_abandoned_newer_checkpoints(tmp_path):
    for step in (1, 2, 3):
        _write_checkpoint(tmp_path, step, keep_last=None)
    # the user resumes from step_1 (run.resume=1) and the run saves step 2 again
    assert resolve_resume(tmp_path, 1).name == "step_1"
    _write_checkpoint(tmp_path, 2, keep_last=None)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_1", "step_2"]
    assert find_latest(tmp_path).name == "step_2"


# ------------------------------------------------------------------ resume at another dp size

#: The default job's tiny actor on the CPU, no KL, fixed lr: what ``FSDPWorker`` saves/loads.
RESHARD_JOB = [
    "device=cpu",
    "model.path=builtin:tiny",
    "seed=1",
    "train.lr=1e-3",
    "train.grad_clip=null",
    "algorithm.kl_coef=0.0",
    "algorithm.use_kl_loss=false",
    "run.deterministic=false",
]


def _reshard_batch():
    """3 prompts x 4 samples of random tokens with old logprobs a little off the policy."""
    from batching import Row, StepBatch

    rnd = random.Random(11)
    rows = []
    for uid in range(3):
        for sample in range(4):
            resp = [rnd.randrange(3, 90) for _ in range(rnd.randint(2, 9))]
            rows.append(
                Row(
                    prompt_ids=[rnd.randrange(3, 90) for _ in range(rnd.randint(3, 12))],
                    response_ids=resp,
                    response_mask=[1] * len(resp),
                    response_logprobs=[-rnd.random() * 3 for _ in resp],
                    uid=uid,
                    trajectory_id=uid * 4 + sample,
                    step_index=0,
                    is_last_step=True,
                    score=rnd.random(),
                )
            )
    batch = StepBatch.from_rows(rows)
    noise = 0.3 * torch.randn(batch.num_tokens, generator=torch.Generator().manual_seed(3))
    batch.set_token_field("old_logprobs", (batch.token_fields["rollout_logprobs"] + noise))
    return batch


def _reshard_rank(rank, world, port, arrays, staging, legacy, resume_from, queue) -> None:
    """One data-parallel rank of the actor. ``staging`` set: train 2 steps, save the
    checkpoint (and its single-file twin into ``legacy``), train step 3, then load the
    checkpoint and train step 3 again. Else: load each dir of ``resume_from`` and train step 3
    from it."""
    from batching import StepBatch, plan_minibatches
    from tests.gloo_ranks import report_and_finish
    from trainer.config import load_config
    from trainer.loop.ranks.fsdp_worker import WorkerSpec
    from trainer.loop.ranks.policy import PolicyWorker

    torch.set_num_threads(1)
    cfg = load_config(None, [*RESHARD_JOB, f"train.dp_size={world}"])
    worker = PolicyWorker(WorkerSpec(role="actor", rank=rank, cfg=cfg))
    worker.setup("127.0.0.1", port)
    worker.load_batch([arrays])
    worker.compute_advantages()
    batch = StepBatch.from_numpy(arrays)
    plan = plan_minibatches(
        batch.row_fields["trajectory_id"].numpy(),
        batch.seq_lens,
        mini_batch_size=3,
        dp_size=world,
        group_ids=batch.row_fields["uid"].numpy(),
    )
    (mini,) = plan.mini_batches

    def step() -> dict:
        report = worker.train_mini_batch(mini.micro_batches[rank], mini.rows.tolist())
        params = {k: v.numpy().copy() for k, v in worker.full_state_dict().items()}
        return {"loss": report.values["loss"], "grad_norm": report.values["grad_norm"], **params}

    out = {}
    if staging is not None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        step(), step()
        out["written"] = worker.save_pieces(staging)
        # What rank 0 wrote before the sharded layout existed (gathers: every rank calls).
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        optim = get_optimizer_state_dict(worker.model, worker.optimizer, options=full)
        model = worker.full_state_dict()
        if rank == 0:
            save_safetensors(model, Path(legacy) / LAYOUT.legacy_model("actor"))
            save_torch(optim, Path(legacy) / LAYOUT.legacy_optim("actor"))
        out["continued"] = step()
        worker.load_pieces(staging)
        out["again"] = step()
    else:
        for ckpt in resume_from:
            worker.load_pieces(ckpt)
            out[ckpt] = step()
    report_and_finish(queue, (rank, out))  # gloo's teardown can abort a passed rank


def _spawn_ranks(world: int, arrays, staging=None, legacy=None, resume_from=()) -> dict[int, dict]:
    import torch.multiprocessing as mp

    from trainer.loop.cluster.group import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_reshard_rank,
            args=(r, world, port, arrays, staging, legacy, resume_from, queue),
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    per_rank: dict[int, dict] = {}
    deadline = time.monotonic() + 600
    while len(per_rank) < world:  # a rank that dies fails the test now, not at the deadline
        try:
            rank, out = queue.get(timeout=2)
            per_rank[rank] = out
        except queue_module.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            assert not dead and time.monotonic() < deadline, f"rank processes exited {dead}"
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0, f"rank process exited with {p.exitcode}"
    return per_rank


def _step_result(per_rank: dict[int, dict], key: str) -> dict:
    """Rank 0's parameters and grad norm (shared by all ranks); loss shares summed."""
    out = dict(per_rank[0][key])
    out["loss"] = sum(r[key]["loss"] for r in per_rank.values())
    return out


def _checkpoint_at(world: int, tmp_path_factory) -> dict:
    """An actor at dp=``world`` trained 2 steps and checkpointed (committed like the
    controller does), plus the same checkpoint in the single-file layout of older runs."""
    run_dir = tmp_path_factory.mktemp(f"reshard_dp{world}")
    arrays = _reshard_batch().to_numpy()
    staging = begin_checkpoint(run_dir, 2)
    legacy = tmp_path_factory.mktemp(f"legacy_dp{world}") / "step_2"
    legacy.mkdir()
    per_rank = _spawn_ranks(world, arrays, staging=str(staging), legacy=str(legacy))
    written = sorted({name for r in per_rank.values() for name in r["written"]})
    save_json({"step": 2, "prompts_consumed": 6}, staging / LAYOUT.trainer_state)
    ckpt = commit_checkpoint(run_dir, 2, staging, keep_last=None, expect_files=written)
    for name in (LAYOUT.scheduler("actor"), *(LAYOUT.rng("actor", r) for r in range(world))):
        (legacy / name).write_bytes((ckpt / name).read_bytes())
    return {
        "arrays": arrays,
        "ckpt": ckpt,
        "written": written,
        "legacy": legacy,
        "continued": _step_result(per_rank, "continued"),
        "again": _step_result(per_rank, "again"),
    }


@pytest.fixture(scope="module")
def dp2_checkpoint(tmp_path_factory):
    """``_checkpoint_at`` dp=2: FSDP2-sharded model and optimizer."""
    return _checkpoint_at(2, tmp_path_factory)


@pytest.fixture(scope="module")
def dp1_checkpoint(tmp_path_factory):
    """``_checkpoint_at`` dp=1: the one rank trains the plain module, nothing sharded."""
    return _checkpoint_at(1, tmp_path_factory)


def _rel_distance(a: dict, b: dict) -> float:
    """Relative L2 distance of the whole parameter vectors (see test_trainer_dp_invariance)."""
    names = sorted(k for k in a if k not in ("loss", "grad_norm"))
    va = np.concatenate([np.asarray(a[k], np.float64).ravel() for k in names])
    vb = np.concatenate([np.asarray(b[k], np.float64).ravel() for k in names])
    return float(np.linalg.norm(va - vb) / np.linalg.norm(va))


@pytest.mark.slow
def test_sharded_checkpoint_every_rank_writes_its_shard(dp2_checkpoint):
    ckpt = dp2_checkpoint["ckpt"]
    manifest = verify_checkpoint(ckpt)
    for sub in (LAYOUT.model_dir("actor"), LAYOUT.optim_dir("actor")):
        shards = sorted(p.name for p in (ckpt / sub).glob("*.distcp"))
        assert shards == ["__0_0.distcp", "__1_0.distcp"], shards  # one file per rank
        assert f"{sub}/__1_0.distcp" in dp2_checkpoint["written"]
        assert f"{sub}/.metadata" in manifest["files"]
    assert not list(ckpt.glob("*.safetensors"))  # nothing gathered into one file
    weights = read_model_weights(ckpt, "actor")
    assert weights["model.embed_tokens.weight"].shape == (102, 64)


@pytest.mark.slow
def test_same_dp_resume_is_bit_exact(dp2_checkpoint):
    continued, again = dp2_checkpoint["continued"], dp2_checkpoint["again"]
    assert again.keys() == continued.keys()
    for key, value in continued.items():
        np.testing.assert_array_equal(again[key], value, err_msg=key)


@pytest.mark.slow
@pytest.mark.parametrize(("saved", "world"), [(2, 1), (2, 4), (1, 2)])
def test_resume_at_another_dp_size_continues_the_run(request, saved, world):
    """A checkpoint written at dp=2 resumes at dp=1 and dp=4, one written at dp=1 (the plain
    module) at dp=2: the next step's loss, grad norm and updated parameters equal the saving
    run's own step 3 (dp invariance, fp32)."""
    written = request.getfixturevalue(f"dp{saved}_checkpoint")
    dirs = [str(written["ckpt"])]
    if world == 1:  # the single-file layout of older checkpoints still loads
        dirs.append(str(written["legacy"]))
    per_rank = _spawn_ranks(world, written["arrays"], resume_from=dirs)
    expected = written["continued"]
    for ckpt in dirs:
        got = _step_result(per_rank, ckpt)
        print(
            f"dp={saved} -> dp={world} from {Path(ckpt).parent.name}/{Path(ckpt).name}: "
            f"loss {got['loss']:.9g} vs {expected['loss']:.9g}, grad norm "
            f"{got['grad_norm']:.9g} vs {expected['grad_norm']:.9g}, "
            f"parameters {_rel_distance(got, expected):.2e} apart"
        )
        assert got["loss"] == pytest.approx(expected["loss"], rel=1e-5, abs=1e-7), ckpt
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5), ckpt
        assert _rel_distance(got, expected) <= 1e-5, ckpt


def test_checkpoint_without_the_role_names_both_layouts(tmp_path):
    with pytest.raises(CheckpointError) as info:
        read_model_weights(tmp_path, "critic")
    msg = str(info.value)
    assert LAYOUT.model_dir("critic") in msg and LAYOUT.legacy_model("critic") in msg


def test_sharded_save_names_its_files_when_torch_returns_metadata_without_storage(
    tmp_path, monkeypatch
):
    """torch 2.10-2.12's ``dcp.save`` returns the metadata without its storage fields
    (pytorch issue 177887; the GPU machine's torch 2.11 did): the files written are read back
    from the ``.metadata`` on disk, the same names a full return gives."""
    import dataclasses

    import torch.distributed.checkpoint as dcp

    full = save_sharded(_model_state(1), tmp_path / "full")
    real_save = dcp.save

    def save_like_torch_2_11(*args, **kwargs):
        return dataclasses.replace(real_save(*args, **kwargs), storage_data=None)

    monkeypatch.setattr(dcp, "save", save_like_torch_2_11)
    names = save_sharded(_model_state(1), tmp_path / "stripped")
    assert names == full and names and all(n.endswith(".distcp") for n in names)
    assert all((tmp_path / "stripped" / n).is_file() for n in names)
