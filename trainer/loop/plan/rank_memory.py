"""What one training rank holds of a step, by role, in bytes (``trainer.loop.plan.memory_budget``
adds the engine, the push's staging and the processes' contexts around it).

``RankState.of(cfg, shape, ...)`` counts, once per step, the parameters of every role on a rank
(actor, reference, LoRA's base copies, critic), which of them train, and where their sharded
state lives (the device, or the host under ``train.param_offload`` /
``train.optimizer_offload``); ``resident`` is that state between steps and ``role_peak`` one
role's update at its peak: parameters, gradients, optimizer state, FSDP2's gathered layers, the
micro-batch's activations (``recompute_bytes`` / ``saved_bytes``), one log-prob chunk of
logits and the kernel set's own buffers (the fused LM head's float32 weight-gradient
accumulator, where the device's kernel set runs it). Pure: no torch, no device; sizes are
bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hal.device_memory import FUSED_HEAD_DEVICES
from trainer.config.schema import Config
from trainer.loop.plan.lora_layout import adapter_params, base_copy_params
from trainer.loop.plan.model_shape import ModelShape

#: Float32 logits of one lean log-prob chunk, bytes (``trainer.loop.ranks.forward``'s
#: ``LEAN_CHUNK_BYTES``, which a test holds equal; that module imports torch).
LEAN_CHUNK_BYTES = 128 * 2**20
#: Tokens per chunk of the plain log-prob path (``token_logprobs``' default).
PLAIN_CHUNK_TOKENS = 4096
#: Tensors of a log-prob chunk alive at once in backward: logits, log-softmax, probabilities.
CHUNK_COPIES = 3
DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
#: LoRA's update holds this many micro-batch x hidden tensors (param_dtype) beyond a full
#: fine-tune's activations: input gradients summed from the base and the adapter paths.
LORA_INPUT_GRADS = 3.5


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


def fused_head(cfg: Config, device: str | None) -> bool:
    """Whether ``cfg``'s update runs the fused LM head (``hal.fused_head``) on backend
    ``device``: its kernel set offers it (``hal.device_memory.FUSED_HEAD_DEVICES``), the lean
    path runs (``train.lean_logprobs``), neither ``train.kernels: reference`` nor
    ``train.reference_kernels`` keeps the reference, and no LoRA wraps or freezes the head."""
    train = cfg.train
    return (
        device in FUSED_HEAD_DEVICES
        and train.lean_logprobs
        and train.kernels != "reference"
        and "lm_head" not in train.reference_kernels
        and not cfg.model.lora.enabled
    )


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


@dataclass(frozen=True)
class RankState:
    """The parameter counts of every role on one training rank's device and where their
    sharded state lives; counts are whole-model parameters (``shard`` divides by dp)."""

    cfg: Config
    tokens: int  # of the largest micro-batch (``micro_batch_tokens``)
    n_actor: int  # the actor's parameters, FSDP2's row padding and LoRA's adapters included
    n_trained: int  # the actor's parameters with gradients (its adapters under LoRA)
    n_adapters: int  # LoRA's adapter parameters (0 without LoRA)
    n_ref: int  # a reference model's (a KL term without LoRA)
    n_copy: int  # LoRA's frozen base copies of a trained embedding and LM head
    n_critic: int  # the critic's (0 without one)
    state_here: bool  # the sharded state on the device (not FSDP2's CPU offload)
    optim_between: bool  # the optimizer state stays on the device between steps
    optim_in_update: bool  # ... and during the update
    before_fixes: bool  # the trainer before issue 24's fixes
    fused_head: bool = False  # the lean path's LM head runs hal.fused_head (``fused_head``)

    @classmethod
    def of(
        cls,
        cfg: Config,
        shape: ModelShape,
        critic: ModelShape,
        *,
        host: bool,
        before_fixes: bool = False,
        device: str | None = None,
    ) -> RankState:
        """The counts of ``cfg``'s roles (the actor of ``shape``, the critic of ``critic``);
        ``host``: the memory is the host's (the CPU), where offloading moves nothing off it;
        ``device``: the HAL backend the ranks run on (which kernels they take)."""
        train, dp = cfg.train, cfg.train.dp_size
        # FSDP2 pads each tensor's rows to a multiple of dp (``ModelShape.padded_params``).
        n_actor = shape.padded_params(dp)
        pad = critic.padded_params(dp) - critic.num_params
        n_critic = critic.value_model_params + pad if cfg.critic.enable else 0
        lora = cfg.model.lora.enabled
        # LoRA (model.lora): only the adapters (and the embeddings, when they train) have
        # gradients and optimizer state; the reference is the actor with its adapters off ...
        n_adapters = adapter_params(cfg, shape) if lora else 0
        n_trained = n_adapters if lora else n_actor
        n_actor += n_adapters
        # Where the sharded state lives: the device, unless FSDP2's CPU offload keeps it on the
        # host; the optimizer state between steps also goes to the host with optimizer_offload.
        state_here = host or not train.param_offload
        optim_between = state_here and (host or not train.optimizer_offload)
        return cls(
            cfg=cfg,
            tokens=micro_batch_tokens(cfg),
            n_actor=n_actor,
            n_trained=n_trained,
            n_adapters=n_adapters,
            n_ref=n_actor if cfg.algorithm.kl_coef > 0 and not lora else 0,
            # ... which keeps a frozen copy of the base embedding and LM head when those train
            n_copy=base_copy_params(cfg, shape),
            n_critic=n_critic,
            state_here=state_here,
            optim_between=optim_between,
            # With more than one optimizer step per step the state, brought back for the first
            # one, stays on the device until the end of the step: offload does not lower the
            # update.
            optim_in_update=state_here and (optim_between or cfg.optimizer_steps_per_step() > 1),
            before_fixes=before_fixes,
            fused_head=fused_head(cfg, device),
        )

    @property
    def param_bytes(self) -> int:
        """Bytes of one element in ``train.param_dtype`` (what the update computes in)."""
        return DTYPE_BYTES[self.cfg.train.param_dtype]

    @property
    def reduce_bytes(self) -> int:
        """Bytes of one element in ``train.reduce_dtype`` (what gradients are reduced in)."""
        return DTYPE_BYTES[self.cfg.train.reduce_dtype]

    def shard(self, count: int, nbytes: int) -> float:
        """Bytes of one rank's shard of ``count`` parameters of ``nbytes`` bytes each."""
        return count * nbytes / self.cfg.train.dp_size

    def resident(self, offloaded: bool) -> dict[str, float]:
        """Every role's state between steps; ``offloaded``: after ``offload_states``."""
        here = self.state_here
        n_trained = self.n_trained + self.n_critic
        every = self.n_actor + self.n_ref + self.n_copy + self.n_critic
        keep_optim = self.optim_between if offloaded else here
        return {
            "params": self.shard(every, 4) if here else 0.0,
            # Before the fixes the last update's sharded gradients stayed until the next one.
            "grads": self.shard(n_trained, 4) if self.before_fixes and here else 0.0,
            "optim": self.shard(n_trained, 8) if keep_optim else 0.0,
        }

    def role_peak(
        self, role_shape: ModelShape, n: int, lm_head: bool, trained: int | None = None
    ) -> dict[str, float]:
        """One training role's update at its peak, the larger of its backward and its
        optimizer step; ``trained``: the parameters with gradients (default all ``n``)."""
        trained = n if trained is None else trained
        params = self.shard(n, 4) if self.state_here else 0.0
        sharded_grads = self.shard(trained, 4) if self.state_here else 0.0
        activ, recompute = self._activations(role_shape, lora=trained != n)
        backward = {
            "params": params,
            "grads": self._backward_grads(role_shape, n, lm_head, trained, sharded_grads),
            "optim": self.shard(trained, 8) if self.optim_in_update else 0.0,
            "gather": self._gathered(role_shape, n, lm_head, trained),
            "activ": activ,
            "logits": self._logits(role_shape, recompute) if lm_head else 0.0,
            "kernel": self._kernel_buffers(role_shape, lm_head, trained == n),
        }
        # The optimizer step: no activations, but foreach AdamW's temporary of the second
        # moment's square root (4 B per parameter shard) beside the state.
        step = {
            "params": params,
            "grads": sharded_grads,
            "optim": self.shard(trained, 12) if self.state_here else 0.0,
        }
        return backward if sum(backward.values()) >= sum(step.values()) else step

    def _head(self, role_shape: ModelShape, lm_head: bool) -> int:
        """The head's parameters: the LM head (one tensor with the embedding when tied) or the
        critic's value head."""
        return role_shape.embedding_params if lm_head else role_shape.hidden_size + 1

    def _backward_grads(
        self, role_shape: ModelShape, n: int, lm_head: bool, trained: int, sharded: float
    ) -> float:
        """Gradients in backward: the sharded ones and the head's whole gradient."""
        pb, rb = self.param_bytes, self.reduce_bytes
        # Before the fixes gradient sync was off until the last micro-batch: FSDP2 kept every
        # parameter's whole gradient in reduce_dtype through the accumulation.
        grads = trained * rb if self.before_fixes else sharded
        if trained == n or self.cfg.model.lora.train_embeddings:
            # the head's whole gradient exists from the start of backward
            grads += self._head(role_shape, lm_head) * pb
        return grads

    def _gathered(self, role_shape: ModelShape, n: int, lm_head: bool, trained: int) -> float:
        """FSDP2's gathered layers (two at once) and root, and a layer's reduce-scatter input.
        FSDP2 keeps the root's parameters (embedding, final norm, head) gathered from the
        forward to the end of the backward."""
        pb, rb = self.param_bytes, self.reduce_bytes
        tied = lm_head and role_shape.tie_word_embeddings
        head = 0 if tied else self._head(role_shape, lm_head)
        root = role_shape.embedding_params + role_shape.hidden_size + head
        # a layer's reduce-scatter input: its gradients, which LoRA has for the adapters alone
        train = self.cfg.train
        layer = role_shape.padded_layer_params(train.dp_size, train.expert_parallel_size)
        scattered = layer if trained == n else trained / role_shape.num_hidden_layers
        return (2 * layer + root) * pb + scattered * rb

    def _activations(self, role_shape: ModelShape, lora: bool) -> tuple[float, float]:
        """The micro-batch's activations, and what the layer being recomputed holds (0 without
        activation checkpointing)."""
        pb = self.param_bytes
        h, tokens = role_shape.hidden_size, self.tokens
        kept = tokens * h * pb
        recompute = 0.0
        if self.cfg.train.activation_checkpointing:
            # Each layer keeps its input; the one being recomputed holds, in its backward,
            # what FSDPMemTracker sees there (tests/test_memory_tracker.py).
            recompute = recompute_bytes(role_shape, tokens, pb)
            activ = (role_shape.num_hidden_layers + 1) * kept + recompute
        else:
            activ = saved_bytes(role_shape, tokens, pb) + kept
        if lora:
            # LoRA: a target's input gradient comes down two paths (the frozen weight and the
            # adapters) and is summed; FSDPMemTracker measured 3.4 x T x H in param_dtype on
            # top at the 7B shape (2 and 4 layers, 8k and 16k tokens): 3.5 is counted.
            activ += LORA_INPUT_GRADS * tokens * h * pb
        return activ, recompute

    def _kernel_buffers(self, role_shape: ModelShape, lm_head: bool, full: bool) -> float:
        """The kernel set's own buffers in backward: the fused head's float32 ``[V, H]``
        weight-gradient accumulator (``hal.fused_head``), alive through the head's backward
        beside the head's gradient, when the head trains (``full``: every parameter does)."""
        if not (self.fused_head and lm_head and full):
            return 0.0
        return role_shape.vocab_size * role_shape.hidden_size * 4.0

    def _logits(self, role_shape: ModelShape, recompute: float) -> float:
        """One log-prob chunk of fp32 logits and its softmax work (the lean path), or the whole
        micro-batch's logits and a chunk on top (the plain path)."""
        train, vocab, tokens = self.cfg.train, role_shape.vocab_size, self.tokens
        if not train.lean_logprobs:  # the full logits stay for backward, fp32 chunks on top
            chunk = min(tokens, PLAIN_CHUNK_TOKENS)
            return tokens * vocab * self.param_bytes + CHUNK_COPIES * chunk * vocab * 4
        chunk = min(tokens, max(1, LEAN_CHUNK_BYTES // (4 * vocab)))
        logits = CHUNK_COPIES * chunk * vocab * 4
        # The head's chunk and a layer's recompute are never alive at once (the head's backward
        # ends before the last layer's begins): only the part beyond the recompute raises the
        # peak (recompute is 0 without activation checkpointing).
        return max(0.0, logits - recompute)
