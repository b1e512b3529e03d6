"""The push to engines of their own (``trainer.loop.weights.weight_group``) where a careful
reading of the device paths found it wrong (issue 56): the ranks enter each gather together,
the gather runs on the rank's device (offloaded shards included), every wait of a replica has a
deadline, a generation's port is held from its announcement, a rebuilt group frees the old
communicator, no vendor's process group is built by crossrl, the deprecated all-gather is not
called, and a stale-prompt policy without a stream is refused.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import hal
from rollout.engines.weights.transfer import ENGINE_NAME, GlooWeightTransfer
from trainer.config import ConfigError, load_config
from trainer.loop.cluster.group import free_port

ROOT = Path(__file__).resolve().parents[1]
CPU = hal.get_backend("cpu")


class _Held:
    """An engine that keeps what it loads."""

    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] = {}
        self.joined = 0

    def init_weight_transfer(self, init_info: dict) -> None:
        from rollout.engines.weights.transfer import TransferInitInfo, TransferReceiver

        self.receiver = TransferReceiver(CPU)
        self.receiver.join(TransferInitInfo(**init_info), 0)
        self.joined += 1

    def receive_weights(self, update_info: dict) -> int:
        from rollout.engines.weights.transfer import TransferUpdateInfo

        def load(named):
            for name, tensor in named:
                self.state[name] = tensor.clone()

        return self.receiver.receive(TransferUpdateInfo(**update_info), load)


def _group(replicas: int, timeout_s: float = 30.0, transport=GlooWeightTransfer):
    from trainer.loop.weights.weight_group import (
        PushReceiver,
        WeightGroupAddress,
        WeightSender,
        connect_store,
        serve_store,
    )

    address = WeightGroupAddress("127.0.0.1", free_port(), replicas, 1, ENGINE_NAME, timeout_s)
    server = serve_store(address.host, address.port, 1 + replicas, timeout_s)
    from trainer.loop.weights.membership import start_membership

    start_membership(server, replicas)
    sender = WeightSender(address, server, transport, CPU)
    receivers = [PushReceiver(connect_store(address), address, r) for r in range(replicas)]
    return sender, receivers


def _state(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(3, 2, generator=gen), "b.bias": torch.randn(2, generator=gen)}


def _in_threads(*calls) -> list:
    out: list = [None] * len(calls)

    def run(i, call):
        try:
            out[i] = call()
        except Exception as err:  # noqa: BLE001 - returned to the test
            out[i] = err

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return out


# ------------------------------------------------------------------ item 7: ranks in step


def test_every_rank_finishes_the_push_before_any_rank_gathers_the_next():
    """The driver asks every rank to finish the push before (rank 0 waits for its sender)
    before it asks any rank to gather the next: no rank sits in the all-gather while rank 0
    still waits for the engines."""
    from trainer.loop.weights import driver

    calls: list[str] = []

    class Actor:
        def call(self, method, *args, timeout_s=None, per_rank=None):
            calls.append(method)

    class Job:
        replay_dir = None
        pushes = 3
        actor = Actor()
        limits = type("L", (), {"push_s": 10.0})()
        layout = type("Layout", (), {"weight_transport": "collective"})()

    assert driver.snapshot_weights(Job()) == ["pushed", 3]
    assert calls == ["finish_push", "broadcast_weights"]


def test_finish_waits_for_the_sender_and_raises_what_broke_the_push():
    sender, _ = _group(replicas=1)
    sender.send(_state(1), torch.float32, 0)  # no engine takes it
    done = threading.Event()
    waiting = threading.Thread(target=lambda: (sender.finish(), done.set()))
    waiting.start()
    waiting.join(timeout=0.3)
    assert waiting.is_alive() and not done.is_set()  # rank 0 waits for the engines
    sender.stop()
    waiting.join(timeout=10)
    assert done.is_set()
    sender.error = OSError("connection reset by peer")
    with pytest.raises(RuntimeError, match="the weight push broke: connection reset"):
        sender.finish()


# ------------------------------------------------------------------ item 3: on the device


def test_the_gather_runs_on_the_ranks_device_whatever_holds_the_shards(monkeypatch):
    """With ``train.param_offload`` the shards sit in host memory; the bucket's all-gather
    runs on the rank's device (here the meta device stands in for it)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from hal import collectives
    from trainer.loop.weights.gather import whole_tensors

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        state = {"w": distribute_tensor(torch.randn(4, 2), mesh, [Shard(0)])}
        devices = []

        def gather(out, flat, group=None):
            devices.append((out.device.type, flat.device.type))
            out.copy_(flat)

        monkeypatch.setattr(collectives, "all_gather_flat", gather)
        ((name, whole),) = list(whole_tensors(state, torch.bfloat16, 1 << 20, torch.device("meta")))
        assert name == "w" and whole.device.type == "meta" and whole.shape == (4, 2)
        assert devices == [("meta", "meta")]
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------ item 8: deadlines, ports


def test_a_replica_asked_for_a_push_already_sent_fails_within_the_timeout_naming_it():
    """Replica 0 took push 0; a replacement for replica 1, never let in, asked for push 0
    (already sent) used to spin for ever: it fails within the address's timeout, as a
    failure the run restarts for."""
    import torch.distributed as dist

    from trainer.loop.cluster.faults import RESTARTABLE_KINDS, fault_kind
    from trainer.loop.weights.weight_group import PushReceiver, connect_store

    sender, (first,) = _group(replicas=1, timeout_s=1.5)
    engine = _Held()
    sender.send(_state(2), torch.float32, 0)
    assert _in_threads(lambda: first.receive(engine, 0)) == [2]
    sender.finish()
    late = PushReceiver(connect_store(sender.address), sender.address, 1)
    began = time.monotonic()
    with pytest.raises(dist.DistStoreError, match=r"push 0: engine replica 1 waited 1.5 s") as err:
        late.receive(_Held(), 0)
    assert time.monotonic() - began < 10
    assert fault_kind(err.value) in RESTARTABLE_KINDS  # the run restarts, in one line


def test_a_generations_port_is_held_from_its_announcement_until_the_sender_joins():
    """Between the announcement (start-up, or a rebuilt group) and the rendezvous no other
    process can bind the port; the sender lets it go when it joins, and the group forms."""
    from trainer.loop.weights.membership import current_group

    sender, (receiver,) = _group(replicas=1)
    port = current_group(sender.store).port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other, pytest.raises(OSError):
        other.bind(("", port))
    engine = _Held()
    sender.send(_state(3), torch.float32, 0)
    assert _in_threads(lambda: receiver.receive(engine, 0)) == [2]
    sender.finish()
    assert torch.equal(engine.state["a.weight"], _state(3)["a.weight"])


def test_a_group_rebuilt_without_a_lost_member_frees_the_old_communicator():
    """Replica 1 is lost after push 0: the next generation is built without it, and the
    sender frees generation 0's communicator before it joins generation 1."""
    made: list = []

    class Counted(GlooWeightTransfer):
        @classmethod
        def trainer_init(cls, init_info):
            member = super().trainer_init(init_info)
            member.destroyed = 0

            def destroy(m=member):
                m.destroyed += 1

            member.destroy = destroy
            made.append(member)
            return member

    sender, receivers = _group(replicas=2, transport=Counted)
    engines = [_Held(), _Held()]
    sender.send(_state(4), torch.float32, 0)
    assert _in_threads(*(lambda r=r, e=e: r.receive(e, 0) for r, e in zip(receivers, engines)))
    sender.finish()
    sender.exclude([1])
    sender.send(_state(5), torch.float32, 1)
    assert _in_threads(lambda: receivers[0].receive(engines[0], 1)) == [2]
    sender.finish()
    assert [m.destroyed for m in made] == [1, 0] and sender.generation == 1
    assert torch.equal(engines[0].state["b.bias"], _state(5)["b.bias"])


# ------------------------------------------------------------------ item 5: the budget


def test_the_budget_keeps_the_staged_push_off_the_device_and_its_chunks_in_the_update():
    """Rank 0's staged copy lives in pinned host memory: the weight push phase on a GPU no
    longer holds the model, the update holds the chunks the sender sends while the step
    trains, and ``crossrl layout`` says where the copy is. On the CPU the host is the device:
    the copy stays in the table."""
    from rollout.engines.weights.transfer import PACKED_BUFFER_BYTES
    from trainer.loop.plan.memory_budget import budget_for
    from trainer.loop.plan.memory_report import format_budget

    keys = [
        "model.path=/models/Qwen2.5-7B-Instruct",
        "rollout.engine=vllm",
        "rollout.engine_devices=2",
        "train.dp_size=6",
        "train.rollout_lag=1",
        "algorithm.rollout_correction=token",
    ]
    collective = load_config(None, ["device=cuda", *keys], check_environment=False)
    host = load_config(
        None, ["device=cuda", *keys, "rollout.weight_transport=host"], check_environment=False
    )
    pushed, snapshot = (budget_for(c, "cuda", 80e9) for c in (collective, host))
    model_bytes = pushed.shape.num_params * 2  # bf16
    extra = pushed.phase("weight push").total - snapshot.phase("weight push").total
    assert 0 < extra < model_bytes / 4  # chunks and a communicator, not the model
    update = pushed.phase("update").total - snapshot.phase("update").total
    assert update >= 2 * PACKED_BUFFER_BYTES  # the chunks in flight while the step trains
    assert "in pinned host memory" in format_budget(pushed, collective)
    cpu = load_config(None, ["device=cpu", *keys], check_environment=False)
    on_cpu = budget_for(cpu, "cpu", 400e9, ranks_per_memory=6)
    assert on_cpu.phase("weight push").parts["gather"] >= model_bytes


# ------------------------------------------------------------------ item 16: no vendor group


def test_the_hf_engine_of_its_own_on_an_accelerator_takes_host_snapshots():
    from trainer.loop.plan.layout import weight_transport_rule

    base = ["rollout.engine=hf", "rollout.engine_devices=1"]
    for device in ("cuda", "npu"):
        cfg = load_config(None, [f"device={device}", *base], check_environment=False)
        assert weight_transport_rule(cfg) == "host"
        explicit = [f"device={device}", *base, "rollout.weight_transport=collective"]
        with pytest.raises(ConfigError) as err:
            load_config(None, explicit, check_environment=False)
        assert "rollout.weight_transport" in str(err.value) and "rollout.engine" in str(err.value)
    cpu = load_config(None, ["device=cpu", *base])
    assert weight_transport_rule(cpu) == "collective"  # crossrl's gloo group on the CPU
    assert weight_transport_rule(cpu, device="cuda") == "host"  # resolved from auto


def test_crossrl_builds_no_vendor_process_group_of_its_own():
    from hal.weight_group import new_process_group

    for name in ("cuda", "npu"):
        backend = hal.backend_class(name)()
        with pytest.raises(ValueError, match="gloo only"):
            new_process_group(backend, None, 0, 2, 10.0)
    files = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    found = [
        name
        for name in files
        if not name.startswith("tests/")
        and any(f"ProcessGroup{v}(" in (ROOT / name).read_text() for v in ("NCCL", "HCCL"))
    ]
    assert found == []


# ------------------------------------------------------------------ item 17: stale prompts


@pytest.mark.parametrize("policy", ["keep", "retry"])
def test_a_stale_prompt_policy_without_a_stream_is_refused_naming_both_keys(policy):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"train.stale_prompts={policy}"])
    assert "train.stale_prompts" in str(err.value) and "train.max_staleness" in str(err.value)
    stream = ["train.max_staleness=1", "algorithm.rollout_correction=token"]
    assert load_config(None, [*stream, f"train.stale_prompts={policy}"]).train.stale_prompts == (
        policy
    )


def test_a_retry_cap_without_retry_is_refused_naming_both_keys():
    stream = ["train.max_staleness=1", "algorithm.rollout_correction=token"]
    with pytest.raises(ConfigError) as err:
        load_config(None, [*stream, "train.max_prompt_retries=5"])
    assert "train.max_prompt_retries" in str(err.value) and "train.stale_prompts" in str(err.value)
    cfg = load_config(None, [*stream, "train.stale_prompts=retry", "train.max_prompt_retries=5"])
    assert cfg.train.max_prompt_retries == 5


# ------------------------------------------------------------------ item 18: no warning


@pytest.mark.slow
def test_a_lagged_job_with_an_engine_of_its_own_runs_with_every_warning_an_error(tmp_path):
    """Every rank gathers at every push (dp 2): torch 2.13 deprecates the all-gather the
    gather called, a ``FutureWarning`` in every rank at every push. With warnings as errors
    in every process of the job, the job runs to its end."""
    env = {**os.environ, "PYTHONWARNINGS": "error"}
    args = [
        "run.resume=never",
        f"run.dir={tmp_path / 'run'}",
        "train.rollout_lag=1",
        "rollout.engine_devices=1",
        "algorithm.rollout_correction=token",
        "train.total_steps=2",
        "train.dp_size=2",
        "train.batch_size=4",
        "train.mini_batch_size=2",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "trainer.cli", "train", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Warning" not in done.stderr
