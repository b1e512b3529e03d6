"""The memory budget put to use: sized for a config's device (``device_memory``,
``budget_for_cli``), the verdict that refuses a job whose phase does not fit and names the key
that lowers it most (``memory_problem``, run by ``trainer.loop.start.preflight``), and the table
``crossrl layout`` prints (``format_budget``, with the weight snapshots of engines on devices
of their own against Ray's object store: ``trainer.loop.plan.snapshot_budget``). The estimate itself
is ``trainer.loop.plan.memory_budget``."""

from __future__ import annotations

from trainer.config.schema import Config
from trainer.loop.plan.layout import Layout, LayoutError
from trainer.loop.plan.memory_budget import (
    COMPONENTS,
    GB,
    MemoryBudget,
    budget_for,
    estimate_memory,
)
from trainer.loop.plan.model_shape import PUBLISHED_SHAPES, ModelShape, ModelShapeError
from trainer.loop.plan.rank_memory import micro_batch_tokens
from trainer.loop.plan.snapshot_budget import format_snapshots
from trainer.loop.plan.stream_budget import format_in_flight

__all__ = [
    "budget_for_cli",
    "device_memory",
    "format_budget",
    "format_in_flight",
    "memory_problem",
]


def device_memory(name: str, override_gb: float | None = None) -> tuple[float, str]:
    """Bytes of one device of type ``name`` (cpu: the host's RAM) for the memory budget, and
    where the number comes from: ``override_gb`` (``crossrl layout --device-memory-gb``),
    else this machine's device 0 when that device type is here (asked in a child process,
    ``hal.device_total_memory``: this process makes no device context), else the type's
    default (``trainer.loop.plan.memory_budget.DEFAULT_DEVICE_MEMORY_BYTES``). Imports torch only
    for an accelerator type, as ``layout_for_cli`` does."""
    from hal import DEFAULT_DEVICE_MEMORY_BYTES, DEFAULT_DEVICE_NAMES

    if override_gb is not None:
        if not override_gb > 0:
            raise LayoutError(f"--device-memory-gb={override_gb}: must be > 0")
        return override_gb * 1e9, "--device-memory-gb"
    if name == "cpu":
        import os

        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return float(ram), "this host's RAM"
    import hal

    if name in hal.available_backends():
        # asked in a child process: the first call into a device runtime makes a context on
        # device 0, which this process would keep for the whole run
        total = hal.device_total_memory(name)
        if total is not None:
            return total, f"this machine's {name} device 0"
    return (
        DEFAULT_DEVICE_MEMORY_BYTES[name],
        f"{DEFAULT_DEVICE_NAMES[name]}, the default without one here",
    )


def budget_for_cli(
    cfg: Config, layout: Layout | None = None, device_memory_gb: float | None = None
) -> MemoryBudget | None:
    """The memory budget of ``cfg``'s step (``trainer.loop.plan.memory_budget``) on its device type,
    sized by ``device_memory``; None when the model's shape is unknown. On the CPU the host's
    RAM holds every rank of the node: those of ``layout``'s fullest node, else all of
    ``train.dp_size``. Raises ``LayoutError`` for a bad ``device_memory_gb`` and for a model
    whose experts the budget cannot count (``trainer.loop.plan.moe_layout``)."""
    import hal

    name = layout.device if layout is not None and layout.device else cfg.device
    if name == "auto":
        name = hal.available_backends()[0]
    memory, source = device_memory(name, device_memory_gb)
    ranks = 1
    if name == "cpu":
        ranks = cfg.train.dp_size
        if layout is not None:
            ranks = max(
                sum(1 for n, _ in layout.rank_slots if n == node)
                for node in range(len(layout.nodes))
            )
    try:
        return budget_for(cfg, name, memory, source, ranks_per_memory=max(1, ranks))
    except ModelShapeError as err:  # a mixture of experts the budget cannot count
        raise LayoutError(f"model.path: {err}") from None


# ----------------------------------------------------------------------------- verdict


def _levers(cfg: Config) -> list[tuple[str, Config]]:
    """The changes that can lower a phase, each as ``(advice naming the key, the changed
    config)``: one natural step of each layout key (twice the ranks, half the micro-batch,
    half the engine's share, twice the tp) and each memory switch that is off."""
    train, roll = cfg.train, cfg.rollout
    out: list[tuple[str, Config]] = []

    def changed(section: str, key: str, value) -> Config:
        new = cfg.model_copy(deep=True)
        setattr(getattr(new, section), key, value)
        return new

    out.append(
        (
            f"raise train.dp_size (now {train.dp_size})",
            changed("train", "dp_size", 2 * train.dp_size),
        )
    )
    if not (train.optimizer_offload or train.param_offload):
        out.append(
            ("set train.optimizer_offload=true", changed("train", "optimizer_offload", True))
        )
    if not train.activation_checkpointing:
        out.append(
            (
                "set train.activation_checkpointing=true",
                changed("train", "activation_checkpointing", True),
            )
        )
    if not train.lean_logprobs:
        out.append(("set train.lean_logprobs=true", changed("train", "lean_logprobs", True)))
    tokens = micro_batch_tokens(cfg)
    if tokens >= 4:
        now = train.max_tokens_per_micro_batch
        out.append(
            (
                f"lower train.max_tokens_per_micro_batch (now {now})"
                if now is not None
                else "set train.max_tokens_per_micro_batch (now null: a rank's whole mini-batch)",
                changed("train", "max_tokens_per_micro_batch", tokens // 2),
            )
        )
    if roll.engine == "vllm":
        out.append(
            (
                f"lower rollout.memory_fraction (now {roll.memory_fraction:g})",
                changed("rollout", "memory_fraction", roll.memory_fraction / 2),
            )
        )
        out.append(
            (
                f"raise rollout.tensor_parallel_size (now {roll.tensor_parallel_size})",
                changed("rollout", "tensor_parallel_size", 2 * roll.tensor_parallel_size),
            )
        )
    if train.param_dtype == "float32":
        out.append(("set train.param_dtype=bfloat16", changed("train", "param_dtype", "bfloat16")))
    return out


def _reestimate(budget: MemoryBudget, cfg: Config, changed: Config) -> MemoryBudget:
    """``budget`` again for ``changed`` (``cfg`` with one lever moved); on the CPU more
    ranks share the host."""
    ranks = budget.ranks_per_memory
    if budget.device == "cpu":
        ranks = max(1, ranks * changed.train.dp_size // cfg.train.dp_size)
    return estimate_memory(
        changed,
        budget.shape,
        budget.device_memory_bytes,
        device=budget.device,
        memory_source=budget.memory_source,
        critic_shape=budget.critic_shape,
        ranks_per_memory=ranks,
        before_fixes=budget.before_fixes,
    )


def memory_problem(
    budget: MemoryBudget, cfg: Config, phases: tuple[str, ...] | None = None
) -> str | None:
    """One line when a phase of ``budget`` (made from ``cfg``) needs more than the device
    has: the largest such phase, its estimate, the device's memory, and the key whose one
    step (``_levers``) lowers that phase the most, with the estimate after it. None when
    every phase fits. ``phases``: the names of the phases to check (default: all)."""
    over = [p for p in budget.over if phases is None or p.name in phases]
    if not over:
        return None
    phase = max(over, key=lambda p: p.total)
    where = "on the host" if budget.device == "cpu" else f"per {budget.device} device"
    head = (
        f"memory: the {phase.name} phase needs about {phase.total / GB:.1f} GB {where}, "
        f"more than its {budget.device_memory_bytes / GB:.1f} GB ({budget.memory_source})"
    )
    best, after = None, phase.total
    for advice, changed in _levers(cfg):
        total = _reestimate(budget, cfg, changed).phase(phase.name).total
        if total < after:
            best, after = advice, total
    if best is None:
        return head + "; no layout key lowers it (`crossrl layout` prints the budget)"
    return (
        f"{head}; {best}: that lowers it most, to about {after / GB:.1f} GB "
        "(`crossrl layout` prints the budget)"
    )


# ----------------------------------------------------------------------------- printing


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}e9" if n >= 1e8 else f"{n:,}"


def _experts_line(shape: ModelShape, ep: int = 1) -> list[str]:
    """The lines saying what a mixture of experts counts (none for a dense model) and how
    its experts split (``train.expert_parallel_size``)."""
    e = shape.experts
    if e is None:
        return []
    shared = f" + shared {e.shared_intermediate_size}" if e.shared_intermediate_size else ""
    lines = [
        f"  experts: {e.count} x width {e.intermediate_size} in {e.sparse_layers}/"
        f"{shape.num_hidden_layers} layers (params, grads, optim); {e.per_token} active a "
        f"token{shared}"
    ]
    if ep > 1:
        lines.append(
            f"  expert parallel: {e.count // ep} experts a rank of {ep} "
            "(train.expert_parallel_size); a layer gathers its share"
        )
    return lines


def format_budget(budget: MemoryBudget | None, cfg: Config) -> str:
    """The budget as ``crossrl layout`` prints it (under 100 columns): where the shape and
    the memory come from, one row per phase with its components in GB, and the peak.
    ``budget`` None: why there is no estimate."""
    import textwrap

    if budget is None:
        return textwrap.fill(
            f"memory: no estimate: the shape of model.path={cfg.model.path!r} is unknown (no "
            "config.json there, and its name is none of "
            f"{', '.join(PUBLISHED_SHAPES)}); nothing is refused",
            width=96,
            subsequent_indent="  ",
        )
    shape, mem = budget.shape, budget.device_memory_bytes
    where = "on the host" if budget.device == "cpu" else f"per {budget.device} device"
    title = (
        "estimated as before issue 24's fixes (GB = 1e9 bytes)"
        if budget.before_fixes
        else 'estimated (GB = 1e9 bytes; docs/cluster.md "Memory budget")'
    )
    tokens = cfg.train.max_tokens_per_micro_batch
    lines = [
        f"memory {where}, {title}:",
        f"  model: {_count(shape.num_params)} parameters, shape from {shape.source}",
        *_experts_line(shape, cfg.train.expert_parallel_size),
        f"  device: {mem / GB:.1f} GB ({budget.memory_source})",
        f"  micro-batch: {budget.micro_batch_tokens:,} tokens (train.max_tokens_per_micro_batch"
        f"={tokens if tokens is not None else 'null'})",
        "  " + f"{'phase':<12}" + "".join(f"{k:>7}" for k in COMPONENTS) + f"{'total':>8}",
    ]
    peak = budget.peak
    for phase in budget.phases:
        cells = "".join(f"{phase.parts.get(k, 0.0) / GB:7.2f}" for k in COMPONENTS)
        mark = "  peak" if phase is peak else ""
        lines.append(f"  {phase.name:<12}{cells}{phase.total / GB:8.2f}{mark}")
    share = peak.total / mem
    verdict = "fits" if share <= 1 else "does NOT fit"
    if budget.allocator_reserve != 1.0:  # what the caching allocator takes (auto sizes fill it)
        reserved = ", ".join(f"{p.name} {budget.reserved(p.name) / GB:.1f}" for p in budget.phases)
        lines.append(
            f"  reserved by the allocator (tensors x {budget.allocator_reserve:.2f}): {reserved} GB"
        )
    lines.append(
        f"  peak: {peak.name}, {peak.total / GB:.1f} of {mem / GB:.1f} GB ({share:.0%}): {verdict}"
    )
    problem = memory_problem(budget, cfg)
    if problem:
        lines.append(
            textwrap.fill(problem, width=96, initial_indent="  ", subsequent_indent="    ")
        )
    snapshots = format_snapshots(cfg, shape)
    if snapshots:
        lines.append(snapshots)
    if cfg.train.max_staleness:
        lines.append(format_in_flight(cfg))
    return "\n".join(lines)
