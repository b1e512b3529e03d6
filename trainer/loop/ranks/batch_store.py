"""A training worker's copy of the step's batch: loaded from the rollout host, completed with
the token fields the ranks compute piecewise (old / reference log-probs, values), cut into
micro-batches, and turned into advantages.

``BatchStore`` is a mixin of ``FSDPWorker``: it uses the worker's ``spec`` and keeps ``batch``.
Every worker holds the whole batch, so each computes the same advantages locally instead of
shipping them around.
"""

from __future__ import annotations

import numpy as np
import torch

from batching import StepBatch
from trainer.loop.cluster.local import fetch, is_ref


class BatchStore:
    """The step's batch on one data-parallel rank (see the module docstring)."""

    batch: StepBatch

    def load_batch(self, refs: list) -> int:
        """Take this step's batch from the object store (``refs[0]`` holds ``to_numpy()``)."""
        arrays = fetch(refs[0]) if not isinstance(refs[0], dict) else refs[0]
        self.batch = StepBatch.from_numpy(arrays)
        return self.batch.num_rows

    def set_token_field(self, name: str, pieces: list) -> None:
        """Fill token field ``name`` of the whole batch from every rank's ``(rows, values)``
        pieces (object refs or plain tuples), so all ranks hold the same full field."""
        batch = self.batch
        full = np.zeros(batch.num_tokens, dtype=np.float32)
        cu = batch.cu_seqlens.numpy()
        for piece in pieces:
            rows, values = fetch(piece) if is_ref(piece) else piece
            rows = np.asarray(rows, dtype=np.int64)
            if rows.size:
                # Row r's tokens are cu[r]:cu[r+1] of the batch, in order at the piece's offset.
                starts, lengths = cu[rows], cu[rows + 1] - cu[rows]
                shift = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
                full[shift + np.arange(int(lengths.sum()))] = values
        batch.set_token_field(name, torch.from_numpy(full))

    def store_rows(self, name: str, rows: list[int], mb: StepBatch, values: torch.Tensor) -> None:
        """Write ``values`` (``[T]`` of micro-batch ``mb``, made of batch rows ``rows``; -1 =
        padding, skipped) into token field ``name`` of this worker's batch, row by row."""
        field = self.batch.token_fields[name]
        values = values.detach().to("cpu", field.dtype)
        cu, mb_cu = self.batch.cu_seqlens.tolist(), mb.cu_seqlens.tolist()
        for j, r in enumerate(rows):
            if r >= 0:
                field[cu[r] : cu[r + 1]] = values[mb_cu[j] : mb_cu[j + 1]]

    def rollout_mismatch_sums(self, micro_batches: list[list[int]]) -> dict[str, float]:
        """Sums behind ``rollout/logprob_abs_diff`` and ``rollout/logprob_kl`` over the loss
        tokens of this rank's rows (``micro_batches`` of every mini-batch): the controller
        adds the ranks' (``trainer.algorithms.rollout_correction.mismatch_from_sums``)."""
        from trainer.algorithms.rollout_correction import mismatch_sums

        rows = sorted({r for mb in micro_batches for r in mb if r >= 0})
        cu = self.batch.cu_seqlens.tolist()
        tokens = torch.cat([torch.arange(cu[r], cu[r + 1]) for r in rows]) if rows else None
        fields = self.batch.token_fields
        if tokens is None:
            return mismatch_sums(torch.zeros(0), torch.zeros(0), torch.zeros(0))
        return mismatch_sums(
            fields["old_logprobs"][tokens],
            fields["rollout_logprobs"][tokens],
            self.batch.loss_mask[tokens],
        )

    def micro_batch(self, rows: list[int]) -> StepBatch:
        """Rows of one micro-batch (``-1`` = padding row), ready on this worker's device."""
        return self.batch.select(rows)

    @torch.no_grad()
    def per_token_pass(
        self, micro_batches: list[list[int]], per_token
    ) -> tuple[np.ndarray, np.ndarray]:
        """Run ``per_token(micro_batch) -> [T] tensor`` over this rank's micro-batches.

        Padding rows (``-1``) are forwarded, to keep collectives in step with the other ranks,
        and dropped. Returns ``(rows, values)``: the real row indices in order and their
        tokens' values concatenated (float32), ready for ``set_token_field`` on every worker.
        """
        rows_out: list[np.ndarray] = []
        pieces: list[np.ndarray] = []
        for rows in micro_batches:
            mb = self.micro_batch(rows)
            values = per_token(mb).float().cpu().numpy()
            cu = mb.cu_seqlens.numpy()
            index = np.asarray(rows, dtype=np.int64)
            real = index >= 0
            rows_out.append(index[real])
            pieces.append(values[: cu[-1]][np.repeat(real, np.diff(cu))])
        flat = np.concatenate(pieces).astype(np.float32) if pieces else np.zeros(0, np.float32)
        rows_out = np.concatenate(rows_out) if rows_out else np.zeros(0, np.int64)
        return rows_out, flat

    def compute_advantages(self, mismatch: bool = True) -> dict[str, float]:
        """Advantages and returns for the whole batch (``algorithm.*``), identical on every
        rank and role. ``mismatch``: also the engine-vs-trainer metrics
        (``rollout/logprob_*``); False when some rows' old log-probs come only with the
        update (``train.old_logprobs_from_update``: ``rollout_mismatch_sums`` after it).

        Every worker holds the whole batch, so each computes the same advantages locally
        instead of shipping them around. Without the KL loss (``algorithm.use_kl_loss:
        false``) a ``kl_coef`` > 0 is a per-token reward penalty against ``ref_logprobs``
        (summed into the trajectory score by the outcome estimators). With
        ``algorithm.rollout_correction`` the truncated importance weights are stored as the
        token field ``is_weights``. Returns statistics over real loss tokens.
        """
        from trainer.algorithms import compute_advantages
        from trainer.algorithms.kl import kl_reward_penalty
        from trainer.algorithms.rollout_correction import (
            mismatch_metrics,
            rollout_correction_weights,
        )

        algo = self.spec.cfg.algorithm
        batch = self.batch
        kl_penalty = 0.0 if algo.use_kl_loss else algo.kl_coef
        penalty = None
        if kl_penalty and "ref_logprobs" in batch.token_fields:
            penalty = kl_reward_penalty(
                batch.token_fields["old_logprobs"],
                batch.token_fields["ref_logprobs"],
                kl_penalty,
                algo.kl_estimator,
                loss_mask=batch.loss_mask,
            )
        advantages, returns = compute_advantages(
            batch,
            algo.adv_estimator,
            gamma=algo.gamma,
            lam=algo.lam,
            norm_adv_by_std=algo.norm_adv_by_std,
            token_penalty=penalty,
        )
        batch.set_token_field("advantages", advantages.float())
        batch.set_token_field("returns", returns.float())
        mask = batch.loss_mask > 0
        if not bool(mask.any()):
            return {"advantage/mean": 0.0, "advantage/std": 0.0}
        adv = advantages[mask].double()
        out = {"advantage/mean": float(adv.mean()), "advantage/std": float(adv.std(unbiased=False))}
        if penalty is not None:
            out["algorithm/kl_penalty_token_mean"] = float(penalty[mask].double().mean())
        if mismatch and "old_logprobs" in batch.token_fields:
            # Engine vs trainer logprobs of the same tokens: the rollout/training mismatch.
            old, rollout = (
                batch.token_fields["old_logprobs"],
                batch.token_fields["rollout_logprobs"],
            )
            out.update(mismatch_metrics(old, rollout, batch.loss_mask))
            if algo.rollout_correction != "none":
                weights, weight_metrics = rollout_correction_weights(
                    old,
                    rollout,
                    batch.loss_mask,
                    batch.cu_seqlens,
                    level=algo.rollout_correction,
                    cap=algo.rollout_correction_cap,
                    versions=batch.token_fields.get("policy_version"),  # a streamed batch's
                )
                batch.set_token_field("is_weights", weights)
                out.update(weight_metrics)
        return out
