"""The weight push: the actor's ranks hand their new weights to their own engine replica.

Every rank takes part (gathering a shard is a collective). Three ways, chosen per call:

- an engine in this very process (``ray.in_process``): the rank's full tensors, copied once
  (``EngineHost.load_weights``);
- CPU ranks that share one host: the whole model in one /dev/shm buffer that each rank
  fills with its own FSDP shard's rows (shared memory replaces the gather);
- otherwise (accelerators): a streamed push (``rollout.engines.weights.stream``). Each rank packs
  gathered tensors, in the engine's dtype, into staging buffers on its own device, shared
  with the engine by IPC handle; the tp group's first rank makes ONE engine call for all
  buckets, and a doorbell (counters in a host file, under a lock) orders the two sides; a
  side that fails aborts the other at once (tp rank 0 also watches the engine's reply). The
  bucket is the whole model when the device has room for it once the ranks have offloaded
  (usually), else two slots sized from the free memory. The staging buffers, and every
  process's mappings of them, live for the push only.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

import hal
from rollout.engines.weights.buckets import tensor_nbytes
from trainer.loop.cluster.local import LocalHandle, LocalRef, fetch
from trainer.loop.weights.colocated_push import ColocatedPush

#: Bytes per bucket of a host-memory snapshot (``snapshot_weights``): big enough that the
#: object store's per-object cost vanishes, small enough to stream to another node.
SNAPSHOT_BUCKET_BYTES = 256 << 20


def full_state(
    model: torch.nn.Module | Mapping[str, torch.Tensor],
) -> list[tuple[str, torch.Tensor]]:
    """``(name, whole tensor)`` of every entry of ``model``'s state dict (or of the state
    ``model``): a DTensor shard (FSDP2, any world size, one rank included) is gathered, a
    plain tensor is itself."""
    state = model.state_dict() if isinstance(model, torch.nn.Module) else model
    return [
        (name, t.full_tensor() if hasattr(t, "full_tensor") else t) for name, t in state.items()
    ]


def _raise_if_ended(reply) -> None:
    """Raise the engine's error if its call (``reply``: a Ray object ref, or a ``LocalRef``
    whose call runs elsewhere and says ``done()``) has ended with one; do nothing while it
    runs. Never waits."""
    if isinstance(reply, LocalRef):
        done = getattr(reply, "done", None)
        ended = done() if callable(done) else reply.error is not None
    else:
        import ray

        ended = bool(ray.wait([reply], timeout=0, fetch_local=False)[0])
    if ended:
        fetch(reply)  # raises the engine's own error (returns when it ended well)


class WeightPush(ColocatedPush):
    """The actor's side of the weight push (mixed into ``PolicyWorker``; it uses the worker's
    ``spec``, ``backend``, ``model`` and ``local_index``)."""

    def push_state(self) -> Mapping[str, torch.Tensor]:
        """What the engines load, by name (FSDP2 shards as they are): the model's state dict,
        a tied parameter under its first name only; for a LoRA actor (``model.lora``), its
        trainable entries alone (``trainer.loop.plan.lora_layout.lora_push``): the adapters,
        and the embedding and LM head when they train, into an engine that holds the same
        base."""
        from rollout.models import tied_parameter_names

        state = self.model.state_dict()
        if not self.spec.cfg.model.lora.enabled:
            # A tied LM head is the embedding: vLLM's loaders skip ``lm_head.`` then, so only
            # the first name of a tied group is pushed (every pushed name must load,
            # rollout.engines.weights.loaded_names).
            tied = {name for group in tied_parameter_names(self.model) for name in group[1:]}
            return {n: t for n, t in state.items() if n not in tied}
        from rollout.lora import trained_names

        trained = trained_names(self.model)
        return {n: t for n, t in state.items() if n in trained}

    def push_weights(
        self, engine, bucket_bytes: int | None = None, via_object_store: bool = False
    ) -> int:
        """Hand the full weights to ``engine``, this rank's engine replica (an ``EngineHost``
        on the devices of this rank's tp group). ``bucket_bytes``: a fixed bucket size, in
        bytes, for the streamed push (None: sized from the free device memory).
        ``via_object_store``: the path before in-node handoff, numpy buckets through Ray's
        object store, kept for ``bench e2e``'s comparison (64 MiB buckets by default).
        Nothing else crosses nodes or goes through the object store.
        Returns the number of buckets sent (0 on ranks that send none).
        """
        if via_object_store:
            return self._push_weights_object_store(engine, bucket_bytes or 64 << 20)
        if isinstance(engine, LocalHandle):  # the engine is in this process: one copy, no buffer
            fetch(engine.load_weights.remote(full_state(self.push_state())))
            return 1
        if not self.backend.is_accelerator and self._ranks_share_a_host():
            return self._push_weights_host_buffer(engine)
        return self.push_weights_streamed(engine, bucket_bytes)

    # ---------------------------------------------------------------- streamed (accelerators)
    def push_weights_streamed(self, engine, bucket_bytes: int | None = None) -> int:
        """The streamed push (module docstring); any backend (the CPU's shared buffers are
        /dev/shm files, which is how tests drive it). Returns the buckets sent by this rank
        (the tp group's first rank sends them all, the others 0)."""
        from rollout.engines.weights.buckets import pack_tensor, plan_buckets
        from rollout.engines.weights.stream import RANK, STREAM_TIMEOUT_S, Doorbell, PushAborted
        from rollout.models import parse_dtype

        cfg, rank = self.spec.cfg, self.spec.rank
        tp = cfg.rollout.tensor_parallel_size
        tp_rank = rank % tp
        state = self.push_state()
        dtype = parse_dtype(cfg.model.dtype)
        shapes = [(name, tuple(t.shape)) for name, t in state.items()]
        if bucket_bytes is None:
            bucket_bytes, _ = self._stream_bucket_bytes(shapes, dtype)
        buckets, nbytes = plan_buckets(shapes, dtype, bucket_bytes)
        slots = min(2, len(buckets))
        staging = [self.backend.shared_buffer(nbytes, self.local_index) for _ in range(slots)]
        bell, bell_handle = Doorbell.create(tp) if tp_rank == 0 else (None, None)
        # Each rank learns its tp group's staging handles (tp rank order) and doorbell.
        group = [([h for _, h in staging], bell_handle)]
        if self.spec.world_size > 1:
            everyone: list = [None] * self.spec.world_size
            torch.distributed.all_gather_object(everyone, group[0])
            group = everyone[rank - tp_rank : rank - tp_rank + tp]
        slot_handles = [[group[t][0][s] for t in range(tp)] for s in range(slots)]
        bell = bell or Doorbell.open(group[0][1])
        reply = None
        if tp_rank == 0:  # one call for every bucket: the engine follows the doorbell
            specs = [[tuple(s) for s in bucket] for bucket in buckets]
            reply = engine.load_weight_stream.remote(slot_handles, group[0][1], specs)
        buffers = [buf for buf, _ in staging]
        # tp rank 0 also watches the engine's reply: an engine error ends the push at once.
        check = None if reply is None else (lambda: _raise_if_ended(reply))
        try:
            for k, specs in enumerate(buckets):
                if k >= slots:  # the slot's previous bucket must have been read
                    bell.wait(
                        bell.read, k - slots + 1, "the engine to read", STREAM_TIMEOUT_S, check
                    )
                for spec in specs:
                    tensor = state[spec.name]
                    full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
                    pack_tensor(buffers[k % slots], spec, full.detach())
                self.backend.synchronize()  # the copies are queued: done before the bell
                bell.ring(tp_rank, k + 1)
            if reply is not None:
                fetch(reply)  # the engine has loaded and finished every bucket
            else:
                bell.wait(bell.read, len(buckets), "the engine to load", STREAM_TIMEOUT_S)
        except BaseException as err:
            bell.abort(RANK)  # the engine and the tp peers stop waiting now
            if reply is not None and isinstance(err, PushAborted):
                fetch(reply)  # the engine stopped the push: raise its own error, which ends it
            raise
        finally:
            bell.close()
            if tp_rank == 0:
                Doorbell.release(group[0][1])
            handles = [handle for _, handle in staging]
            del staging, buffers[:]  # the staging memory goes back before the KV cache wakes
            for handle in handles:
                self.backend.release_shared_buffer(handle)
            if self.backend.is_accelerator:
                self.backend.empty_cache()
        return len(buckets) if tp_rank == 0 else 0

    def _stream_bucket_bytes(self, shapes, dtype: torch.dtype, copies: int = 1) -> tuple[int, int]:
        """``(bucket_bytes, slots)`` for this push (``rollout.engines.weights.buckets.stream_buckets``)
        from the least free device memory over all ranks (a collective), so every rank plans
        the same buckets. ``copies``: of each bucket the push holds at once (2 where the
        engine copies a chunk out of the buffer before loading it)."""
        from rollout.engines.weights.buckets import plan_buckets, stream_buckets

        _, model_bytes = plan_buckets(shapes, dtype, 1 << 62)
        model_bytes *= copies
        layers, _ = plan_buckets(shapes, dtype, 0)  # one bucket per layer or tensor
        floor = max(b[-1].offset + tensor_nbytes(b[-1].shape, dtype) for b in layers)
        largest_fp32 = max(tensor_nbytes(shape, torch.float32) for _, shape in shapes)
        free = self.backend.free_memory_bytes(self.local_index)
        if free is None:  # the CPU: host memory, no device budget to respect
            return model_bytes, 1
        least = torch.tensor([free], dtype=torch.int64, device=self.device)
        if self.spec.world_size > 1:
            torch.distributed.all_reduce(least, op=torch.distributed.ReduceOp.MIN)
        tp = self.spec.cfg.rollout.tensor_parallel_size
        return stream_buckets(
            model_bytes,
            int(least.item()),
            engine_bytes=model_bytes // tp,  # the engine's woken weights, its shard of them
            reserve_bytes=largest_fp32 + (1 << 30),  # one gathered tensor, allocator slack
            floor_bytes=floor,
        )

    # ---------------------------------------------------------------- CPU, one host
    def _ranks_share_a_host(self) -> bool:
        """Whether every rank runs on this host (asked once: a collective of host names)."""
        known = getattr(self, "_one_host", None)
        if known is None:
            import socket

            names: list = [None] * self.spec.world_size
            torch.distributed.all_gather_object(names, socket.gethostname())
            known = self._one_host = len(set(names)) == 1
        return known

    def drop_host_buffer(self) -> None:
        """Forget the CPU sync's shared buffer (``_push_weights_host_buffer``): the next push
        makes a fresh one that every replica maps. For a replaced engine replica: the held
        buffer's name is gone once the first replicas mapped it, so a new process cannot."""
        self._host_buffer = None

    def _push_weights_host_buffer(self, engine) -> int:
        """The CPU sync when all ranks share one host: the whole model, in the engine's
        dtype, lives in one shared-memory buffer that every rank maps; each rank writes its
        own FSDP shard's rows in place, so shared memory replaces the gather collective, and
        after one barrier every replica reads the full weights from it. Returns 1 bucket on
        the ranks that sent (each tp group's first), else 0."""
        from rollout.engines.weights.buckets import plan_buckets, tensor_view
        from rollout.models import parse_dtype

        cfg, rank, world = self.spec.cfg, self.spec.rank, self.spec.world_size
        state = self.push_state()
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

    # ---------------------------------------------------------------- engines of their own
    def snapshot_weights(self, bucket_bytes: int = SNAPSHOT_BUCKET_BYTES) -> list:
        """This rank's part of a host-memory snapshot of the new weights, for engines on
        devices of their own (``rollout.engine_devices``). No rank gathers the model: each
        publishes only the rows it holds (its FSDP2 shard of every tensor; a tensor that is
        not sharded, by rank 0 alone), in the engine's dtype, in Ray's object store on its
        own node, one object per bucket. The buckets are planned on the whole tensors, so
        every rank's bucket b holds its rows of the same tensors (never splitting a layer),
        and an engine joins the ranks' bucket b into whole tensors (``assemble_pieces``)
        one bucket at a time (``EngineHost.load_host_buckets``). A rank holds at most its
        shard plus one bucket's rows beyond its model. The snapshot outlives the ranks' next
        update, so an engine loads it whenever its queue of rollouts reaches it. Returns
        ``[bucket refs, bucket specs]`` of this rank: ``Trainer.snapshot_weights`` collects
        every rank's."""
        import ray

        from rollout.engines.weights.buckets import pack_pieces, plan_buckets
        from rollout.models import parse_dtype

        state = self.push_state()
        dtype = parse_dtype(self.spec.cfg.model.dtype)
        buckets, _ = plan_buckets(((n, t.shape) for n, t in state.items()), dtype, bucket_bytes)
        refs, specs = [], []
        for planned in buckets:
            pieces = []
            for spec in planned:
                rows = self._own_rows(state[spec.name])
                if rows is not None:
                    pieces.append((spec.name, rows))
            flat, local = pack_pieces(pieces, dtype)
            refs.append(ray.put(flat.numpy()))
            specs.append([tuple(s) for s in local])
        return [refs, specs]

    def _own_rows(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """The rows of ``tensor`` this rank publishes: its dim-0 shard of an FSDP2 DTensor
        (possibly empty), the whole tensor on rank 0 when it is not sharded (a plain tensor,
        a replicated DTensor), None on the other ranks. Another placement is gathered (a
        collective every rank joins) and published by rank 0."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        first = self.spec.rank == 0
        if not isinstance(tensor, DTensor):
            return tensor if first else None
        placements = tuple(tensor.placements)
        if placements == (Shard(0),):
            return tensor.to_local()
        if all(isinstance(p, Replicate) for p in placements):
            return tensor.to_local() if first else None
        full = tensor.full_tensor()
        return full if first else None

    # ---------------------------------------------------------------- the transfer group
    def weight_group_address(self, replicas: int, timeout_s: float):
        """Serve the push's control store (training rank 0 only) for ``replicas`` engine
        replicas, naming the transfer group's first generation, broadcasts failing past
        ``timeout_s`` seconds; returns the ``WeightGroupAddress`` every member takes
        (``join_weight_group``)."""
        from rollout.engines.weights.transfer import ENGINE_NAME
        from trainer.loop.weights.membership import start_membership
        from trainer.loop.weights.weight_group import WeightGroupAddress, serve_store

        cfg = self.spec.cfg
        host, port = self.rendezvous_address()
        self._weight_store = serve_store(host, port, 1 + replicas, timeout_s)
        start_membership(self._weight_store, replicas)
        vllm = cfg.rollout.engine == "vllm"
        return WeightGroupAddress(
            host=host,
            port=port,
            replicas=replicas,
            workers=cfg.rollout.tensor_parallel_size if vllm else 1,
            engine=self.backend.weight_transfer_engine if vllm else ENGINE_NAME,
            timeout_s=timeout_s,
            layerwise=self.backend.vllm_layerwise_reload,
        )

    def join_weight_group(self, address) -> None:
        """Take part in the push at ``address`` (``trainer.loop.weights.weight_group``):
        rank 0 as its sender, which joins the engines' transfer group at its first push; the
        other ranks only gather."""
        from trainer.loop.weights.weight_group import WeightSender, trainer_transport

        self._weight_sender = WeightSender(
            address,
            getattr(self, "_weight_store", None),
            trainer_transport(address, self.backend),
            self.backend,
            self.local_index,
        )

    def shutdown(self) -> None:
        """Give up a push no engine will take any more (the sender thread stops waiting for
        its engines), then end the worker as ``FSDPWorker.shutdown`` does."""
        sender = getattr(self, "_weight_sender", None)
        if sender is not None:
            sender.stop()
        super().shutdown()

    def exclude_from_weight_group(self, lost: list[int]) -> None:
        """Rank 0: leave the lost replicas ``lost`` out of the transfer group; the sender
        builds its next generation without them (``WeightSender.exclude``)."""
        self._weight_sender.exclude(lost)

    def finish_push(self) -> None:
        """Wait for the push before (rank 0: its sender thread; the other ranks: nothing) and
        raise what broke it. The driver calls it on every rank before ``broadcast_weights``,
        so no rank sits in the next gather's all-gather while rank 0 still waits for the
        engines (a collective that would time out at ``train.rollout_lag`` >= 2)."""
        self._weight_sender.finish()

    def broadcast_weights(self, seq: int) -> int:
        """Push ``seq`` of the new weights: every rank gathers each tensor whole, rank 0
        keeps a copy in the engine's dtype and its sender thread broadcasts it to every engine
        worker once they are ready (``weight_group.WeightSender``). Returns the tensors rank 0
        sends (0 elsewhere)."""
        from rollout.models import parse_dtype

        return self._weight_sender.send(
            self.push_state(), parse_dtype(self.spec.cfg.model.dtype), seq
        )

    # ---------------------------------------------------------------- object store (bench)
    def _push_weights_object_store(self, engine, bucket_bytes: int) -> int:
        """The weight sync before in-node handoff: float32 numpy buckets through Ray's object
        store, sent by each tp group's first rank (kept for ``bench e2e``'s comparison)."""
        sender = self.spec.rank % self.spec.cfg.rollout.tensor_parallel_size == 0
        bucket: dict[str, np.ndarray] = {}
        size = 0
        sent = 0
        for name, tensor in self.push_state().items():
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
