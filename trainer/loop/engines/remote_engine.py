"""A peer engine replica's actor handle seen as an ``Engine`` by the rollout host's router
(``rollout.engines.router``): its ``generate`` waits for the peer, and a peer whose process is
gone raises ``ReplicaLostError``, so the router deals its requests to the others. Loading a
weight snapshot or push into the peers (engines on devices of their own) skips lost ones the
same way.
"""

from __future__ import annotations

from rollout.engines.base import Engine
from rollout.engines.router import ReplicaLostError
from trainer.loop.cluster.local import fetch


class RemoteEngine(Engine):
    """An ``EngineHost`` actor (``handle``, engine replica ``replica``) seen as an ``Engine``."""

    def __init__(self, handle, replica: int | None = None) -> None:
        self.handle = handle
        self.replica = replica

    def generate(self, requests, sampling):
        """Generate on the remote replica and wait for it; ``ReplicaLostError`` when its
        process died (before or during the call)."""
        import ray

        try:
            return fetch(self.handle.generate.remote(requests, sampling))
        except ray.exceptions.RayActorError as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ReplicaLostError(f"engine replica {self.replica} is lost: {first}") from err

    def update_weights(self, named_tensors) -> None:
        """Not here: the replica's own training ranks sync it."""
        raise NotImplementedError("engine replicas are synced by their own training ranks")


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

    from rollout.engines.buckets import TensorSpec, assemble_pieces, unpack_bucket

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
