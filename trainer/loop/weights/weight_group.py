"""The push to engines of their own through the engines' weight-transfer API
(``rollout.weight_transport=collective``; ``rollout.engines.weights.transfer``).

The members: training rank 0 (the sender, member 0) and every worker of every engine replica
(a vLLM engine's tp workers each, an HF engine as one), member ``1 + replica x workers +
worker``. The transfer group is the engine's own (``hal`` ``DeviceBackend.weight_transfer_
engine``: vLLM's on accelerators, crossrl's gloo engine on the CPU) and the trainer calls that
engine module's static ``trainer_init`` / ``trainer_send_weights``, so both ends speak one
packed format. One communicator per process, whatever the number of ranks and replicas.

Training rank 0 also serves a small control store (``serve_store``; who is in the group:
``trainer.loop.weights.membership``). The group forms at the
first push and again whenever its members change: ``wanted`` names the replicas that should be
members and a version bumped at each change (a lost replica left out by the driver,
``exclude``; its replacement let in by the rollout host when it connects it, ``include``);
``group`` names the generation, its port, its members and the version it was built from. The
sender builds a new generation, on a fresh port, as soon as it finds ``wanted`` newer than
``group`` (``announce_group``). Every member says ``joining/<generation>/<replica>`` before it
takes part in a push, and joins (vLLM's ``init_weight_transfer_engine``, which blocks until
every member has) only once the sender, having seen every member say so, says
``form/<generation>``: a member that died never says so, so nobody waits inside a rendezvous
for it, and the next generation leaves it out. So a replacement joins a group rebuilt without
the dead member, and nothing restarts.

A push is numbered ``seq`` (0, 1, ...): every rank gathers the tensors whole, cast to the
engine's dtype first, a bucket of shards per all-gather (``gather.whole_tensors``; in the step,
on the ranks' own stream: never a thread racing FSDP's collectives), rank 0 keeps the copy and
writes the push's ``update_info`` (names, dtypes, shapes, packing) under ``weights/<seq>``. A
replica that loads it (``PushReceiver.receive``: when the
rollout that asks for that version starts, between engine calls) says
``ready/<seq>/<generation>/<replica>`` and waits for ``go``; rank 0's sender thread, once
every replica is ready, says ``go`` and broadcasts the packed chunks (the engine module's
producer: its own streams, a bounded number of chunks in flight). No member enters a
broadcast before every member is ready, so a replica lost before a push never leaves the
others blocked in it: they see the next generation and join that instead. With
``train.rollout_lag`` > 0 the ranks train on while the engines finish older rollouts, and an
engine never mixes two versions in one rollout.

Every rank waits for the push before gathering the next one (``finish``, called on every rank
by the driver before ``send``): rank 0 alone blocked on its sender while the others sat in the
all-gather would time that collective out at ``train.rollout_lag`` >= 2.

Working set: rank 0 keeps the whole model in the engine's dtype in pinned host memory from the
gather until the engines took it (one push at a time; ``hal.push_staging``), and on its device
the gather's bucket and the producer's chunks in flight (``PACKED_NUM_BUFFERS`` of
``PACKED_BUFFER_BYTES``), through the next training step at a lag; each worker holds the chunks
in flight beside its engine (``trainer.loop.plan.memory_budget.transfer_bytes``).

Every wait has a deadline: a replica waits for the sender's word at most the address's
``timeout_s`` (``run.collective_timeout_s``) and then fails its load in one line; a broadcast
with a member gone (PyNccl has no timeout of its own) ends at the driver's call limit, which
restarts the run. A generation's port is held from its announcement until the sender joins it,
and a generation rebuilt without a member frees the old communicator.
"""

from __future__ import annotations

import importlib
import pickle
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from rollout.engines.weights.transfer import (
    ENGINE_NAME,
    PACKED_BUFFER_BYTES,
    PACKED_NUM_BUFFERS,
    GlooWeightTransfer,
    update_info,
)
from trainer.loop.weights.membership import (
    Generation,
    announce_group,
    change_members,
    current_group,
    release_port,
    release_ports,
    wanted,
)

#: Where ``RolloutHost.take_weights`` finds weights that came through the transfer group
#: (``rollout.weight_transport``), in place of a snapshot's bucket refs.
PUSHED = "pushed"
#: Seconds between the sender's looks for the replicas' readiness (a store lookup).
POLL_S = 0.02


@dataclass(frozen=True)
class WeightGroupAddress:
    """Where the push meets: training rank 0's control store at ``host:port`` (which names
    the transfer group's port, ``announce_group``); ``replicas`` engine replicas of
    ``workers`` members each (a vLLM engine's tp workers); ``engine``: the weight-transfer
    engine's name (``DeviceBackend.weight_transfer_engine``); a broadcast not done in
    ``timeout_s`` seconds fails (``run.collective_timeout_s``)."""

    host: str
    port: int
    replicas: int
    workers: int
    engine: str
    timeout_s: float
    layerwise: bool = True

    def world_size(self, replicas: int) -> int:
        """Members of a transfer group of ``replicas`` replicas: the sender and every worker."""
        return 1 + replicas * self.workers

    def init_info(self, position: int, transfer_port: int, replicas: int) -> dict:
        """What the replica at ``position`` among a generation's ``replicas`` members joins
        it on ``transfer_port`` with (``init_weight_transfer``): vLLM's own engines take
        exactly the first four keys; crossrl's also the timeout and how it loads."""
        info = {
            "master_address": self.host,
            "master_port": int(transfer_port),
            "rank_offset": 1 + position * self.workers,
            "world_size": self.world_size(replicas),
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
    the HAL's for a vLLM engine's own transfer engine, crossrl's gloo one on the CPU (the HF
    engine, the CPU lane's vLLM). No other pair exists: the HF engine on an accelerator takes
    host snapshots (``trainer.loop.plan.layout.weight_transport_rule``)."""
    if address.engine == backend.weight_transfer_engine and address.engine != ENGINE_NAME:
        module, name = backend.weight_transfer_trainer
        return getattr(importlib.import_module(module), name)
    if backend.device_type == "cpu":
        return GlooWeightTransfer
    raise ValueError(
        f"no weight push through {address.engine!r} from {backend.device_type} ranks: the "
        "HF engine on devices of its own takes host snapshots there (rollout.weight_transport"
        "=host)"
    )


def _weights_key(seq: int) -> str:
    return f"weights/{seq}"


def _ready_key(seq: int, generation: int, replica: int) -> str:
    return f"ready/{seq}/{generation}/{replica}"


def _go_key(seq: int, generation: int) -> str:
    return f"go/{seq}/{generation}"


def _joining_key(generation: int, replica: int) -> str:
    return f"joining/{generation}/{replica}"


def _form_key(generation: int) -> str:
    return f"form/{generation}"


class WeightSender:
    """A training rank's side of the push. Every rank gathers (``send``); rank 0 (``store``
    not None) keeps the copy in host memory and sends it from a thread of its own once the
    engines are ready, joining the transfer group's current generation first. One push at a
    time: every rank calls ``finish`` before ``send`` (the driver does)."""

    def __init__(self, address: WeightGroupAddress, store, transport, backend, device_index=0):
        from hal.push_staging import PushStaging

        self.address = address
        self.store = store
        self.transport = transport
        self.backend = backend
        self.device_index = device_index
        self.staging = PushStaging(backend, device_index)
        self.generation: int | None = None  # the group generation joined (None: none yet)
        self.group = None
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def send(self, state: Mapping[str, torch.Tensor], dtype: torch.dtype, seq: int) -> int:
        """Start push ``seq`` of ``state`` (name -> tensor, FSDP2 shards as they are) in
        ``dtype``: every rank gathers the tensors whole on its device
        (``gather.whole_tensors``); rank 0 keeps them in host memory, writes the push's
        ``update_info`` and starts sending. Returns the tensors rank 0 sends (0 on the other
        ranks)."""
        from hal.push_staging import drain
        from trainer.loop.weights.gather import whole_tensors

        self.finish()  # the driver called it on every rank already: returns at once
        device = self.staging.device if self.backend.is_accelerator else None
        staged: list[tuple[str, torch.Tensor]] = []
        for name, whole in whole_tensors(state, dtype, PACKED_BUFFER_BYTES, device):
            if self.store is not None:  # a copy of its own: the next update changes the weights
                staged.append((name, self.staging.keep(whole)))
            del whole
        if self.store is None:
            return 0
        info = update_info(staged, None, PACKED_BUFFER_BYTES, PACKED_NUM_BUFFERS)
        self.store.set(_weights_key(seq), pickle.dumps(info))
        if seq > 0:  # every replica read the last push's info before it could receive it
            self.store.delete_key(_weights_key(seq - 1))
        self.staging.ready()  # the host copies are done before another thread sends them
        self._thread = threading.Thread(
            target=self._send_all, args=(drain(staged), seq), name="weight-sender", daemon=True
        )
        self._thread.start()
        return len(info["names"])

    def exclude(self, lost: list[int]) -> None:
        """Leave replicas ``lost`` out of the transfer group (they died): the sender builds
        its next generation without them before it sends again."""
        change_members(self.store, lambda members: members - set(lost))

    def _current(self) -> Generation:
        """The transfer group's current generation, a new one built first if the wanted
        members changed since it was (a fresh port, the wanted members)."""
        generation = current_group(self.store)
        version, members = wanted(self.store)
        if version != generation.built_from:
            if generation.number != self.generation:  # announced, never joined: its port goes
                release_port(generation.port)
            generation = announce_group(
                self.store, Generation(generation.number + 1, 0, members, version)
            )
        return generation

    def _join(self, generation: Generation) -> bool:
        """Join ``generation`` once every member has said it is joining (a member that died
        never says so, and the next generation leaves it out); False while one has not. The
        communicator of the generation before is freed first (``hal.push_staging.
        destroy_communicator``)."""
        from hal.push_staging import destroy_communicator

        keys = [_joining_key(generation.number, r) for r in generation.members]
        if not self.store.check(keys):
            return False
        old, self.group = self.group, None
        destroy_communicator(old)
        self.store.set(_form_key(generation.number), b"1")
        init = {
            "master_address": self.address.host,
            "master_port": generation.port,
            "world_size": self.address.world_size(len(generation.members)),
            "timeout_s": self.address.timeout_s,
        }
        release_port(generation.port)  # the rendezvous binds it now
        self.group = self.transport.trainer_init(init)  # blocks until every member joined
        self.generation = generation.number
        return True

    def _send_all(self, staged, seq: int) -> None:
        try:
            if self.backend.is_accelerator:  # a thread starts on device 0
                self.backend.set_device(self.device_index)
            while True:
                generation = self._current()
                joined = generation.number == self.generation or self._join(generation)
                keys = [_ready_key(seq, generation.number, r) for r in generation.members]
                # every member ready, and no change of members since (or a new generation)
                if joined and self.store.check(keys):
                    if wanted(self.store)[0] == generation.built_from:
                        break
                if self._stop.wait(POLL_S):
                    return
            self.store.set(_go_key(seq, generation.number), b"1")
            with self.staging.sending():  # a stream of the push's own
                self.transport.trainer_send_weights(
                    staged,
                    {
                        "group": self.group,
                        "packed": True,
                        "packed_buffer_size_bytes": PACKED_BUFFER_BYTES,
                        "packed_num_buffers": PACKED_NUM_BUFFERS,
                        # to the device one tensor at a time, after the broadcasts queued
                        "post_iter_func": self.staging.chunk_source(),
                    },
                )
            for key in [*keys, _go_key(seq, generation.number)]:
                self.store.delete_key(key)
        except BaseException as err:  # noqa: BLE001 - raised by the rank's next finish
            self.error = err

    def finish(self) -> None:
        """Wait for the push being sent, if any (rank 0; the other ranks return at once);
        raise what broke it (a replica that died)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.error is not None:
            err, self.error = self.error, None
            raise RuntimeError(f"the weight push broke: {err}") from err

    def stop(self) -> None:
        """Give up a push no engine will take (shutdown), and the ports held for the group."""
        self._stop.set()
        release_ports()


@dataclass
class PushReceiver:
    """An engine replica's side of the push: the control store, the address and the group
    generation its engine joined (None: none yet)."""

    store: object
    address: WeightGroupAddress
    replica: int
    generation: int | None = None

    def include(self, replicas: list[int]) -> None:
        """Let replicas ``replicas`` (replacements, connected by the rollout host before any
        of them loads) into the transfer group: the sender builds its next generation with
        them before it sends again."""
        change_members(self.store, lambda members: members | set(replicas))

    def receive(self, engine, seq: int) -> int:
        """Take push ``seq`` into ``engine`` (``Engine.receive_weights``): join the current
        generation if this replica is a member and has not joined it, say ready once the
        members are the wanted ones, and enter the broadcast once the sender says go; a
        generation that changes meanwhile is joined instead. Every wait for the sender ends
        within ``address.timeout_s`` seconds (``run.collective_timeout_s``) with one
        ``DistStoreError`` naming it (a push already sent, a sender gone). Returns the tensor
        count."""
        info = pickle.loads(self.store.get(_weights_key(seq)))  # waited for: the store timeout
        deadline = time.monotonic() + self.address.timeout_s
        while True:
            generation = current_group(self.store)
            if self.replica not in generation.members:  # let in by the next generation
                self._pause(deadline, seq, "to be let into the transfer group")
                continue
            if generation.number != self.generation:
                # say so, and join once the sender has seen every member say so (it blocks
                # until every member joined)
                self.store.set(_joining_key(generation.number, self.replica), b"1")
                if not self.store.check([_form_key(generation.number)]):
                    self._pause(deadline, seq, f"the sender to form generation {generation.number}")
                    continue
                position = generation.members.index(self.replica)
                engine.init_weight_transfer(
                    self.address.init_info(position, generation.port, len(generation.members))
                )
                self.generation = generation.number
            if wanted(self.store)[0] != generation.built_from:  # a new generation comes
                self._pause(deadline, seq, "the transfer group's next generation")
                continue
            self.store.set(_ready_key(seq, generation.number, self.replica), b"1")
            while not self.store.check([_go_key(seq, generation.number)]):
                if current_group(self.store).number != generation.number:
                    break
                self._pause(deadline, seq, "the sender's go")
            else:
                return engine.receive_weights(info)

    def _pause(self, deadline: float, seq: int, what: str) -> None:
        """Sleep ``POLL_S``, or raise once ``deadline`` (monotonic seconds) has passed: a
        store wait that timed out (``DistStoreError``), which the driver restarts the run for
        (``trainer.loop.cluster.faults``: a broken collective)."""
        if time.monotonic() >= deadline:
            import torch.distributed as dist

            raise dist.DistStoreError(
                f"weight push {seq}: engine replica {self.replica} waited "
                f"{self.address.timeout_s:g} s for {what} (run.collective_timeout_s); the "
                "sender is gone or sent this push without it"
            )
        time.sleep(POLL_S)
