"""What every FSDP2 training worker shares: process group, sharded model, optimizer and the
update loop; its batch store comes from ``trainer/loop/ranks/batch_store.py``, its checkpoint
pieces from ``trainer/loop/ranks/checkpointing.py``, building, sharding and loading its model
from ``trainer/loop/ranks/model_loading.py``. A single rank that needs no FSDP2 policy
trains the plain module (``WorkerSpec.sharded``); every method here takes either.

A worker is one data-parallel rank. It is a plain class (tests drive it in-process); the
controller wraps it with ``ray.remote`` (or, in one process, ``trainer.loop.cluster.local``). The
device comes from the HAL only.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
import torch

import hal
from batching import StepBatch
from trainer.loop.cluster.startup import Phases, process_start_time
from trainer.loop.ranks.batch_store import BatchStore
from trainer.loop.ranks.checkpointing import CheckpointPieces
from trainer.loop.ranks.model_loading import (
    ModelLoading,
    decoder_layers,
    enable_activation_checkpointing,
)
from trainer.loop.ranks.optim import build_optimizer
from trainer.loop.ranks.spec import ROLES, WorkerSpec
from trainer.loop.ranks.step_stats import StepStats

__all__ = ["ROLES", "FSDPWorker", "WorkerSpec", "held_gradient_bytes"]


def held_gradient_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of gradients ``model`` holds on this rank: ``sharded``, each parameter's own
    shard (what the optimizer steps), and ``unsharded``, whole gradients FSDP2 keeps aside
    (accumulated across micro-batches while gradient sync is off). The memory budget counts
    the first only; the second must stay 0 (``run_micro_batches``)."""
    from torch.distributed.fsdp import FSDPModule

    def nbytes(t: torch.Tensor | None) -> int:
        if t is None:
            return 0
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    sharded = sum(nbytes(p.grad) for p in model.parameters())
    unsharded = 0
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = getattr(module._get_fsdp_state(), "_fsdp_param_group", None)
        for param in getattr(group, "fsdp_params", ()):
            unsharded += nbytes(getattr(param, "unsharded_accumulated_grad", None))
            whole = getattr(param, "_unsharded_param", None)
            unsharded += nbytes(getattr(whole, "grad", None))
    return {"sharded": sharded, "unsharded": unsharded}


class FSDPWorker(BatchStore, CheckpointPieces, ModelLoading):
    """Base class of the actor, reference and critic workers."""

    def __init__(self, spec: WorkerSpec) -> None:
        # Start-up phases, from this process's start: its boot and imports, then setup's.
        self.startup = Phases(process_start_time())
        self.startup.done("boot")
        self.spec = spec
        self.backend = hal.get_backend(spec.cfg.device)
        self.batch: StepBatch | None = None
        self.model: torch.nn.Module | None = None
        self.optimizer = None
        self.scheduler = None
        self.deterministic_settings: dict[str, str] = {}
        self.local_index = 0  # this rank's device among the visible ones, set by setup

    # ---------------------------------------------------------------- setup
    @staticmethod
    def rendezvous_address() -> tuple[str, int]:
        """This node's IP and a port free on it: where the other ranks meet rank 0."""
        import sys

        from trainer.loop.cluster.group import free_port

        port = free_port("")
        ray = sys.modules.get("ray")
        if ray is None or not ray.is_initialized():  # in-process workers (ray.in_process)
            return "127.0.0.1", port
        return ray.util.get_node_ip_address(), port

    def setup(self, master_addr: str, master_port: int) -> dict[str, Any]:
        """Join the process group at rank 0's ``master_addr:master_port``, build and shard the
        model, build the optimizer.

        Returns facts for the controller (parameter count, deterministic settings applied).
        """
        spec, cfg = self.spec, self.spec.cfg
        self.startup.done("queued")
        torch.set_num_threads(max(1, spec.threads))
        if cfg.run.deterministic:
            self.deterministic_settings = self.backend.set_deterministic(cfg.seed)
        # One index for the process group and the model, right also when Ray's ids come
        # out of rank order (rank % device_count would not be).
        local_rank = self.local_index = self.local_rank()
        # In one process (ray.in_process) a group may already exist: then it is not ours to end.
        self.owns_process_group = self.backend.init_process_group(
            spec.rank,
            spec.world_size,
            master_addr=master_addr,
            master_port=master_port,
            timeout_s=cfg.run.collective_timeout_s,
            local_rank=local_rank,
            # FSDP2's CPU offload reduces the gradient norm of host-resident shards.
            host_collectives=cfg.train.param_offload,
        )
        self.device = self.backend.device(local_rank)
        self.startup.done("process_group")
        # Every rank starts from identical weights: same path, same seed.
        self.backend.manual_seed(cfg.seed)
        self._materialise_model_files()
        # Built on the meta device, sharded, then loaded: a node's host memory holds at most
        # one full copy of the weights (rank 0's), whatever the dp size.
        model = self.build_model()
        self.kernels = self._choose_kernels()
        self.kernels.apply(model)  # on this instance, before checkpointing and sharding
        self.startup.done("build")
        # What the role built for real, not on meta (the critic's value head), keeps its values.
        own = {k: v.detach().clone() for k, v in model.state_dict().items() if not v.is_meta}
        own.update(self.starting_values(model))
        if cfg.train.activation_checkpointing and spec.trainable:
            enable_activation_checkpointing(model)
        self.kernels.compile_layers(decoder_layers(model))  # before sharding
        self._shard(model)
        self.startup.done("shard")
        self._load_initial_weights(model, own)
        self.startup.done("load")
        self.model = model
        if spec.trainable:
            self.optimizer, self.scheduler = build_optimizer(
                [p for p in model.parameters() if p.requires_grad],
                lr=spec.optim.lr,
                weight_decay=spec.optim.weight_decay,
                warmup_steps=spec.optim.warmup_steps,
                total_steps=cfg.optimizer_steps_per_step() * cfg.train.total_steps,
                schedule=cfg.train.lr_schedule,
                min_lr_ratio=cfg.train.min_lr_ratio,
                options=self.kernels.optimizer_options(),
            )
        else:
            model.requires_grad_(False)
            model.eval()
        # Different ranks draw different dropout / sampling noise from here on.
        self.backend.manual_seed(cfg.seed + 1000 * (spec.rank + 1))
        num_params = sum(p.numel() for p in model.parameters())
        self.startup.done("optimizer")
        return {
            "rank": spec.rank,
            "num_params": int(num_params),
            "deterministic": self.deterministic_settings,
            "kernels": self.kernels.report(),
            "startup": self.startup.seconds,
        }

    def _choose_kernels(self):
        """The update's kernel of each op on this device (``hal.kernels``, ``train.kernels``):
        the reference where the key, ``run.deterministic`` or an offloaded optimizer asks
        for it; per-block compilation with ``train.compile_blocks``."""
        from hal.kernels import choose_kernels

        cfg = self.spec.cfg
        return choose_kernels(
            self.backend.kernel_providers,
            mode=cfg.train.kernels,
            reference_ops=tuple(cfg.train.reference_kernels),
            deterministic=cfg.run.deterministic,
            optimizer_offload=cfg.train.optimizer_offload or cfg.train.param_offload,
            compile_blocks=cfg.train.compile_blocks,
        )

    def local_rank(self) -> int:
        """This process's device index among the devices it can see
        (``DeviceBackend.local_device_index``).

        By default Ray narrows the visible-devices variable to the device it assigned, so the
        index is 0. With the HAL's Ray no-set variable exported (docs/cluster.md), every
        process sees all devices and takes the one Ray assigned it.
        """
        noset = self.backend.ray_noset_env_var
        ids = None
        if noset and os.environ.get(noset) == "1":
            import ray

            ids = ray.get_runtime_context().get_accelerator_ids().get(self.backend.ray_resource)
        return self.backend.local_device_index(ids)

    def build_model(self) -> torch.nn.Module:
        """The unsharded model of this role (subclasses override)."""
        raise NotImplementedError

    def starting_values(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Whole tensors ``setup`` gives the model instead of the checkpoint's (subclasses:
        the actor's LoRA adapters); names as in ``model``'s state dict."""
        return {}

    # ---------------------------------------------------------------- end of step
    def offload_states(self) -> None:
        """End of a step: free this worker's device memory for the rollout engine.

        The root's unsharded parameters (which a forward without backward leaves gathered)
        and the last update's gradients are freed. ``train.optimizer_offload`` parks the optimizer state in (pinned) host
        memory until the next optimizer step. ``train.param_offload`` needs nothing here:
        FSDP2's CPU-offload policy keeps the sharded parameters, their gradients and so the
        optimizer state in host memory all along, and gathers them onto the device per use.
        """
        from torch.distributed.fsdp import FSDPModule

        if isinstance(self.model, FSDPModule):
            self.model.reshard()
        if self.optimizer is not None:  # the step's gradients: nothing reads them any more
            self.optimizer.zero_grad(set_to_none=True)
        if self.spec.cfg.train.optimizer_offload and self.optimizer is not None:
            self.backend.offload(self.optimizer)
        self.backend.empty_cache()

    def end_of_step(self, asks: list[tuple[str, tuple]]) -> list:
        """The end of a step on this rank in one call: ``offload_states``, then this rank's
        peak memory (``peak_memory_gb``) and the answer to each of ``asks``, ``(method name,
        args)`` of this worker (what the step's records read from it, such as
        ``param_stats``), in that order."""
        self.offload_states()
        return [self.peak_memory_gb(), *(getattr(self, name)(*args) for name, args in asks)]

    def peak_memory_gb(self) -> float:
        """This rank's peak memory since the last call, in GB (1e9 bytes): device memory
        allocated on an accelerator, the process's peak RSS on the CPU. Starts a new peak."""
        peak = self.backend.peak_memory_bytes() / 1e9
        self.backend.reset_peak_memory()
        return peak

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """Move a batch tensor to this worker's device."""
        return tensor.to(self.device, non_blocking=True)

    # ---------------------------------------------------------------- update helpers
    def run_micro_batches(self, micro_batches: list[list[int]], loss_fn) -> StepStats:
        """Forward/backward every micro-batch, then clip and step the optimizer.

        ``loss_fn(micro_batch) -> (loss, metric_sums)``; ``loss`` is this micro-batch's share of
        the mini-batch loss (global normalizers), metric sums (detached tensors, the keys of
        ``trainer.loop.ranks.step_stats.SCHEMAS[role]``) are added up over micro-batches on the
        device and read back once. Every micro-batch's gradients are reduce-scattered into the
        sharded ones as its backward ends (``held_gradient_bytes``). Returns this rank's
        report of the optimizer step.
        """
        model = self.model
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, Any] = {}
        # Gradient sync stays on for every micro-batch: FSDP2 reduce-scatters each backward's
        # gradients into the sharded ones. With it off until the last micro-batch, FSDP2
        # keeps every parameter's whole gradient in reduce_dtype through the accumulation
        # (4 B x all parameters on every rank, whatever dp: 30.5 GB at 7B), which is what
        # the memory budget (trainer/loop/plan/memory_budget.py) cannot afford.
        for rows in micro_batches:
            mb = self.micro_batch(rows)
            loss, metric_sums = loss_fn(mb)
            # FSDP averages gradients over ranks; each rank's loss is already a share of the
            # global mini-batch loss, so scale by dp size to turn that average into the sum.
            (loss * self.spec.world_size).backward()
            for key, value in metric_sums.items():
                sums[key] = sums.get(key, 0.0) + value
        sums = {key: float(value) for key, value in sums.items()}
        # grad_clip null: no clipping, but the norm is still measured (an infinite max norm)
        max_norm = self.spec.optim.grad_clip or math.inf
        if self.spec.cfg.train.expert_parallel_size > 1:  # parameters on two meshes
            from trainer.loop.ranks.expert_parallel import grad_norm as clip_over_meshes

            grad_norm = clip_over_meshes(list(model.parameters()), max_norm)
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        grad_norm = float(grad_norm)
        # A non-finite loss or grad norm on any rank skips the step (and its lr schedule tick)
        # on every rank, so the shards stay in step; the controller counts skips against
        # run.max_nonfinite_steps.
        skip = self._any_rank(not (np.isfinite(grad_norm) and np.isfinite(sums.get("loss", 0.0))))
        if not skip:
            if self.spec.cfg.train.optimizer_offload:
                self.backend.onload(self.optimizer, self.local_index)
            self.optimizer.step()
            self.scheduler.step()
        lr = float(self.scheduler.get_last_lr()[0])
        sums["skipped"] = float(skip)
        return StepStats.of_update(self.spec.role, sums, grad_norm=grad_norm, lr=lr)

    @torch.no_grad()
    def weights_finite(self) -> bool:
        """Whether every element of this rank's parameter shards is finite (no collective).

        The largest magnitude of each shard (an inf-norm: NaN and inf carry through it, and it
        cannot overflow) for all of them in one go, and one read of the answer."""
        local = [p.to_local() if hasattr(p, "to_local") else p for p in self.model.parameters()]
        local = [t for t in local if t.numel()]  # an empty shard is finite
        if not local:
            return True
        largest = torch._foreach_norm(local, math.inf)
        return bool(torch.isfinite(torch.stack(largest)).all())

    def _any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any data-parallel rank (one tiny all-reduce)."""
        import torch.distributed as dist

        if self.spec.world_size == 1 or not dist.is_initialized():
            return flag
        value = torch.tensor([float(flag)], device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def shutdown(self) -> None:
        """End the process group, if this worker made it (in one process, others may share a
        group made before them, by another worker or by the program itself)."""
        import torch.distributed as dist

        if getattr(self, "owns_process_group", False) and dist.is_initialized():
            dist.destroy_process_group()
