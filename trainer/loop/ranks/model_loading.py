"""An FSDP2 training rank's model: built on the meta device, sharded (``fully_shard`` per
decoder layer, then the root), then given its starting weights tensor by tensor from rank 0
(``ModelLoading``, mixed into ``trainer.loop.ranks.fsdp_worker.FSDPWorker``); activation
checkpointing and the tied weights a plain ``to_empty`` would untie.
"""

from __future__ import annotations

import torch

import hal
from rollout.models import tied_parameter_names  # noqa: F401 - the tracker and bench call it here
from rollout.moe_routing import checkpoint_contexts, control_routers, moe_routers


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a causal LM (``model.model.layers``), or none."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    return list(layers) if layers is not None else []


def _dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    from rollout.models import parse_dtype

    return parse_dtype(name)


def enable_activation_checkpointing(model: torch.nn.Module) -> int:
    """Recompute every decoder layer's activations in backward instead of keeping them.

    Uses transformers' per-layer checkpointing (non-reentrant ``torch.utils.checkpoint``, which
    composes with FSDP2 and with frozen inputs); it acts only in training mode. Returns the
    number of decoder layers it covers; a model that does not support it raises, naming
    ``train.activation_checkpointing``.
    """
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"train.activation_checkpointing=true: {type(model).__name__} does not support "
            "activation checkpointing; set train.activation_checkpointing=false"
        )
    kwargs: dict = {"use_reentrant": False}
    if moe_routers(model):  # the recompute routes as the forward did (rollout.moe_routing)
        kwargs["context_fn"] = checkpoint_contexts
    if hasattr(model, "activation_checkpointing_enable"):  # newer transformers' name for it
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return len(decoder_layers(model))


def retie(model: torch.nn.Module, tied: list[list[str]]) -> None:
    """Make every name of a ``tied_parameter_names`` group hold its first name's parameter
    again: ``to_empty`` gives a plain module a fresh tensor per name (FSDP2 keeps the ties)."""
    for first, *others in tied:
        param = model.get_parameter(first)
        for name in others:
            owner, _, leaf = name.rpartition(".")
            if model.get_parameter(name) is not param:
                setattr(model.get_submodule(owner), leaf, param)


class ModelLoading:
    """Building, sharding and loading a rank's model (``self.spec``, ``self.backend``,
    ``self.device``, ``self.kernels``: ``FSDPWorker``'s)."""

    def _materialise_model_files(self) -> None:
        """A ``builtin:`` model's files are written on first use: rank 0 writes them while
        the other ranks wait, so no rank reads a directory another is still creating."""
        import torch.distributed as dist

        from rollout.models import model_directory

        if self.spec.model_path.startswith("builtin:") and self.spec.rank == 0:
            model_directory(self.spec.model_path, self.spec.cfg.seed)
        if self.spec.world_size > 1:
            dist.barrier()

    def load_causal_lm(self) -> torch.nn.Module:
        """This role's causal LM with the HAL's varlen attention, in float32 (parameters and
        optimizer state are master weights whatever ``train.param_dtype`` computes in), on
        the meta device: ``setup`` shards it, then loads the checkpoint's weights into it."""
        from rollout.models import build_empty_model

        hal.register_attention()
        model = build_empty_model(
            self.spec.model_path,
            dtype=torch.float32,
            seed=self.spec.cfg.seed,
            attn_implementation=hal.ATTN_IMPLEMENTATION,
        )
        # A mixture's routers: replayable, and routing in a recompute as in its forward.
        replay = self.spec.cfg.algorithm.routing_replay
        required = None if replay == "none" else f"algorithm.routing_replay={replay}"
        control_routers(model, required=required)
        return model

    def _shard(self, model: torch.nn.Module) -> None:
        """FSDP2 in place: each decoder layer, then the root. ``train.param_offload`` keeps
        the sharded parameters (and so their gradients and optimizer step) in host memory
        through FSDP2's CPU-offload policy, pinned on an accelerator. A single rank that needs
        none of FSDP2's policies keeps the plain module (``WorkerSpec.sharded``)."""
        if not self.spec.sharded:
            return
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            MixedPrecisionPolicy,
            OffloadPolicy,
            fully_shard,
        )

        train = self.spec.cfg.train
        mp = MixedPrecisionPolicy(
            param_dtype=_dtype(train.param_dtype), reduce_dtype=_dtype(train.reduce_dtype)
        )
        offload = (
            CPUOffloadPolicy(pin_memory=self.backend.is_accelerator)
            if train.param_offload
            else OffloadPolicy()
        )
        # The mesh names the HAL's device: FSDP2's default mesh takes the machine's
        # accelerator, so a device=cpu run on a GPU node would quietly shard onto the GPU.
        world, ep = self.spec.world_size, train.expert_parallel_size
        if ep > 1:  # experts split over ep ranks (trainer.loop.ranks.expert_parallel)
            from trainer.loop.ranks.expert_parallel import shard_experts

            grid = init_device_mesh(
                self.backend.device_type, (world // ep, ep), mesh_dim_names=("dp", "ep")
            )
            policies = {"mp_policy": mp, "offload_policy": offload}
            sharded = shard_experts(
                model,
                grid,
                lambda m, **kw: fully_shard(m, **kw, **policies),
                compute=self.kernels.expert_rows(),
            )
            if not sharded and self.spec.role == "actor":
                raise ValueError(
                    f"train.expert_parallel_size={ep}: {self.spec.model_path} has no experts "
                    "crossrl can split (transformers' fused experts modules); set it to 1"
                )
            mesh = grid._flatten("dp_ep")
        else:
            mesh = init_device_mesh(self.backend.device_type, (world,))
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=offload)
        fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload)

    @torch.no_grad()
    def _load_initial_weights(self, model: torch.nn.Module, own: dict[str, torch.Tensor]) -> None:
        """Give the sharded meta model its starting weights (a collective: every rank calls).

        Tensor by tensor, rank 0 reads a weight from the checkpoint's safetensors files and
        broadcasts it, and every rank keeps its shard: no process holds more than its shards
        and one full tensor (a mixture's per-expert tensors are stacked into each fused one as
        it is read: ``rollout.models.CheckpointTensors``). A checkpoint whose names
        transformers converts otherwise is read whole by rank 0 through ``from_pretrained``
        instead (one full copy on the host).
        ``own``: full tensors the role built for real (the critic's value head), sent instead.
        """
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor, distribute_tensor

        from rollout.lora import base_name
        from rollout.models import checkpoint_tensors, load_model, reset_non_persistent_buffers

        # With ``train.param_offload`` the shards live in host memory from the start: FSDP2's
        # CPU-offload policy refuses a root whose parameters were made on the device (the first
        # GPU run found the embedding and final norm left there), and pins them itself.
        tied = tied_parameter_names(model)
        model.to_empty(device="cpu" if self.spec.cfg.train.param_offload else self.device)
        retie(model, tied)
        reset_non_persistent_buffers(model, self.device)
        # Tied weights are one tensor under several names: sent once.
        targets: dict[int, tuple[list[str], torch.Tensor]] = {}
        for name, tensor in model.state_dict(keep_vars=True).items():
            targets.setdefault(id(tensor), ([], tensor))[0].append(name)
        if self.spec.rank == 0:
            path, seed = self.spec.model_path, self.spec.cfg.seed
            source = checkpoint_tensors(path, seed)
            read = source.read
            # a LoRA layer's frozen weight (X.base_layer.weight) is the checkpoint's X.weight
            if any(
                all(base_name(n) not in source and n not in own for n in names)
                for names, _ in targets.values()
            ):
                source = load_model(path, dtype=torch.float32, seed=seed).state_dict()
                read = source.__getitem__
        for names, target in targets.values():
            if self.spec.rank == 0:
                name = next(n for n in names if n in own or base_name(n) in source)
                value = own[name] if name in own else read(base_name(name))
                full = value.to(self.device, target.dtype)
            else:
                full = torch.empty(target.shape, dtype=target.dtype, device=self.device)
            dist.broadcast(full, src=0)
            if isinstance(target, DTensor):
                # This rank's slice of the full tensor, as FSDP2 shards it; no communication.
                placed = distribute_tensor(
                    full, target.device_mesh, target.placements, src_data_rank=None
                )
                target.to_local().copy_(placed.to_local())
            else:
                target.copy_(full)
