"""The collective weight push (``trainer.loop.weights.weight_group``) over gloo, its members in
threads of this process: each training rank broadcasts only the rows it holds, every replica
receives the ranks' pieces of a bucket and joins them into the whole tensors, pushes arrive
tagged by number while nothing loads them and are taken in order; and the rule that picks the
transport, with the combinations refused before start-up."""

from __future__ import annotations

import threading

import pytest
import torch

import hal
from trainer.config import ConfigError, load_config
from trainer.loop.cluster.group import free_port
from trainer.loop.weights.weight_group import (
    WeightGroupAddress,
    WeightReceiver,
    WeightSender,
    join,
    serve_store,
)

CPU = hal.get_backend("cpu")


def _state(version: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(version)
    return {
        "model.embed_tokens.weight": torch.randn(7, 4, generator=gen),  # 7 rows over 2 ranks
        "model.layers.0.self_attn.q_proj.weight": torch.randn(4, 4, generator=gen),
        "model.layers.0.mlp.up_proj.weight": torch.randn(6, 4, generator=gen),
        "model.layers.1.mlp.up_proj.weight": torch.randn(6, 4, generator=gen),
        "model.norm.weight": torch.randn(1, generator=gen),  # fewer rows than ranks
        "rotary.inv_freq": torch.randn(3, generator=gen),  # not sharded: rank 0 sends it
    }


def _rows(name: str, tensor: torch.Tensor, rank: int, ranks: int) -> torch.Tensor | None:
    """What rank ``rank`` holds of ``tensor``: its ``torch.chunk`` rows (FSDP2's dim-0 shard,
    empty past the end), the whole unsharded tensor on rank 0 alone."""
    if name == "rotary.inv_freq":
        return tensor if rank == 0 else None
    chunk = -(-tensor.shape[0] // ranks)
    return tensor[rank * chunk : (rank + 1) * chunk]


def _group(ranks: int, replicas: int):
    """Every member joined (each in its own thread, as each is its own process in a job):
    ``(memberships of the ranks, memberships of the replicas, the store server)``."""
    port = free_port()
    address = WeightGroupAddress("127.0.0.1", port, ranks, replicas, 30.0)
    server = serve_store("127.0.0.1", port, ranks + replicas, 30.0)
    out: dict = {}

    def member(key, **who):
        store = server if who.get("rank") == 0 else None
        out[key] = join(CPU, address, store=store, **who)

    threads = [
        threading.Thread(target=member, args=(("r", r),), kwargs={"rank": r}) for r in range(ranks)
    ]
    threads += [
        threading.Thread(target=member, args=(("e", e),), kwargs={"replica": e})
        for e in range(replicas)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return [out["r", r] for r in range(ranks)], [out["e", e] for e in range(replicas)], server


def _push(ranks_joined, state: dict, seq: int, bucket_bytes: int) -> list[int]:
    """Every rank sends push ``seq`` of ``state`` at once; returns the buckets each sent."""
    ranks = len(ranks_joined)
    shapes = [(name, tuple(t.shape)) for name, t in state.items()]
    sent = [0] * ranks

    def rank_sends(rank: int) -> None:
        def pieces_of(planned):
            held = ((s.name, _rows(s.name, state[s.name], rank, ranks)) for s in planned)
            return [(name, rows) for name, rows in held if rows is not None]

        sender = WeightSender(ranks_joined[rank], rank, "cpu", CPU, bucket_bytes)
        sent[rank] = sender.send(pieces_of, shapes, torch.bfloat16, seq)
        sender.wait()  # the bytes are out (a rank's next push would wait for them too)

    threads = [threading.Thread(target=rank_sends, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return sent


@pytest.mark.parametrize("ranks,replicas", [(1, 1), (2, 1), (2, 2)])
def test_every_replica_gets_the_whole_tensors_from_the_ranks_rows(ranks, replicas):
    ranks_joined, replicas_joined, _server = _group(ranks, replicas)
    receivers = [WeightReceiver(m) for m in replicas_joined]
    try:
        state = _state(1)
        # Buckets of about one layer: several buckets, none splitting a layer.
        sent = _push(ranks_joined, state, 0, bucket_bytes=64)
        assert sent[0] >= 3 and all(n >= 1 for n in sent)
        for receiver in receivers:
            got = [pair for bucket in receiver.take(0, timeout_s=30) for pair in bucket]
            assert [name for name, _ in got] == list(state)
            for name, tensor in got:
                assert tensor.dtype == torch.bfloat16
                assert torch.equal(tensor, state[name].to(torch.bfloat16)), name
            assert receiver.held_pushes() == 0
    finally:
        for receiver in receivers:
            receiver.stop()


def test_pushes_wait_tagged_until_taken_and_an_untaken_one_is_dropped():
    ranks_joined, (replica,), _server = _group(2, 1)
    receiver = WeightReceiver(replica)
    try:
        states = [_state(v) for v in range(3)]
        for seq, state in enumerate(states):  # nothing loads meanwhile: all three wait
            _push(ranks_joined, state, seq, bucket_bytes=1 << 20)
        assert receiver.held_pushes() == 3
        # The engine asks for push 1 (push 0 was never asked for: dropped, not mixed in).
        got = dict(pair for bucket in receiver.take(1, timeout_s=30) for pair in bucket)
        for name, tensor in states[1].items():
            assert torch.equal(got[name], tensor.to(torch.bfloat16)), name
        assert receiver.held_pushes() == 1  # push 2, still waiting for its rollout
        got = dict(pair for bucket in receiver.take(2, timeout_s=30) for pair in bucket)
        assert torch.equal(got["model.norm.weight"], states[2]["model.norm.weight"].bfloat16())
    finally:
        receiver.stop()


def test_a_push_that_never_comes_times_out_naming_the_key():
    _, (replica,), _server = _group(1, 1)
    receiver = WeightReceiver(replica)
    try:
        with pytest.raises(TimeoutError, match="run.collective_timeout_s"):
            next(iter(receiver.take(0, timeout_s=0.2)))
    finally:
        receiver.stop()


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
