"""Which process runs on which device: a pure function of the config and the cluster.

``plan_layout(cfg, nodes, resource)`` places ``train.dp_size`` training ranks (one device each;
every role of a rank, actor / reference / critic, shares that device) and
``train.dp_size / rollout.tensor_parallel_size`` engine replicas, each on the devices of its
tp group of ranks (ranks ``g*tp .. g*tp+tp-1``), which never spans nodes. It starts nothing and
asks no device, so ``crossrl layout`` and the tests run it anywhere; the controller reserves
exactly this shape (one placement group of ``tp`` bundles per replica, see
``trainer.loop.cluster.group.make_placement``).

``deal_prompt`` (``rollout.engines.serving.router``) says which replica serves a prompt: all ``rollout.n`` samples of a prompt, on
every turn, go to one replica, chosen from the prompt's index in the run's prompt stream only
(never from timing), so runs stay reproducible and the samples of a group share the
replica's prefix cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from rollout.engines.serving.router import deal_prompt
from trainer.config.schema import Config

__all__ = [
    "Layout",
    "LayoutError",
    "Replica",
    "deal_prompt",
    "plan_layout",
]

#: Ray's share of one bundle's device each process asks for: they add up to one device.
#: (Shares only keep Ray's books; device memory is handed over by sleep/wake, not by them.)
RAY_SHARES: dict[str, float] = {"actor": 0.4, "reference": 0.2, "critic": 0.2, "rollout": 0.2}


class LayoutError(ValueError):
    """A layout that cannot work; the one-line message names the keys and the fix."""


@dataclass(frozen=True)
class Replica:
    """One engine replica: its ``tp`` devices on one node, and the training ranks it shares
    them with (none when the engines have devices of their own)."""

    index: int
    ranks: tuple[int, ...]
    node: int
    devices: tuple[int, ...]  # device indices on ``node``, tp rank order

    @property
    def tp(self) -> int:
        """Devices of this replica (``rollout.tensor_parallel_size``)."""
        return len(self.devices)


@dataclass(frozen=True)
class Layout:
    """Where everything of a job runs (see the module docstring)."""

    device: str  # the HAL backend name (hal.get_backend)
    resource: str  # its Ray resource (DeviceBackend.ray_resource)
    nodes: tuple[int, ...]  # devices of each node
    roles: tuple[str, ...]  # training roles, each one process per rank
    rank_slots: tuple[tuple[int, int], ...]  # rank r -> (node, device index on that node)
    replicas: tuple[Replica, ...]
    engine: str  # rollout.engine
    engine_memory_fraction: float  # of each device, while the engine is awake
    shares: dict[str, float] = field(default_factory=dict)
    separate: bool = False  # the engines on devices of their own (rollout.engine_devices)
    # When the engines' backend differs from the trainer's (rollout.device): its Ray
    # resource, name, and devices per node (same node order as ``nodes``); empty otherwise.
    engine_resource: str = ""
    engine_device: str = ""
    engine_nodes: tuple[int, ...] = ()
    # How new weights reach the engines (``weight_transport_rule``): "collective" or "host"
    # for engines of their own; "ipc" (vLLM's transfer API) or "" (crossrl's shared buckets)
    # for colocated ones.
    weight_transport: str = ""
    lora: bool = False  # the actor trains LoRA adapters (model.lora.enabled)

    @property
    def dp_size(self) -> int:
        """Training ranks (``train.dp_size``)."""
        return len(self.rank_slots)

    @property
    def tp(self) -> int:
        """Devices per engine replica (``rollout.tensor_parallel_size``)."""
        return self.replicas[0].tp

    def replica_of_rank(self, rank: int) -> int:
        """The replica whose tp group holds training rank ``rank`` (colocated layouts)."""
        return rank // self.tp

    @property
    def devices_used(self) -> int:
        """Devices the job takes: the ranks', plus the engines' own when separate."""
        return self.dp_size + (sum(r.tp for r in self.replicas) if self.separate else 0)

    @property
    def other_engine_device(self) -> bool:
        """Whether the engines run on another device type than the ranks (``rollout.device``)."""
        return bool(self.engine_resource) and self.engine_resource != self.resource


def _separate_layout(
    cfg: Config,
    nodes: tuple[int, ...],
    resource: str,
    device: str,
    engine: tuple[tuple[int, ...], str, str] | None = None,
) -> Layout:
    """``plan_layout`` with ``rollout.engine_devices`` > 0: the training ranks fill the nodes
    from the first, one device each; the engine replicas, ``tp`` devices each on one node,
    fill what is left from the last node back, so on a cluster of several nodes the engines
    sit on nodes of their own (their weights then cross nodes, through host memory).
    ``engine``: ``(devices per node, Ray resource, backend)`` of the engines when their backend
    differs from the trainer's; they then fill those devices, from the last node back."""
    dp, tp = cfg.train.dp_size, cfg.rollout.tensor_parallel_size
    count = cfg.rollout.engine_devices // tp
    shape = "/".join(map(str, nodes))
    if engine is None and dp + cfg.rollout.engine_devices > sum(nodes):
        raise LayoutError(
            f"train.dp_size={dp} + rollout.engine_devices={cfg.rollout.engine_devices} need "
            f"{dp + cfg.rollout.engine_devices} {resource} devices, the cluster has "
            f"{sum(nodes)} ({len(nodes)} node(s) of {shape}); lower one of them or add nodes"
        )
    if engine is not None and dp > sum(nodes):
        raise LayoutError(
            f"train.dp_size={dp} needs {dp} {resource} devices, the cluster has {sum(nodes)} "
            f"({len(nodes)} node(s) of {shape}); lower train.dp_size or add nodes"
        )
    free = [list(range(n)) for n in nodes]
    slots: list[tuple[int, int]] = []
    for node in range(len(nodes)):
        while free[node] and len(slots) < dp:
            slots.append((node, free[node].pop(0)))
    if engine is not None:  # the engines' own device type: all of its devices are free
        free = [list(range(n)) for n in engine[0]]
        shape = "/".join(map(str, engine[0]))
    replicas: list[Replica] = []
    for node in reversed(range(len(nodes))):
        while len(free[node]) >= tp and len(replicas) < count:
            devices = tuple(free[node][-tp:])
            del free[node][-tp:]
            replicas.append(Replica(len(replicas), (), node, devices))
    if len(replicas) < count:
        raise LayoutError(
            f"rollout.engine_devices={cfg.rollout.engine_devices} with "
            f"rollout.tensor_parallel_size={tp}: after train.dp_size={dp} ranks, nodes of "
            f"{shape} {engine[1] if engine else resource} devices hold only {len(replicas)} "
            f"whole replica(s) of {tp} devices on one node; lower train.dp_size or "
            "rollout.tensor_parallel_size"
        )
    roles = training_roles(cfg)
    # Each training process and each engine owns its device: no sharing to keep books of.
    shares = {role: 1.0 / len(roles) for role in roles}
    return Layout(
        device=device,
        resource=resource,
        nodes=nodes,
        roles=roles,
        rank_slots=tuple(slots),
        replicas=tuple(replicas),
        engine=cfg.rollout.engine,
        engine_memory_fraction=cfg.rollout.memory_fraction,
        shares={**shares, "rollout": 1.0},
        separate=True,
        engine_resource=engine[1] if engine else "",
        engine_device=engine[2] if engine else "",
        engine_nodes=engine[0] if engine else (),
        weight_transport=weight_transport_rule(
            cfg, other_device=engine is not None, device=device or None
        ),
        lora=cfg.model.lora.enabled,
    )


def weight_transport_rule(
    cfg: Config, *, other_device: bool | None = None, device: str | None = None
) -> str:
    """How new weights reach the engines. Engines of their own: ``collective`` (through the
    engine's own weight-transfer API, training rank 0 broadcasting to every engine worker,
    ``trainer.loop.weights.weight_group``) unless ``rollout.weight_transport=host``, the
    engines run on another device type (``other_device``, None: ``rollout.device`` names
    one other than ``device``; no collective joins two vendors) or the actor trains LoRA
    adapters (served through the engine's LoRA load, not its weight transfer), where a
    host-memory snapshot in Ray's object store carries them. Colocated engines: ``ipc`` for
    vLLM (its weight-transfer API, each worker mapping the buffer its own device's rank
    packed: ``WeightPush.push_transfer``), else "" (crossrl's shared buckets, which the HF
    engine and LoRA adapters take). The HF engine on an accelerator (``device``: the
    resolved device type, None: ``device``'s key) takes host snapshots too: only vLLM's and
    vllm-ascend's own weight-transfer engines push through a collective there, and crossrl
    builds no vendor's process group of its own (an explicit ``collective`` is refused,
    ``trainer.config.engine_checks``)."""
    if not cfg.rollout.engine_devices:
        return "ipc" if cfg.rollout.engine == "vllm" and not cfg.model.lora.enabled else ""
    if other_device is None:
        other_device = cfg.rollout.device not in (None, cfg.device)
    from trainer.config.engine_checks import CPU_OR_AUTO

    accelerator = (device or cfg.device) not in CPU_OR_AUTO
    if other_device or cfg.rollout.weight_transport == "host" or cfg.model.lora.enabled:
        return "host"
    if cfg.rollout.engine == "hf" and accelerator:
        return "host"
    return "collective"


def training_roles(cfg: Config) -> tuple[str, ...]:
    """The training roles a job runs: the actor always, the reference when the KL term is on
    (``algorithm.kl_coef > 0``) unless the actor trains LoRA adapters (``model.lora``: its
    forward with the adapters off is the reference), the critic when ``critic.enable``."""
    roles = ["actor"]
    if cfg.algorithm.kl_coef > 0 and not cfg.model.lora.enabled:
        roles.append("reference")
    if cfg.critic.enable:
        roles.append("critic")
    return tuple(roles)


def plan_layout(
    cfg: Config,
    nodes: Sequence[int],
    resource: str,
    device: str = "",
    *,
    engine_nodes: Sequence[int] | None = None,
    engine_resource: str = "",
    engine_device: str = "",
) -> Layout:
    """Place the job of ``cfg`` on a cluster whose node ``i`` has ``nodes[i]`` devices of Ray
    resource ``resource`` (the HAL backend's Ray resource; ``device`` names the backend for printing).

    tp groups fill the nodes in order, each whole on one node; training rank ``r`` is tp rank
    ``r % tp`` of replica ``r // tp``. With ``rollout.engine_devices`` the engines get devices
    of their own (``_separate_layout``); when their backend (``rollout.device``) differs from
    the trainer's, node ``i`` also has ``engine_nodes[i]`` devices of ``engine_resource``
    (``engine_device``), the nodes in the same order, and ``nodes[i]`` may be 0. Raises
    ``LayoutError`` for a layout that cannot work: tp not dividing dp, tp larger than any node,
    a tp group that would have to span nodes, more ranks than devices.
    """
    dp, tp = cfg.train.dp_size, cfg.rollout.tensor_parallel_size
    nodes = tuple(int(n) for n in nodes)
    if engine_nodes is not None and cfg.rollout.engine_devices:
        engine_nodes = tuple(int(n) for n in engine_nodes)
        if len(engine_nodes) != len(nodes) or any(n < 0 for n in nodes + engine_nodes):
            raise LayoutError(
                f"nodes={list(nodes)}, engine nodes={list(engine_nodes)}: one count each per node"
            )
        return _separate_layout(
            cfg, nodes, resource, device, engine=(engine_nodes, engine_resource, engine_device)
        )
    if not nodes or any(n < 1 for n in nodes):
        raise LayoutError(f"nodes={list(nodes)}: every node needs at least 1 {resource} device")
    if cfg.rollout.engine_devices:
        return _separate_layout(cfg, nodes, resource, device)
    total = sum(nodes)
    if dp % tp:
        raise LayoutError(
            f"rollout.tensor_parallel_size={tp} does not divide train.dp_size={dp}: each engine "
            f"replica takes the devices of {tp} training ranks; pick a divisor of {dp}"
        )
    if tp > max(nodes):
        raise LayoutError(
            f"rollout.tensor_parallel_size={tp} is larger than a node ({max(nodes)} {resource} "
            f"devices): a replica's devices must be on one node; lower it to <= {max(nodes)}"
        )
    if dp > total:
        raise LayoutError(
            f"train.dp_size={dp} needs {dp} {resource} devices, the cluster has {total} "
            f"({len(nodes)} node(s) of {'/'.join(map(str, nodes))}); lower train.dp_size or add "
            "nodes"
        )
    slots: list[tuple[int, int]] = []
    replicas: list[Replica] = []
    for node, count in enumerate(nodes):
        for first in range(0, count - tp + 1, tp):
            if len(slots) == dp:
                break
            devices = tuple(range(first, first + tp))
            ranks = tuple(range(len(slots), len(slots) + tp))
            replicas.append(Replica(len(replicas), ranks, node, devices))
            slots += [(node, d) for d in devices]
    if len(slots) < dp:
        raise LayoutError(
            f"train.dp_size={dp} with rollout.tensor_parallel_size={tp}: nodes of "
            f"{'/'.join(map(str, nodes))} {resource} devices hold only {len(slots) // tp} whole tp "
            f"groups ({len(slots)} ranks) and a tp group cannot span nodes; lower train.dp_size "
            f"to {len(slots)} or use a tp that divides each node's device count"
        )
    roles = training_roles(cfg)
    return Layout(
        device=device,
        resource=resource,
        nodes=nodes,
        roles=roles,
        rank_slots=tuple(slots),
        replicas=tuple(replicas),
        engine=cfg.rollout.engine,
        engine_memory_fraction=cfg.rollout.memory_fraction,
        shares={role: RAY_SHARES[role] for role in (*roles, "rollout")},
        weight_transport=weight_transport_rule(cfg),
    )


def in_process_blockers(cfg: Config, device: str) -> list[str]:
    """What keeps the job of ``cfg`` from running in one process (``ray.in_process``), as
    ``key=value`` entries; empty when nothing does. ``device``: the backend's name, or
    ``auto`` to resolve it (``hal``; only when nothing else blocks)."""
    found = []
    if cfg.train.dp_size != 1:
        found.append(f"train.dp_size={cfg.train.dp_size}")
    if cfg.rollout.engine_devices:  # the engines run beside the ranks, in their own process
        found.append(f"rollout.engine_devices={cfg.rollout.engine_devices}")
    if cfg.rollout.engine != "hf":
        found.append(f"rollout.engine={cfg.rollout.engine}")
    if cfg.ray.address is not None:
        found.append(f"ray.address={cfg.ray.address}")
    if device == "auto" and not found:
        import hal

        device = hal.get_backend("auto").name
    if device not in ("cpu", "auto"):
        found.append(f"device={device}")
    return found


def runs_in_process(cfg: Config, device: str | None = None) -> bool:
    """Whether the job runs its workers in the driver's process (``ray.in_process``: auto =
    when ``in_process_blockers`` finds nothing). ``device``: the backend's name (default:
    ``cfg.device``). Raises ``LayoutError`` for ``true`` when something stops it, naming what."""
    if cfg.ray.in_process is False:
        return False
    blockers = in_process_blockers(cfg, device or cfg.device)
    if cfg.ray.in_process is True and blockers:
        raise LayoutError(
            f"ray.in_process=true needs a one-rank CPU job with the hf engine and a local "
            f"Ray; this one has {', '.join(blockers)}: set ray.in_process=auto or false"
        )
    return not blockers


def local_ray_cpus(cfg: Config) -> int:
    """CPUs a local Ray is started with (``ray.num_cpus``, else 2 per rank + 2, plus the
    engines' own ``rollout.engine_devices``, at least 4): on the CPU backend, the devices of
    the one local node."""
    return cfg.ray.num_cpus or max(4, 2 * cfg.train.dp_size + 2 + cfg.rollout.engine_devices)


def prompt_sharing_rule(cfg: Config, device: str) -> str:
    """Whether the job's prompts are shared on ``device`` (``train.share_prompts``), and by
    which kernel, as ``crossrl layout`` prints it: only where a fused varlen kernel takes
    separate query and key offsets at ``train.param_dtype`` (``hal.shared_prompt_kernel``);
    elsewhere SDPA with a mask would fall to its math kernel, so prompts stay unshared. For
    a device this machine lacks, its packages stand in for the node's: start-up checks again."""
    if not cfg.train.share_prompts:
        return "prompt sharing: off (train.share_prompts=false)"
    import hal
    from rollout.models import parse_dtype

    backend = hal.backend_class(device)()
    kernel = backend.shared_prompt_kernel(
        parse_dtype(cfg.train.param_dtype), deterministic=cfg.run.deterministic
    )
    if kernel is None:
        return (
            f"prompt sharing: off on {device} at train.param_dtype={cfg.train.param_dtype}"
            f"{' with run.deterministic' if cfg.run.deterministic else ''}: no fused varlen "
            "kernel takes a shared prompt there (SDPA's math kernel would); on with bfloat16 "
            "where flash-attn, or torch's varlen_attn outside deterministic runs, is present"
        )
    here = device in hal.available_backends()
    return f"prompt sharing: on, {kernel}" + (
        "" if here else " (this machine's packages; start-up checks the node's)"
    )


def layout_for_cli(
    cfg: Config, *, nodes: int | None = None, devices_per_node: int | None = None
) -> Layout:
    """``crossrl layout``'s layout: ``nodes`` nodes (default 1) of ``devices_per_node`` devices
    of the config's device type. Default devices per node: what this machine's HAL sees when
    that device type is here (on the CPU: a local Ray's CPUs), else enough for
    ``train.dp_size`` (plus ``rollout.engine_devices``) over the nodes (the config's own
    intent, e.g. a GPU job read on a laptop). Engines of another device type
    (``rollout.device``) get one more node of their own, holding ``rollout.engine_devices``.
    """
    import hal

    name = cfg.device if cfg.device != "auto" else hal.available_backends()[0]
    resource = hal.RAY_RESOURCES[name]  # without importing torch for a named device
    count = nodes or 1
    if count < 1:
        raise LayoutError(f"--nodes={count}: must be >= 1")
    engine_name = cfg.engine_device() if cfg.engine_device() != "auto" else name
    if devices_per_node is None:
        if name == "cpu":
            devices_per_node = local_ray_cpus(cfg)
        elif name in hal.available_backends():
            devices_per_node = hal.get_backend(name).device_count()
        else:
            engine_here = cfg.rollout.engine_devices if engine_name == name else 0
            devices_per_node = -(-(cfg.train.dp_size + engine_here) // count)
    if devices_per_node < 1:
        raise LayoutError(f"--devices-per-node={devices_per_node}: must be >= 1")
    if cfg.rollout.engine_devices and engine_name != name:
        # Engines of another device type: one more node, the engine pool, holding theirs.
        return plan_layout(
            cfg,
            [devices_per_node] * count + [0],
            resource,
            device=name,
            engine_nodes=[0] * count + [cfg.rollout.engine_devices],
            engine_resource=hal.RAY_RESOURCES[engine_name],
            engine_device=engine_name,
        )
    return plan_layout(cfg, [devices_per_node] * count, resource, device=name)
