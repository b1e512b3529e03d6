"""How new weights reach an engine from the training ranks, per device type: the buffers a
colocated engine maps without a copy (``shared_buffer``; the reader's ``open_shared_buffer``)
and the weight-transfer engines of vLLM (or crossrl's own where none ships) each kind of push
goes through, with the class whose static trainer helpers the ranks call
(``rollout.engines.weights.transfer``, ``rollout.engines.weights.shm_transfer``). Mixed into
``hal.base.DeviceBackend``; a device's backend overrides the names.
"""

from __future__ import annotations

import torch


class WeightHandoff:
    """The weight path's facts and buffers of one device type (``DeviceBackend``'s part)."""

    #: The weight-transfer engine vLLM's workers take pushes through on this device type
    #: (``WeightTransferConfig.backend``; the CPU's is crossrl's own, ``rollout.engines.weights.transfer``)
    #: and the class whose static ``trainer_init`` / ``trainer_send_weights`` the trainer calls.
    weight_transfer_engine: str = "crossrl_gloo"
    weight_transfer_trainer: tuple[str, str] = (
        "rollout.engines.weights.transfer",
        "GlooWeightTransfer",
    )
    #: The same for a colocated engine, whose workers sit on the ranks' own devices and map
    #: the ranks' buffers (``WeightTransferConfig.backend``: vLLM's ``ipc`` on CUDA; on the
    #: CPU crossrl's ``crossrl_shm``, /dev/shm files), and its trainer class.
    colocated_transfer_engine: str = "crossrl_shm"
    colocated_transfer_trainer: tuple[str, str] = (
        "rollout.engines.weights.shm_transfer",
        "SharedMemoryTransfer",
    )

    def shared_buffer(self, nbytes: int, local_index: int = 0) -> tuple[torch.Tensor, tuple]:
        """A flat uint8 buffer of ``nbytes`` bytes on device ``local_index`` that another process
        on the same device can map, and its picklable handle (``open_shared_buffer``).

        Accelerators: device memory shared by IPC handle (``torch.multiprocessing``'s
        reductions). Keep the tensor alive while a reader may use it; after writing, call
        ``synchronize`` before handing the handle over."""
        from torch.multiprocessing.reductions import reduce_tensor

        buf = torch.empty(int(nbytes), dtype=torch.uint8, device=self.device(local_index))
        return buf, ("ipc", reduce_tensor(buf))

    def release_shared_buffer(self, handle: tuple) -> None:
        """Drop the name of a shared buffer once every reader has mapped it (mappings stay
        valid; the memory goes when the last process lets go). IPC handles have no name:
        blocks that readers have let go of are returned to the allocator instead."""
        collect = (
            getattr(self.device_module(), "ipc_collect", None) if self.is_accelerator else None
        )
        if collect is not None:
            collect()


def ipc_rebuild_args(args: tuple, device_index: int) -> list:
    """``torch.multiprocessing.reductions.reduce_tensor``'s rebuild arguments for a reader
    whose device index differs from the writer's (another visible-devices list): the storage
    device is argument 6 of ``rebuild_cuda_tensor`` (and of torch_npu's ``rebuild_npu_tensor``).
    """
    out = list(args)
    out[6] = int(device_index)
    return out


def open_shared_buffer(handle: tuple, device_index: int = 0) -> torch.Tensor:
    """Map a buffer another process made with ``DeviceBackend.shared_buffer``: the flat uint8
    tensor, the same memory (no copy), on this process's device ``device_index``."""
    kind = handle[0]
    if kind == "file":
        from hal.shm import open_shm_file

        return open_shm_file(handle[1], handle[2])
    if kind == "ipc":
        rebuild, args = handle[1]
        return rebuild(*ipc_rebuild_args(args, device_index))
    raise ValueError(f"shared buffer handle of kind {kind!r}: expected 'file' or 'ipc'")


def close_shared_buffer(handle: tuple) -> None:
    """This process is done with a buffer it mapped with ``open_shared_buffer``: drop the
    mapping it keeps for later buckets (a file's; the memory goes once no tensor views it).
    IPC handles keep nothing here (torch's own ref-counted cache holds them)."""
    if handle[0] == "file":
        from hal.shm import close_shm_file

        close_shm_file(handle[1])
