"""The critic worker: a causal-LM backbone with a scalar value head, for GAE."""

from __future__ import annotations

import numpy as np
import torch

import hal
from batching import StepBatch, loss_normalizers
from trainer.loop.step_stats import StepStats
from trainer.loop.workers.forward import shift_to_targets
from trainer.loop.workers.fsdp_worker import FSDPWorker


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
            self.model,
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
