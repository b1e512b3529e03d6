"""The policy worker: actor (trainable) or reference (frozen), one per data-parallel rank."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

import hal
from batching import LossNormalizers, PromptSharing, StepBatch, loss_normalizers, share_prompts
from rollout.moe_routing import RouterPass
from trainer.config.schema import Config
from trainer.loop.ranks.forward import packed_token_logprobs
from trainer.loop.ranks.fsdp_worker import FSDPWorker
from trainer.loop.ranks.step_stats import StepStats
from trainer.loop.weights.weight_push import WeightPush


def prompt_sharing(mb: StepBatch, cfg: Config, device: torch.device) -> PromptSharing | None:
    """The shared layout of ``mb`` (``batching.share_prompts``) when ``train.share_prompts``
    is on, ``device`` has a kernel that runs it at the compute dtype (``sharing_kernel``) and
    two of its rows share a prompt, else None."""
    if sharing_kernel(cfg, device) is None:
        return None
    return share_prompts(mb.input_ids.numpy(), mb.cu_seqlens.numpy(), mb.prompt_len.numpy())


def sharing_kernel(cfg: Config, device: torch.device) -> str | None:
    """The kernel that runs shared prompts for this job on ``device`` (at
    ``train.param_dtype``, the compute dtype), or None when ``train.share_prompts`` is off or
    no fused kernel there takes them (``hal.shared_prompt_kernel``; ``crossrl layout`` prints
    the rule)."""
    if not cfg.train.share_prompts:
        return None
    from rollout.models import parse_dtype

    return hal.shared_prompt_kernel(torch.device(device), parse_dtype(cfg.train.param_dtype))


def route_replay(
    mb: StepBatch, cfg: Config, device: torch.device, *, loads: bool = False
) -> RouterPass | None:
    """What the actor's routers do for micro-batch ``mb``: replay the engine's routes
    (``algorithm.routing_replay``: enforced with ``rollout``, only compared with ``measure``;
    not when the batch carries none: a dense model's engine returns none) and, with
    ``loads`` (the update of a run with ``algorithm.router_aux_loss_coef`` > 0), report the
    real tokens' expert loads. None when neither applies."""
    mode = cfg.algorithm.routing_replay
    routes = mb.token_fields.get("routed_experts")
    routes = None if mode == "none" or routes is None else routes.to(device)
    loads = loads and cfg.algorithm.router_aux_loss_coef > 0
    if routes is None and not loads:
        return None
    weights = None
    if loads:  # 1 for each real token, 0 for padding
        seq_lens = torch.from_numpy(np.asarray(mb.seq_lens))
        weights = torch.repeat_interleave((~mb.is_padding).float(), seq_lens).to(device)
    return RouterPass(routes, enforce=mode == "rollout", weights=weights)


def load_balance_loss(router: RouterPass, num_tokens: int, coef: float) -> torch.Tensor | None:
    """The routers' load-balancing loss (``algorithm.router_aux_loss_coef``; Switch's, per
    MoE layer, averaged over layers) of one micro-batch, as this rank's share of its
    mini-batch's: ``coef * E * sum_e f_e * P_e``. ``f_e``: the share of the top-k slots that
    went to expert ``e`` over this micro-batch step's real tokens on every data-parallel rank
    (one all-reduce: the loads of the global batch, not of one rank's rows); ``P_e``: the
    mean router probability of ``e``, this rank's real tokens summed over the mini-batch's
    ``num_tokens`` real tokens (so the ranks' and micro-batches' shares add up to the mean).
    Padding rows count in neither. None when the model reported no loads (dense)."""
    import torch.distributed as dist

    counts, prob_sums = router.loads() if router.weights is not None else ([], [])
    if not counts:
        return None
    counts = torch.stack(counts)  # [L, E]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(counts)
    experts = counts.shape[-1]
    share = counts / counts.sum(-1, keepdim=True).clamp(min=1.0)
    probs = torch.stack(prob_sums) / max(num_tokens, 1)
    return coef * experts * (share * probs).sum(-1).mean()


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
    metric sums (``trainer.loop.ranks.step_stats.SCHEMAS["actor"]`` keys, detached); ``mb``'s
    tensors go to ``device``, the model's compute device. What ``PolicyWorker.train_mini_batch``
    runs per micro-batch, and what the train benchmark times.

    ``keep_old``: the weights have not changed since the rollout (the step's first update),
    so this forward's log-probs, detached, are the old log-probs: they are used as such and
    handed to ``keep_old`` (``[T]``, for later epochs) instead of read from ``mb``."""
    from trainer.algorithms.losses import actor_loss, masked_sums

    algo = cfg.algorithm
    cu = mb.cu_seqlens.to(device)
    replay = route_replay(mb, cfg, device, loads=True)
    # Entropy is always logged; it carries gradient only when it is in the loss.
    logprobs, entropy = packed_token_logprobs(
        model,
        mb.input_ids.to(device),
        mb.position_ids.to(device),
        cu,
        temperature=cfg.rollout.temperature,
        lean=cfg.train.lean_logprobs,
        entropy_grad=bool(algo.entropy_coef),
        sharing=prompt_sharing(mb, cfg, device),
        replay=replay,
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
    if replay is not None and replay.routes is not None and keep_old is not None:
        sums.update(routing_sums(replay, mask))  # on the weights that sampled
    aux = (
        None
        if replay is None
        else load_balance_loss(replay, normalizers.num_tokens, algo.router_aux_loss_coef)
    )
    if aux is not None:
        loss = loss + aux
        sums["loss"] = loss.detach()
        sums["router_aux_loss"] = aux.detach()
    return loss, sums


def routing_sums(replay: RouterPass, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """``routing_flips`` (flipped MoE-layer shares summed over loss tokens) and
    ``routing_tokens`` (the loss tokens): ``actor/routing_flip_rate`` is their ratio."""
    return {"routing_flips": (replay.per_target * mask).sum(), "routing_tokens": mask.sum()}


def inject_lora(model: torch.nn.Module, lora) -> list[str]:
    """``model.lora``'s adapters (``lora``: the typed section) put into ``model`` in place
    (``rollout.lora.inject``); returns the trainable parameters' names."""
    from rollout.lora import inject

    return inject(
        model,
        lora.rank,
        lora.alpha,
        lora.dropout,
        lora.target_modules,
        embeddings=lora.train_embeddings,
    )


class PolicyWorker(WeightPush, FSDPWorker):
    """Computes log-probabilities of packed rows and runs PPO-family updates on them; the
    actor also pushes its weights to its engine replica (``WeightPush``)."""

    def build_model(self) -> torch.nn.Module:
        """The causal LM with the HAL's varlen attention, float32 master weights; the actor of
        a LoRA run (``model.lora``) with adapters on its frozen base."""
        model = self.load_causal_lm()
        if self.spec.cfg.model.lora.enabled and self.spec.role == "actor":
            inject_lora(model, self.spec.cfg.model.lora)
        return model

    def setup(self, master_addr: str, master_port: int) -> dict:
        """``FSDPWorker.setup``; then, for a LoRA actor whose embedding and LM head train whole
        (``model.lora.train_embeddings``) and whose run reads a reference
        (``algorithm.kl_coef`` > 0), frozen copies of their base values, sharded as they are
        (``rollout.lora.base_copies``): the reference forward swaps them in."""
        facts = super().setup(master_addr, master_port)
        cfg = self.spec.cfg
        self.routing_pending: dict[str, float] = {}  # routing_sums of the old-log-prob pass
        self.lora_base: dict[str, torch.Tensor] = {}
        if self.spec.role == "actor" and cfg.model.lora.enabled and cfg.algorithm.kl_coef > 0:
            from rollout.lora import base_copies

            self.lora_base = base_copies(self.model)  # empty unless embeddings train
        return facts

    def starting_values(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The LoRA adapters' seeded starting values (B zero: the policy starts as the base)."""
        if not (self.spec.cfg.model.lora.enabled and self.spec.role == "actor"):
            return {}
        from rollout.lora import initial_adapters

        return initial_adapters(model, self.spec.cfg.seed)

    def _logprobs(self, mb: StepBatch) -> torch.Tensor:
        cfg = self.spec.cfg
        # the actor's old log-probs route as the update will; the reference routes itself
        replay = route_replay(mb, cfg, self.device) if self.spec.trainable else None
        logprobs, _ = packed_token_logprobs(
            self.model,
            self.to_device(mb.input_ids),
            self.to_device(mb.position_ids),
            self.to_device(mb.cu_seqlens),
            temperature=cfg.rollout.temperature,
            lean=cfg.train.lean_logprobs,
            sharing=prompt_sharing(mb, cfg, self.device),
            replay=replay,
        )
        if replay is not None:  # measured on the weights that sampled; reported by the update
            sums = routing_sums(replay, self.to_device(mb.loss_mask))
            for key, value in sums.items():
                self.routing_pending[key] = self.routing_pending.get(key, 0.0) + float(value)
        return logprobs

    def compute_logprobs(self, micro_batches: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        """Log-probabilities of this rank's rows under the current weights, as
        ``(rows, values)`` (see ``BatchStore.per_token_pass``); old log-probs for the actor,
        reference log-probs for the reference model.

        The reference then gives back what its no-grad pass left on the device: FSDP2 keeps
        the root's parameters (embedding, final norm, LM head: 2.18 GB in bf16 at 7B) gathered
        after a forward, waiting for a backward that a frozen model never runs, and the
        allocator keeps the pass's peak cached; both would sit beside the actor's update.
        The actor's update gathers its root again at once, so the actor keeps it."""
        self.model.eval()  # no dropout in a pass that scores (model.lora.dropout)
        out = self.per_token_pass(micro_batches, self._logprobs)
        if not self.spec.trainable:
            from torch.distributed.fsdp import FSDPModule

            if isinstance(self.model, FSDPModule):
                self.model.reshard()
            self.backend.empty_cache()
        return out

    def compute_ref_logprobs(self, micro_batches: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        """The reference log-probabilities of a LoRA actor (``model.lora``): its own forward
        with the adapters off and, when they train whole, the embedding and LM head's base
        values swapped in (``setup``'s copies), which is the base model, so no reference
        worker holds a second copy of the weights. As ``compute_logprobs`` returns them."""
        from rollout.lora import adapters_off

        self.model.eval()
        with adapters_off(self.model, getattr(self, "lora_base", None)):
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
        used and stored for later epochs, unless the forward drops out (``_drops_out``): then a
        no-grad pass with dropout off takes them first. Returns this rank's ``StepStats``.
        """
        normalizers = loss_normalizers(self.batch, mini_batch_rows)
        if old_from_update and self._drops_out():
            # A training forward with dropout (model.lora.dropout) is not the policy's: the
            # old log-probs take a pass of their own, dropout off, on the same weights.
            self.model.eval()
            with torch.no_grad():
                for rows in micro_batches:
                    mb = self.micro_batch(rows)
                    self.store_rows("old_logprobs", rows, mb, self._logprobs(mb))
            old_from_update = False
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

        stats = self.run_micro_batches(micro_batches, loss_fn)
        for key, value in self.routing_pending.items():  # the old-log-prob pass's, once
            stats.values[key] = stats.values.get(key, 0.0) + value
        self.routing_pending = {}
        return stats

    def _drops_out(self) -> bool:
        """Whether the model's training forward drops anything (a dropout module with p > 0:
        LoRA's ``model.lora.dropout``, or the model's own)."""
        return any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in self.model.modules())

    @torch.no_grad()
    def param_stats(self) -> dict[str, list[float]]:
        """This rank's share of the parity checksum (``trainer.records.fingerprint.local_param_stats``): float64
        sums over its own parameter shards, so no collective; the controller adds the ranks."""
        from trainer.records.fingerprint import local_param_stats

        named = self.model.named_parameters()
        if self.spec.cfg.model.lora.enabled:  # a LoRA run's fingerprint: what trains
            named = [(n, p) for n, p in named if p.requires_grad]
        return local_param_stats(named)

    def mini_batch_counts(self, mini_batches: list[list[int]]) -> list[tuple[int, int]]:
        """``(real rows, loss tokens)`` of each mini-batch (lists of row indices), as the loss
        normalizers of ``train_mini_batch`` count them; for the parity fingerprint."""
        out = []
        for rows in mini_batches:
            norm = loss_normalizers(self.batch, rows)
            out.append((int(norm.num_rows), int(norm.num_loss_tokens)))
        return out
