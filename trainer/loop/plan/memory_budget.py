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

Every process on an accelerator adds what it holds beyond its tensors
(``hal.process_bytes``: context, workspaces, allocator cache; measured on NVIDIA GPUs), and the buffers
of each collective communicator it builds (``hal.communicator_buffer_bytes``: one per training
process, its role's group; one per engine process whose tensor parallelism is above 1). ``crossrl layout``
prints the table and ``trainer.loop.start.preflight`` refuses a job whose phase does not fit, naming
the key to change (both in ``trainer.loop.plan.memory_report``). docs/cluster.md ("Memory budget")
explains each term and shows the shipped configs' tables.

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
from hal.device_memory import communicator_buffer_bytes, process_bytes
from trainer.config.schema import Config
from trainer.loop.plan.layout import weight_transport_rule
from trainer.loop.plan.lora_layout import adapter_params, base_copy_params
from trainer.loop.plan.model_shape import ModelShape, model_shape

__all__ = [
    "COMPONENTS",
    "MemoryBudget",
    "Phase",
    "budget_for",
    "estimate_memory",
    "micro_batch_tokens",
    "recompute_bytes",
    "saved_bytes",
]

GB = 1e9
#: A process's device context (the device runtime and its kernels), bytes, where nothing more
#: is measured (Ascend: ``hal.process_bytes``); communicator buffers come on top
#: (``hal.communicator_buffer_bytes``).
CONTEXT_BYTES = 0.5e9
#: Float32 logits of one lean log-prob chunk, bytes (``trainer.loop.ranks.forward``'s
#: ``LEAN_CHUNK_BYTES``, which a test holds equal; that module imports torch).
LEAN_CHUNK_BYTES = 128 * 2**20
#: Tokens per chunk of the plain log-prob path (``token_logprobs``' default).
PLAIN_CHUNK_TOKENS = 4096
#: Tensors of a log-prob chunk alive at once in backward: logits, log-softmax, probabilities.
CHUNK_COPIES = 3
#: Allocator slack the streamed weight push leaves free beside its staging
#: (``trainer.loop.weights.weight_push``'s reserve, with one gathered fp32 tensor).
STAGING_SLACK_BYTES = 1 << 30
#: The weight push's bucket before issue 24's streamed push (``push_weights(64 << 20)``).
BEFORE_BUCKET_BYTES = 64 << 20
DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
#: LoRA's update holds this many micro-batch x hidden tensors (param_dtype) beyond a full
#: fine-tune's activations: input gradients summed from the base and the adapter paths.
LORA_INPUT_GRADS = 3.5

#: The columns of a phase, in table order, with what each counts.
COMPONENTS: dict[str, str] = {
    "params": "sharded fp32 parameters of every training role",
    "grads": "gradients: fp32 shards, and the LM head's whole gradient in backward",
    "optim": "AdamW state on the device: two fp32 moments (and a temporary in its step)",
    "gather": "update: FSDP2's gathered layers and root (param_dtype) and a layer's "
    "reduce-scatter input; push: the staging buffer and one gathered fp32 tensor",
    "activ": "activations of one micro-batch",
    "logits": "one log-prob chunk of fp32 logits and its softmax work",
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


def micro_batch_tokens(cfg: Config) -> int:
    """Tokens of the largest micro-batch a rank runs: ``train.max_tokens_per_micro_batch``,
    or a row of ``rollout.max_input_len + rollout.max_new_tokens`` tokens when that is longer
    (a longer row goes alone); null budget: all of a rank's rows of one mini-batch
    (``train.mini_batch_size`` prompts x ``rollout.n`` samples x one row per turn when
    step-wise, each as long as a row can be, over ``train.dp_size`` ranks)."""
    roll, train = cfg.rollout, cfg.train
    row = roll.max_input_len + roll.max_new_tokens
    if train.max_tokens_per_micro_batch is not None:
        return max(train.max_tokens_per_micro_batch, row)
    rows = train.mini_batch_size * roll.n * (roll.max_turns if roll.step_wise else 1)
    return math.ceil(rows / train.dp_size) * row


def recompute_bytes(shape: ModelShape, tokens: int, param_bytes: int) -> float:
    """Bytes one activation-checkpointed decoder layer holds at the peak of its backward, for a
    micro-batch of ``tokens`` tokens computed in ``param_bytes``-byte floats: six ``[T, i]`` MLP
    tensors (gate, up, their activation and product, and gradients), seven ``[T, h]`` (the
    layer's input, attention projections and output, residuals and gradients) and the
    RMSNorms' two float32 ``[T, h]`` copies. At bf16 that is ``T x (12 i + 22 h)`` bytes,
    within a few percent of FSDPMemTracker's count of the same backward at Qwen2.5's shapes
    (``tests/test_memory_tracker.py``); the budget before issue 32 counted
    ``T x (4 h + 3 i) x 2``, half of it. A mixture of experts' sparse layer holds its experts'
    instead of the six ``[T, i]`` (``Experts.backward_bytes``); the larger layer counts."""
    h = shape.hidden_size
    mlps = []
    if shape.sparse_layers < shape.num_hidden_layers:
        mlps.append(tokens * 6 * shape.intermediate_size * param_bytes)
    if shape.experts is not None and shape.sparse_layers:
        mlps.append(shape.experts.backward_bytes(tokens, h, param_bytes))
    return float(tokens * (7 * h * param_bytes + 2 * h * 4) + max(mlps))


def saved_bytes(shape: ModelShape, tokens: int, param_bytes: int) -> float:
    """Bytes every decoder layer saves for its backward without activation checkpointing:
    ``T x (4 h + 3 i)`` in param_dtype per dense layer, a sparse layer's experts
    (``Experts.saved_bytes``) instead of its ``3 i``."""
    h = shape.hidden_size
    attention = tokens * 4 * h * param_bytes
    dense = shape.num_hidden_layers - shape.sparse_layers
    total = dense * (attention + tokens * 3 * shape.intermediate_size * param_bytes)
    if shape.experts is not None:
        moe = shape.experts.saved_bytes(tokens, h, param_bytes)
        total += shape.sparse_layers * (attention + moe)
    return float(total)


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
    train, roll = cfg.train, cfg.rollout
    host = device == "cpu"
    dp, tp = train.dp_size, roll.tensor_parallel_size
    pb, rb = DTYPE_BYTES[train.param_dtype], DTYPE_BYTES[train.reduce_dtype]
    eb = DTYPE_BYTES[cfg.model.dtype]
    tokens = micro_batch_tokens(cfg)
    # FSDP2 pads each tensor's rows to a multiple of dp (``ModelShape.padded_params``).
    n_actor = shape.padded_params(dp)
    critic = critic_shape or shape
    pad = critic.padded_params(dp) - critic.num_params
    n_critic = critic.value_model_params + pad if cfg.critic.enable else 0
    lora = cfg.model.lora.enabled
    # LoRA (model.lora): only the adapters (and the embeddings, when they train) have
    # gradients and optimizer state; the reference is the actor with its adapters off.
    n_adapters = adapter_params(cfg, shape) if lora else 0
    n_trained = n_adapters if lora else n_actor
    n_actor += n_adapters
    n_ref = n_actor if cfg.algorithm.kl_coef > 0 and not lora else 0
    # ... but keeps a frozen copy of the base embedding and LM head when those train whole
    n_copy = base_copy_params(cfg, shape)
    # Where the sharded state lives: the device, unless FSDP2's CPU offload keeps it on the
    # host; the optimizer state between steps also goes to the host with optimizer_offload.
    state_here = host or not train.param_offload
    optim_between = state_here and (host or not train.optimizer_offload)
    # With more than one optimizer step per step the state, brought back for the first one,
    # stays on the device until the end of the step: offload does not lower the update.
    optim_in_update = state_here and (optim_between or cfg.optimizer_steps_per_step() > 1)

    def shard(count: int, nbytes: int) -> float:
        return count * nbytes / dp

    def resident(offloaded: bool) -> dict[str, float]:
        """Every role's state between steps; ``offloaded``: after ``offload_states``."""
        params = shard(n_actor + n_ref + n_copy + n_critic, 4) if state_here else 0.0
        keep_optim = optim_between if offloaded else state_here
        optim = shard(n_trained + n_critic, 8) if keep_optim else 0.0
        # Before the fixes the last update's sharded gradients stayed until the next one.
        grads = shard(n_trained + n_critic, 4) if before_fixes and state_here else 0.0
        return {"params": params, "grads": grads, "optim": optim}

    def role_peak(
        role_shape: ModelShape, n: int, lm_head: bool, trained: int | None = None
    ) -> dict[str, float]:
        """One training role's update at its peak, the larger of its backward and its
        optimizer step; ``trained``: the parameters with gradients (default all ``n``)."""
        trained = n if trained is None else trained
        h, layers = role_shape.hidden_size, role_shape.num_hidden_layers
        # The head: the LM head (one tensor with the embedding when tied) or the critic's
        # value head. FSDP2 keeps the root's parameters (embedding, final norm, head)
        # gathered from the forward to the end of the backward.
        head = role_shape.embedding_params if lm_head else h + 1
        tied = lm_head and role_shape.tie_word_embeddings
        root = role_shape.embedding_params + h + (0 if tied else head)
        sharded_grads = shard(trained, 4) if state_here else 0.0
        # Before the fixes gradient sync was off until the last micro-batch: FSDP2 kept every
        # parameter's whole gradient in reduce_dtype through the accumulation.
        grads = trained * rb if before_fixes else sharded_grads
        if trained == n or cfg.model.lora.train_embeddings:
            grads += head * pb  # the head's whole gradient exists from the start of backward
        # a layer's reduce-scatter input: its gradients, which LoRA has for the adapters alone
        layer = role_shape.padded_layer_params(dp)
        scattered = layer if trained == n else trained / layers
        gather = (2 * layer + root) * pb + scattered * rb
        kept = tokens * h * pb
        if train.activation_checkpointing:
            # Each layer keeps its input; the one being recomputed holds, in its backward,
            # what FSDPMemTracker sees there (tests/test_memory_tracker.py).
            recompute = recompute_bytes(role_shape, tokens, pb)
            activ = (layers + 1) * kept + recompute
        else:
            activ = saved_bytes(role_shape, tokens, pb) + kept
        if trained != n:
            # LoRA: a target's input gradient comes down two paths (the frozen weight and the
            # adapters) and is summed; FSDPMemTracker measured 3.4 x T x H in param_dtype on
            # top at the 7B shape (2 and 4 layers, 8k and 16k tokens): 3.5 is counted.
            activ += LORA_INPUT_GRADS * tokens * h * pb
        logits = 0.0
        if lm_head:
            vocab = role_shape.vocab_size
            if train.lean_logprobs:
                chunk = min(tokens, max(1, LEAN_CHUNK_BYTES // (4 * vocab)))
                logits = CHUNK_COPIES * chunk * vocab * 4
                if train.activation_checkpointing:
                    # The head's chunk and a layer's recompute are never alive at once (the
                    # head's backward ends before the last layer's begins): only the part of
                    # the chunk beyond the recompute raises the peak.
                    logits = max(0.0, logits - recompute)
            else:  # the full logits stay for backward, chunks of them in fp32 on top
                chunk = min(tokens, PLAIN_CHUNK_TOKENS)
                logits = tokens * vocab * pb + CHUNK_COPIES * chunk * vocab * 4
        params = shard(n, 4) if state_here else 0.0
        backward = {
            "params": params,
            "grads": grads,
            "optim": shard(trained, 8) if optim_in_update else 0.0,
            "gather": gather,
            "activ": activ,
            "logits": logits,
        }
        # The optimizer step: no activations, but foreach AdamW's temporary of the second
        # moment's square root (4 B per parameter shard) beside the state.
        step = {
            "params": params,
            "grads": sharded_grads,
            "optim": shard(trained, 12) if state_here else 0.0,
        }
        return backward if sum(backward.values()) >= sum(step.values()) else step

    # The engine: vLLM takes memory_fraction of each device awake and drops its weights and
    # KV cache asleep; on the CPU it has no sleep mode and the replicas split the fraction.
    # Engines of their own (rollout.engine_devices) never sleep, and on an accelerator sit on
    # devices of their own: a phase of their own below.
    separate = bool(roll.engine_devices) and not before_fixes
    engine_replicas = (roll.engine_devices if separate else dp) // tp
    replicas = (engine_replicas if separate else max(1, ranks_per_memory // tp)) if host else 1
    model_bytes = (shape.num_params + n_adapters) * eb  # the engine's weights: no padding
    if roll.engine == "vllm":
        awake = roll.memory_fraction * device_memory_bytes
        asleep = awake if host else 0.0
    else:  # hf: its weights and the KV cache of its share of a step's rows
        rows = math.ceil(cfg.train.batch_size / engine_replicas) * roll.n
        kv = (
            rows
            * (roll.max_input_len + roll.max_new_tokens)
            * shape.num_hidden_layers
            * 2
            * shape.num_key_value_heads
            * shape.head_dim
            * eb
        )
        awake = replicas * (model_bytes + kv)
        asleep = replicas * model_bytes if host else 0.0
    engine_weights = asleep if host else model_bytes / tp

    processes = (1 + (n_ref > 0) + (n_critic > 0) + 1) * ranks_per_memory
    # Each training process joins its role's group (one communicator); an engine builds one
    # for its tensor-parallel group when it has one.
    comm = communicator_buffer_bytes(device) if communicator_bytes is None else communicator_bytes
    training_comms = (processes - ranks_per_memory) * comm
    engine_comms = ranks_per_memory * comm if tp > 1 else 0.0
    context = process_bytes(device)  # a process's memory beyond its tensors
    ctx = {"ctx": 0.0 if host else processes * context + training_comms + engine_comms}

    def per_memory(parts: dict[str, float]) -> dict[str, float]:
        """A rank's parts times the ranks that share this memory."""
        return {k: v * ranks_per_memory for k, v in parts.items()}

    rollout = _add(per_memory(resident(offloaded=True)), {"engine": awake}, ctx)

    actor = role_peak(shape, n_actor, lm_head=True, trained=n_trained)
    others = [{"params": shard(n_ref + n_copy, 4) if state_here else 0.0}]
    if n_critic:
        others.append(role_peak(critic, n_critic, lm_head=False))
    update = _add(per_memory(_add(actor, *others)), {"engine": asleep}, ctx)

    # The weight push: after the fixes the ranks offload first, then stream the weights
    # through a staging buffer sized from what is left (rollout.engines.buckets.
    # stream_buckets): the whole model when it fits, else two slots of half the room.
    state = per_memory(resident(offloaded=not before_fixes))
    gathered = 0.0 if host else shape.largest_tensor_params * 4
    largest_layer = max(shape.layer_params, shape.embedding_params) * eb
    if host:  # one shared model buffer on the host, each rank writing its shards in place
        staging = model_bytes
    elif before_fixes:
        staging = max(BEFORE_BUCKET_BYTES, shape.largest_tensor_params * eb)
    else:
        room = device_memory_bytes - sum(state.values()) - ctx["ctx"] - engine_weights
        room -= gathered + STAGING_SLACK_BYTES
        staging = model_bytes if room >= model_bytes else 2 * max(room // 2, largest_layer)
        if weight_transport_rule(cfg) == "ipc":
            # vLLM's transfer API: one buffer the engine copies each chunk out of before it
            # loads it (WeightPush.push_transfer): the buffer and the copy within the room
            chunk = model_bytes if room >= 2 * model_bytes else max(room // 2, largest_layer)
            staging = 2 * chunk
    if lora:  # the push carries what trains alone (model.lora): no whole tensor gathered
        staging = min(staging, n_trained * eb)  # but the embedding, when it trains
        gathered = gathered if cfg.model.lora.train_embeddings else 0.0
    push = _add(state, {"engine": engine_weights, "gather": staging + gathered}, ctx)

    phases = [Phase("rollout", rollout), Phase("update", update), Phase("weight push", push)]
    if separate:
        # Through the engines' transfer API (trainer.loop.weights.weight_group): rank 0 keeps
        # the whole model in the engine's dtype until the engines take it, plus the chunks in
        # flight and one communicator more; each engine worker one communicator and its chunks.
        pushed = transfer_bytes(cfg, model_bytes, comm) if not lora else (0.0, 0.0)
        phases = _separate_phases(
            per_memory(_add(actor, *others)),
            per_memory(resident(offloaded=True)),
            engine=awake,
            # the snapshot: one gathered tensor on the device, the whole model on the host
            snapshot=(model_bytes if host else shape.largest_tensor_params * 4) + pushed[0],
            ctx=0.0 if host else (processes - ranks_per_memory) * context + training_comms,
            engine_ctx=context + (comm if tp > 1 else 0.0) + pushed[1],
            host=host,
            # engines of another device type (rollout.device) are not on this device's budget
            own_phase=roll.device in (None, device),
        )
    return MemoryBudget(
        device=device,
        device_memory_bytes=float(device_memory_bytes),
        memory_source=memory_source,
        shape=shape,
        micro_batch_tokens=tokens,
        phases=tuple(phases),
        critic_shape=critic_shape,
        ranks_per_memory=ranks_per_memory,
        before_fixes=before_fixes,
    )


def transfer_bytes(cfg: Config, model_bytes: float, comm: float) -> tuple[float, float]:
    """Bytes the push through the engines' transfer API (``rollout.weight_transport``
    resolving to ``collective``) adds on training rank 0 (the staged model, its packed chunks
    in flight, one communicator) and on each engine worker (one communicator, its chunks);
    (0, 0) for host snapshots or colocated engines."""
    from rollout.engines.transfer import PACKED_BUFFER_BYTES, PACKED_NUM_BUFFERS

    if weight_transport_rule(cfg) != "collective":
        return 0.0, 0.0
    chunks = float(PACKED_NUM_BUFFERS * PACKED_BUFFER_BYTES)
    return model_bytes + chunks + comm, chunks + comm


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
