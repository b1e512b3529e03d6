"""Several engine replicas behind one ``Engine``: requests are dealt to replicas by prompt.

Every sample and every turn of one prompt (``GenerationRequest.group``, the prompt's index in
the run's prompt stream) goes to replica ``deal_prompt(group, replicas)``: the choice depends
on the prompt only, never on timing or load, so a run is reproducible, and the samples of a
group share one replica's prefix cache. Each replica gets its share in one ``generate`` call,
all replicas at once; results come back in request order. The agent loop's batcher does not
wait for that: it sees the replicas as lanes (``lanes``, ``lane_of``) and keeps one call in
flight on each, so a slow replica delays only its own prompts.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from rollout.engines.base import Engine, GenerationRequest, GenerationResult, SamplingParams


def deal_prompt(prompt_index: int, num_replicas: int) -> int:
    """The replica that serves every sample and turn of prompt ``prompt_index``: round robin,
    so a step's consecutive prompts spread evenly over the replicas."""
    return int(prompt_index) % num_replicas


class ReplicaRouter(Engine):
    """``replicas[i].generate`` serves the requests dealt to replica i (see the module
    docstring). Weights and memory are each replica's own business (the trainer syncs every
    replica directly), so those methods are not routed."""

    def __init__(self, replicas: Sequence[Engine]) -> None:
        if not replicas:
            raise ValueError("ReplicaRouter needs at least one engine replica")
        self.replicas = list(replicas)
        self._pool = ThreadPoolExecutor(max_workers=len(self.replicas))

    def generate(
        self, requests: list[GenerationRequest], sampling: SamplingParams
    ) -> list[GenerationResult]:
        """Deal the requests, generate on every replica at once, return results in order."""
        count = len(self.replicas)
        shares: list[list[int]] = [[] for _ in range(count)]
        for i, req in enumerate(requests):
            shares[deal_prompt(req.group, count)].append(i)
        futures = [
            self._pool.submit(engine.generate, [requests[i] for i in share], sampling)
            for engine, share in zip(self.replicas, shares)
            if share
        ]
        results: list[GenerationResult | None] = [None] * len(requests)
        for share, future in zip([s for s in shares if s], futures):
            for i, res in zip(share, future.result()):
                results[i] = res
        return results  # type: ignore[return-value]

    def lanes(self) -> list[Engine]:
        """One lane per replica: a batching caller serves each replica's share on its own,
        so the slowest replica does not hold up the others' next turns."""
        return list(self.replicas)

    def lane_of(self, group: int) -> int:
        """The replica ``deal_prompt`` gives prompt ``group``."""
        return deal_prompt(group, len(self.replicas))

    def update_weights(self, named_tensors) -> None:
        """Not routed: each replica is synced from its own tp group of training ranks."""
        raise NotImplementedError("sync each engine replica directly, not through the router")

    def shutdown(self) -> None:
        """Stop the dispatch threads (the replicas are shut down by their owners)."""
        self._pool.shutdown(wait=False)
