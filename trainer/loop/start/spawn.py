"""Creating a job's workers: each training role's ranks and the engine replicas, as Ray actors
on their ranks' bundles, or, in one process (``ray.in_process``), as the objects themselves
behind ``LocalHandle``s. Nothing here calls a worker's ``setup``; the controller does, after
every worker exists, so their processes boot side by side."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from trainer.config.schema import Config
from trainer.loop.cluster.group import CALL_TIMEOUT_S, Placement, WorkerGroup


@dataclass
class Spawner:
    """Makes the workers of ``cfg`` placed as ``layout`` (``trainer.loop.plan.layout``) says, on
    ``placement``'s bundles (None in one process), for device ``backend``."""

    cfg: Config
    layout: Any
    placement: Placement | None
    backend: Any
    in_process: bool

    def spawn(
        self,
        cls,
        rank: int,
        share: float,
        *args,
        env: dict | None = None,
        engine=None,
        actor: dict | None = None,
    ):
        """A worker of class ``cls`` built with ``args``: a Ray actor on training rank
        ``rank``'s bundle (or, ``engine`` given, on that engine replica's own first bundle)
        taking ``share`` of its device (``env``: its extra environment; ``actor``: options of
        its actor class, e.g. concurrency groups), or, in one process, the object itself behind
        a ``LocalHandle``."""
        if self.in_process:
            from trainer.loop.cluster.local import LocalHandle

            return LocalHandle(cls(*args))
        import ray

        from trainer.loop.cluster.group import actor_options

        strategy, kind = None, ""
        if engine is not None:
            strategy = self.placement.engine_strategy(engine)
            kind = self.placement.engine_resource
        opts = actor_options(self.placement, rank, share, strategy=strategy, resource=kind)
        if env is not None:
            opts["runtime_env"] = {"env_vars": env}
        actor_class = ray.remote(**actor)(cls) if actor else ray.remote(cls)
        return actor_class.options(**opts).remote(*args)

    def group(self, role: str) -> WorkerGroup:
        """The workers of training role ``role``, one per rank."""
        from trainer.loop.ranks.critic import CriticWorker
        from trainer.loop.ranks.policy import PolicyWorker
        from trainer.loop.ranks.spec import WorkerSpec

        cfg, dp = self.cfg, self.cfg.train.dp_size
        cls = CriticWorker if role == "critic" else PolicyWorker
        # CPU: the ranks split the cores, less the engines' own when they have some.
        cores = max(1, (os.cpu_count() or 1) - self.cfg.rollout.engine_devices)
        threads = max(1, cores // dp) if self.backend.name == "cpu" else 4
        env = self.process_env(self.backend, role) or None
        handles = [
            self.spawn(
                cls,
                rank,
                self.layout.shares[role],
                WorkerSpec(role=role, rank=rank, cfg=cfg, threads=threads),
                env=env,
            )
            for rank in range(dp)
        ]
        return WorkerGroup(role, handles)

    def replicas(self, replay_dir: str | None = None) -> list:
        """One engine replica per tp group, on the group's first rank's bundle; replica 0 is
        the rollout host (agent loop, prompts) and deals requests to the others. With
        ``replay_dir``, one host that replays recorded rollouts instead."""
        from trainer.loop.engines.replay_host import ReplayHost

        layout = self.layout
        own = 0 if layout.separate else None  # the engines' own bundles, when they have them
        if replay_dir is not None:
            return [self.spawn(ReplayHost, 0, layout.shares["rollout"], replay_dir, engine=own)]
        return [self.replica(rep.index) for rep in layout.replicas]

    def replica(self, index: int):
        """Engine replica ``index`` of the layout, on its tp group's first rank's bundle (its
        own bundle when separate): the rollout host for 0, else an ``EngineHost``. Also how a
        lost replica is started again in its place (``trainer.loop.schedule.replicas``)."""
        from trainer.loop.engines.engine_host import EngineHost
        from trainer.loop.engines.remote_engine import peer_actor_options
        from trainer.loop.engines.rollout_host import RolloutHost

        cfg, layout, backend = self.cfg, self.layout, self.engine_backend()
        rep = layout.replicas[index]
        share = layout.shares["rollout"]
        # CPU: the replicas split the cores (their own ones, when separate); an
        # accelerator's engine uses few of them.
        cpus = cfg.rollout.engine_devices or os.cpu_count() or 1
        threads = max(1, cpus // len(layout.replicas)) if backend.name == "cpu" else 4
        env = None
        if backend.is_accelerator:
            # The replica's process sees exactly its tp group's devices (Ray would
            # show it only its own bundle's) plus what the device's engine needs.
            ids = [i for b in range(rep.tp) for i in self._device_ids(rep, b)]
            env = {**backend.engine_env(ids), **self.process_env(backend, "engine")}
        cls = RolloutHost if rep.index == 0 else EngineHost
        first = rep.ranks[0] if rep.ranks else 0
        engine = rep.index if layout.separate else None
        # a peer of a stream takes interrupts beside its call in flight (RemoteEngine)
        actor = peer_actor_options(cfg) if rep.index else None
        return self.spawn(
            cls, first, share, cfg, threads, rep.index, env=env, engine=engine, actor=actor
        )

    def process_env(self, backend, kind: str) -> dict[str, str]:
        """What every process of ``kind`` starts with: its collectives' ports (``port_env``)
        and the device library's watchdog at ``run.collective_timeout_s``."""
        timeout_s = self.cfg.run.collective_timeout_s
        return {**self.port_env(backend, kind), **backend.collective_timeout_env(timeout_s)}

    def port_env(self, backend, kind: str) -> dict[str, str]:
        """What the processes of ``kind`` (a training role, or ``engine``) start with so that
        their collectives' ports stay apart from the other kinds' on a shared device: one slot
        per kind, the roles in ``layout.roles`` order, then the engine
        (``DeviceBackend.process_port_env``; empty where the device needs none)."""
        kinds = (*self.layout.roles, "engine")
        return backend.process_port_env(kinds.index(kind))

    def engine_backend(self):
        """The engine replicas' backend: the trainer's, or, with ``rollout.device`` naming
        another, that one's class (its devices are on other nodes: nothing is asked of them
        here)."""
        import hal

        if not self.layout.other_engine_device:
            return self.backend
        return hal.backend_class(self.layout.engine_device)()

    def _device_ids(self, rep, bundle: int) -> list[str]:
        """Ray's device ids of tp rank ``bundle`` of replica ``rep``: its training rank's
        bundle when colocated, else its own."""
        from trainer.loop.cluster.group import bundle_device_ids

        if self.layout.separate:
            strategy = self.placement.engine_strategy(rep.index, bundle)
            return bundle_device_ids(self.placement, 0, timeout_s=CALL_TIMEOUT_S, strategy=strategy)
        return bundle_device_ids(self.placement, rep.ranks[bundle], timeout_s=CALL_TIMEOUT_S)
