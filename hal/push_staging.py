"""How training rank 0 holds a weight push for engines of their own and feeds it to the engine's
packed producer (``trainer.loop.weights.weight_group``), per device.

The push is staged on the host, not the device: at ``train.rollout_lag`` >= 1 the sender sends
while the ranks train the next step, and a whole copy of the model on rank 0's device through
that step (140 GB at 70B) is memory the update needs. On an accelerator each gathered tensor
is copied into pinned host memory (``keep``); the producer's ``post_iter_func``
(``chunk_source``) copies it back to the device one tensor at a time, on the producer's own
stream, so the device holds only the chunks in flight.

The producers (vLLM 0.24's ``packed_nccl_broadcast_producer``, vllm-ascend 0.26.0rc1's
``packed_broadcast_producer``, read in their wheels' ``weight_transfer/packed_tensor.py``)
pack each chunk with ``torch.cat`` on a side stream of their own. vllm-ascend's then
broadcasts on the *current* stream, and the host waits only for the side streams, so the
side stream that packs chunk k + 2 can write into the memory of chunk k (the caching
allocator hands a block back to the stream it came from as soon as Python drops it) while
chunk k's broadcast is still queued. ``chunk_source`` makes the side stream wait for the
collective's stream first, so nothing the producer writes overtakes a broadcast queued before
it. The collective's stream is one of the push's own (``sending``): the training step on the
device's default stream is never waited for, and the push overlaps it.

On the CPU there are no streams: a gathered tensor is already on the host and is kept as is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch


class PushStaging:
    """Rank 0's side of a staged push on device ``device_index`` of ``backend`` (a
    ``hal.DeviceBackend``, whose ``device_module`` gives the streams that order the copies)."""

    def __init__(self, backend, device_index: int = 0) -> None:
        self.backend = backend
        self.device_index = int(device_index)
        self.streams = backend.is_accelerator
        self.module = backend.device_module() if self.streams else None
        self.collective = None  # the push's own stream while ``sending``

    @property
    def device(self) -> torch.device:
        """The device the producer packs and broadcasts on."""
        return self.backend.device(self.device_index)

    def keep(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (a gathered whole tensor, a copy of the rank's own) held until it is
        sent: in pinned host memory on an accelerator (the copy is queued; ``ready`` waits
        for it), itself on the CPU."""
        if not self.streams:
            return tensor
        out = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
        out.copy_(tensor, non_blocking=True)
        return out

    def ready(self) -> None:
        """Wait until every ``keep`` copy has landed (before another thread sends them)."""
        if self.streams:
            self.backend.synchronize()

    @contextmanager
    def sending(self):
        """Run the producer under a stream of the push's own: its broadcasts (vllm-ascend's
        run on the current stream) queue there, not on the stream the training step uses."""
        if not self.streams:
            yield
            return
        stream = self.module.Stream()
        self.collective = stream
        try:
            with self.module.stream(stream):
                yield
            stream.synchronize()
        finally:
            self.collective = None

    def chunk_source(self) -> Callable[[tuple[str, torch.Tensor]], torch.Tensor]:
        """The producer's ``post_iter_func``: (name, kept tensor) -> the tensor to pack, on the
        device. Called on the producer's packing stream: that stream first waits for the
        broadcasts queued on the push's stream, then copies the tensor in (pinned memory: the
        host allocator keeps the source until the copy has run)."""
        if not self.streams:
            return lambda item: item[1]
        module, device = self.module, self.device

        def source(item: tuple[str, torch.Tensor]) -> torch.Tensor:
            packing = module.current_stream()
            if self.collective is not None and packing != self.collective:
                packing.wait_stream(self.collective)
            return item[1].to(device, non_blocking=True)

        return source


def drain(staged: list[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``staged``'s entries in order, each dropped from the list as it goes (the host
    copy is freed once packed)."""
    staged.reverse()
    while staged:
        yield staged.pop()


def destroy_communicator(group) -> None:
    """Free a weight-transfer communicator the push no longer uses (a group rebuilt without a
    lost member): vLLM's ``PyNcclCommunicator.destroy`` (0.24: ``ncclCommAbort`` in a thread
    of its own), vllm-ascend's ``PyHcclCommunicator`` through its library's
    ``hcclCommDestroy`` (0.26.0rc1 has no ``destroy``); a gloo group of crossrl's own is
    dropped with its last reference. Errors are swallowed: the communicator is already gone."""
    if group is None:
        return
    try:
        destroy = getattr(group, "destroy", None)
        if callable(destroy):
            destroy()
        elif getattr(group, "hccl", None) is not None and getattr(group, "comm", None):
            if getattr(group, "available", True) and not getattr(group, "disabled", False):
                group.hccl.hcclCommDestroy(group.comm)
                group.available, group.disabled = False, True
    except Exception:  # noqa: BLE001 - a communicator whose peer died may refuse to close
        pass
