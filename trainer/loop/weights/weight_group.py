"""The collective weight push to engines on devices of their own (``rollout.engine_devices``,
``rollout.weight_transport``): no rank-0 funnel, no object store.

The members: the ``train.dp_size`` training ranks (the actor's) and the engine replicas' host
processes. Training rank 0 serves a ``torch.distributed`` TCP store (the control channel);
every member joins ``dp_size`` process groups over it (``hal.weight_group``: the device's own
collective library), group r made of training rank r (its member 0) and every
replica (member 1 + replica index). So each rank broadcasts only the rows it holds, straight to
every engine, and no rank receives another's.

A push (``WeightSender.send``, on every rank at once) is numbered ``seq`` (0, 1, ...). The buckets
are planned on the whole tensors (``plan_buckets``, never splitting a layer) so that bucket b
of every rank holds its rows of the same tensors; each rank first writes its pieces' specs
(names, shapes, offsets) of every bucket under ``weights/<seq>/<rank>`` in the store, then
broadcasts its bucket b, b = 0, 1, ..., in the engine's dtype, in its own group. A replica's
receiver thread (``WeightReceiver``) waits for every rank's specs, receives the ranks' bucket b
at once (one broadcast per group), joins the pieces into whole tensors (``assemble_pieces``)
and queues them under ``seq``; the engine loads push ``seq`` from that queue bucket by bucket
(``WeightReceiver.take``) when a rollout or validation asks for it. The receiver runs beside
the replica's generation, so with ``train.rollout_lag`` > 0 a push overlaps the rollouts still
queued, and the pushed version waits, tagged by ``seq``, until the rollout that asks for it:
an engine never mixes two versions in one rollout.

A rank packs a copy of its rows and sends them from a thread of its own (``WeightSender``), so
its step ends once they are copied and the bytes travel while it trains on.

Working set (the bound ``bench snapshot`` checks): a training rank holds, beyond its shard, a
packed copy of its own rows in the engine's dtype (its shard again, plus the unsharded tensors
rank 0 alone sends) until they are sent, freed bucket by bucket as they go, one push at a time;
a replica holds, beyond its engine's weights, the buckets received and not yet loaded: one
bucket while it loads as they arrive (lag 0), up to one whole model per push not yet loaded
while it generates (``train.rollout_lag`` pushes at most).
"""

from __future__ import annotations

import pickle
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch

#: Where ``RolloutHost.take_weights`` finds weights that came through the weight group
#: (``rollout.weight_transport``), in place of a snapshot's bucket refs.
PUSHED = "pushed"
#: Bytes per bucket of a collective push (the whole bucket, every rank's rows of it).
PUSH_BUCKET_BYTES = 256 << 20
#: Seconds between a receiver's looks for a new push (a store lookup; never blocking, so
#: its stop flag is seen at once).
POLL_S = 0.02


@dataclass(frozen=True)
class WeightGroupAddress:
    """Where the weight group meets: training rank 0's store at ``host:port``; ``ranks``
    training ranks and ``replicas`` engine replicas; a collective not done in ``timeout_s``
    seconds fails (``run.collective_timeout_s``)."""

    host: str
    port: int
    ranks: int
    replicas: int
    timeout_s: float


@dataclass
class Membership:
    """One process's part of the weight group: the store and its groups by training rank."""

    store: object
    groups: dict[int, object]
    address: WeightGroupAddress


def serve_store(host: str, port: int, members: int, timeout_s: float):
    """The weight group's store, served by this process (training rank 0) on ``port``."""
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore(
        host,
        port,
        members,
        True,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def join(
    backend,
    address: WeightGroupAddress,
    *,
    rank: int | None = None,
    replica: int | None = None,
    store=None,
) -> Membership:
    """Join the weight group as training rank ``rank`` or engine replica ``replica`` (one of
    the two), on device backend ``backend``; ``store``: the store itself on the process that
    serves it. Every member must join at once (each group's creation waits for its members)."""
    from datetime import timedelta

    import torch.distributed as dist

    from hal.weight_group import new_process_group

    if store is None:
        store = dist.TCPStore(
            address.host,
            address.port,
            address.ranks + address.replicas,
            False,
            timeout=timedelta(seconds=address.timeout_s),
        )
    size = 1 + address.replicas
    sources = [rank] if rank is not None else range(address.ranks)
    member = 0 if rank is not None else 1 + int(replica)
    groups = {
        source: new_process_group(
            backend, dist.PrefixStore(f"group/{source}", store), member, size, address.timeout_s
        )
        for source in sources
    }
    return Membership(store, groups, address)


def _specs_key(seq: int, rank: int) -> str:
    return f"weights/{seq}/{rank}"


class WeightSender:
    """A training rank's side of the weight group (rank ``rank``, its buckets packed on
    ``device``, ``backend``'s). ``send`` copies this rank's rows of every bucket (the next
    update may change the weights at once) and a thread of its own broadcasts them, freeing
    each as it goes: the rank goes on with the next step while its rows travel. One push at a
    time: ``send`` first waits for the one before (``wait``)."""

    def __init__(
        self,
        membership: Membership,
        rank: int,
        device,
        backend,
        bucket_bytes: int = PUSH_BUCKET_BYTES,
    ) -> None:
        self.membership = membership
        self.rank = rank
        self.device = device
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def send(self, pieces_of, shapes: list[tuple[str, tuple[int, ...]]], dtype, seq: int) -> int:
        """Start push ``seq``: for each bucket planned on the model's ``shapes`` (name, whole
        shape), this rank's pieces (``pieces_of(planned)``: ``(name, rows)`` of the bucket's
        tensors it holds rows of, in the bucket's order), packed in ``dtype``; their specs go
        to the store at once, the bytes follow from the sending thread. Returns the buckets
        this rank sends (those it holds rows of)."""
        from rollout.engines.buckets import pack_pieces, piece_specs, plan_buckets

        self.wait()
        buckets, _ = plan_buckets(shapes, dtype, self.bucket_bytes)
        mine = [pieces_of(planned) for planned in buckets]  # views: nothing copied yet
        layout = []
        for pieces in mine:
            specs, nbytes = piece_specs(pieces, dtype)
            layout.append(([tuple(s) for s in specs], nbytes))
        store = self.membership.store
        store.set(_specs_key(seq, self.rank), pickle.dumps(layout))
        if seq > 0:  # every replica read the last push's specs before it could receive it
            store.delete_key(_specs_key(seq - 1, self.rank))
        packed = [
            pack_pieces(pieces, dtype, self.device)[0]
            for pieces, (_, nbytes) in zip(mine, layout)
            if nbytes
        ]
        self.backend.synchronize()  # the copies are done before another thread sends them
        self._thread = threading.Thread(
            target=self._send_all, args=(packed,), name="weight-sender", daemon=True
        )
        self._thread.start()
        return len(packed)

    def _send_all(self, packed: list[torch.Tensor]) -> None:
        from hal.weight_group import broadcast

        group = self.membership.groups[self.rank]
        try:
            while packed:
                flat = packed.pop(0)
                broadcast(group, flat).wait()
                del flat  # freed as soon as every replica has it
        except BaseException as err:  # noqa: BLE001 - raised by the rank's next wait
            self.error = err
        finally:
            packed.clear()

    def wait(self) -> None:
        """Wait for the push being sent, if any; raise what broke it (a replica that died)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.error is not None:
            err, self.error = self.error, None
            raise RuntimeError(f"the weight push broke: {err}") from err


class WeightReceiver:
    """An engine replica's side of the weight group: a thread that receives every push as it
    comes (``seq`` 0, 1, ...), bucket by bucket, into a queue per push that ``take`` drains.
    ``device``: where a bucket is received (the engine's device, which the device's collective
    library needs); each is then held in host memory until loaded, so the device holds one
    bucket beyond the engine's own memory."""

    def __init__(self, membership: Membership, device: torch.device | str = "cpu") -> None:
        self.membership = membership
        self.device = device
        self.error: BaseException | None = None
        self._queues: dict[int, queue.Queue] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weight-receiver", daemon=True)
        self._thread.start()

    def _queue(self, seq: int) -> queue.Queue:
        with self._lock:
            return self._queues.setdefault(seq, queue.Queue())

    def _run(self) -> None:
        seq = 0
        try:
            while not self._stop.is_set():
                if self._announced(seq):
                    self._receive(seq)
                    seq += 1
                else:
                    self._stop.wait(POLL_S)
        except BaseException as err:  # noqa: BLE001 - handed to the loader, which raises it
            self.error = err
            self._queue(seq).put(err)

    def _announced(self, seq: int) -> bool:
        """Whether every rank has written push ``seq``'s specs (never blocks)."""
        ranks = self.membership.address.ranks
        return self.membership.store.check([_specs_key(seq, r) for r in range(ranks)])

    def _receive(self, seq: int) -> None:
        from hal.weight_group import broadcast
        from rollout.engines.buckets import TensorSpec, assemble_pieces, unpack_bucket

        store, groups = self.membership.store, self.membership.groups
        ranks = range(self.membership.address.ranks)
        layouts = [pickle.loads(store.get(_specs_key(seq, r))) for r in ranks]
        out = self._queue(seq)
        for bucket in range(len(layouts[0])):
            parts = [layouts[r][bucket] for r in ranks]  # (specs, nbytes) of each rank
            flats = [torch.empty(n, dtype=torch.uint8, device=self.device) for _, n in parts]
            works = [broadcast(groups[r], flats[r]) for r in ranks if parts[r][1]]
            for work in works:
                work.wait()
            if torch.device(self.device).type != "cpu":  # held in host memory, not beside
                flats = [flat.cpu() for flat in flats]  # the engine's weights and KV cache
            out.put(
                assemble_pieces(
                    [
                        unpack_bucket(flat, [TensorSpec(*s) for s in specs])
                        for flat, (specs, _) in zip(flats, parts)
                    ]
                )
            )
        out.put(None)  # the push is whole

    def take(self, seq: int, timeout_s: float) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Push ``seq``'s buckets, whole named tensors, in order as they arrive (each waited
        for at most ``timeout_s`` seconds); pushes before it that nothing took are dropped.
        Raises what broke the receiver (a rank that died mid-push)."""
        with self._lock:
            for old in [s for s in self._queues if s < seq]:
                del self._queues[old]
        pending = self._queue(seq)
        while True:
            try:
                item = pending.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(
                    f"weight push {seq} did not reach this engine in {timeout_s:g} s "
                    "(run.collective_timeout_s)"
                ) from None
            if item is None:
                break
            if isinstance(item, BaseException):
                raise RuntimeError(f"weight push {seq} broke: {item}") from item
            yield item
        with self._lock:
            self._queues.pop(seq, None)

    def held_pushes(self) -> int:
        """Pushes arriving or received that nothing has taken yet (each up to a whole model
        of buckets in this process's memory)."""
        with self._lock:
            return len(self._queues)

    def stop(self) -> None:
        """End the thread (it looks at its stop flag between pushes)."""
        self._stop.set()
        self._thread.join(timeout=2 * POLL_S)
