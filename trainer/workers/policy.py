"""The policy worker: actor (trainable) or reference (frozen), one per data-parallel rank."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

import hal
from batching import LossNormalizers, PromptSharing, StepBatch, loss_normalizers, share_prompts
from trainer.config_schema import Config
from trainer.step_stats import StepStats
from trainer.workers.forward import packed_token_logprobs
from trainer.workers.fsdp_worker import FSDPWorker
from trainer.workers.local import LocalHandle, fetch


def prompt_sharing(mb: StepBatch, cfg: Config) -> PromptSharing | None:
    """The shared layout of ``mb`` (``batching.share_prompts``) when ``train.share_prompts``
    is on and two of its rows share a prompt, else None."""
    if not cfg.train.share_prompts:
        return None
    return share_prompts(mb.input_ids.numpy(), mb.cu_seqlens.numpy(), mb.prompt_len.numpy())


def actor_micro_batch_loss(
    model: torch.nn.Module,
    mb: StepBatch,
    normalizers: LossNormalizers,
    cfg: Config,
    device: torch.device,
    *,
    keep_old: Callable[[torch.Tensor], None] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One packed micro-batch's share of the mini-batch actor loss (``algorithm.*``) and its
    metric sums (``trainer.step_stats.SCHEMAS["actor"]`` keys, detached); ``mb``'s tensors
    go to ``device``, the model's compute device. What ``PolicyWorker.train_mini_batch`` runs
    per micro-batch, and what the train benchmark times.

    ``keep_old``: the weights have not changed since the rollout (the step's first update),
    so this forward's log-probs, detached, are the old log-probs: they are used as such and
    handed to ``keep_old`` (``[T]``, for later epochs) instead of read from ``mb``."""
    from trainer.losses import actor_loss, masked_sums

    algo = cfg.algorithm
    cu = mb.cu_seqlens.to(device)
    # Entropy is always logged; it carries gradient only when it is in the loss.
    logprobs, entropy = packed_token_logprobs(
        model,
        mb.input_ids.to(device),
        mb.position_ids.to(device),
        cu,
        temperature=cfg.rollout.temperature,
        lean=cfg.train.lean_logprobs,
        entropy_grad=bool(algo.entropy_coef),
        sharing=prompt_sharing(mb, cfg),
    )
    mask = mb.loss_mask.to(device)
    field = mb.token_fields
    if keep_old is None:
        old = field["old_logprobs"].to(device)
    else:
        old = logprobs.detach()
        keep_old(old)
    loss, terms = actor_loss(
        logprobs,
        old,
        field["advantages"].to(device),
        mask,
        cu,
        normalizers,
        cfg,
        ref_logprobs=field["ref_logprobs"].to(device) if cfg.algorithm.use_kl_loss else None,
        entropy=entropy,
        is_weights=field["is_weights"].to(device) if "is_weights" in field else None,
    )
    sums = dict(masked_sums(terms, mask))
    sums["loss"] = loss.detach()
    # Parity fingerprint: old / new logprob sums over loss tokens (float64).
    keep = mask > 0
    sums["old_logprob"] = old[keep].double().sum()
    sums["new_logprob"] = logprobs.detach()[keep].double().sum()
    return loss, sums


class PolicyWorker(FSDPWorker):
    """Computes log-probabilities of packed rows and runs PPO-family updates on them."""

    def build_model(self) -> torch.nn.Module:
        """The causal LM with the HAL's varlen attention, float32 master weights."""
        return self.load_causal_lm()

    def _logprobs(self, mb: StepBatch) -> torch.Tensor:
        cfg = self.spec.cfg
        logprobs, _ = packed_token_logprobs(
            self.model,
            self.to_device(mb.input_ids),
            self.to_device(mb.position_ids),
            self.to_device(mb.cu_seqlens),
            temperature=cfg.rollout.temperature,
            lean=cfg.train.lean_logprobs,
            sharing=prompt_sharing(mb, cfg),
        )
        return logprobs

    def compute_logprobs(self, micro_batches: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        """Log-probabilities of this rank's rows under the current weights, as
        ``(rows, values)`` (see ``BatchStore.per_token_pass``); old log-probs for the actor,
        reference log-probs for the reference model."""
        return self.per_token_pass(micro_batches, self._logprobs)

    def train_mini_batch(
        self,
        micro_batches: list[list[int]],
        mini_batch_rows: list[int],
        old_from_update: bool = False,
    ) -> StepStats:
        """One optimizer step of the actor (loss settings: ``algorithm.*``) on this rank's
        micro-batches of one mini-batch.

        ``mini_batch_rows`` are all real rows of the mini-batch (every rank's); the loss is
        normalised by their global counts, so the update does not depend on dp size,
        micro-batch split or padding. ``old_from_update``: the step's first update, whose
        rows got no old log-probs (``train.old_logprobs_from_update``): this forward's are
        used and stored for later epochs. Returns this rank's ``StepStats`` of the step.
        """
        normalizers = loss_normalizers(self.batch, mini_batch_rows)
        self.model.train()
        rows_of = iter(micro_batches)

        def loss_fn(mb: StepBatch):
            rows = next(rows_of)
            keep = None
            if old_from_update:

                def keep(values: torch.Tensor) -> None:
                    self.store_rows("old_logprobs", rows, mb, values)

            return actor_micro_batch_loss(
                self.model, mb, normalizers, self.spec.cfg, self.device, keep_old=keep
            )

        return self.run_micro_batches(micro_batches, loss_fn)

    @torch.no_grad()
    def param_stats(self) -> dict[str, list[float]]:
        """This rank's share of the parity checksum (``trainer.fingerprint.local_param_stats``): float64
        sums over its own parameter shards, so no collective; the controller adds the ranks."""
        from trainer.fingerprint import local_param_stats

        return local_param_stats(self.model.named_parameters())

    def mini_batch_counts(self, mini_batches: list[list[int]]) -> list[tuple[int, int]]:
        """``(real rows, loss tokens)`` of each mini-batch (lists of row indices), as the loss
        normalizers of ``train_mini_batch`` count them; for the parity fingerprint."""
        out = []
        for rows in mini_batches:
            norm = loss_normalizers(self.batch, rows)
            out.append((int(norm.num_rows), int(norm.num_loss_tokens)))
        return out

    def push_weights(self, engine, bucket_bytes: int, via_object_store: bool = False) -> int:
        """Hand the full weights to ``engine``, this rank's engine replica (an ``EngineHost``
        on the devices of this rank's tp group), in buckets of about ``bucket_bytes`` bytes.

        Every rank takes part (gathering a shard is a collective). Each rank packs the
        gathered tensors, in the engine's dtype (``model.dtype``), into a buffer shared with
        the engine on its own device (``hal``: a /dev/shm file on the CPU, an IPC handle on
        accelerators); the tp group's first rank sends the engine the handles and the specs
        only, and the engine reads the memory in place. Nothing crosses nodes or goes through
        the object store. Peak extra memory: one bucket. ``via_object_store``: the earlier path,
        numpy buckets through Ray's object store, kept for ``bench e2e``'s comparison. An
        engine in this very process (``ray.in_process``) gets the tensors themselves and
        copies them once (``EngineHost.load_weights``).
        Returns the number of buckets sent (0 on ranks that send none).
        """
        from rollout.engines.buckets import pack_tensor, plan_buckets
        from rollout.models import parse_dtype

        if via_object_store:
            return self._push_weights_object_store(engine, bucket_bytes)
        if isinstance(engine, LocalHandle):  # the engine is in this process: one copy, no buffer
            fetch(engine.load_weights.remote(list(self.model.state_dict().items())))
            return 1
        if not self.backend.is_accelerator and self._ranks_share_a_host():
            return self._push_weights_host_buffer(engine)
        cfg = self.spec.cfg
        tp = cfg.rollout.tensor_parallel_size
        leader = self.spec.rank % tp == 0
        state = self.model.state_dict()
        dtype = parse_dtype(cfg.model.dtype)
        buckets, nbytes = plan_buckets(
            ((n, t.shape) for n, t in state.items()), dtype, bucket_bytes
        )
        buf, handles, fresh = self._shared_weight_buffer(nbytes, tp)
        for specs in buckets:
            for spec in specs:
                tensor = state[spec.name]
                full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
                pack_tensor(buf, spec, full.detach())
            if self.backend.is_accelerator:  # the copies are queued: finish before the reader
                self.backend.synchronize()
            if leader:
                fetch(engine.load_shared_bucket.remote(handles, [tuple(s) for s in specs]))
            if tp > 1:  # the group's buffers are reused only once its engine has read them
                torch.distributed.barrier()
            if fresh:  # the engine has mapped the buffer: its name can go
                self.backend.release_shared_buffer(handles[self.spec.rank % tp])
                fresh = False
        return len(buckets) if leader else 0

    def _ranks_share_a_host(self) -> bool:
        """Whether every rank runs on this host (asked once: a collective of host names)."""
        known = getattr(self, "_one_host", None)
        if known is None:
            import socket

            names: list = [None] * self.spec.world_size
            torch.distributed.all_gather_object(names, socket.gethostname())
            known = self._one_host = len(set(names)) == 1
        return known

    def _push_weights_host_buffer(self, engine) -> int:
        """The CPU sync when all ranks share one host: the whole model, in the engine's
        dtype, lives in one shared-memory buffer that every rank maps; each rank writes its
        own FSDP shard's rows in place, so shared memory replaces the gather collective, and
        after one barrier every replica reads the full weights from it. Returns 1 bucket on
        the ranks that sent (each tp group's first), else 0."""
        from rollout.engines.buckets import plan_buckets, tensor_view
        from rollout.models import parse_dtype

        cfg, rank, world = self.spec.cfg, self.spec.rank, self.spec.world_size
        state = self.model.state_dict()
        dtype = parse_dtype(cfg.model.dtype)
        (specs,), nbytes = plan_buckets(((n, t.shape) for n, t in state.items()), dtype, 1 << 62)
        held = getattr(self, "_host_buffer", None)
        fresh = held is None or held[0].numel() < nbytes
        if fresh:
            made = self.backend.shared_buffer(nbytes) if rank == 0 else (None, None)
            shared = [made[1]]
            torch.distributed.broadcast_object_list(shared, src=0)
            buf = made[0] if rank == 0 else hal.open_shared_buffer(shared[0])
            held = self._host_buffer = (buf, shared[0])
        buf, handle = held
        for spec in specs:
            tensor, view = state[spec.name], tensor_view(buf, spec)
            placements = getattr(tensor, "placements", None)
            if placements is not None and len(placements) == 1 and placements[0].is_shard(0):
                local = tensor.to_local()  # FSDP2 shards dim 0 in torch.chunk order
                start = rank * -(-spec.shape[0] // world)
                view[start : start + local.shape[0]].copy_(local.detach())
            else:
                full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
                if rank == 0:
                    view.copy_(full.detach())
        torch.distributed.barrier()  # every shard is in place
        leader = rank % cfg.rollout.tensor_parallel_size == 0
        if leader:
            fetch(engine.load_shared_bucket.remote([handle], [tuple(s) for s in specs]))
        if fresh:  # every replica has mapped it: the name can go
            torch.distributed.barrier()
            if rank == 0:
                self.backend.release_shared_buffer(handle)
        return 1 if leader else 0

    def _shared_weight_buffer(self, nbytes: int, tp: int) -> tuple[torch.Tensor, list, bool]:
        """This rank's buffer shared with its engine (made once, grown when too small), the
        handles of its tp group's buffers in tp rank order, and whether it is new."""
        held = getattr(self, "_weight_buffer", None)
        if held is not None and held[0].numel() >= nbytes:
            return held[0], held[1], False
        buf, handle = self.backend.shared_buffer(nbytes, self.local_index)
        handles = [handle]
        if tp > 1:  # every rank takes part, so all gather; each keeps its own group's handles
            everyone: list = [None] * self.spec.world_size
            torch.distributed.all_gather_object(everyone, handle)
            first = self.spec.rank - self.spec.rank % tp
            handles = everyone[first : first + tp]
        self._weight_buffer = (buf, handles)
        return buf, handles, True

    def _push_weights_object_store(self, engine, bucket_bytes: int) -> int:
        """The weight sync before in-node handoff: float32 numpy buckets through Ray's object
        store, sent by each tp group's first rank (kept for ``bench e2e``'s comparison)."""
        sender = self.spec.rank % self.spec.cfg.rollout.tensor_parallel_size == 0
        bucket: dict[str, np.ndarray] = {}
        size = 0
        sent = 0
        for name, tensor in self.model.state_dict().items():
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            if not sender:
                continue
            array = full.detach().to("cpu", torch.float32).numpy()
            bucket[name] = array
            size += array.nbytes
            if size >= bucket_bytes:
                fetch(engine.update_weights.remote(bucket))
                bucket, size, sent = {}, 0, sent + 1
        if sender and bucket:
            fetch(engine.update_weights.remote(bucket))
            sent += 1
        return sent
