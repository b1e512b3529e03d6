"""The weight push's driver side: what the controller asks of the ranks and the engines so that
the actor's new weights reach every engine replica.

- ``join_weight_group``: at start-up, with the push through the engines' transfer API
  (``rollout.weight_transport``), every training rank and engine replica take the push's
  address (``weight_group``); ``rejoin_weight_group``: after a lost replica is replaced;
- ``snapshot_weights``: after an update, for engines on devices of their own: the ranks push
  through the weight group, or put a host-memory snapshot in the object store
  (``WeightPush.snapshot_weights``); the pipeline hands it to the rollout host;
- ``sync_weights``: load the new weights into the engines now: colocated vLLM engines
  through vLLM's weight-transfer API (``WeightPush.push_transfer``), other colocated engines
  from their own tp group's ranks (``WeightPush.push_weights``), engines of their own load a
  snapshot.

``job`` is the controller's ``Trainer``: its ``cfg``, ``layout``, ``actor``, ``replicas``,
``rollout`` (replica 0), ``replay_dir``, ``limits`` and ``pushes`` are read here.
"""

from __future__ import annotations

import time

from trainer.loop.cluster.group import wait_all

__all__ = ["join_weight_group", "rejoin_weight_group", "snapshot_weights", "sync_weights"]


def join_weight_group(job) -> None:
    """With the push through the engines' transfer API (``Layout.weight_transport``):
    training rank 0 serves the push's control store, every rank and every engine replica
    take its address (``job.weight_address``; the transfer group forms at the first push,
    ``trainer.loop.weights.weight_group``); pushes are numbered from 0 again."""
    job.pushes = 0
    job.weight_address = None
    if job.layout.weight_transport != "collective" or job.replay_dir is not None:
        return
    cfg, limits = job.cfg, job.limits
    (address,) = wait_all(
        [
            job.actor.handles[0].weight_group_address.remote(
                len(job.replicas), cfg.run.collective_timeout_s
            )
        ],
        ["actor rank 0"],
        timeout_s=limits.setup_s,
        what="actor.weight_group_address",
    )
    job.weight_address = address
    refs = job.actor.submit("join_weight_group", address)
    refs += [h.join_weight_group.remote(address) for h in job.replicas]
    names = job.actor.names + [f"engine replica {i}" for i in range(len(job.replicas))]
    wait_all(refs, names, timeout_s=limits.setup_s, what="join_weight_group")


def rejoin_weight_group(job, indices: list[int]) -> None:
    """Replicas ``indices`` replaced: training rank 0 leaves the dead ones out of the transfer
    group (its sender builds the next generation without them) and the replacements take the
    push's address; the rollout host lets them in when it connects them, before they load
    (``RolloutHost.connect``). Nothing to do with host snapshots."""
    if getattr(job, "weight_address", None) is None:
        return
    calls = [job.actor.handles[0].exclude_from_weight_group.remote(list(indices))]
    calls += [job.replicas[i].join_weight_group.remote(job.weight_address) for i in indices]
    names = ["actor rank 0"] + [f"engine replica {i} (replacement)" for i in indices]
    wait_all(calls, names, timeout_s=job.limits.setup_s, what="rejoin_weight_group")


def snapshot_weights(job) -> list | None:
    """The actor's new weights for engines of their own, as ``RolloutHost.take_weights``
    finds them: pushed through the engines' transfer API (``rollout.weight_transport``:
    every rank gathers, rank 0 keeps a copy and broadcasts it to every engine worker when
    the rollout that asks for it loads it), ``[PUSHED, push number]``; else in host memory, ``[bucket refs, bucket
    specs]``, each indexed by rank, then bucket (every rank publishes its own rows,
    ``WeightPush.snapshot_weights``); None when replaying (no engine)."""
    if job.replay_dir is not None:
        return None
    if job.layout.weight_transport == "collective":
        from trainer.loop.weights.weight_group import PUSHED

        seq, job.pushes = job.pushes, job.pushes + 1
        # every rank leaves the push before together, then gathers the next one together
        job.actor.call("finish_push", timeout_s=job.limits.push_s)
        job.actor.call("broadcast_weights", seq, timeout_s=job.limits.push_s)
        return [PUSHED, seq]
    parts = job.actor.call("snapshot_weights", timeout_s=job.limits.push_s)
    return [[refs for refs, _ in parts], [specs for _, specs in parts]]


def sync_weights(job, *, via_object_store: bool = False) -> None:
    """Load the actor's new weights into the engines: colocated engines take them from the
    ranks on their own devices (vLLM's through its weight-transfer API, rank 0 driving every
    replica; the others from their tp group's ranks) and wake their weights (not their KV
    cache) as they load them (nothing to push when replaying); engines of their own load a snapshot
    of them from host memory. ``via_object_store``: the earlier path through Ray's object
    store, for ``bench e2e``. The push's seconds set later pushes' limit
    (``CallLimits.observe``)."""
    if job.replay_dir is not None:
        return
    started = time.monotonic()
    if job.layout.separate:  # engines of their own: a host-memory snapshot, loaded now
        wait_all(
            [job.rollout.take_weights.remote([None, *snapshot_weights(job)])],
            ["rollout host"],
            timeout_s=job.limits.push_s,
            what="rollout.take_weights",
        )
    elif job.layout.weight_transport == "ipc" and not via_object_store:
        # colocated vLLM engines, through vLLM's weight-transfer API: rank 0 drives every
        # replica; each replica's workers map the buffers their own devices' ranks pack
        job.actor.call("push_transfer", list(job.replicas), timeout_s=job.limits.push_s)
    else:
        owner = [job.replicas[job.layout.replica_of_rank(r)] for r in range(job.cfg.train.dp_size)]
        job.actor.call(
            "push_weights", None, via_object_store, per_rank=owner, timeout_s=job.limits.push_s
        )
    job.limits.observe("push", time.monotonic() - started)  # later pushes' limit
