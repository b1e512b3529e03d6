"""``crossrl layout``'s text: the summary of a ``Layout`` (where every process runs, how new
weights reach the engines) and one line per device used. The plan itself is
``trainer.loop.plan.layout``."""

from __future__ import annotations

from trainer.loop.plan.layout import Layout, Replica

__all__ = ["format_layout"]


def format_layout(layout: Layout) -> str:
    """The layout as ``crossrl layout`` prints it: a summary, then one line per used device."""
    other = layout.other_engine_device
    n_used = layout.dp_size if other else layout.devices_used
    total = sum(layout.nodes)
    nodes = layout.nodes
    counts = [n for n in nodes if n] if other else nodes
    shape = (
        f"{len(counts)} node(s) x {counts[0]}"
        if len(set(counts)) == 1
        else "/".join(map(str, counts))
    )
    lines = [
        f"device {layout.device or '?'} (Ray resource {layout.resource}): {shape} devices, "
        f"{n_used} of {total} used"
        + (
            f"; engines on {layout.engine_device} (Ray resource {layout.engine_resource}): "
            f"{layout.devices_used - layout.dp_size} of {sum(layout.engine_nodes)} used"
            if other
            else ""
        ),
        f"training: {layout.dp_size} ranks (train.dp_size), roles {', '.join(layout.roles)}: "
        "one process per role per rank, on the rank's device",
        f"rollout: {len(layout.replicas)} {layout.engine} engine replicas x tp {layout.tp} "
        "(rollout.tensor_parallel_size) over "
        + (
            f"{layout.devices_used - layout.dp_size} "
            + (f"{layout.engine_device} " if layout.other_engine_device else "")
            + "devices of their own (rollout.engine_devices)"
            if layout.separate
            else f"{layout.dp_size} devices"
        ),
        f"memory: an engine takes {layout.engine_memory_fraction:g} of each of its devices "
        "(rollout.memory_fraction)"
        + (
            "; it stays awake, generating while the ranks train; new weights reach it "
            + _transport_words(layout)
            if layout.separate
            else " while awake and sleeps while the ranks train; new weights reach it "
            + _colocated_words(layout)
        ),
        "Ray shares of a device: "
        + ", ".join(f"{role} {share:g}" for role, share in layout.shares.items()),
    ]
    for node in range(len(nodes)):
        here = [(d, r) for r, (n, d) in enumerate(layout.rank_slots) if n == node]
        engines = [
            (d, rep)
            for rep in layout.replicas
            if rep.node == node and layout.separate
            for d in rep.devices
        ]
        if not here and not engines:
            continue
        lines.append(f"node {node}:")
        # Engines on another device type (rollout.device) count their own device indices.
        other = f"{layout.engine_device} " if layout.other_engine_device else ""
        for kind, dev, what in sorted(
            [("", d, _rank_line(layout, r)) for d, r in here]
            + [(other, d, _engine_line(rep, d)) for d, rep in engines]
        ):
            lines.append(f"  {kind}device {dev:2d}: {what}")
    return "\n".join(lines)


def _transport_words(layout: Layout) -> str:
    """How new weights reach engines of their own, for ``format_layout``."""
    if layout.weight_transport == "collective":
        import hal
        from rollout.engines.weights.transfer import ENGINE_NAME

        named = hal.backend_class(layout.device).weight_transfer_engine  # no device needed
        name = named if layout.engine == "vllm" else ENGINE_NAME
        return (
            f"through the engines' weight-transfer API ({name!r}): training rank 0 "
            "broadcasts to every engine worker (rollout.weight_transport=collective; host = "
            "through Ray's object store)"
        )
    why = "rollout.weight_transport=host"
    if layout.other_engine_device or layout.lora:
        why = "rollout.device" if layout.other_engine_device else "model.lora: adapters"
    return f"through a host-memory snapshot in Ray's object store ({why})"


def _colocated_words(layout: Layout) -> str:
    """How new weights reach colocated engines, for ``format_layout``."""
    if layout.weight_transport == "ipc":
        import hal

        named = hal.backend_class(layout.device).colocated_transfer_engine  # no device needed
        return (
            f"through vLLM's weight-transfer API ({named!r}): each engine worker maps the "
            "buffer its own device's rank packs"
        )
    why = "model.lora: adapters" if layout.lora else f"the {layout.engine} engine"
    return f"in buffers its tp group's ranks share with it ({why})"


def _rank_line(layout: Layout, rank: int) -> str:
    """What runs on training rank ``rank``'s device, for ``format_layout``."""
    procs = ", ".join(f"{role} rank {rank}" for role in layout.roles)
    if layout.separate:
        return procs
    rep = layout.replicas[layout.replica_of_rank(rank)]
    return f"{procs}, engine replica {rep.index} (tp rank {rank - rep.ranks[0]} of {rep.tp})"


def _engine_line(rep: Replica, device: int) -> str:
    """An engine replica's own device, for ``format_layout``."""
    return f"engine replica {rep.index} (tp rank {rep.devices.index(device)} of {rep.tp})"
