"""Weights into a colocated engine through vLLM's weight-transfer API, by shared memory.

A colocated engine's workers sit on the training ranks' own devices, so a push needs no
collective to the engine: vLLM ships the ``ipc`` engine (device IPC handles) and vllm-ascend
``npu_ipc`` for it, with a static ``trainer_send_weights`` on the trainer's side. The HAL names
them per device type (``DeviceBackend.colocated_transfer_engine`` / ``..._trainer``). This
module is the CPU's counterpart, ``crossrl_shm`` (its vLLM engine class registered with vLLM's
factory by ``rollout.engines.weights.transfer_engines.register``), with the same protocol, so the CPU
lane runs vLLM's own ``update_weights`` path for colocated engines too:

- every training rank yields each tensor whole, in the engine's dtype (gathering a shard is a
  collective every rank joins);
- the first rank on each device (on the CPU: on each host, whose processes all map /dev/shm)
  packs them, in order, into one buffer of ``packed_buffer_size_bytes`` its engine workers
  map; a chunk closes when the next tensor would not fit (vLLM's ``packed_ipc_producer``).
  On the CPU, when every rank runs on one host, the ranks yield their FSDP2 shards instead
  and each writes its own rows into the one buffer (``SharedMemoryTransfer.takes_shards``):
  shared memory replaces the gather;
- per chunk the ranks gather every device's handle, rank 0 hands the chunk's update info to
  ``send_mode`` (crossrl: every replica's ``update_weights``), and a barrier keeps every rank
  from refilling its buffer before every engine has read it.

The update info has the fields of vLLM's ``IPCWeightTransferUpdateInfo`` (``ipc_handles`` maps
a device key to a ``hal`` shared-buffer handle). Nothing here imports vLLM at module level.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

#: The name crossrl's shared-memory engine registers under with vLLM's factory.
ENGINE_NAME = "crossrl_shm"


def device_key() -> str:
    """This process's device as the update info's handles are keyed: the host (every process
    on it maps the same /dev/shm files), as vLLM keys its IPC handles by the device's UUID."""
    return f"host:{socket.gethostname()}"


@dataclass
class SharedUpdateInfo:
    """One chunk of a push: the tensors' names, torch dtype names, shapes and byte sizes, in
    packing order, and the buffer that holds them per device key (``ipc_handles``)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    ipc_handles: dict[str, tuple]
    tensor_sizes: list[int]
    packed: bool = True
    update_kind: str = field(default="dense", repr=False)

    def __post_init__(self) -> None:
        counts = {len(self.names), len(self.dtype_names), len(self.shapes), len(self.tensor_sizes)}
        if len(counts) != 1:
            raise ValueError(
                f"update_info: {len(self.names)} names, {len(self.dtype_names)} dtype_names, "
                f"{len(self.shapes)} shapes, {len(self.tensor_sizes)} tensor_sizes: every "
                "tensor needs all four"
            )
        if self.update_kind != "dense" or not self.packed or not self.ipc_handles:
            raise ValueError(f"{ENGINE_NAME} receives dense packed updates with their handles")


def read_chunk(info: SharedUpdateInfo, key: str | None = None) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of chunk ``info`` as views of the buffer of device ``key`` (None:
    this process's), mapped here without a copy."""
    import hal
    from rollout.engines.weights.transfer import unpack_chunk

    key = key or device_key()
    if key not in info.ipc_handles:
        raise ValueError(
            f"{ENGINE_NAME}: no buffer for {key!r} in the push (it has "
            f"{sorted(info.ipc_handles)}): the engine must run on a training rank's host"
        )
    flat = hal.open_shared_buffer(tuple(info.ipc_handles[key]))[: sum(info.tensor_sizes)]
    dtypes = [getattr(torch, d) for d in info.dtype_names]
    return unpack_chunk(flat, info.names, info.shapes, dtypes)


def load_chunk(info: SharedUpdateInfo, load: Callable[..., object]) -> int:
    """Hand chunk ``info``'s tensors to ``load`` (a model's ``load_weights``), each copied out
    of the buffer as the loader asks for it: vLLM's layerwise reload keeps what it is handed
    until its layer is whole, and the buffer is refilled with the next chunk. This process's
    mapping is dropped afterwards. Returns the tensor count."""
    import hal

    views = read_chunk(info)
    load((name, view.clone()) for name, view in views)
    count = len(views)
    del views
    hal.close_shared_buffer(tuple(info.ipc_handles[device_key()]))
    return count


def ipc_chunks(
    iterator: Iterator[tuple[str, torch.Tensor]], buffer_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The tensors ``iterator`` yields, grouped as chunks of one buffer of ``buffer_bytes``:
    a chunk closes when the next tensor would not fit (vLLM's ``packed_ipc_producer``); a
    tensor bigger than the buffer is refused, naming it."""
    chunk, total = [], 0
    for name, tensor in iterator:
        size = tensor.numel() * tensor.element_size()
        if size > buffer_bytes:
            raise ValueError(
                f"{ENGINE_NAME}: tensor {name!r} has {size} bytes, more than the buffer's "
                f"{buffer_bytes}: raise packed_buffer_size_bytes to at least {size}"
            )
        if chunk and total + size > buffer_bytes:
            yield chunk
            chunk, total = [], 0
        chunk.append((name, tensor))
        total += size
    if chunk:
        yield chunk


class SharedMemoryTransfer:
    """The trainer's side of ``crossrl_shm``, by the name of vLLM's ``ipc`` engine's static
    helper, so the trainer calls every colocated backend alike. It also takes FSDP2 shards
    (``takes_shards``): when every rank runs on one host, each writes its own rows of a
    ``Shard(0)`` tensor into the one buffer they all map, so shared memory replaces the
    gather; across hosts a shard is gathered whole first."""

    takes_shards = True

    @staticmethod
    def trainer_send_weights(iterator: Iterator[tuple[str, torch.Tensor]], trainer_args) -> None:
        """Send the tensors ``iterator`` yields (whole, or FSDP2 shards, on every rank) chunk
        by chunk (module docstring): ``trainer_args`` holds ``send_mode`` (a callable taking
        each chunk's ``SharedUpdateInfo``, called on rank 0) and ``packed_buffer_size_bytes``."""
        import hal

        args = dict(trainer_args)
        send: Callable[[SharedUpdateInfo], object] = args["send_mode"]
        buffer_bytes = int(args["packed_buffer_size_bytes"])
        dist = torch.distributed
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if world > 1 else 0
        key = device_key()
        keys = [key]
        if world > 1:
            keys = [None] * world
            dist.all_gather_object(keys, key)
        packer = keys.index(key) == rank  # the first rank on this device makes its buffer
        one_host = len(set(keys)) == 1  # then every rank writes its rows into rank 0's
        made = hal.get_backend("cpu").shared_buffer(buffer_bytes) if packer else (None, None)
        handle = made[1]
        if one_host and world > 1:
            shared = [handle]
            dist.broadcast_object_list(shared, src=0)
            handle = shared[0]
        buf = made[0] if packer else hal.open_shared_buffer(handle) if one_host else None
        try:
            for chunk in ipc_chunks(iterator, buffer_bytes):
                sizes = _pack(buf, chunk, rank, world, one_host)
                handles = [{key: handle} if packer else {}]
                if world > 1:
                    if one_host:
                        dist.barrier()  # every rank's rows are in the buffer
                    else:
                        handles = [None] * world
                        dist.all_gather_object(handles, {key: handle} if packer else {})
                if rank == 0:
                    send(
                        SharedUpdateInfo(
                            names=[name for name, _ in chunk],
                            dtype_names=[str(t.dtype).removeprefix("torch.") for _, t in chunk],
                            shapes=[[int(d) for d in t.shape] for _, t in chunk],
                            ipc_handles={k: h for part in handles for k, h in part.items()},
                            tensor_sizes=sizes,
                        )
                    )
                if world > 1:
                    dist.barrier()  # every engine has read this chunk: the buffers refill
        finally:
            del buf, made
            if packer:
                hal.get_backend("cpu").release_shared_buffer(handle)
            elif one_host:
                hal.close_shared_buffer(handle)


def _pack(buf, chunk: list, rank: int, world: int, one_host: bool) -> list[int]:
    """Write ``chunk``'s tensors into ``buf`` in order (``buf`` None: this rank writes none,
    another rank on its device does); returns their byte sizes. A ``Shard(0)`` DTensor: on
    one host each rank writes its own rows (FSDP2's ``torch.chunk`` split), else it is
    gathered whole; any other DTensor is gathered whole (a collective every rank joins)."""
    from torch.distributed.tensor import DTensor, Shard

    sizes, offset = [], 0
    for _, tensor in chunk:
        size = tensor.numel() * tensor.element_size()
        if isinstance(tensor, DTensor):
            if one_host and tuple(tensor.placements) == (Shard(0),):
                local = tensor.to_local().detach().contiguous()
                row = size // max(1, tensor.shape[0])
                start = offset + rank * -(-tensor.shape[0] // world) * row
                flat = local.view(torch.uint8).view(-1)
                buf[start : start + flat.numel()].copy_(flat)
                sizes.append(size)
                offset += size
                continue
            tensor = tensor.full_tensor()
        if buf is not None and (rank == 0 or not one_host):
            flat = tensor.detach().contiguous().view(torch.uint8).view(-1)
            buf[offset : offset + size].copy_(flat)
        sizes.append(size)
        offset += size
    return sizes
