"""Lost engine replicas are replaced between a rollout and the weight sync.

When a peer replica's process dies mid-rollout, the rollout host deals its unfinished requests
to the surviving replicas (``rollout.engines.serving.router``) and names it in the rollout's metadata
(``lost_replicas``). The controller then, in two calls:

- ``start(meta)``, right after the rollout and before the engines sleep: counts the losses
  against ``rollout.max_replica_failures``, drops the dead handle (``Trainer.replicas[i]``
  is None meanwhile, so nothing calls it) and starts a new ``EngineHost`` with the same
  replica index on the same bundle (``Spawner.replica``); its ``setup`` is submitted, not
  waited for, so the engine loads while the ranks train;
- ``rejoin()``, before the weight sync: waits for the setup, puts the replica back at its
  index and reconnects the rollout host's peers (``RolloutHost.connect``), so the sync loads
  the current weights into it as into every replica.

Colocated engines: the sync pushes to every replica in ``Trainer.replicas``, the replacement
included; it is put to sleep first, as the others are, so the sync's wake-ups apply to it, and
the ranks drop the CPU sync's shared buffer, whose name is gone, so the push makes one it can
map (``WeightPush.drop_host_buffer``).
Engines on devices of their own: the rollout host is busy with queued rollouts, so
``connect`` is queued behind them (not waited for) and names the replacement ``waiting``: it
serves only after the host has loaded the next snapshot into it (``take_weights``), which the
rollout queued right after it carries; until then the others serve its prompts. In one
process (``ray.in_process``) there is one replica and nothing to replace. With the push
through the engines' transfer API (``rollout.weight_transport``) training rank 0 names the
transfer group's next generation and every member, the replacement included, joins it before
its next push (``trainer.loop.weights.driver.rejoin_weight_group``): no worker restarts.
"""

from __future__ import annotations

from typing import Any

from trainer.loop.cluster.group import WorkerFailedError, agree_on_settings, wait_all
from trainer.loop.weights.driver import rejoin_weight_group


class ReplicaReplacer:
    """Replaces the engine replicas of ``job`` (a ``Trainer``) that its rollouts lost."""

    def __init__(self, job) -> None:
        self.job = job
        self.lost_total = 0  # replicas lost in this run so far
        self.pending: dict[int, tuple[Any, Any]] = {}  # index -> (new handle, setup ref)

    def start(self, meta: dict[str, Any]) -> None:
        """Start replacing the replicas a rollout (``meta``, its metadata) lost; raises
        ``WorkerFailedError`` naming ``rollout.max_replica_failures`` past the bound."""
        lost = [int(i) for i in meta.get("lost_replicas", ())]
        if not lost:
            return
        self.lost_total += len(lost)
        bound = self.job.cfg.rollout.max_replica_failures
        if self.lost_total > bound:
            raise WorkerFailedError(
                f"engine replica(s) {lost} lost; {self.lost_total} lost in this run, more than "
                f"rollout.max_replica_failures={bound}; raise it to replace more"
            )
        import ray

        job = self.job
        for index in lost:
            dead = job.replicas[index]
            if dead is not None:
                ray.kill(dead, no_restart=True)  # gone already; frees its bundle share at once
            job.replicas[index] = None
            handle = job.spawner.replica(index)
            self.pending[index] = (handle, handle.setup.remote())

    def rejoin(self) -> None:
        """Wait for the replacements' setup, put them back in ``Trainer.replicas`` and
        reconnect the rollout host's peers (nothing to do without replacements)."""
        if not self.pending:
            return
        job, indices = self.job, sorted(self.pending)
        infos = wait_all(
            [self.pending[i][1] for i in indices],
            [f"engine replica {i} (replacement)" for i in indices],
            timeout_s=job.limits.setup_s,
            what="rollout.setup",
        )
        reference = job.replica_info[0].get("deterministic", {})
        for index, info in zip(indices, infos):
            # The same deterministic switches as the replica it replaces, or the run's
            # fingerprints could move.
            agree_on_settings(
                [
                    ("engine replica 0", reference),
                    (f"engine replica {index}", info.get("deterministic", {})),
                ]
            )
            job.replicas[index] = self.pending[index][0]
            job.replica_info[index] = info
        self.pending = {}
        if job.layout.separate:
            # The transfer group rebuilt without the dead (nothing without one).
            rejoin_weight_group(job, indices)
            # Queued behind the host's rollouts: the replacement serves from its next snapshot.
            job.rollout.connect.remote(job.replicas[1:], indices)
            return
        # the CPU sync's buffer: a fresh one it can map
        job.actor.call("drop_host_buffer", timeout_s=job.limits.setup_s)
        fresh = [job.replicas[i] for i in indices]
        # Asleep as the other replicas are now; the sync wakes its weights, then its KV cache.
        calls = [h.sleep.remote(True) for h in fresh]
        calls.append(job.rollout.connect.remote(job.replicas[1:]))
        wait_all(
            calls,
            [f"engine replica {i}" for i in indices] + ["engine replica 0"],
            timeout_s=job.limits.setup_s,
            what=["rollout.sleep"] * len(fresh) + ["rollout.connect"],
        )
