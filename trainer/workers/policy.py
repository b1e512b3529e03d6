"""The policy worker: actor (trainable) or reference (frozen), one per data-parallel rank."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import hal
from batching import LossNormalizers, StepBatch
from trainer.workers.forward import token_entropy, token_logprobs
from trainer.workers.fsdp_worker import FSDPWorker


class PolicyWorker(FSDPWorker):
    """Computes log-probabilities of packed rows and runs PPO-family updates on them."""

    def build_model(self) -> torch.nn.Module:
        """The causal LM with the HAL's varlen attention, in the configured storage dtype."""
        from rollout.models import load_model

        hal.register_attention()
        return load_model(self.spec.model_path, dtype=self.spec.dtype, seed=self.spec.seed,
                          attn_implementation=hal.ATTN_IMPLEMENTATION)

    def _logits(self, mb: StepBatch) -> torch.Tensor:
        return hal.packed_forward(
            self.model, self.to_device(mb.input_ids), self.to_device(mb.position_ids),
            self.to_device(mb.cu_seqlens),
        )

    @torch.no_grad()
    def compute_logprobs(self, micro_batches: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        """Log-probabilities of this rank's rows under the current weights.

        ``micro_batches`` lists row indices (``-1`` padding rows are forwarded, to keep
        collectives in step with other ranks, and dropped). Returns ``(rows, values)``: the
        real row indices in order and their tokens' logprobs concatenated (float32).
        """
        temperature = float(self.spec.extra.get("temperature", 1.0))
        rows_out: list[int] = []
        values: list[np.ndarray] = []
        for rows in micro_batches:
            mb = self.micro_batch(rows)
            lp = token_logprobs(self._logits(mb), self.to_device(mb.input_ids),
                                self.to_device(mb.cu_seqlens), temperature=temperature)
            lp = lp.cpu().numpy()
            cu = mb.cu_seqlens.numpy()
            for j, r in enumerate(rows):
                if r >= 0:
                    rows_out.append(r)
                    values.append(lp[cu[j]:cu[j + 1]])
        flat = np.concatenate(values).astype(np.float32) if values else np.zeros(0, np.float32)
        return np.asarray(rows_out, dtype=np.int64), flat

    def compute_advantages(self, options: dict[str, Any]) -> dict[str, float]:
        """Advantages and returns for the whole batch, identical on every rank.

        Every rank holds the whole batch, so each computes the same advantages locally instead
        of shipping them around. Returns advantage statistics (real loss tokens only).
        """
        from trainer.algorithms import compute_advantages

        batch = self.batch
        advantages, returns = compute_advantages(batch, **options)
        batch.set_token_field("advantages", advantages.float())
        batch.set_token_field("returns", returns.float())
        mask = batch.loss_mask > 0
        if not bool(mask.any()):
            return {"advantage/mean": 0.0, "advantage/std": 0.0}
        adv = advantages[mask].double()
        return {"advantage/mean": float(adv.mean()), "advantage/std": float(adv.std(unbiased=False))}

    def train_mini_batch(self, micro_batches: list[list[int]], normalizers: LossNormalizers,
                         options: dict[str, Any]) -> dict[str, float]:
        """One optimizer step of the actor on this rank's micro-batches of one mini-batch.

        ``normalizers`` are the mini-batch's global counts (identical on every rank), so the
        update does not depend on dp size, micro-batch split or padding. Returns metric sums
        (divide by the global counts) plus ``grad_norm`` and ``lr``.
        """
        from trainer.losses import loss_for_micro_batch

        self.model.train()
        temperature = float(self.spec.extra.get("temperature", 1.0))
        need_entropy = float(options.get("entropy_coef", 0.0)) != 0.0 or options.get("log_entropy", True)

        def loss_fn(mb: StepBatch):
            logits = self._logits(mb)
            cu = self.to_device(mb.cu_seqlens)
            logprobs = token_logprobs(logits, self.to_device(mb.input_ids), cu,
                                      temperature=temperature)
            entropy = token_entropy(logits.detach() if options.get("entropy_coef", 0.0) == 0
                                    else logits, cu, temperature=temperature) if need_entropy else None
            field = mb.token_fields
            ref = field.get("ref_logprobs")
            return loss_for_micro_batch(
                logprobs=logprobs,
                old_logprobs=self.to_device(field["old_logprobs"]),
                advantages=self.to_device(field["advantages"]),
                loss_mask=self.to_device(mb.loss_mask),
                cu_seqlens=cu,
                normalizers=normalizers,
                entropy=entropy,
                ref_logprobs=None if ref is None else self.to_device(ref),
                **options["loss"],
            )

        return self.run_micro_batches(micro_batches, loss_fn)

    def push_weights(self, engine, bucket_bytes: int) -> int:
        """Send the full weights to a rollout host in buckets of about ``bucket_bytes`` bytes.

        Every rank takes part (gathering a shard is a collective); only rank 0 sends. Peak extra
        memory is one bucket, not the whole model. Returns the number of buckets sent.
        """
        import ray

        bucket: dict[str, np.ndarray] = {}
        size = 0
        sent = 0
        for name, tensor in self.model.state_dict().items():
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            if self.spec.rank != 0:
                continue
            array = full.detach().to("cpu", torch.float32).numpy()
            bucket[name] = array
            size += array.nbytes
            if size >= bucket_bytes:
                ray.get(engine.update_weights.remote(bucket))
                bucket, size, sent = {}, 0, sent + 1
        if self.spec.rank == 0 and bucket:
            ray.get(engine.update_weights.remote(bucket))
            sent += 1
        return sent
