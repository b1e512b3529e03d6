"""Device memory of a training step, phase by phase, estimated before anything starts.

``estimate_memory(cfg, shape, device_memory_bytes, device=...)`` (``shape``:
``trainer.loop.plan.model_shape``) adds up, per device (one
training rank's device; on the CPU the whole host, shared by its ranks), what each phase of a
step holds:

- **rollout**: the engine awake (vLLM takes ``rollout.memory_fraction`` of the device) beside
  the training ranks' state between steps (sharded fp32 parameters of every role, the
  optimizer state unless ``train.optimizer_offload``);
- **update**: the actor at its peak (parameters, gradients, optimizer state, FSDP2's gathered
  layers, the micro-batch's activations, one log-prob chunk of logits), the critic at its peak
  too (the controller runs both updates at once, one process each on the same device), the
  reference's parameters, the engine asleep;
- **weight push**: the ranks' state after offload, the engine's woken weights, the staging
  buffer the ranks pack the weights into and one gathered fp32 tensor.

What a training rank holds of each role (its state, a role's update at its peak) is counted in
``trainer.loop.plan.rank_memory``; this module adds the engine, the push's staging and the
processes' contexts around it.

Every process on an accelerator adds what it holds beyond its tensors (``hal.process_bytes``:
context, workspaces, allocator cache; measured on NVIDIA GPUs), and the buffers of each
collective communicator it builds (``hal.communicator_buffer_bytes``: one per training process,
its role's group; one per engine process whose tensor parallelism is above 1). ``crossrl
layout`` prints the table and ``trainer.loop.start.preflight`` refuses a job whose phase does
not fit, naming the key to change (both in ``trainer.loop.plan.memory_report``).
docs/cluster.md ("Memory budget") explains each term and shows the shipped configs' tables.

``before_fixes=True`` is the model of the trainer before issue 24's fixes, kept to show what
they bought: every rank held whole fp32 gradients through gradient accumulation (gradient
sync off until the last micro-batch), kept its sharded gradients until the next update, and
pushed weights in 64 MB buckets before offloading its optimizer state.

Pure: reads ``config.json`` files only; no torch, no device. Sizes are bytes; printed GB are
1e9 bytes. Estimates, not measurements: allocator caching and fragmentation come on top.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hal import DEFAULT_DEVICE_MEMORY_BYTES, DEFAULT_DEVICE_NAMES  # noqa: F401 - re-exported
from hal.device_memory import allocator_reserve, communicator_buffer_bytes, process_bytes
from trainer.config.schema import Config
from trainer.loop.plan.layout import weight_transport_rule
from trainer.loop.plan.model_shape import ModelShape, model_shape
from trainer.loop.plan.rank_memory import DTYPE_BYTES, RankState

__all__ = ["COMPONENTS", "MemoryBudget", "Phase", "budget_for", "estimate_memory"]

GB = 1e9
#: A process's device context (the device runtime and its kernels), bytes, where nothing more
#: is measured (Ascend: ``hal.process_bytes``); communicator buffers come on top
#: (``hal.communicator_buffer_bytes``).
CONTEXT_BYTES = 0.5e9
#: Allocator slack the streamed weight push leaves free beside its staging
#: (``trainer.loop.weights.weight_push``'s reserve, with one gathered fp32 tensor).
STAGING_SLACK_BYTES = 1 << 30
#: The weight push's bucket before issue 24's streamed push (``push_weights(64 << 20)``).
BEFORE_BUCKET_BYTES = 64 << 20

#: The columns of a phase, in table order, with what each counts.
COMPONENTS: dict[str, str] = {
    "params": "sharded fp32 parameters of every training role",
    "grads": "gradients: fp32 shards, and the LM head's whole gradient in backward",
    "optim": "AdamW state on the device: two fp32 moments (and a temporary in its step)",
    "gather": "update: FSDP2's gathered layers and root (param_dtype) and a layer's "
    "reduce-scatter input; push: the staging buffer and one gathered fp32 tensor",
    "activ": "activations of one micro-batch",
    "logits": "one log-prob chunk of fp32 logits and its softmax work",
    "kernel": "the kernel set's own buffers: the fused LM head's fp32 [V, H] gradient sum",
    "engine": "rollout engine: awake (rollout.memory_fraction of the device) or its weights",
    "ctx": "device context of every process on the device and its communicators' buffers",
}


# ----------------------------------------------------------------------------- the estimate


@dataclass(frozen=True)
class Phase:
    """One phase of a step on one device: bytes by ``COMPONENTS`` key."""

    name: str
    parts: dict[str, float]

    @property
    def total(self) -> float:
        """Bytes of the whole phase."""
        return float(sum(self.parts.values()))


@dataclass(frozen=True)
class MemoryBudget:
    """The phases of a step on one device (the host on the CPU) against its memory."""

    device: str  # a HAL backend name (hal.BACKEND_NAMES)
    device_memory_bytes: float
    memory_source: str  # where device_memory_bytes came from, for printing
    shape: ModelShape
    micro_batch_tokens: int
    phases: tuple[Phase, ...]
    critic_shape: ModelShape | None = None
    ranks_per_memory: int = 1
    before_fixes: bool = False
    #: bytes the device's caching allocator reserves per byte of tensors (hal)
    allocator_reserve: float = 1.0

    def reserved(self, name: str) -> float:
        """Bytes phase ``name`` takes from the device as its caching allocator reserves them:
        its tensors times ``allocator_reserve`` (cached blocks, fragmentation), the engine's
        own pool and the processes' contexts as they are."""
        parts = self.phase(name).parts
        apart = parts.get("engine", 0.0) + parts.get("ctx", 0.0)
        return (sum(parts.values()) - apart) * self.allocator_reserve + apart

    @property
    def peak(self) -> Phase:
        """The phase that needs the most memory."""
        return max(self.phases, key=lambda p: p.total)

    @property
    def over(self) -> list[Phase]:
        """Phases that need more than the device has."""
        return [p for p in self.phases if p.total > self.device_memory_bytes]

    def phase(self, name: str) -> Phase:
        """The phase called ``name``; KeyError if there is none."""
        for p in self.phases:
            if p.name == name:
                return p
        raise KeyError(name)


def _zero() -> dict[str, float]:
    return dict.fromkeys(COMPONENTS, 0.0)


def _add(*parts: dict[str, float]) -> dict[str, float]:
    out = _zero()
    for p in parts:
        for k, v in p.items():
            out[k] += v
    return out


def estimate_memory(
    cfg: Config,
    shape: ModelShape,
    device_memory_bytes: float,
    *,
    device: str,
    memory_source: str = "",
    critic_shape: ModelShape | None = None,
    ranks_per_memory: int = 1,
    before_fixes: bool = False,
    communicator_bytes: float | None = None,
) -> MemoryBudget:
    """The phases of one step of ``cfg`` on one device of ``device_memory_bytes`` bytes
    (see the module docstring). ``device``: a HAL backend name; on the CPU the memory is the
    host's, shared by ``ranks_per_memory`` ranks and their engine replicas, and offloading
    moves nothing off it. ``critic_shape``: the critic's (default ``shape``).
    ``before_fixes``: the model of the trainer before issue 24's fixes.
    ``communicator_bytes``: device bytes of one communicator's buffers (default
    ``hal.communicator_buffer_bytes(device)``, which reads the environment)."""
    roll, tp = cfg.rollout, cfg.rollout.tensor_parallel_size
    host = device == "cpu"
    critic = critic_shape or shape
    ranks = RankState.of(cfg, shape, critic, host=host, before_fixes=before_fixes, device=device)
    lora = cfg.model.lora.enabled

    def per_memory(parts: dict[str, float]) -> dict[str, float]:
        """A rank's parts times the ranks that share this memory."""
        return {k: v * ranks_per_memory for k, v in parts.items()}

    # Engines of their own (rollout.engine_devices) never sleep, and on an accelerator sit on
    # devices of their own: a phase of their own below.
    separate = bool(roll.engine_devices) and not before_fixes
    model_bytes = (shape.num_params + ranks.n_adapters) * DTYPE_BYTES[cfg.model.dtype]
    awake, asleep = _engine_memory(
        cfg, shape, device_memory_bytes, model_bytes, host, separate, ranks_per_memory
    )
    engine_weights = asleep if host else model_bytes / tp

    processes = (1 + (ranks.n_ref > 0) + (ranks.n_critic > 0) + 1) * ranks_per_memory
    # Each training process joins its role's group (one communicator); an engine builds one
    # for its tensor-parallel group when it has one.
    comm = communicator_buffer_bytes(device) if communicator_bytes is None else communicator_bytes
    training_comms = (processes - ranks_per_memory) * comm
    engine_comms = ranks_per_memory * comm if tp > 1 else 0.0
    context = process_bytes(device)  # a process's memory beyond its tensors
    ctx = {"ctx": 0.0 if host else processes * context + training_comms + engine_comms}

    rollout = _add(per_memory(ranks.resident(offloaded=True)), {"engine": awake}, ctx)

    actor = ranks.role_peak(shape, ranks.n_actor, lm_head=True, trained=ranks.n_trained)
    others = [{"params": ranks.shard(ranks.n_ref + ranks.n_copy, 4) if ranks.state_here else 0.0}]
    if ranks.n_critic:
        others.append(ranks.role_peak(critic, ranks.n_critic, lm_head=False))
    update = _add(per_memory(_add(actor, *others)), {"engine": asleep}, ctx)

    state = per_memory(ranks.resident(offloaded=not before_fixes))
    room = device_memory_bytes - sum(state.values()) - ctx["ctx"] - engine_weights
    staging, gathered = _push_staging(cfg, shape, model_bytes, ranks, room, host)
    push = _add(state, {"engine": engine_weights, "gather": staging + gathered}, ctx)

    phases = [Phase("rollout", rollout), Phase("update", update), Phase("weight push", push)]
    if separate:
        # Through the engines' transfer API (trainer.loop.weights.weight_group): rank 0 keeps
        # the whole model in the engine's dtype until the engines take it, plus the chunks in
        # flight and one communicator more; each engine worker one communicator and its chunks.
        pushed = (
            transfer_bytes(cfg, model_bytes, comm, host=host, device=device)
            if not lora
            else TransferBytes()
        )
        # the sender sends while the ranks train the next step: its chunks are in the update
        phases = _separate_phases(
            per_memory(_add(actor, *others, {"gather": pushed.sender})),
            per_memory(ranks.resident(offloaded=True)),
            engine=awake,
            # the snapshot: one gathered tensor on the device, the whole model on the host
            snapshot=(model_bytes if host else shape.largest_tensor_params * 4) + pushed.sender,
            ctx=0.0 if host else (processes - ranks_per_memory) * context + training_comms,
            engine_ctx=context + (comm if tp > 1 else 0.0) + pushed.worker,
            host=host,
            # engines of another device type (rollout.device) are not on this device's budget
            own_phase=roll.device in (None, device),
        )
    return MemoryBudget(
        device=device,
        device_memory_bytes=float(device_memory_bytes),
        memory_source=memory_source,
        shape=shape,
        micro_batch_tokens=ranks.tokens,
        phases=tuple(phases),
        critic_shape=critic_shape,
        ranks_per_memory=ranks_per_memory,
        before_fixes=before_fixes,
        allocator_reserve=allocator_reserve(device),
    )


def _engine_memory(
    cfg: Config,
    shape: ModelShape,
    device_memory_bytes: float,
    model_bytes: float,
    host: bool,
    separate: bool,
    ranks_per_memory: int,
) -> tuple[float, float]:
    """The engine's bytes on this memory awake and asleep. vLLM takes
    ``rollout.memory_fraction`` of each device awake and drops its weights and KV cache
    asleep; on the CPU it has no sleep mode and the replicas split the fraction. The HF engine:
    its weights (``model_bytes``) and the KV cache of its share of a step's rows, per replica
    on this memory. ``separate``: engines of their own (``rollout.engine_devices``)."""
    roll, tp = cfg.rollout, cfg.rollout.tensor_parallel_size
    engine_replicas = (roll.engine_devices if separate else cfg.train.dp_size) // tp
    replicas = (engine_replicas if separate else max(1, ranks_per_memory // tp)) if host else 1
    if roll.engine == "vllm":
        awake = roll.memory_fraction * device_memory_bytes
        return awake, awake if host else 0.0
    rows = math.ceil(cfg.train.batch_size / engine_replicas) * roll.n
    kv = (
        rows
        * (roll.max_input_len + roll.max_new_tokens)
        * shape.num_hidden_layers
        * 2
        * shape.num_key_value_heads
        * shape.head_dim
        * DTYPE_BYTES[cfg.model.dtype]
    )
    return replicas * (model_bytes + kv), replicas * model_bytes if host else 0.0


def _push_staging(
    cfg: Config, shape: ModelShape, model_bytes: float, ranks: RankState, room: float, host: bool
) -> tuple[float, float]:
    """The weight push's staging buffer and its one gathered fp32 tensor, bytes; ``room``: what
    the device has left beside the ranks' state, the contexts and the engine's weights. After
    the fixes the ranks offload first, then stream the weights through a staging buffer sized
    from what is left (``rollout.engines.weights.buckets.stream_buckets``): the whole model when it
    fits, else two slots of half the room."""
    eb = DTYPE_BYTES[cfg.model.dtype]
    gathered = 0.0 if host else shape.largest_tensor_params * 4
    largest_layer = max(shape.layer_params, shape.embedding_params) * eb
    if host:  # one shared model buffer on the host, each rank writing its shards in place
        staging = model_bytes
    elif ranks.before_fixes:
        staging = max(BEFORE_BUCKET_BYTES, shape.largest_tensor_params * eb)
    else:
        room -= gathered + STAGING_SLACK_BYTES
        staging = model_bytes if room >= model_bytes else 2 * max(room // 2, largest_layer)
        if weight_transport_rule(cfg) == "ipc":
            # vLLM's transfer API: one buffer the engine copies each chunk out of before it
            # loads it (WeightPush.push_transfer): the buffer and the copy within the room
            chunk = model_bytes if room >= 2 * model_bytes else max(room // 2, largest_layer)
            staging = 2 * chunk
    if cfg.model.lora.enabled:  # the push carries what trains alone: no whole tensor gathered
        staging = min(staging, ranks.n_trained * eb)  # but the embedding, when it trains
        gathered = gathered if cfg.model.lora.train_embeddings else 0.0
    return staging, gathered


@dataclass(frozen=True)
class TransferBytes:
    """Bytes of the push through the engines' transfer API (``transfer_bytes``) on training
    rank 0's device (``sender``) and on each engine worker's (``worker``)."""

    sender: float = 0.0
    worker: float = 0.0


def transfer_bytes(
    cfg: Config, model_bytes: float, comm: float, *, host: bool, device: str = ""
) -> TransferBytes:
    """Bytes the push through the engines' transfer API (``rollout.weight_transport``
    resolving to ``collective``) adds (``trainer.loop.weights.weight_group``). Rank 0 stages
    the whole model in the engine's dtype in pinned host memory (``hal.push_staging``) and
    holds on its device the gather's bucket, the producer's chunks in flight and the one it
    packs, and one communicator, through the next step's update at a lag; each engine worker
    one communicator and its chunks. On the CPU (``host``) the device is the host: the staged
    model counts there (on an accelerator ``crossrl layout`` names its host bytes,
    ``snapshot_budget.format_snapshots``). Nothing for host snapshots or colocated engines."""
    from rollout.engines.weights.transfer import PACKED_BUFFER_BYTES, PACKED_NUM_BUFFERS

    if weight_transport_rule(cfg, device=device or None) != "collective":
        return TransferBytes()
    chunk = min(float(PACKED_BUFFER_BYTES), model_bytes)  # a small model is one chunk
    chunks = PACKED_NUM_BUFFERS * chunk
    packing = 2.0 * chunk  # the gather's bucket, or the chunk being packed
    staged = model_bytes if host else 0.0
    return TransferBytes(staged + chunks + packing + comm, chunks + comm)


def _separate_phases(
    training: dict[str, float],
    between: dict[str, float],
    *,
    engine: float,
    snapshot: float,
    ctx: float,
    host: bool,
    own_phase: bool = True,
    engine_ctx: float = CONTEXT_BYTES,
) -> list[Phase]:
    """The phases of a step whose engines have devices of their own (``rollout.engine_devices``):
    on a rank's device the update (``training``: the roles at their peak) and the snapshot of
    the new weights (``between``: the state after the update, plus ``snapshot`` bytes); no
    engine there, and no sleep. On an accelerator the engine's own device is a phase of its
    own, ``engines`` (``engine`` bytes awake and ``engine_ctx``, its context and communicator
    buffers; not with ``own_phase`` False, engines
    of another device type); on the host, where every process shares the
    memory and the engines generate while the ranks train, the engines come on top of both."""
    here = {"engine": engine} if host else {}
    phases = [
        Phase("update", _add(training, here, {"ctx": ctx})),
        Phase("weight push", _add(between, {"gather": snapshot}, here, {"ctx": ctx})),
    ]
    if not host and own_phase:
        phases.append(Phase("engines", {"engine": engine, "ctx": engine_ctx}))
    return phases


def budget_for(
    cfg: Config,
    device: str,
    device_memory_bytes: float,
    memory_source: str = "",
    *,
    ranks_per_memory: int = 1,
    before_fixes: bool = False,
) -> MemoryBudget | None:
    """``estimate_memory`` with the shapes of ``model.path`` (and ``model.critic_path``) from
    ``model_shape``; None when the policy's shape is unknown (no estimate is possible)."""
    shape = model_shape(cfg.model.path)
    if shape is None:
        return None
    critic = None
    if cfg.critic.enable and cfg.model.critic_path is not None:
        critic = model_shape(cfg.model.critic_path)
    return estimate_memory(
        cfg,
        shape,
        device_memory_bytes,
        device=device,
        memory_source=memory_source,
        critic_shape=critic,
        ranks_per_memory=ranks_per_memory,
        before_fixes=before_fixes,
    )
