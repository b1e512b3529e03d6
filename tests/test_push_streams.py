"""The packed producers of the weight push on accelerators, run as the pinned wheels ship them
(``tests/fixtures/packed_producers.json``, recorded by ``scripts/record_packed_producers.py``
from vLLM 0.24.0 and vllm-ascend 0.26.0rc1) on a model of device streams and the caching
allocator, with what ``hal.push_staging`` hands them.

The model: every tensor lives in a block of device memory (or on the host); an operation is
queued on a stream and reads and writes blocks; a block freed by Python goes back to the
stream it was allocated on and the next allocation on that stream takes it at once (torch's
caching allocator). Streams run as late as they may: an operation is known done only once
the host synchronised its stream, or another stream waited for it (``wait_stream``). A hazard
is an operation that touches a block a queued operation of another stream touches, one of them
writing, with no such order between them: on a device the later one may run first.
"""

from __future__ import annotations

import itertools
import json
from contextlib import contextmanager
from pathlib import Path

import pytest

from hal.push_staging import PushStaging, drain

PRODUCERS = json.loads(
    (Path(__file__).resolve().parent / "fixtures" / "packed_producers.json").read_text()
)
BUFFER_BYTES = 100  # a chunk closes once it holds more than this
TENSOR_BYTES = 60  # so two tensors a chunk
TENSORS = 12  # six chunks: a buffer is reused three times


class Stream:
    """A queue of operations on the modelled device."""

    names = itertools.count()

    def __init__(self, device: Device) -> None:
        self.device = device
        self.name = f"stream{next(self.names)}"
        self.queued = 0  # operations queued so far
        self.done = 0  # operations the host knows are done (``synchronize``)
        self.waits: dict[Stream, int] = {}  # other stream -> its operations waited for

    def synchronize(self) -> None:
        self.done = self.queued

    def wait_stream(self, other: Stream) -> None:
        self.waits[other] = max(self.waits.get(other, 0), other.queued)

    def ordered_after(self, other: Stream, index: int) -> bool:
        """Whether this stream's next operation runs after ``other``'s operation ``index``."""
        return other is self or other.done > index or self.waits.get(other, 0) > index


class Tensor:
    """A tensor of the model: its bytes, and the block it views (None: on the host)."""

    def __init__(self, device: Device, nbytes: int, block: Block | None) -> None:
        self.device_model = device
        self.nbytes = nbytes
        self.block = block
        self.shape = (nbytes,)
        self.dtype = "uint8"

    def contiguous(self) -> Tensor:
        return self

    def view(self, *_) -> Tensor:
        return Tensor(self.device_model, self.nbytes, self.block)

    def numel(self) -> int:
        return self.nbytes

    def to(self, device, non_blocking: bool = False) -> Tensor:
        """A copy onto the device, queued on the current stream (from pinned host memory:
        the host allocator keeps the source until the copy ran)."""
        out = self.device_model.empty(self.nbytes)
        self.device_model.queue(reads=[self], writes=[out])
        return out


class Block:
    """A block of device memory; freed (back to its stream) once no tensor views it."""

    def __init__(self, device: Device, address: int, stream: Stream) -> None:
        self.device, self.address, self.stream = device, address, stream

    def __del__(self) -> None:
        self.device.free.setdefault(self.stream, []).append(self.address)


class Device:
    """The modelled device: its streams, allocator and the hazards found."""

    def __init__(self) -> None:
        self.default = Stream(self)
        self.current = [self.default]
        self.free: dict[Stream, list[int]] = {}
        self.addresses = itertools.count()
        self.touched: dict[int, list[tuple[Stream, int, bool]]] = {}  # address -> ops
        self.hazards: list[str] = []

    # the torch.<device> module's names the producers and the staging use
    def Stream(self) -> Stream:  # noqa: N802 - torch's name
        return Stream(self)

    @contextmanager
    def stream(self, stream: Stream):
        self.current.append(stream)
        try:
            yield
        finally:
            self.current.pop()

    def current_stream(self) -> Stream:
        return self.current[-1]

    def synchronize(self) -> None:
        for stream in {s for ops in self.touched.values() for s, _, _ in ops} | {self.default}:
            stream.synchronize()

    # memory and operations
    def empty(self, nbytes: int) -> Tensor:
        stream = self.current_stream()
        if not nbytes:
            return Tensor(self, 0, None)
        pool = self.free.get(stream, [])
        address = pool.pop() if pool else next(self.addresses)
        return Tensor(self, nbytes, Block(self, address, stream))

    def queue(self, reads: list[Tensor], writes: list[Tensor]) -> None:
        """Queue an operation on the current stream; record a hazard it makes."""
        stream = self.current_stream()
        for tensor, writing in [*((t, False) for t in reads), *((t, True) for t in writes)]:
            if tensor.block is None:
                continue
            address = tensor.block.address
            for other, index, wrote in self.touched.get(address, []):
                if (wrote or writing) and not stream.ordered_after(other, index):
                    self.hazards.append(
                        f"{stream.name} {'writes' if writing else 'reads'} block {address} "
                        f"while {other.name}'s op {index} may still {'write' if wrote else 'read'} it"
                    )
            self.touched.setdefault(address, []).append((stream, stream.queued, writing))
        stream.queued += 1


class FakeTorch:
    """The ``torch`` names the recorded producers call, on the modelled device."""

    uint8 = "uint8"
    Tensor = Tensor
    dtype = str

    def __init__(self, device: Device) -> None:
        self.model = device
        self.cuda = self.npu = device

    def cat(self, tensors: list[Tensor], dim: int = 0) -> Tensor:
        out = self.model.empty(sum(t.nbytes for t in tensors))
        self.model.queue(reads=tensors, writes=[out])
        return out

    def empty(self, size, dtype=None, device=None) -> Tensor:
        return self.model.empty(int(size))


class Group:
    """A communicator whose broadcast reads the tensor on the given or current stream."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self.sent = 0

    def broadcast(self, tensor: Tensor, src: int, stream: Stream | None = None) -> None:
        with self.device.stream(stream or self.device.current_stream()):
            self.device.queue(reads=[tensor], writes=[])
        self.sent += tensor.nbytes


class Backend:
    """The HAL backend's names ``PushStaging`` uses, on the modelled device."""

    is_accelerator = True

    def __init__(self, device: Device) -> None:
        self.model = device

    def device(self, index: int = 0) -> str:
        return "modelled"

    def device_module(self) -> Device:
        return self.model

    def synchronize(self) -> None:
        self.model.synchronize()


def _producer(key: str, device: Device):
    """The recorded producer ``key``, its ``torch`` the modelled device."""
    from collections.abc import Callable, Iterator
    from dataclasses import dataclass
    from typing import Any

    recorded = PRODUCERS[key]
    scope = {
        "torch": FakeTorch(device),
        "dataclass": dataclass,
        "Any": Any,
        "Callable": Callable,
        "Iterator": Iterator,
        "reduce_tensor": None,
        "DEFAULT_PACKED_BUFFER_SIZE_BYTES": BUFFER_BYTES,
        "DEFAULT_PACKED_NUM_BUFFERS": 2,
    }
    exec(compile(recorded["source"], recorded["file"], "exec"), scope)  # noqa: S102
    return scope[recorded["producer"]]


def _training(device: Device):
    """The training step on the main thread: allocates and writes on the default stream."""
    with device.stream(device.default):
        scratch = device.empty(TENSOR_BYTES)
        device.queue(reads=[], writes=[scratch])


def _push(key: str, staged_on_device: bool, staging: bool) -> tuple[Device, int]:
    """Push ``TENSORS`` tensors through producer ``key`` while the step trains, the way
    before the fix (``staged_on_device``: the gathered copies kept on the device, the
    producer on the training thread's stream, its default ``post_iter_func``) or through
    ``PushStaging`` (``staging``). Returns the device model and the bytes broadcast."""
    device = Device()
    producer = _producer(key, device)
    group = Group(device)
    if staged_on_device:  # gathered in the step, on the default stream
        staged = [(f"w{i}", device.empty(TENSOR_BYTES)) for i in range(TENSORS)]
    else:  # pinned host copies (hal.push_staging.PushStaging.keep)
        staged = [(f"w{i}", Tensor(device, TENSOR_BYTES, None)) for i in range(TENSORS)]

    def items():
        for item in drain(staged):
            yield item
            _training(device)  # the next update runs meanwhile (train.rollout_lag >= 1)

    push = PushStaging(Backend(device))
    if staging:
        with push.sending():
            producer(items(), group, 0, push.chunk_source(), BUFFER_BYTES, 2)
    else:
        producer(items(), group, 0, lambda item: item[1], BUFFER_BYTES, 2)
    return device, group.sent


@pytest.mark.parametrize("key", sorted(PRODUCERS))
def test_the_staged_push_makes_no_hazard_in_either_pinned_producer(key):
    """Host-staged tensors copied in on the packing stream after it waited for the push's
    broadcasts: every byte sent, no operation overtakes another on a block, while the
    training step allocates and writes on the default stream throughout."""
    device, sent = _push(key, staged_on_device=False, staging=True)
    assert sent == TENSORS * TENSOR_BYTES
    assert device.hazards == []


def test_the_packing_stream_of_vllm_ascend_overwrote_a_chunk_still_queued_for_broadcast():
    """Item 2, as before the fix: vllm-ascend's producer broadcasts on the current stream
    and the host waits only for the packing streams, so a later chunk's ``cat`` takes the
    block of a chunk whose broadcast may not have run."""
    device, _ = _push("vllm-ascend 0.26.0rc1 hccl", staged_on_device=True, staging=False)
    assert any("writes block" in h and "may still read" in h for h in device.hazards)


def test_a_source_freed_after_its_cat_was_queued_raced_the_training_step():
    """Item 6, as before the fix: vLLM 0.24's ``pack_tensors`` drops its list of sources
    once their ``cat`` is queued on a packing stream, so a gathered copy on the device goes
    back to the default stream, whose next allocation (the training step's) takes the block
    and writes it before the ``cat`` may have read it. vllm-ascend's producer keeps its list
    until it synchronised that packing stream: no such race there, as the model finds."""
    device, _ = _push("vllm 0.24.0 nccl", staged_on_device=True, staging=False)
    assert any(h.startswith(f"{device.default.name} writes") for h in device.hazards)
    device, _ = _push("vllm-ascend 0.26.0rc1 hccl", staged_on_device=True, staging=False)
    assert not any(h.startswith(f"{device.default.name} writes") for h in device.hazards)


def test_the_staging_keeps_cpu_tensors_as_they_are_and_feeds_them_unchanged():
    """On the CPU nothing is copied: the gathered tensor is the staged one and the producer
    packs it as is, under no stream."""
    import torch

    import hal

    staging = PushStaging(hal.get_backend("cpu"))
    tensor = torch.arange(4.0)
    kept = staging.keep(tensor)
    with staging.sending():
        assert staging.chunk_source()(("w", kept)) is tensor
    staging.ready()


class _OnCuda:
    """``torch`` for a recorded producer on CUDA: vllm-ascend's ``torch.npu`` names are
    torch.cuda's, its ``device="npu"`` is ``cuda``."""

    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.npu = torch.cuda

    def __getattr__(self, name: str):
        return getattr(self.torch, name)

    def empty(self, *args, device=None, **kwargs):
        return self.torch.empty(*args, device="cuda" if device == "npu" else device, **kwargs)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(not _cuda_available(), reason="needs a CUDA device (a GPU tier's check)")
@pytest.mark.parametrize("key", sorted(PRODUCERS))
def test_on_cuda_every_byte_of_a_staged_push_arrives_while_the_step_trains(key):
    """The staged push through each recorded producer on real CUDA streams: the collective's
    stream lags (each broadcast starts after a spin), the training step allocates, writes and
    frees on the default stream between tensors, and every byte received equals the byte
    sent."""
    from collections.abc import Callable, Iterator
    from dataclasses import dataclass
    from typing import Any

    import torch

    recorded = PRODUCERS[key]
    scope = {
        "torch": _OnCuda(),
        "dataclass": dataclass,
        "Any": Any,
        "Callable": Callable,
        "Iterator": Iterator,
        "DEFAULT_PACKED_BUFFER_SIZE_BYTES": 1 << 20,
        "DEFAULT_PACKED_NUM_BUFFERS": 2,
    }
    exec(compile(recorded["source"], recorded["file"], "exec"), scope)  # noqa: S102
    producer = scope[recorded["producer"]]
    received: list[torch.Tensor] = []

    class Copy:
        """A broadcast's read of the chunk: a copy on the stream it runs on, late."""

        def broadcast(self, tensor, src, stream=None):
            with torch.cuda.stream(stream or torch.cuda.current_stream()):
                torch.cuda._sleep(2_000_000)
                received.append(tensor.clone())

    import hal

    gen = torch.Generator(device="cuda").manual_seed(0)
    sent = [torch.randn(300_000, device="cuda", generator=gen) for _ in range(16)]
    push = PushStaging(hal.get_backend("cuda"))
    staged = [(f"w{i}", push.keep(t)) for i, t in enumerate(sent)]
    push.ready()

    def items():
        for item in drain(staged):
            yield item
            scratch = torch.empty(600_000, device="cuda")  # the step, on the default stream
            scratch.fill_(float("nan"))
            del scratch

    with push.sending():
        producer(items(), Copy(), 0, push.chunk_source(), 1 << 20, 2)
    torch.cuda.synchronize()
    expected = torch.cat([t.view(torch.uint8).view(-1) for t in sent])
    assert torch.equal(torch.cat(received), expected)
