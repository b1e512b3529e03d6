"""Start-up of a training job: reserve devices, start the engine replicas and the training
workers, set them up, agree on their deterministic settings, resume from a checkpoint.

``start(job)`` fills a ``trainer.loop.schedule.controller.Trainer`` (``job``)'s workers; the
controller keeps the loop and the step.
"""

from __future__ import annotations

import sys
from typing import Any

from trainer.loop.cluster.group import WorkerGroup, agree_on_settings, wait_all


def start(job) -> None:
    """Reserve devices, start the engine replicas and training workers, resume if asked.

    Every actor is created before any is waited on, so their processes boot and import
    side by side; then every setup runs at once, except on an accelerator, where the
    engines take their share of device memory before the training ranks load theirs (an
    engine sizes its cache from the memory it finds free).
    """
    import hal
    from trainer.loop.cluster.startup import CLOCK
    from trainer.loop.plan.layout import runs_in_process
    from trainer.loop.start.spawn import Spawner

    cfg = job.cfg
    backend = hal.get_backend(cfg.device)
    job.in_process = runs_in_process(cfg, backend.name)
    _reserve(job, backend)
    job.use_ref = "reference" in job.layout.roles
    job.use_critic = "critic" in job.layout.roles
    CLOCK.done("placement")
    spawner = Spawner(cfg, job.layout, job.placement, backend, job.in_process)
    job.spawner = (
        spawner  # kept: a lost engine replica is started again (trainer/loop/schedule/replicas.py)
    )
    job.replicas = spawner.replicas(job.replay_dir)
    job.rollout = job.replicas[0]
    job.actor = spawner.group("actor")
    job.ref = spawner.group("reference") if job.use_ref else None
    job.critic = spawner.group("critic") if job.use_critic else None
    CLOCK.done("actors_created")
    replica_refs = [h.setup.remote() for h in job.replicas]
    replica_names = [f"engine replica {i}" for i in range(len(job.replicas))]
    if backend.is_accelerator:
        _setup_replicas(
            job,
            wait_all(
                replica_refs, replica_names, timeout_s=job.limits.setup_s, what="rollout.setup"
            ),
        )
        replica_refs, replica_names = [], []
    groups = job.all_groups()
    refs = {g.role: g.submit("setup", *_rendezvous(g)) for g in groups}
    answers = wait_all(
        replica_refs + [r for g in groups for r in refs[g.role]],
        replica_names + [n for g in groups for n in g.names],
        timeout_s=job.limits.setup_s,
        what="setup",
    )
    if replica_refs:
        _setup_replicas(job, answers[: len(replica_refs)])
    answers = answers[len(replica_refs) :]
    for group in groups:
        group.setup_info, answers = answers[: len(group.handles)], answers[len(group.handles) :]
        CLOCK.add_worker(group.role, group.setup_info[0].get("startup", {}))
    CLOCK.done("actors_setup")
    job.deterministic_settings = _agreed_deterministic_settings(job)
    # what each role's kernels are (rank 0's; every rank chose alike), for config.yaml
    job.kernels = {g.role: g.setup_info[0].get("kernels", {}) for g in job.all_groups()}
    resume(job)
    CLOCK.done("resume")
    _start_rollouts(job)


def _start_rollouts(job) -> None:
    """Engines on devices of their own join the weight group (the collective push); then the
    run's one stream-or-lag decision (``trainer.loop.schedule.rollouts``) gives ``job`` its
    pipeline, started with the weights the run starts from (None: each step samples its own
    rollout, in the step)."""
    from trainer.loop.schedule.rollouts import rollout_pipeline, start_pipeline
    from trainer.loop.weights.driver import join_weight_group

    if job.layout.separate:
        join_weight_group(job)
    job.pipeline = rollout_pipeline(job)
    if job.pipeline is not None:
        start_pipeline(job)


PLACEMENT_TRY_S = 5.0
"""Seconds one reservation may wait before the layout is planned again without the nodes
that do not answer (a node lost a moment ago is still listed alive for a while)."""
NODE_PROBE_S = 3.0
"""Seconds a node has to run a tiny task before it counts as lost (``unresponsive_nodes``)."""


def _reserve(job, backend) -> None:
    """Plan the layout on the cluster's live nodes and reserve its devices. Fails naming the
    key when the cluster cannot hold the job (``trainer/loop/plan/layout.py``). A reservation not
    granted within ``PLACEMENT_TRY_S`` is planned again without the nodes that do not answer
    a probe (``unresponsive_nodes``), until
    ``ray.placement_timeout_s``: after a lost node (``trainer.loop.start.restarts``) the run goes on
    with the nodes that are left."""
    import time

    import hal
    from trainer.loop.cluster.group import (
        WorkerFailedError,
        cluster_node_ids,
        cluster_node_table,
        cluster_nodes,
        make_placement,
        unresponsive_nodes,
    )
    from trainer.loop.plan.layout import plan_layout

    cfg, resource = job.cfg, backend.ray_resource
    deadline = time.monotonic() + cfg.ray.placement_timeout_s
    down: set[str] = set()  # nodes listed alive that did not answer
    while True:
        engine = _other_engine_device(cfg, backend.name)
        if engine is not None:  # rollout.device: the engines' devices are of another type
            node_ids, counts = cluster_node_table([resource, hal.RAY_RESOURCES[engine]], down)
            job.layout = plan_layout(
                cfg,
                counts[resource],
                resource,
                device=backend.name,
                engine_nodes=counts[hal.RAY_RESOURCES[engine]],
                engine_resource=hal.RAY_RESOURCES[engine],
                engine_device=engine,
            )
        else:
            nodes = [1] if job.in_process else cluster_nodes(resource, down)
            job.layout = plan_layout(cfg, nodes, resource, device=backend.name)
            node_ids = [] if job.in_process else cluster_node_ids(resource, down)
        if job.in_process:
            return
        if cfg.ray.address is not None:
            _check_snapshots(cfg, job.layout, node_ids)
        left = deadline - time.monotonic()
        try:
            job.placement = make_placement(
                resource, job.layout, timeout_s=min(PLACEMENT_TRY_S, left), node_ids=node_ids
            )
            return
        except WorkerFailedError as err:
            down |= unresponsive_nodes(NODE_PROBE_S)
            if left <= PLACEMENT_TRY_S:
                raise WorkerFailedError(
                    str(err).replace(
                        f"within {min(PLACEMENT_TRY_S, left):.0f} s",
                        f"within ray.placement_timeout_s={cfg.ray.placement_timeout_s:g} s",
                    ),
                    kind="raised",
                ) from err


def _check_snapshots(cfg, layout, node_ids: list[str]) -> None:
    """The live weight snapshots fit the object store of every node of the cluster joined
    that holds training ranks (each holds its ranks' rows, ``trainer.loop.plan.snapshot_budget``;
    ``node_ids[n]``: Ray's id of ``layout``'s node n); ``LayoutError`` when not."""
    from trainer.loop.plan.layout import LayoutError
    from trainer.loop.plan.model_shape import model_shape
    from trainer.loop.plan.snapshot_budget import node_object_store_bytes, snapshot_problem

    if layout.weight_transport != "host":  # colocated, or pushed through a collective
        return
    shape = model_shape(cfg.model.path)
    for node in sorted({n for n, _ in layout.rank_slots}):
        store = node_object_store_bytes(node_ids[node])
        if store is None:
            continue
        ranks = [r for r, (n, _) in enumerate(layout.rank_slots) if n == node]
        where = f"Ray node {node_ids[node][:8]}'s object_store_memory"
        problem = snapshot_problem(cfg, shape, store, where, ranks)
        if problem:
            raise LayoutError(problem)


def _other_engine_device(cfg, trainer_device: str) -> str | None:
    """The engines' backend name when ``rollout.device`` names another than the trainer's
    (``trainer_device``, resolved), else None. ``auto`` resolves on this machine."""
    import hal

    name = cfg.engine_device()
    if name == "auto":
        name = hal.get_backend("auto").name
    return None if name == trainer_device or not cfg.rollout.engine_devices else name


def _rendezvous(group: WorkerGroup) -> list:
    """References to rank 0's address and port, where a role's ranks meet (they may sit on
    several nodes); passed on unresolved, so no rank waits for the controller."""
    return group.handles[0].rendezvous_address.options(num_returns=2).remote()


def _setup_replicas(job, infos: list[dict[str, Any]]) -> None:
    """Keep the replicas' setup answers; with several, the rollout host deals to all."""
    from trainer.loop.cluster.startup import CLOCK

    job.rollout_info = infos[0]
    job.replica_info = infos
    job.limits.set_validation(infos[0].get("val_records", 0))  # the call limits' sizes
    job.limits.set_engines(infos)
    CLOCK.add_worker("rollout", infos[0].get("startup", {}))
    if len(job.replicas) > 1:
        wait_all(
            [job.rollout.connect.remote(job.replicas[1:])],
            ["engine replica 0"],
            timeout_s=job.limits.setup_s,
            what="rollout.connect",
        )


def resume(job) -> None:
    from trainer.records.checkpoint import LAYOUT, load_json, resolve_resume

    # run_training's preflight verified every file's sha256 seconds ago; sizes suffice here
    ckpt = resolve_resume(job.run_dir, job.cfg.run.resume, check_hashes=False)
    if ckpt is None:
        return
    job.resumed_from = ckpt
    state = load_json(ckpt / LAYOUT.trainer_state)
    for group in job.training_groups():
        group.call("load_pieces", str(ckpt), timeout_s=job.limits.checkpoint_load_s)
    job.start_step = int(state["step"])
    consumed = state.get("prompts_consumed", job.start_step * job.cfg.train.batch_size)
    wait_all(
        [job.rollout.set_prompts_consumed.remote(consumed)],
        ["rollout host"],
        timeout_s=job.limits.setup_s,
        what="rollout.set_prompts_consumed",
    )
    if not job.layout.separate:  # else the pipeline's first rollouts take a snapshot
        job.sync_weights()
    print(f"crossrl: resumed from {ckpt} (step {job.start_step})", file=sys.stderr)


def _agreed_deterministic_settings(job) -> dict[str, str]:
    """The deterministic settings every worker and the rollout engine's process applied,
    which must be the same everywhere (``agree_on_settings``)."""
    applied = [
        (name, info.get("deterministic", {}))
        for g in job.all_groups()
        for name, info in zip(g.names, g.setup_info)
    ]
    engines = [
        (f"engine replica {i}", info["deterministic"])
        for i, info in enumerate(job.replica_info)
        if "deterministic" in info  # a replaying probe runs no engine
    ]
    # The engines' batch-invariant mode is theirs alone (the trainers have no such switch).
    invariant = next((i["batch_invariant"] for i in job.replica_info if "batch_invariant" in i), {})
    if job.layout.other_engine_device:  # another backend has switches of its own
        if engines:
            agree_on_settings(engines)
        return {**agree_on_settings(applied), **invariant}
    return {**agree_on_settings(applied + engines), **invariant}
