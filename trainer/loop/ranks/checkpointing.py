"""A training worker's state in checkpoints: its whole model for export and weight sync, and
its pieces of a checkpoint (sharded model and optimizer, scheduler, RNG) written and read back.

``CheckpointPieces`` is a mixin of ``FSDPWorker``: it uses the worker's ``spec``, ``model``,
``optimizer``, ``scheduler`` and ``backend``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from trainer.loop.ranks.optim import reapply_hyperparameters


class CheckpointPieces:
    """Checkpoint writing and reading of one data-parallel rank (see the module docstring)."""

    def _state_options(self):
        """What the model's state holds in checkpoints: everything, or a LoRA actor's
        (``model.lora``) trainable entries alone, the frozen base staying at ``model.path``
        (a resume checks its digest, ``trainer.loop.start.preflight``)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        lora = self._lora_actor()
        return StateDictOptions(ignore_frozen_params=lora, strict=not lora)

    def _lora_actor(self) -> bool:
        return self.spec.cfg.model.lora.enabled and self.spec.role == "actor"

    def _trained_only(self, model_state: dict) -> dict:
        """A LoRA actor's model state without its frozen entries: ``ignore_frozen_params``
        keeps a tied LM head's second name (torch 2.13), the base's embedding again."""
        if not self._lora_actor():
            return model_state
        from rollout.lora import trained_names

        trained = trained_names(self.model)
        return {k: v for k, v in model_state.items() if k in trained}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole unsharded model state on CPU (a collective: every rank must call)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(
            self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )

    def save_pieces(self, staging_dir: str) -> list[str]:
        """Write this rank's part of a checkpoint into ``staging_dir`` (a collective: every rank
        of the role calls). Model and optimizer state go as torch.distributed.checkpoint shards,
        every rank writing its own in parallel (no gather); rank 0 adds the scheduler, each
        rank its RNG. Returns the relative paths the checkpoint must hold (for the commit)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        from trainer.records.checkpoint import LAYOUT, rng_state, save_sharded, save_torch

        staging = Path(staging_dir)
        role = self.spec.role
        options = self._state_options()
        if self.optimizer is not None:
            model_state, optim_state = get_state_dict(self.model, self.optimizer, options=options)
        else:
            model_state, optim_state = get_model_state_dict(self.model, options=options), None
        model_state = self._trained_only(model_state)
        written = [
            f"{LAYOUT.model_dir(role)}/{name}"
            for name in save_sharded(model_state, staging / LAYOUT.model_dir(role))
        ]
        if optim_state is not None:
            written += [
                f"{LAYOUT.optim_dir(role)}/{name}"
                for name in save_sharded(optim_state, staging / LAYOUT.optim_dir(role))
            ]
            if self.spec.rank == 0:
                save_torch(self.scheduler.state_dict(), staging / LAYOUT.scheduler(role))
                written.append(LAYOUT.scheduler(role))
        rng_name = LAYOUT.rng(role, self.spec.rank)
        save_torch(rng_state(self._device_rng_getter()), staging / rng_name)
        written.append(rng_name)
        return written

    def _device_rng_getter(self):
        """The accelerator's generator state goes into checkpoints too (dropout, sampling
        noise on the device); None on the CPU."""
        return self.backend.device_rng_state if self.backend.is_accelerator else None

    def _device_rng_setter(self):
        return self.backend.set_device_rng_state if self.backend.is_accelerator else None

    def load_pieces(self, ckpt_dir: str) -> None:
        """Restore model, optimizer, scheduler and this rank's RNG from a checkpoint (a
        collective). Sharded state loads at any dp size: each rank reads the slices of its
        fresh shards. A rank with no RNG file of its own (the checkpoint had fewer ranks)
        keeps its fresh stream."""
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_state_dict,
            set_model_state_dict,
            set_state_dict,
        )

        from trainer.records.checkpoint import LAYOUT, load_sharded, load_torch, set_rng_state

        ckpt = Path(ckpt_dir)
        role = self.spec.role
        if not (ckpt / LAYOUT.model_dir(role)).is_dir():
            self._load_single_file_pieces(ckpt)
        elif self.optimizer is not None:
            options = self._state_options()
            model_state, optim_state = get_state_dict(self.model, self.optimizer, options=options)
            model_state = self._trained_only(model_state)
            load_sharded(model_state, ckpt / LAYOUT.model_dir(role))
            load_sharded(optim_state, ckpt / LAYOUT.optim_dir(role))
            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict=model_state,
                optim_state_dict=optim_state,
                options=options,
            )
        else:
            model_state = get_model_state_dict(self.model, options=self._state_options())
            load_sharded(model_state, ckpt / LAYOUT.model_dir(role))
            set_model_state_dict(self.model, model_state, options=self._state_options())
        if self.scheduler is not None:
            self.scheduler.load_state_dict(load_torch(ckpt / LAYOUT.scheduler(role)))
            optim = self.spec.optim
            reapply_hyperparameters(
                self.optimizer, self.scheduler, lr=optim.lr, weight_decay=optim.weight_decay
            )
        rng_file = ckpt / LAYOUT.rng(role, self.spec.rank)
        if rng_file.exists():  # a larger dp size resumes its new ranks with fresh streams
            set_rng_state(load_torch(rng_file), self._device_rng_setter())

    def _load_single_file_pieces(self, ckpt: Path) -> None:
        """Model and optimizer of a checkpoint in the single-file layout (written before the
        sharded one): every rank reads the whole files and keeps its own shard."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        from trainer.records.checkpoint import LAYOUT, CheckpointError, load_safetensors, load_torch

        role = self.spec.role
        if not (ckpt / LAYOUT.legacy_model(role)).is_file():
            raise CheckpointError(
                f"checkpoint {ckpt} holds no {role} model ({LAYOUT.model_dir(role)}/ or "
                f"{LAYOUT.legacy_model(role)}); resume from a checkpoint of this job "
                "(same critic.enable) or set run.resume=never"
            )
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        set_model_state_dict(
            self.model, load_safetensors(ckpt / LAYOUT.legacy_model(role)), options=options
        )
        if self.optimizer is not None:
            optim = load_torch(ckpt / LAYOUT.legacy_optim(role))
            set_optimizer_state_dict(self.model, self.optimizer, optim, options=options)
