"""The critic worker: a causal-LM backbone with a scalar value head, for GAE."""

from __future__ import annotations

import types
from types import SimpleNamespace

import numpy as np
import torch

import hal
from batching import StepBatch, loss_normalizers
from trainer.loop.ranks.forward import shift_to_targets
from trainer.loop.ranks.fsdp_worker import FSDPWorker
from trainer.loop.ranks.step_stats import StepStats

#: The name under which the value forward is attached to the critic's model (an FSDP2 forward
#: method, as the actor's lean forward in ``trainer.loop.ranks.forward``).
_VALUES_METHOD = "crossrl_values_forward"


def _values_forward(self: torch.nn.Module, **body_kwargs) -> torch.Tensor:
    """The backbone, then the value head on its last hidden states: ``[T, 1]`` values of one
    packed row; bound to the critic's model as its method ``_VALUES_METHOD``.

    Not the causal LM's own forward: that calls its head on ``[1, T, H]``, and a ``Linear``
    with a bias computes a 3-D input as ``addmm`` on ``[T, H]`` and returns a *view* of the
    result, so the FSDP2 root returned a view and warned on every update that an in-place op
    on it would skip the pre-backward hook. Here the head runs on ``[T, H]``: the same
    ``addmm`` on the same numbers (bit-identical values), its own tensor as the output. It also
    leaves out what some LMs do to their logits after the head (soft-capping, scaling), which
    a value has no use for."""
    hidden = self.base_model(**body_kwargs).last_hidden_state[0]
    return self.lm_head(hidden)


def _values_method(model: torch.nn.Module):
    """``model``'s value forward, attached on first use (and again if sharded since). FSDP2
    runs the root's pre/post-forward hooks around it as around ``model.forward``, so the head
    and the rest of the root's parameter group are gathered for it and their gradients reduced;
    nothing is added to the module tree (parameter names and checkpoints are unchanged)."""
    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

    fsdp = isinstance(model, FSDPModule)
    if model.__dict__.get("_crossrl_values_fsdp") != fsdp:
        model.__dict__[_VALUES_METHOD] = types.MethodType(_values_forward, model)
        register_fsdp_forward_method(model, _VALUES_METHOD)
        model.__dict__["_crossrl_values_fsdp"] = fsdp
    return getattr(model, _VALUES_METHOD)


class _ValuesCall:
    """What ``hal.packed_forward`` calls in the critic's place: it checks the model's attention
    and builds the packed-row arguments as for any forward, and gets ``[1, T, 1]`` back."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.config = model.config
        self._forward = _values_method(model)

    def __call__(self, **kwargs) -> SimpleNamespace:
        return SimpleNamespace(logits=self._forward(**kwargs)[None])


class CriticWorker(FSDPWorker):
    """Predicts per-token values and fits them to the GAE returns with a clipped value loss.

    The value of token ``t`` is read from the hidden state at ``t - 1``, the same alignment as
    log-probabilities, so it is the value of the state in which token ``t`` was chosen.
    """

    def build_model(self) -> torch.nn.Module:
        """The backbone from ``critic_path`` (or the policy's path) with a zero-initialised
        one-output head replacing the LM head."""
        model = self.load_causal_lm()
        hidden = model.config.hidden_size
        model.config.tie_word_embeddings = False
        head = torch.nn.Linear(hidden, 1, bias=True, dtype=model.lm_head.weight.dtype)
        torch.nn.init.zeros_(head.weight)
        torch.nn.init.zeros_(head.bias)
        model.lm_head = head
        return model

    def _values(self, mb: StepBatch) -> torch.Tensor:
        out = hal.packed_forward(
            _ValuesCall(self.model),
            self.to_device(mb.input_ids),
            self.to_device(mb.position_ids),
            self.to_device(mb.cu_seqlens),
        )
        return shift_to_targets(out[:, 0].float(), self.to_device(mb.cu_seqlens))

    def compute_values(self, micro_batches: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        """Values of this rank's rows as ``(rows, values)`` (see ``per_token_pass``)."""
        return self.per_token_pass(micro_batches, self._values)

    def train_mini_batch(
        self, micro_batches: list[list[int]], mini_batch_rows: list[int]
    ) -> StepStats:
        """One optimizer step of the value loss on this rank's micro-batches (normalised by
        the global counts of ``mini_batch_rows``, every real row of the mini-batch)."""
        from trainer.algorithms.losses import value_loss_for_micro_batch

        cfg = self.spec.cfg
        normalizers = loss_normalizers(self.batch, mini_batch_rows)
        self.model.train()

        def loss_fn(mb: StepBatch):
            field = mb.token_fields
            loss, sums = value_loss_for_micro_batch(
                values=self._values(mb),
                old_values=self.to_device(field["values"]),
                returns=self.to_device(field["returns"]),
                loss_mask=self.to_device(mb.loss_mask),
                cu_seqlens=self.to_device(mb.cu_seqlens),
                normalizers=normalizers,
                mode=cfg.algorithm.loss_agg,
                horizon=cfg.loss_horizon_tokens(),
                cliprange_value=cfg.algorithm.cliprange_value,
            )
            return loss, {**sums, "loss": loss.detach()}

        return self.run_micro_batches(micro_batches, loss_fn)
