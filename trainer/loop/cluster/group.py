"""Ray plumbing: place workers through the HAL, wait without hanging (starting or joining Ray:
``trainer.loop.cluster.ray_start``, re-exported here).

The controller never blocks on a plain ``ray.get`` of many workers: if one worker dies
mid-collective the others wait forever inside the process group, so ``wait_all`` watches
every reference, reports the first failure with the worker's name at once, and gives up
after a timeout.
"""

from __future__ import annotations

import inspect
import random
import socket
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from trainer.loop.cluster.faults import RESTARTABLE_KINDS, describe, fault_kind
from trainer.loop.cluster.local import LocalRef
from trainer.loop.cluster.ray_start import (  # noqa: F401 - re-exported, where callers look
    RayConnectError,
    check_reachable,
    start_ray,
)

if TYPE_CHECKING:  # Ray is imported where it is used: an in-process run never needs it
    from ray.util.placement_group import PlacementGroup
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

#: Seconds a controller call on the workers may take before it is called hung.
CALL_TIMEOUT_S = 1800.0


class WorkerFailedError(RuntimeError):
    """A Ray worker died, hung or raised; the message names the worker. ``kind`` says what
    happened (``trainer.loop.cluster.faults``): ``died`` (a process of the job is gone),
    ``lost`` (an object the call read went with its process or node), ``collective`` (a
    collective broke), ``hung`` (no answer within the call's limit; ``limit`` names which
    kind of limit, ``trainer.loop.plan.call_limits``), ``raised`` (anything else it raised)."""

    def __init__(self, message: str, kind: str = "raised", limit: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.limit = limit

    @property
    def restartable(self) -> bool:
        """Whether starting the workers again may get past it (``run.max_restarts``): a lost
        process or object, a broken collective, a hang, yes; an error the worker's own code
        raised would only repeat."""
        return self.kind in RESTARTABLE_KINDS


def worker_failure(what: str, name: str, err: BaseException) -> WorkerFailedError:
    """The ``WorkerFailedError`` of call ``what`` of worker ``name`` that failed with ``err``
    (Ray's error, or an in-process call's own), its kind read from what happened
    (``trainer.loop.cluster.faults.fault_kind``)."""
    kind = fault_kind(err)
    return WorkerFailedError(describe(what, name, err, kind), kind=kind)


#: Where ``free_port`` looks: below Linux's ephemeral range (32768-60999, where every
#: ``bind(0)`` of Ray's and gRPC's many sockets lands) and above Ray's worker ports
#: (10002-19999), so a port found free stays free until the rendezvous binds it.
RENDEZVOUS_PORTS = range(20000, 32768)


def free_port(host: str = "127.0.0.1", tries: int = 64) -> int:
    """A TCP port free on ``host`` right now, for a process-group rendezvous: a random one of
    ``RENDEZVOUS_PORTS`` that binds (an ephemeral port, picked by the OS, could be handed to
    another process's socket before the rendezvous binds it), else, after ``tries``, one the
    OS picks."""
    pick = random.SystemRandom()
    for _ in range(tries):
        port = pick.randrange(RENDEZVOUS_PORTS.start, RENDEZVOUS_PORTS.stop)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass
class Placement:
    """The job's placement groups, each on the node the layout (``trainer.loop.plan.layout``) names.
    Colocated: one group of ``tp`` bundles (one device each) per engine replica; training rank
    r sits on bundle ``r % tp`` of group ``r // tp``, its replica on the group's first bundle.
    With engine devices of their own (``engine_groups``): one group of one bundle per rank,
    and one group of ``tp`` bundles per replica."""

    groups: list[PlacementGroup]
    resource: str
    tp: int = 1
    engine_groups: list[PlacementGroup] = field(default_factory=list)
    engine_resource: str = ""  # the engines' Ray resource when it differs (rollout.device)

    def strategy(self, rank: int) -> PlacementGroupSchedulingStrategy:
        """Scheduling strategy that pins an actor to training rank ``rank``'s bundle."""
        return _bundle_strategy(self.groups[rank // self.tp], rank % self.tp)

    def engine_strategy(self, replica: int, bundle: int = 0) -> PlacementGroupSchedulingStrategy:
        """Scheduling strategy on bundle ``bundle`` of engine replica ``replica``'s own group
        (layouts with ``rollout.engine_devices``)."""
        return _bundle_strategy(self.engine_groups[replica], bundle)

    def remove(self) -> None:
        """Give the devices back to Ray."""
        from ray.util.placement_group import remove_placement_group

        for group in self.groups + self.engine_groups:
            remove_placement_group(group)


def _bundle_strategy(group, bundle: int) -> PlacementGroupSchedulingStrategy:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(
        placement_group=group, placement_group_bundle_index=bundle
    )


def _live_nodes(resource: str, down: Collection[str] = ()) -> list[dict]:
    """Ray's records of the live nodes with at least one ``resource`` device, in Ray's order,
    less those in ``down`` (ids of nodes found not answering, ``unresponsive_nodes``)."""
    import ray

    return [
        n
        for n in ray.nodes()
        if n.get("Alive")
        and n["NodeID"] not in down
        and int(n.get("Resources", {}).get(resource, 0)) >= 1
    ]


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def unresponsive_nodes(timeout_s: float) -> set[str]:
    """Ids of the nodes Ray lists alive that do not run a tiny task pinned to them within
    ``timeout_s`` seconds: a node lost a moment ago stays listed until Ray's health checks
    give up on it (tens of seconds), and a layout planned on it would never be placed."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    probe = ray.remote(_node_id)
    ids = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
    refs = {
        probe.options(
            num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
        ).remote(): node
        for node in ids
    }
    _, late = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    for ref in late:
        try:
            ray.cancel(ref, force=True)
        except Exception:  # noqa: BLE001 - its node is gone: nothing left to cancel
            pass
    return {refs[ref] for ref in late}


def cluster_nodes(resource: str, down: Collection[str] = ()) -> list[int]:
    """Devices of Ray resource ``resource`` on each live node of the cluster Ray is joined to
    (nodes without any left out): the ``nodes`` of ``trainer.loop.plan.layout.plan_layout``."""
    return [int(n["Resources"][resource]) for n in _live_nodes(resource, down)]


def cluster_node_ids(resource: str, down: Collection[str] = ()) -> list[str]:
    """Ray's node ids of ``cluster_nodes``' nodes, in the same order."""
    return [n["NodeID"] for n in _live_nodes(resource, down)]


def cluster_node_table(
    resources: Sequence[str], down: Collection[str] = ()
) -> tuple[list[str], dict[str, list[int]]]:
    """The live nodes that have any of ``resources`` (e.g. the trainer's GPUs and the engines'
    NPUs, ``rollout.device``), in Ray's order: their ids, and per resource its count on each
    (0 where a node has none): the ``nodes`` and ``engine_nodes`` of ``plan_layout``."""
    import ray

    live = [
        n
        for n in ray.nodes()
        if n.get("Alive")
        and n["NodeID"] not in down
        and any(int(n.get("Resources", {}).get(r, 0)) >= 1 for r in resources)
    ]
    counts = {r: [int(n["Resources"].get(r, 0)) for n in live] for r in resources}
    return [n["NodeID"] for n in live], counts


def make_placement(resource: str, layout, *, timeout_s: float, node_ids: list[str]) -> Placement:
    """Reserve the devices of ``layout`` (``trainer.loop.plan.layout.Layout``; ``resource`` is the
    HAL's Ray resource name), each group STRICT_PACKed on the node the layout names
    (``node_ids[i]``: Ray's id of the layout's node ``i``), so a replica's devices never span
    nodes and ``crossrl layout`` says where everything runs.

    Raises ``WorkerFailedError`` naming the resource when the cluster cannot provide the
    bundles within ``timeout_s`` seconds, instead of waiting forever.
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    def device_bundle(kind: str) -> dict[str, float]:
        return {kind: 1.0} if kind == "CPU" else {kind: 1.0, "CPU": 1.0}

    engine_resource = layout.engine_resource or resource

    # Ray before bundle label selectors (2.4x) places each group on any node with room.
    pins = "bundle_label_selector" in inspect.signature(placement_group).parameters
    if layout.separate and not pins:
        raise WorkerFailedError(
            f"rollout.engine_devices={layout.devices_used - layout.dp_size} places the engines "
            f"on nodes of their own, which needs Ray's bundle label selectors (ray "
            f"{ray.__version__} lacks them): upgrade ray, or set rollout.engine_devices=0"
        )

    def on_node(node: int, size: int, kind: str = resource):
        kwargs = {}
        if pins:
            kwargs["bundle_label_selector"] = [{"ray.io/node-id": node_ids[node]}] * size
        bundles = [device_bundle(kind) for _ in range(size)]
        return placement_group(bundles, "STRICT_PACK", **kwargs)

    if layout.separate:
        tp = 1
        groups = [on_node(node, 1) for node, _ in layout.rank_slots]
        engine_groups = [on_node(rep.node, rep.tp, engine_resource) for rep in layout.replicas]
    else:
        tp = layout.tp
        groups = [on_node(rep.node, rep.tp) for rep in layout.replicas]
        engine_groups = []
    every = groups + engine_groups
    ready, _ = ray.wait([g.ready() for g in every], num_returns=len(every), timeout=timeout_s)
    if len(ready) < len(every):
        available = ray.available_resources().get(resource, 0)
        for group in every:
            remove_placement_group(group)
        raise WorkerFailedError(
            f"could not reserve {layout.devices_used} x {resource} as the layout places them "
            f"(`crossrl layout`) within {timeout_s:.0f} s (Ray reports {available:g} {resource} "
            "free): lower train.dp_size or rollout.engine_devices, free the devices, or raise "
            "ray.placement_timeout_s"
        )
    return Placement(
        groups=groups,
        resource=resource,
        tp=tp,
        engine_groups=engine_groups,
        engine_resource=layout.engine_resource,
    )


def _assigned_ids(resource: str) -> list[str]:
    import ray

    ids = ray.get_runtime_context().get_accelerator_ids().get(resource, [])
    return [str(i) for i in ids]


def bundle_device_ids(
    placement: Placement, rank: int, *, timeout_s: float, strategy=None
) -> list[str]:
    """The node's id of training rank ``rank``'s device (Ray's assignment), asked by a tiny
    task on its bundle (or on ``strategy``'s, e.g. an engine's own bundle): what an engine
    replica spanning several bundles must be shown."""
    import ray

    kind = placement.engine_resource if strategy is not None else ""
    opts = actor_options(placement, rank, 0.001, strategy=strategy, resource=kind)
    probe = ray.remote(_assigned_ids).options(**opts)
    ref = probe.remote(kind or placement.resource)
    return wait_all([ref], [f"device probe of rank {rank}"], timeout_s=timeout_s, what="probe")[0]


def wait_all(
    refs: Sequence[Any],
    names: Sequence[str],
    *,
    timeout_s: float,
    what: str | Sequence[str],
) -> list[Any]:
    """Results of ``refs`` in order; the first failure raises ``WorkerFailedError`` naming
    the worker (``names[i]`` for ``refs[i]``) and the call (``what``, or ``what[i]``)
    without waiting for the others."""
    whats = [what] * len(refs) if isinstance(what, str) else list(what)
    # In-process calls (and results kept by the driver, e.g. a resumed pipeline's rollouts)
    # are done already: read them first, then wait for the Ray calls among them.
    local = [i for i, ref in enumerate(refs) if isinstance(ref, LocalRef)]
    results: list[Any] = [None] * len(refs)
    for i, value in zip(
        local, _local_results([refs[i] for i in local], [names[i] for i in local], whats, local)
    ):
        results[i] = value
    if len(local) == len(refs):
        return results
    import ray

    index = {ref: i for i, ref in enumerate(refs) if not isinstance(ref, LocalRef)}
    pending = list(index)
    deadline = time.monotonic() + timeout_s
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            late = ", ".join(names[index[r]] for r in pending)
            calls = ", ".join(dict.fromkeys(whats[index[r]] for r in pending))
            raise WorkerFailedError(
                f"{calls}: no answer from {late} within {timeout_s:.0f} s",
                kind="hung",
                limit=getattr(timeout_s, "call", None),  # a CallLimits limit names its call
            )
        done, pending = ray.wait(pending, num_returns=1, timeout=min(left, 5.0))
        for ref in done:
            i = index[ref]
            try:
                results[i] = ray.get(ref)
            except ray.exceptions.RayError as err:  # died, lost, raised: faults.fault_kind
                raise worker_failure(whats[i], names[i], err) from err
    return results


def is_done(ref: Any) -> bool:
    """Whether the call behind ``ref`` has finished (with a result or an error), without
    waiting: in-process calls always have; a Ray call when ``ray.wait`` finds it ready."""
    if isinstance(ref, LocalRef):
        return True
    import ray

    done, _ = ray.wait([ref], num_returns=1, timeout=0)
    return bool(done)


class Later:
    """The result of one call (``ref``, made by worker ``name``; ``what`` names the call),
    read when it is ready: ``done`` never waits, ``result`` waits and raises
    ``WorkerFailedError`` as ``wait_all`` does."""

    def __init__(self, ref: Any, name: str, what: str, timeout_s: float = CALL_TIMEOUT_S) -> None:
        self.ref = ref
        self.name = name
        self.what = what
        self.timeout_s = timeout_s  # the call's limit when ``result`` is given none

    def done(self) -> bool:
        """Whether the call has finished (``is_done``)."""
        return is_done(self.ref)

    def result(self, timeout_s: float | None = None) -> Any:
        """The call's result, waiting at most ``timeout_s`` seconds (default: its limit)."""
        wait_s = self.timeout_s if timeout_s is None else timeout_s
        return wait_all([self.ref], [self.name], timeout_s=wait_s, what=self.what)[0]


def _local_results(
    refs: Sequence[LocalRef], names: Sequence[str], whats: list[str], at: Sequence[int]
) -> list:
    """``wait_all`` of in-process calls (``refs``, the calls ``at`` of ``whats``): the first
    one that raised fails as a Ray task would."""
    for i, ref in enumerate(refs):
        if ref.error is not None:
            err = ref.error
            text = str(err).strip().splitlines()
            message = f"{type(err).__name__}: {text[0]}" if text else type(err).__name__
            raise WorkerFailedError(
                f"{whats[at[i]]}: worker {names[i]} raised {message}", kind=fault_kind(err)
            ) from err
    return [ref.result() for ref in refs]


def actor_options(
    placement: Placement, rank: int, share: float, *, strategy=None, resource: str = ""
) -> dict[str, Any]:
    """Ray actor options that take ``share`` of training rank ``rank``'s device (colocated
    workers split a bundle: actor, reference, critic and an engine replica share a device),
    or of ``strategy``'s bundle when given (``Placement.engine_strategy``), whose device is
    of Ray resource ``resource`` (default: the placement's)."""
    opts: dict[str, Any] = {"scheduling_strategy": strategy or placement.strategy(rank)}
    kind = resource or placement.resource
    if kind == "CPU":
        opts["num_cpus"] = share
    elif kind == "GPU":  # Ray refuses GPU inside `resources`
        opts.update(num_gpus=share, num_cpus=0)
    else:
        opts.update(resources={kind: share}, num_cpus=0)
    return opts


class WorkerGroup:
    """The Ray actors of one role, one per data-parallel rank, called together."""

    def __init__(self, role: str, handles: list) -> None:
        self.role = role
        self.handles = handles
        self.names = [f"{role} rank {r}" for r in range(len(handles))]

    def call(
        self, method: str, *args, per_rank: list | None = None, timeout_s: float = CALL_TIMEOUT_S
    ) -> list:
        """Call ``method`` on every rank (``per_rank[r]`` prepended to rank r's args) and wait,
        failing fast with the worker's name."""
        refs = self.submit(method, *args, per_rank=per_rank)
        return wait_all(refs, self.names, timeout_s=timeout_s, what=f"{self.role}.{method}")

    def submit(self, method: str, *args, per_rank: list | None = None) -> list:
        """Start ``method`` on every rank; returns the object refs."""
        return [
            getattr(h, method).remote(*(([per_rank[r]] if per_rank else []) + list(args)))
            for r, h in enumerate(self.handles)
        ]


class PendingCalls:
    """Calls on actors started without waiting, then waited for together.

    Ray runs one actor's calls in the order they were submitted, so a chain on the same
    workers (``load_batch`` -> ``compute_logprobs`` -> ``set_token_field`` ->
    ``compute_advantages``) needs no wait in between: the round trips of a step overlap
    instead of queueing one after another. ``wait`` fails fast naming the worker and method.
    """

    def __init__(self) -> None:
        self._refs: list = []
        self._names: list[str] = []
        self._whats: list[str] = []

    def submit(self, group: WorkerGroup, method: str, *args, per_rank: list | None = None) -> list:
        """``group.submit(...)``, remembered for ``wait``; returns the refs (rank order)."""
        refs = group.submit(method, *args, per_rank=per_rank)
        self.add(refs, group.names, f"{group.role}.{method}")
        return refs

    def add(self, refs: list, names: Sequence[str], what: str) -> list:
        """Remember refs started elsewhere (``names[i]`` made ``refs[i]``); returns them."""
        self._refs.extend(refs)
        self._names.extend(names)
        self._whats.extend([what] * len(refs))
        return refs

    def wait(self, timeout_s: float = CALL_TIMEOUT_S) -> dict:
        """Wait for every call; returns ``{ref: result}``. Raises ``WorkerFailedError``."""
        results = wait_all(self._refs, self._names, timeout_s=timeout_s, what=self._whats)
        out = dict(zip(self._refs, results))
        self._refs, self._names, self._whats = [], [], []
        return out


def agree_on_settings(applied: list[tuple[str, dict[str, str]]]) -> dict[str, str]:
    """The settings every named process applied, ``(name, settings)`` each; they must be the
    same everywhere (a process that skipped run.deterministic's switches would make the run
    irreproducible): raises ``WorkerFailedError`` naming the odd one."""
    first_name, first = applied[0]
    for name, settings in applied:
        if settings != first:
            raise WorkerFailedError(
                f"{name} applied deterministic settings {settings}, {first_name} applied {first}"
            )
    return first
