"""The push to engines of their own through the engines' weight-transfer API
(``rollout.weight_transport=collective``; ``rollout.engines.transfer``).

The members: training rank 0 (the sender, member 0) and every worker of every engine replica
(a vLLM engine's tp workers each, an HF engine as one), member ``1 + replica x workers +
worker``. The transfer group is the engine's own (``hal`` ``DeviceBackend.weight_transfer_
engine``: vLLM's on accelerators, crossrl's gloo engine on the CPU) and the trainer calls that
engine module's static ``trainer_init`` / ``trainer_send_weights``, so both ends speak one
packed format. One communicator per process, whatever the number of ranks and replicas.

Training rank 0 also serves a small control store (``serve_store``). A push is numbered
``seq`` (0, 1, ...): every rank gathers each tensor whole in turn (FSDP2's all-gather, in
the step, on the ranks' own stream: never a thread racing FSDP's collectives), rank 0 keeps a
copy in the engine's dtype and writes the push's ``update_info`` (names, dtypes, shapes,
packing) under ``weights/<seq>``; its sender thread then waits until every replica has said
``ready/<seq>/<replica>`` (``receive_push``: a replica says it when the rollout that asks for
that version loads it, between engine calls) and broadcasts the packed chunks (the engine
module's producer: its own streams, a bounded number of chunks in flight). So with
``train.rollout_lag`` > 0 the ranks train on while the engines finish older rollouts, and an
engine never mixes two versions in one rollout.

Working set: rank 0 holds the whole model in the engine's dtype from the gather until the
engines took it (one push at a time), plus ``PACKED_NUM_BUFFERS`` chunks of
``PACKED_BUFFER_BYTES`` while it sends; each worker holds the chunks in flight beside its
engine (``trainer.loop.plan.snapshot_budget``).
"""

from __future__ import annotations

import importlib
import pickle
import threading
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from rollout.engines.transfer import (
    ENGINE_NAME,
    PACKED_BUFFER_BYTES,
    PACKED_NUM_BUFFERS,
    GlooWeightTransfer,
    update_info,
)

#: Where ``RolloutHost.take_weights`` finds weights that came through the transfer group
#: (``rollout.weight_transport``), in place of a snapshot's bucket refs.
PUSHED = "pushed"
#: Seconds between the sender's looks for the replicas' readiness (a store lookup).
POLL_S = 0.02


@dataclass(frozen=True)
class WeightGroupAddress:
    """Where the push meets: training rank 0's control store at ``host:port`` and the
    transfer group's store at ``host:transfer_port``; ``replicas`` engine replicas of
    ``workers`` members each (a vLLM engine's tp workers); ``engine``: the weight-transfer
    engine's name (``DeviceBackend.weight_transfer_engine``); a broadcast not done in
    ``timeout_s`` seconds fails (``run.collective_timeout_s``)."""

    host: str
    port: int
    transfer_port: int
    replicas: int
    workers: int
    engine: str
    timeout_s: float
    layerwise: bool = True

    @property
    def world_size(self) -> int:
        """Members of the transfer group: the sender and every engine worker."""
        return 1 + self.replicas * self.workers

    def init_info(self, replica: int) -> dict:
        """What replica ``replica``'s engine joins with (``init_weight_transfer``): vLLM's
        own engines take exactly the first four keys; crossrl's also the timeout and how it
        loads."""
        info = {
            "master_address": self.host,
            "master_port": self.transfer_port,
            "rank_offset": 1 + replica * self.workers,
            "world_size": self.world_size,
        }
        if self.engine == ENGINE_NAME:
            info.update(timeout_s=self.timeout_s, layerwise=self.layerwise)
        return info


def serve_store(host: str, port: int, members: int, timeout_s: float):
    """The control store, served by this process (training rank 0) on ``port``."""
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore(
        host, port, members, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )


def connect_store(address: WeightGroupAddress):
    """A client of the control store at ``address``."""
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore(
        address.host,
        address.port,
        1 + address.replicas,
        False,
        timeout=timedelta(seconds=address.timeout_s),
    )


def trainer_transport(address: WeightGroupAddress, backend):
    """The class whose static ``trainer_init`` / ``trainer_send_weights`` the sender calls:
    the HAL's for a vLLM engine's own transfer engine, crossrl's over ``backend``'s library
    otherwise (the HF engine)."""
    if address.engine == backend.weight_transfer_engine and address.engine != ENGINE_NAME:
        module, name = backend.weight_transfer_trainer
        return getattr(importlib.import_module(module), name)
    if backend.device_type == "cpu":
        return GlooWeightTransfer
    return GlooWeightTransfer.for_backend(backend)


def _weights_key(seq: int) -> str:
    return f"weights/{seq}"


def _ready_key(seq: int, replica: int) -> str:
    return f"ready/{seq}/{replica}"


class WeightSender:
    """A training rank's side of the push. Every rank gathers (``send``); rank 0 (``group``
    not None: ``trainer_init``'s) keeps the copy and sends it from a thread of its own once
    the engines are ready. One push at a time: ``send`` first waits for the one before."""

    def __init__(
        self,
        address: WeightGroupAddress,
        store,
        transport,
        group,
        backend,
        device_index: int = 0,
    ) -> None:
        self.address = address
        self.store = store
        self.transport = transport
        self.group = group
        self.backend = backend
        self.device_index = device_index
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def send(self, state: Mapping[str, torch.Tensor], dtype: torch.dtype, seq: int) -> int:
        """Start push ``seq`` of ``state`` (name -> tensor, FSDP2 shards as they are) in
        ``dtype``: every rank gathers each tensor whole in turn; rank 0 keeps a copy, writes
        the push's ``update_info`` and starts sending. Returns the tensors rank 0 sends (0 on
        the other ranks)."""
        self.wait()
        staged: list[tuple[str, torch.Tensor]] = []
        for name, tensor in state.items():
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            if self.group is not None:  # the next update changes the weights: a copy
                staged.append((name, full.detach().to(dtype=dtype, copy=True)))
            del full
        if self.group is None:
            return 0
        info = update_info(staged, None, PACKED_BUFFER_BYTES, PACKED_NUM_BUFFERS)
        self.store.set(_weights_key(seq), pickle.dumps(info))
        if seq > 0:  # every replica read the last push's info before it could receive it
            self.store.delete_key(_weights_key(seq - 1))
        self.backend.synchronize()  # the copies are done before another thread sends them
        self._thread = threading.Thread(
            target=self._send_all, args=(staged, seq), name="weight-sender", daemon=True
        )
        self._thread.start()
        return len(info["names"])

    def _send_all(self, staged: list[tuple[str, torch.Tensor]], seq: int) -> None:
        try:
            if self.backend.is_accelerator:  # a thread starts on device 0
                self.backend.set_device(self.device_index)
            keys = [_ready_key(seq, r) for r in range(self.address.replicas)]
            while not self.store.check(keys):
                if self._stop.wait(POLL_S):
                    return

            def items():
                while staged:  # each tensor freed once packed
                    yield staged.pop(0)

            self.transport.trainer_send_weights(
                items(),
                {
                    "group": self.group,
                    "packed": True,
                    "packed_buffer_size_bytes": PACKED_BUFFER_BYTES,
                    "packed_num_buffers": PACKED_NUM_BUFFERS,
                },
            )
            for key in keys:
                self.store.delete_key(key)
        except BaseException as err:  # noqa: BLE001 - raised by the rank's next wait
            self.error = err
        finally:
            staged.clear()

    def wait(self) -> None:
        """Wait for the push being sent, if any; raise what broke it (a replica that died)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.error is not None:
            err, self.error = self.error, None
            raise RuntimeError(f"the weight push broke: {err}") from err

    def stop(self) -> None:
        """Give up a push no engine will take (shutdown)."""
        self._stop.set()


def receive_push(engine, store, replica: int, seq: int) -> int:
    """Replica ``replica``'s side of push ``seq``: read its ``update_info`` (waited for, at
    most the store's timeout), say this replica is ready, and take it through the engine's
    transfer API (``Engine.receive_weights``). Returns the tensor count."""
    info = pickle.loads(store.get(_weights_key(seq)))
    store.set(_ready_key(seq, replica), b"1")
    return engine.receive_weights(info)
