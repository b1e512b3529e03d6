"""A peer engine replica's actor handle seen as an ``Engine`` by the rollout host's router
(``rollout.engines.router``): its ``generate`` waits for the peer, and a peer whose process is
gone raises ``ReplicaLostError``, so the router deals its requests to the others. Loading new
weights into the peers skips lost ones the same way
(``trainer.loop.weights.engine_weights.load_into_peers``).
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
