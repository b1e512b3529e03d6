"""An engine replica's side of the weight push (mixed into ``EngineHost``): each way new
weights arrive wakes the engine's weights first (its KV cache stays asleep), so the push
needs no call of its own for that.

- colocated vLLM engines: through vLLM's weight-transfer API, training rank 0 opening the
  update, handing over each chunk its ranks packed on their devices and closing it
  (``start_transfer`` / ``receive_chunk`` / ``finish_transfer``;
  ``trainer.loop.weights.weight_push.WeightPush.push_transfer``);
- colocated HF engines: shared buckets or a streamed push from their own tp group's ranks;
- engines of their own: a push through the transfer group (``load_pushed``) or a host-memory
  snapshot (``load_host_buckets``);
- the engine in the rank's own process (``ray.in_process``): its tensors, copied once.

The host's calls into its peer replicas for a snapshot or a push (``load_into_peers``) and the
reading of a snapshot's buckets (``read_snapshot_bucket``) are here too.
"""

from __future__ import annotations

import numpy as np
import torch

import hal
from trainer.loop.cluster.local import fetch


class EngineWeights:
    """The weight-loading calls of an engine replica (``self.engine``, ``self.replica``)."""

    def settle_server(self) -> None:
        """Wait until no decode batch runs on the engine: nothing to wait for without an
        engine server (``EngineHost.settle_server`` waits for its own)."""

    def wake_weights(self) -> None:
        """Before new weights go in: the engine idle (``settle_server``), its weights awake
        (its KV cache stays asleep)."""
        self.settle_server()
        self.engine.wake_up(["weights"])

    def load_shared_bucket(self, handles: list, specs: list) -> int:
        """Load one bucket of new weights that this replica's training ranks put in memory
        shared with this process (``trainer.loop.ranks.policy.PolicyWorker.push_weights``);
        returns the tensor count. The weights are woken first when they sleep, so the sync
        needs no call of its own for that (the KV cache stays asleep)."""
        from rollout.engines.weights.buckets import TensorSpec

        specs = [TensorSpec(*s) for s in specs]
        self.wake_weights()
        self.engine.load_shared_bucket(hal.open_shared_buffer, handles, specs)
        return len(specs)

    def load_weight_stream(self, slots: list, doorbell: tuple, buckets: list) -> int:
        """Load a whole streamed weight push in this one call (``rollout.engines.weights.stream``):
        ``buckets`` in order from the staging ``slots`` this replica's training ranks fill on
        their devices, each once every tp rank has written it. Wakes the weights first;
        returns the tensor count."""
        from rollout.engines.weights.stream import receive_weight_stream

        self.wake_weights()
        return receive_weight_stream(self.engine, hal.open_shared_buffer, slots, doorbell, buckets)

    def load_host_buckets(self, refs: list, specs: list) -> int:
        """Load a host-memory snapshot of the weights (``Trainer.snapshot_weights``: per
        training rank, ``refs`` to its flat byte buckets in Ray's object store and each
        bucket's tensor specs), one bucket at a time: every rank's bucket b, read here from
        this node's copy, joined into whole tensors (``assemble_pieces``). Returns the tensor
        count."""
        self.wake_weights()
        count = 0
        for bucket in range(len(refs[0])):
            named = read_snapshot_bucket(refs, specs, bucket)
            self.engine.update_weights(named)
            count += len(named)
        self.engine.finish_weight_update()
        return count

    def join_weight_group(self, address) -> None:
        """Take part in the push at ``address`` as this replica (``trainer.loop.weights.
        weight_group``): its engine joins the transfer group at its first push."""
        from trainer.loop.weights.weight_group import PushReceiver, connect_store

        self.push_receiver = PushReceiver(connect_store(address), address, self.replica)

    def load_pushed(self, seq: int) -> int:
        """Load push ``seq`` into the engine through its transfer API (``PushReceiver``).
        Returns the tensor count."""
        self.wake_weights()
        return self.push_receiver.receive(self.engine, seq)

    def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Load new weights handed over in this process (``ray.in_process``: the training
        rank's own tensors, copied once into the engine); wakes them first, as
        ``load_shared_bucket`` does. Returns the tensor count."""
        self.wake_weights()
        self.engine.update_weights(named_tensors)
        return len(named_tensors)

    def update_weights(self, bucket: dict[str, np.ndarray]) -> int:
        """Load one bucket of new weights (HF names -> arrays) sent through Ray's object
        store: the path before in-node sync, kept for ``bench e2e``'s comparison only. Wakes
        the weights first, as ``load_shared_bucket`` does."""
        self.wake_weights()
        self.engine.update_weights(
            (name, torch.from_numpy(array)) for name, array in bucket.items()
        )
        return len(bucket)

    def start_transfer(self) -> None:
        """Open a push through the engine's weight-transfer API (colocated vLLM engines,
        ``Layout.weight_transport == "ipc"``): wake the weights, start the update."""
        self.wake_weights()
        self.engine.begin_transfer()

    def receive_chunk(self, update_info: dict) -> int:
        """Load one chunk of the push (``update_info``: the transfer engine's fields, its
        buffers' handles included); returns its tensor count."""
        return self.engine.receive_chunk(update_info)

    def finish_transfer(self) -> None:
        """Close the push: every layer post-processed, the prefix cache reset."""
        self.engine.end_transfer()

    def abort_transfer(self) -> None:
        """Reset a push that failed midway (``VLLMTransfer.abort_transfer``), so the next
        push's ``start_transfer`` finds the engine out of any update."""
        self.engine.abort_transfer()


def load_into_peers(
    peers: list, router, replicas, method: str, args: tuple, meanwhile=None
) -> None:
    """Call ``method(*args)`` (a load of new weights: ``EngineHost.load_host_buckets`` for a
    host-memory snapshot, ``EngineHost.load_pushed`` for a collective push) on peer replicas
    ``replicas`` (indices; ``peers[i - 1]`` is replica i's handle) at once, run
    ``meanwhile()`` (the host's own load), and wait. A replica the router (``ReplicaRouter``)
    has lost is skipped; one whose process dies while loading is marked lost there, so its
    prompts go to the others."""
    import ray

    live = [i for i in replicas if not router.is_lost(i)]
    calls = [(i, getattr(peers[i - 1], method).remote(*args)) for i in live]
    if meanwhile is not None:
        meanwhile()
    for i, call in calls:
        try:
            fetch(call)
        except ray.exceptions.RayActorError:
            router.mark_lost(i)


def read_snapshot_bucket(refs: list, specs: list, bucket: int) -> list:
    """Bucket ``bucket`` of a host-memory snapshot (``Trainer.snapshot_weights``: ``refs[r]``
    and ``specs[r]``, training rank r's buckets and their tensor specs) as whole named tensors:
    every rank's piece read from this node's copy, joined (``assemble_pieces``)."""
    import warnings

    import ray
    import torch

    from rollout.engines.weights.buckets import TensorSpec, assemble_pieces, unpack_bucket

    arrays = ray.get([rank_refs[bucket] for rank_refs in refs])
    with warnings.catch_warnings():  # Ray's arrays are read-only; the engine copies
        warnings.simplefilter("ignore", UserWarning)
        flats = [torch.from_numpy(array) for array in arrays]
    return assemble_pieces(
        [
            unpack_bucket(flat, [TensorSpec(*s) for s in rank_specs[bucket]])
            for flat, rank_specs in zip(flats, specs)
        ]
    )
