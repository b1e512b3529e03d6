"""A colocated vLLM push that fails midway (issue 56, items 1 and 4;
``trainer.loop.weights.colocated_push``): a replica whose chunk raised ends the push on every
rank at once with one line, and every replica is reset, so the next push works.

The engines are the shipped ``VLLMEngine`` (its ``VLLMTransfer`` calls) around a fake of
``vllm.LLM`` whose workers keep the update state as the pinned wheels' do (read in the wheels):

- vLLM 0.24.0 ``v1/worker/gpu_worker.py`` ``Worker.start_weight_update`` /
  ``update_weights`` / ``finish_weight_update`` (and 0.26.0's, 0.32.0's alike): a chunk that
  raises clears ``_weight_update_active`` but leaves the layerwise reload open (its layers on
  the meta device); ``finish_weight_update`` then raises "without a matching start";
- vllm-ascend 0.26.0rc1 ``worker/worker.py`` ``NPUWorker``: a chunk that raises leaves
  ``_weight_update_active`` set, so every later ``start_weight_update`` raises "already
  active".

The ranks are two gloo processes pushing through the CPU's ``crossrl_shm`` helper (its
per-chunk barrier is where rank 1 waited for the collective timeout before the fix).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import hal
from rollout.engines.base import WAKE_TAGS
from tests.gloo_ranks import finish_rank
from trainer.loop.cluster.group import free_port
from trainer.loop.cluster.local import LocalHandle
from trainer.loop.weights.colocated_push import ColocatedPush
from trainer.loop.weights.engine_weights import EngineWeights

WORLD = 2
#: Bytes of the push's one buffer: the state below takes several chunks of it.
BUFFER_BYTES = 64


def _state(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return {f"model.layers.{i}.weight": torch.randn(3, 4, generator=gen) for i in range(4)}


class FakeWorkers:
    """``vllm.LLM``'s weight-transfer calls over workers that keep the update state as the
    pinned release ``style`` does (module docstring). ``reload_open``: the layerwise reload is
    open (the layers sit on the meta device); ``fail_at``: the chunk (1-based, counted over
    the engine's life) whose load raises."""

    def __init__(self, style: str, fail_at: int | None = None) -> None:
        self.style, self.fail_at = style, fail_at
        self.active = self.reload_open = False
        self.params: dict[str, torch.Tensor] = {}
        self.chunks = 0

    def start_weight_update(self) -> None:
        if self.active:
            raise RuntimeError(
                "start_weight_update called while a weight update is already active. "
                "Call finish_weight_update first."
            )
        self.active = self.reload_open = True

    def update_weights(self, request: dict) -> None:
        from rollout.engines.weights.shm_transfer import SharedUpdateInfo, load_chunk

        if not self.active:
            raise RuntimeError("start_weight_update must be called before update_weights.")
        self.chunks += 1
        try:
            if self.chunks == self.fail_at:
                raise ValueError(f"chunk {self.chunks} fell over")
            load_chunk(SharedUpdateInfo(**request["update_info"]), self.params.update)
        except BaseException:
            if self.style == "vllm":  # gpu_worker: the flag is cleared, the reload stays open
                self.active = False
            raise

    def finish_weight_update(self) -> None:
        if not self.active:
            raise RuntimeError(
                "finish_weight_update called without a matching start_weight_update."
            )
        self.active = self.reload_open = False

    def reset_prefix_cache(self) -> None:
        pass


def _engine(llm: FakeWorkers):
    from rollout.engines.vllm.engine import VLLMEngine

    engine = VLLMEngine.__new__(VLLMEngine)
    engine.llm, engine.layerwise_reload, engine.in_process = llm, True, True
    engine.sleep_mode, engine._awake, engine.adapter = False, set(WAKE_TAGS), None
    engine._updating = engine._weights_discarded = False
    return engine


class Replica(EngineWeights):
    """An engine replica's weight calls (``EngineHost``'s), on ``engine``."""

    def __init__(self, engine) -> None:
        self.engine = engine


class Rank(ColocatedPush):
    """A training rank's colocated push on the CPU, pushing ``state``."""

    def __init__(self, rank: int, world: int) -> None:
        cfg = SimpleNamespace(model=SimpleNamespace(dtype="float32"))
        self.spec = SimpleNamespace(rank=rank, world_size=world, cfg=cfg)
        self.backend = hal.get_backend("cpu")
        self.state = _state(1)

    def push_state(self) -> dict[str, torch.Tensor]:
        return self.state


@pytest.mark.parametrize("style", ["vllm", "ascend"])
def test_a_failed_chunk_resets_the_replica_and_the_next_push_works(style):
    """One rank, two replicas, one of which fails the push's second chunk: the push raises
    one line naming that error, both replicas are out of the update (no layer left on the
    meta device, no flag left set), and the next push loads every tensor into both."""
    rank = Rank(0, 1)
    bad, good = FakeWorkers(style, fail_at=2), FakeWorkers(style)
    replicas = [LocalHandle(Replica(_engine(llm))) for llm in (good, bad)]
    with pytest.raises(RuntimeError) as failed:
        rank.push_transfer(replicas, BUFFER_BYTES)
    said = str(failed.value)
    assert "\n" not in said and "ValueError: chunk 2 fell over" in said, said
    for llm in (good, bad):
        assert not llm.active and not llm.reload_open, llm.style
    rank.state = _state(2)
    assert rank.push_transfer(replicas, BUFFER_BYTES) == 4  # one tensor of 48 bytes a chunk
    for llm in (good, bad):
        assert not llm.active and not llm.reload_open
        assert set(llm.params) == set(rank.state)
        for name, tensor in rank.state.items():
            assert torch.equal(llm.params[name], tensor), name


def test_a_replica_that_cannot_start_leaves_no_other_mid_update():
    """A replica wedged before the push (its flag left set) fails ``start_transfer``; the
    replica that did start is reset with it, and the push says which call failed."""
    rank = Rank(0, 1)
    wedged, fine = FakeWorkers("ascend"), FakeWorkers("ascend")
    wedged.active = True
    engine = _engine(wedged)
    engine._transfer_open = False  # opened outside crossrl: begin cannot know
    replicas = [LocalHandle(Replica(_engine(fine))), LocalHandle(Replica(engine))]
    with pytest.raises(RuntimeError, match="start_transfer failed: RuntimeError: start_weight"):
        rank.push_transfer(replicas, BUFFER_BYTES)
    assert not fine.active and not wedged.active
    assert rank.push_transfer(replicas, BUFFER_BYTES) == 4


def _two_ranks(rank: int, port: int, style: str) -> None:
    backend = hal.get_backend("cpu")
    # Before the fix rank 1 waited in the helper's barrier until this timeout.
    backend.init_process_group(rank, WORLD, master_addr="127.0.0.1", master_port=port, timeout_s=30)
    try:
        pusher = Rank(rank, WORLD)
        llm = FakeWorkers(style, fail_at=2)
        replicas = [LocalHandle(Replica(_engine(llm)))]  # called by rank 0 alone
        with pytest.raises(RuntimeError) as failed:
            pusher.push_transfer(replicas, BUFFER_BYTES)
        said = str(failed.value)
        assert "\n" not in said and "ValueError: chunk 2 fell over" in said, said
        if rank == 0:
            assert not llm.active and not llm.reload_open
        pusher.state = _state(3)
        sent = pusher.push_transfer(replicas, BUFFER_BYTES)
        if rank == 0:
            assert sent == 4 and not llm.active and not llm.reload_open
            for name, tensor in pusher.state.items():
                assert torch.equal(llm.params[name], tensor), name
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    finish_rank()


@pytest.mark.parametrize("style", ["vllm", "ascend"])
def test_a_replica_failing_midway_ends_the_push_on_every_rank_with_one_line(style):
    """Two ranks push in chunks of one buffer; the replica fails chunk 2. Both ranks run the
    helper's loop to its end (no rank left in its per-chunk barrier), both raise the replica's
    error as one line, the replica is reset, and the next push reaches it whole."""
    mp.spawn(_two_ranks, args=(free_port(), style), nprocs=WORLD, join=True)
