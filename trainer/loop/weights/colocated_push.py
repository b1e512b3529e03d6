"""The colocated vLLM push (``Layout.weight_transport == "ipc"``): the actor's ranks hand their
new weights to colocated vLLM engines through vLLM's weight-transfer API, by the trainer helper
of the backend's own colocated engine (``DeviceBackend.colocated_transfer_trainer``). Mixed into
``WeightPush`` (it uses the worker's ``spec``, ``backend``, ``push_state`` and
``_stream_bucket_bytes``).

A push is ``start_transfer`` on every replica, the helper's chunks (rank 0 hands each to every
replica's ``receive_chunk``), then ``finish_transfer``; a push that fails midway resets every
replica (``abort_transfer``), so the next push finds none of them mid-update.
"""

from __future__ import annotations

import torch

from rollout.engines.weights.buckets import tensor_nbytes
from trainer.loop.cluster.local import fetch


def update_payload(info) -> dict:
    """The ``update_info`` dict of a colocated chunk (the trainer helper's update-info
    dataclass): its fields, without those left None. vLLM's ``IPCWeightTransferUpdateInfo``
    has ``ipc_handles_pickled`` beside ``ipc_handles`` (0.24 and 0.26), and vllm-ascend's
    ``NPUIPCWeightTransferEngine.parse_update_info`` refuses a dict holding both keys, a None
    included ("Cannot specify both"); vLLM's own ``parse_update_info`` pops a None. Shallow:
    the IPC handles are passed on as they are."""
    from dataclasses import fields

    values = {f.name: getattr(info, f.name) for f in fields(info)}
    return {name: value for name, value in values.items() if value is not None}


def one_line(err: BaseException) -> str:
    """``err`` as one line: a Ray task error's cause (the engine's own exception), its type
    and its message's first line."""
    cause = getattr(err, "cause", None)
    err = cause if isinstance(cause, BaseException) else err
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def _reset_replicas(replicas: list) -> None:
    """Reset every replica's weight update (``abort_transfer``), each whatever the others
    do: a replica whose reset fails is left to the run's restart."""
    import logging

    for replica in replicas:
        try:
            fetch(replica.abort_transfer.remote())
        except Exception as err:  # noqa: BLE001 - the push's own error is what is raised
            logging.getLogger(__name__).warning("engine replica reset failed: %s", one_line(err))


class ColocatedPush:
    """The colocated vLLM push of ``WeightPush`` (module docstring)."""

    def push_transfer(self, replicas: list, buffer_bytes: int | None = None) -> int:
        """Push the new weights to colocated vLLM engines through vLLM's weight-transfer API
        (``Layout.weight_transport == "ipc"``), by the trainer helper of the backend's own
        colocated engine (``DeviceBackend.colocated_transfer_trainer``: vLLM's ``ipc``,
        vllm-ascend's ``npu_ipc``, the CPU's ``crossrl_shm``): every rank gathers each tensor
        whole in the engine's dtype, the first rank on each device packs them into one buffer
        of ``buffer_bytes`` (None: sized from the free device memory) that its engine workers
        map, and rank 0 opens the update on every replica of ``replicas``, hands each chunk to
        all of them and closes it. Returns the chunks sent (0 on the other ranks).

        A replica that fails a chunk does not end the sender's loop on rank 0 alone (the other
        ranks would wait in the helper's per-chunk barrier until the collective timeout): its
        error is kept, the remaining chunks go to no replica, every rank learns the error once
        the loop has ended, every replica's update is reset (``abort_transfer``) and every
        rank raises that one line."""
        import importlib

        from rollout.engines.weights.transfer import PACKED_BUFFER_BYTES
        from rollout.models import parse_dtype
        from trainer.loop.weights.gather import whole_tensors

        state = self.push_state()
        dtype = parse_dtype(self.spec.cfg.model.dtype)
        if buffer_bytes is None:  # room for the buffer and the engine's copy of a chunk
            shapes = [(name, tuple(t.shape)) for name, t in state.items()]
            bucket, _ = self._stream_bucket_bytes(shapes, dtype, copies=2)
            buffer_bytes = min(bucket, sum(tensor_nbytes(shape, dtype) for _, shape in shapes))
        module, helper = self.backend.colocated_transfer_trainer
        sender = getattr(importlib.import_module(module), helper)
        sent: list[int] = []
        failed: list[str] = []  # rank 0: the first replica error of this push

        def send(info) -> None:  # rank 0: one chunk to every replica, read before it refills
            if failed:  # a replica failed: the loop runs on (every rank's barriers), sends none
                return
            payload = update_payload(info)
            replies = [r.receive_chunk.remote(payload) for r in replicas]
            for reply in replies:  # every reply, so no replica still reads the buffer
                try:
                    fetch(reply)
                except Exception as err:  # noqa: BLE001 - told to every rank after the loop
                    if not failed:
                        failed.append(one_line(err))
            if not failed:
                sent.append(len(payload["names"]))

        self._on_every_replica(replicas, "start_transfer", reset=True)
        args = {"send_mode": send, "packed": True, "packed_buffer_size_bytes": buffer_bytes}
        looped = False
        try:
            if getattr(sender, "takes_shards", False):  # the CPU's: shards on one host
                items = ((n, t.detach().to(dtype)) for n, t in state.items())
            else:
                items = whole_tensors(state, dtype, min(buffer_bytes, PACKED_BUFFER_BYTES))
            sender.trainer_send_weights(items, args)
            looped = True
        finally:
            if self.backend.is_accelerator:
                self.backend.empty_cache()  # the buffer goes back before the KV cache wakes
            if not looped and self.spec.rank == 0:
                # This rank's own loop raised (its peers are left in a collective, which
                # only the group's timeout ends): the replicas are reset for the next push.
                _reset_replicas(replicas)
        error = self._tell_every_rank(failed[0] if failed else None)
        if error is not None:
            try:
                self._on_every_replica(replicas, "abort_transfer")
            except RuntimeError as reset:  # the same on every rank: said with the push's
                error = f"{error} (then {reset})"
            raise RuntimeError(f"weight push to the colocated engines failed: {error}")
        self._on_every_replica(replicas, "finish_transfer", reset=True)
        return len(sent)

    def _tell_every_rank(self, error: str | None) -> str | None:
        """Rank 0's ``error`` (one line, or None), on every rank (a broadcast)."""
        told = [error]
        if self.spec.world_size > 1:
            torch.distributed.broadcast_object_list(told, src=0)
        return told[0]

    def _on_every_replica(self, replicas: list, method: str, reset: bool = False) -> None:
        """Rank 0 calls ``method`` on every replica and waits for every reply; every rank
        learns whether one failed (a broadcast), so none goes on into the push's collectives
        alone, and every rank raises the same one line. ``reset``: where one failed, rank 0
        first resets every replica's update (``abort_transfer``: those that opened or closed
        theirs too, so no replica is left mid-update)."""
        error = None
        if self.spec.rank == 0:
            for reply in [getattr(r, method).remote() for r in replicas]:
                try:
                    fetch(reply)
                except Exception as err:  # noqa: BLE001 - re-raised on every rank below
                    error = error or one_line(err)
            if error is not None and reset:
                _reset_replicas(replicas)
        told = self._tell_every_rank(error)
        if told is not None:
            raise RuntimeError(f"engine replica {method} failed: {told}")
