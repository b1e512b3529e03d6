"""Per-token log-probabilities, entropies and values of packed rows.

Convention shared with rollout: the log-probability of token ``t`` is stored at position
``t`` and comes from the logits at position ``t - 1`` of the same row. The first token of a
row has no predecessor, so its entry is 0 (it is always a prompt token with loss mask 0).

Two paths give the same numbers (``train.lean_logprobs``):

- lean (``packed_token_logprobs(..., lean=True)``, the default): the model's body gives the
  final hidden states ``[T, H]``; the LM head runs on them a chunk of tokens at a time, and
  each chunk's logits, log-softmax and entropy are recomputed in backward instead of kept. No
  ``[T, V]`` tensor ever exists; the largest one is a chunk's ``[chunk, V]`` (``LEAN_CHUNK_BYTES``).
  Where the kernel set chose the fused head (``hal.kernels`` op ``lm_head``), it computes the
  same per chunk with a closed-form backward (``hal.fused_head``).
- plain (``lean=False``): the model's full ``[T, V]`` logits, then ``token_logprobs`` /
  ``token_entropy`` chunk by chunk over them. The logits stay alive until backward.
"""

from __future__ import annotations

import functools
import types
from types import SimpleNamespace

import numpy as np
import torch

import hal
from batching import PromptSharing
from hal.kernels import HEAD_KERNEL
from rollout.moe_routing import RouterPass, replaying

#: Largest float32 logits chunk of the lean path, in bytes: ``LEAN_CHUNK_BYTES // (4 * V)``
#: tokens per chunk (220 tokens at Qwen2.5's 151,936-token vocabulary). Backward holds a few
#: tensors of this size at a time (logits, log-softmax, probabilities, their gradients).
LEAN_CHUNK_BYTES = 128 * 2**20


def row_start_mask(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Bool [T]: True at the first token of every row."""
    mask = torch.zeros(num_tokens, dtype=torch.bool, device=cu_seqlens.device)
    mask[cu_seqlens[:-1].long()] = True
    return mask


def shift_to_targets(per_position: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Move values computed at position ``t - 1`` to position ``t`` ([T] -> [T]), zero at row starts."""
    out = torch.zeros_like(per_position)
    out[1:] = per_position[:-1]
    return out.masked_fill(row_start_mask(cu_seqlens, per_position.shape[0]), 0.0)


def _per_chunk(fn, tensors: tuple[torch.Tensor, ...], chunk_tokens: int, *, need_grad=None):
    """``fn`` over row chunks of ``tensors`` (split along dim 0), concatenated (each output
    of ``fn`` on its own when it returns a tuple). Under autograd each chunk is checkpointed:
    what ``fn`` computes from its chunk (a float32 copy of the logits, the log-softmax) is
    recomputed in backward instead of kept, so at most one chunk's exists at any time.
    ``need_grad``: None = whether ``tensors[0]`` requires grad."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens!r} must be >= 1")
    if need_grad is None:
        need_grad = tensors[0].requires_grad
    need_grad = need_grad and torch.is_grad_enabled()
    pieces = []
    for chunk in zip(*(t.split(chunk_tokens, dim=0) for t in tensors)):
        if need_grad:
            pieces.append(torch.utils.checkpoint.checkpoint(fn, *chunk, use_reentrant=False))
        else:
            pieces.append(fn(*chunk))
    if isinstance(pieces[0], tuple):
        return tuple(torch.cat(outputs) for outputs in zip(*pieces))
    return torch.cat(pieces)


def next_token_targets(input_ids: torch.Tensor) -> torch.Tensor:
    """[T] -> [T]: the token each position predicts (the next one; 0 past the end). Across a
    row boundary the target is the next row's first token, a value ``shift_to_targets``
    drops."""
    targets = torch.zeros_like(input_ids)
    targets[:-1] = input_ids[1:]
    return targets


def token_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 4096,
) -> torch.Tensor:
    """Log-probability [T] (float32) of each token under ``log_softmax(logits / temperature)``.

    ``logits`` is [T, V] from a packed forward, computed ``chunk_tokens`` tokens at a time
    (see ``_per_chunk``: no whole float32 copy of the logits, none kept for backward).
    """
    targets = next_token_targets(input_ids)
    logprobs = target_logprobs(logits, targets, temperature=temperature, chunk_tokens=chunk_tokens)
    return shift_to_targets(logprobs, cu_seqlens)


def target_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 4096,
) -> torch.Tensor:
    """Log-probability [N] (float32) of ``targets[i]`` under ``log_softmax(logits[i] /
    temperature)``; ``logits`` [N, V], computed chunk by chunk as ``_per_chunk``."""

    def chunk_logprobs(part: torch.Tensor, part_targets: torch.Tensor) -> torch.Tensor:
        lp = torch.log_softmax(part.float() / temperature, dim=-1)
        return lp.gather(-1, part_targets[:, None]).squeeze(-1)

    return _per_chunk(chunk_logprobs, (logits, targets), chunk_tokens)


def logits_entropy(
    logits: torch.Tensor, *, temperature: float = 1.0, chunk_tokens: int = 4096
) -> torch.Tensor:
    """Entropy (nats, at least float32) of ``softmax(logits / temperature)`` per row:
    ``[T, V] -> [T]``, ``H = logsumexp(z) - sum_v softmax(z)_v z_v``, chunked as
    ``_per_chunk``. A banned token (logit -inf) adds exactly 0, with no NaN in backward."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [tokens, vocab], got shape {tuple(logits.shape)}")
    if logits.shape[0] == 0:
        return logits.new_zeros(0, dtype=torch.promote_types(logits.dtype, torch.float32))
    return _per_chunk(functools.partial(_entropy, temperature=temperature), (logits,), chunk_tokens)


def _entropy(z: torch.Tensor, temperature: float) -> torch.Tensor:
    z = z.to(torch.promote_types(z.dtype, torch.float32)) / temperature
    p = torch.softmax(z, dim=-1)
    # p = 0 at a -inf logit, and 0 * -inf would be NaN: replace z there (replacing z, not
    # the product, keeps the backward NaN-free too).
    z_safe = torch.where(p > 0, z, torch.zeros((), dtype=z.dtype, device=z.device))
    return torch.logsumexp(z, dim=-1) - (p * z_safe).sum(dim=-1)


def token_entropy(
    logits: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 4096,
) -> torch.Tensor:
    """Entropy [T] (float32) of the distribution that predicted each token (same alignment
    as ``token_logprobs``)."""
    entropy = logits_entropy(logits, temperature=temperature, chunk_tokens=chunk_tokens)
    return shift_to_targets(entropy.float(), cu_seqlens)


# ----------------------------------------------------------------------------- lean path


def _logprob_and_entropy(
    hidden: torch.Tensor, targets: torch.Tensor, *, head: torch.nn.Module, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk through the LM head: ``[c, H]`` hidden states and ``[c]`` targets ->
    (log-prob of the target, entropy in nats), both ``[c]`` float32, of
    ``softmax(head(hidden) / temperature)``. One function for both, so the chunk's logits are
    computed (and recomputed in backward) once."""
    z = head(hidden).float()
    if temperature != 1.0:  # x / 1.0 == x: skipping the copy changes no bit
        z = z / temperature
    logprob = torch.log_softmax(z, dim=-1).gather(-1, targets[:, None]).squeeze(-1)
    return logprob, _entropy(z, temperature=1.0)


def head_logprobs_entropy(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position ``t``: log-prob of ``targets[t]`` and entropy (float32, ``[T]`` each) of
    ``softmax(head(hidden[t]) / temperature)``, from ``hidden`` ``[T, H]`` through the LM head
    ``chunk_tokens`` tokens at a time (None: as many as fit ``LEAN_CHUNK_BYTES`` of float32
    logits). Under autograd each chunk is recomputed in backward (``_per_chunk``): only the
    hidden states are kept, never a chunk's logits."""
    if chunk_tokens is None:
        vocab = head.weight.shape[0]
        chunk_tokens = max(1, LEAN_CHUNK_BYTES // (4 * vocab))
    need_grad = hidden.requires_grad or any(p.requires_grad for p in head.parameters())
    chunk_fn = functools.partial(_logprob_and_entropy, head=head, temperature=temperature)
    return _per_chunk(chunk_fn, (hidden, targets), chunk_tokens, need_grad=need_grad)


#: The name under which the lean forward is attached to a model (an FSDP2 forward method).
_LEAN_METHOD = "crossrl_lean_forward"


def _lean_forward(
    self: torch.nn.Module,
    *,
    targets: torch.Tensor,
    temperature: float,
    chunk_tokens: int | None,
    eval_index: torch.Tensor | None = None,
    **body_kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The causal LM's body, then ``head_logprobs_entropy`` on its last hidden states (those at
    ``eval_index`` when given, in that order); bound to the model as its method
    ``_LEAN_METHOD``. Per-position ``(log-probs, entropies)``."""
    hidden = self.base_model(**body_kwargs).last_hidden_state[0]
    if eval_index is not None:
        hidden = hidden.index_select(0, eval_index)
    head = self.get_output_embeddings()
    if chunk_tokens is None:
        chunk_tokens = max(1, LEAN_CHUNK_BYTES // (4 * head.weight.shape[0]))
    kernel = self.__dict__.get(HEAD_KERNEL)  # the fused head (hal.kernels), where chosen
    if kernel is not None:
        return kernel(
            hidden,
            head,
            targets,
            temperature=temperature,
            chunk_tokens=chunk_tokens,
            reference=head_logprobs_entropy,
        )
    return head_logprobs_entropy(
        hidden, head, targets, temperature=temperature, chunk_tokens=chunk_tokens
    )


def _lean_method(model: torch.nn.Module):
    """``model``'s lean forward, attached on first use.

    Under FSDP2 the LM head (tied to the embedding or not) belongs to the root module's
    parameter group, which FSDP2 all-gathers in the root's pre-forward hook and whose gradients
    it reduce-scatters through hooks set up there. ``register_fsdp_forward_method`` runs those
    hooks around this method as around ``model.forward``, so the head sees whole weights and
    its gradients are reduced. Nothing is added to the module tree: parameter names, state
    dicts and checkpoints are those of the plain model.
    """
    # Here, not at the top: the controller imports this module only to name the worker classes.
    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

    fsdp = isinstance(model, FSDPModule)
    if model.__dict__.get("_crossrl_lean_fsdp") != fsdp:  # first use, or sharded since
        config = model.config
        for key in ("final_logit_softcapping", "logit_scale"):
            if getattr(config, key, None) not in (None, 1.0):
                raise ValueError(
                    f"train.lean_logprobs=true: {type(model).__name__} transforms its logits "
                    f"after the LM head ({key}={getattr(config, key)!r}), which the lean path "
                    "does not; set train.lean_logprobs=false"
                )
        model.__dict__[_LEAN_METHOD] = types.MethodType(_lean_forward, model)
        register_fsdp_forward_method(model, _LEAN_METHOD)
        model.__dict__["_crossrl_lean_fsdp"] = fsdp
    return getattr(model, _LEAN_METHOD)


class _LeanCall:
    """What ``hal.packed_forward`` calls in the model's place on the lean path: it checks the
    model's attention and builds the packed-row arguments as for any forward, and gets the
    stacked ``[1, T, 2]`` (log-prob, entropy) per position back as ``logits``. The entropy is
    detached before stacking unless ``entropy_grad``: no backward runs through it then."""

    def __init__(self, model: torch.nn.Module, entropy_grad: bool) -> None:
        self.config = model.config
        self._forward = _lean_method(model)
        self._entropy_grad = entropy_grad

    def __call__(self, **kwargs) -> SimpleNamespace:
        logprob, entropy = self._forward(**kwargs)
        if not self._entropy_grad:
            entropy = entropy.detach()
        return SimpleNamespace(logits=torch.stack([logprob, entropy], dim=-1)[None])


def packed_token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    temperature: float = 1.0,
    lean: bool = True,
    entropy_grad: bool = False,
    chunk_tokens: int | None = None,
    sharing: PromptSharing | None = None,
    replay: RouterPass | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability and entropy ``[T]`` (float32, nats) of every token of one packed row
    under ``model``'s ``softmax(logits / temperature)``, aligned as ``token_logprobs`` (0 at
    every row start). What every estimator and loss reads log-probs and entropies from.

    ``lean`` (``train.lean_logprobs``): from the hidden states through the LM head chunk by
    chunk, never a ``[T, V]`` tensor (``head_logprobs_entropy``; ``chunk_tokens`` None = by
    ``LEAN_CHUNK_BYTES``); False: from the model's full logits (``token_logprobs`` /
    ``token_entropy``). ``entropy_grad``: whether the entropy carries gradient (it does when
    it is in the loss); it is detached otherwise. ``sharing``: the row's shared layout
    (``batching.share_prompts``): the model runs each shared prompt once
    (``shared_token_logprobs``); the values come back in the usual layout. ``replay``: a
    mixture's routes (``rollout.moe_routing``; ``algorithm.routing_replay``), ``[L, K, T]``
    in this layout; after the call its ``per_target`` holds, per token, the share of MoE
    layers whose own choice differed at the position that predicts it (0 at row starts).
    """
    if sharing is not None:
        return shared_token_logprobs(
            model,
            input_ids,
            position_ids,
            sharing,
            temperature=temperature,
            lean=lean,
            entropy_grad=entropy_grad,
            chunk_tokens=chunk_tokens,
            replay=replay,
        )
    chunk = {} if chunk_tokens is None else {"chunk_tokens": chunk_tokens}
    with replaying(replay):
        if not lean:
            logits = hal.packed_forward(model, input_ids, position_ids, cu_seqlens)
            logprobs = token_logprobs(
                logits, input_ids, cu_seqlens, temperature=temperature, **chunk
            )
            entropy = token_entropy(
                logits if entropy_grad else logits.detach(),
                cu_seqlens,
                temperature=temperature,
                **chunk,
            )
        else:
            stats = hal.packed_forward(
                _LeanCall(model, entropy_grad),
                input_ids,
                position_ids,
                cu_seqlens,
                targets=next_token_targets(input_ids),
                temperature=temperature,
                chunk_tokens=chunk_tokens,
            )
            logprobs = shift_to_targets(stats[:, 0], cu_seqlens)
            held = stats[:, 1] if entropy_grad else stats[:, 1].detach()
            entropy = shift_to_targets(held, cu_seqlens)
    if replay is not None:
        share = replay.flip_share(input_ids.shape[0], input_ids.device)
        replay.per_target = shift_to_targets(share, cu_seqlens)
    return logprobs, entropy


def shared_token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    sharing: PromptSharing,
    *,
    temperature: float = 1.0,
    lean: bool = True,
    entropy_grad: bool = False,
    chunk_tokens: int | None = None,
    replay: RouterPass | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``packed_token_logprobs`` of a packed row whose rows share prompts, run in the shared
    layout: each shared prompt once, every row's rest attending to it (``hal.packed_forward``'s
    ``parents``); the LM head scores each distinct (position, next token) pair once. The same
    numbers as the usual layout up to float rounding; returned in the usual layout ``[T]``."""
    device = input_ids.device
    index = torch.from_numpy(sharing.token_index).to(device)
    shared_ids = input_ids.index_select(0, index)
    shared_pos = position_ids.index_select(-1, index)
    cu = torch.tensor(sharing.offsets, dtype=torch.int32, device=device)
    at = torch.from_numpy(sharing.eval_hidden).to(device)
    targets = torch.from_numpy(sharing.eval_targets).to(device)
    if replay is not None:  # a shared prompt routes as its first row's engine request did
        replay.in_layout(index, shared_multiplicity(sharing))
    with replaying(replay):
        if lean:
            stats = hal.packed_forward(
                _LeanCall(model, entropy_grad),
                shared_ids,
                shared_pos,
                cu,
                parents=sharing.parents,
                targets=targets,
                eval_index=at,
                temperature=temperature,
                chunk_tokens=chunk_tokens,
            )
            logprob, entropy = stats[:, 0], stats[:, 1]
        else:
            logits = hal.packed_forward(model, shared_ids, shared_pos, cu, parents=sharing.parents)
            logits = logits.index_select(0, at)
            chunk = {} if chunk_tokens is None else {"chunk_tokens": chunk_tokens}
            logprob = target_logprobs(logits, targets, temperature=temperature, **chunk)
            entropy = logits_entropy(
                logits if entropy_grad else logits.detach(), temperature=temperature, **chunk
            ).float()
    back = torch.from_numpy(sharing.eval_of_token).to(device)
    starts = torch.from_numpy(sharing.row_starts).to(device)
    if replay is not None:
        share = replay.flip_share(shared_ids.shape[0], device).index_select(0, at)
        replay.per_target = share.index_select(0, back).masked_fill(starts, 0.0)
    return (
        logprob.index_select(0, back).masked_fill(starts, 0.0),
        entropy.index_select(0, back).masked_fill(starts, 0.0),
    )


def shared_multiplicity(sharing: PromptSharing) -> torch.Tensor:
    """How many tokens of the usual layout each position of the shared layout stands for
    (float32 ``[T_s]``): a shared prompt's, as many as the rows that continue it; every other
    one, itself."""
    counts = np.ones(sharing.num_tokens, dtype=np.float32)
    children = np.bincount([p for p in sharing.parents if p >= 0], minlength=len(sharing.parents))
    for segment, rows in enumerate(children):
        if rows:
            counts[sharing.offsets[segment] : sharing.offsets[segment + 1]] = rows
    return torch.from_numpy(counts)
