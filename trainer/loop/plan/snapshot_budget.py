"""The weight snapshots of engines on devices of their own, held against Ray's object store.

With ``rollout.engine_devices > 0`` the ranks put a snapshot of the new weights into Ray's
object store after every update (``WeightPush.snapshot_weights``: every training rank puts
its own rows of each tensor, its FSDP2 dim-0 shard, in the object store of its own node; a
tensor that is not sharded, rank 0), and the fixed-lag pipeline (``trainer.loop.schedule.pipeline``,
``train.rollout_lag`` = k) queues the rollout of step t+1+k with the snapshot of step t. A
snapshot lives as long as a queued call holds it: Ray keeps a task's arguments until that task
finishes, not once it has loaded them. So while the ranks put the snapshot of step t+1, the
live ones are:

- those of steps t+1-k .. t, held by the queued rollouts of steps t+2 .. t+1+k (the rollout
  of step t+1, which held the snapshot of step t-k, has finished: step t+1 trained on it);
- a validation after step s (``run.val_every``) is queued with the snapshot of step s, which
  the rollout of step s+1+k holds anyway: no extra copy;
- the new one of step t+1 (the pipeline keeps only the version of the last one it handed on).

That is k + 1 snapshots (``live_snapshots``); colocated engines take none. A streamed run
(``train.max_staleness`` = s) queues a load of every step's snapshot on the rollout host; the
step that trains with policy t needs groups sampled by policy t - s or newer, so the host has
loaded that one, and the snapshots of t - s + 1 .. t wait in the queue beside the new one:
s + 1 snapshots, as a lag of s. A snapshot holds
every state-dict entry of the policy in the engine's dtype (``model.dtype``): the parameters,
and the LM head again when it is tied to the embedding (the state dict names both),
``snapshot_bytes``; a node holds its ranks' rows of it (``node_snapshot_bytes``: all of it
when every rank is on one node). An engine on another node reads a copy, which Ray may evict
once read; the primary copies are what must fit. ``snapshot_problem`` refuses a job whose
snapshots exceed a node's object store (``ray.object_store_gb``, else Ray's default:
``default_object_store_bytes``). Pure but for ``host_object_store_bytes`` /
``node_object_store_bytes``, which read this host or Ray.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence

from trainer.config.schema import Config
from trainer.loop.plan.model_shape import ModelShape
from trainer.loop.plan.rank_memory import DTYPE_BYTES

__all__ = [
    "default_object_store_bytes",
    "format_snapshots",
    "host_object_store_bytes",
    "live_snapshots",
    "node_object_store_bytes",
    "node_snapshot_bytes",
    "snapshot_bytes",
    "snapshot_problem",
]

GB = 1e9
#: Ray's default object store: this share of the memory available when the node starts
#: (``ray._private.ray_constants.DEFAULT_OBJECT_STORE_MEMORY_PROPORTION``, Ray 2.60) ...
DEFAULT_PROPORTION = 0.3
#: ... at most this many bytes (``DEFAULT_OBJECT_STORE_MAX_MEMORY_BYTES``) ...
DEFAULT_MAX_BYTES = 200_000_000_000
#: ... and at most 95 % of /dev/shm's free space, unless that is below this many bytes
#: (``REQUIRE_SHM_SIZE_THRESHOLD``; ``ray._private.utils.resolve_object_store_memory``).
SHM_FLOOR_BYTES = 10**10
#: Ray's smallest object store, GB (``OBJECT_STORE_MINIMUM_MEMORY_BYTES``, 75 MiB): the least
#: ``ray.object_store_gb`` takes.
MIN_STORE_GB = 0.08


def live_snapshots(cfg: Config) -> int:
    """Weight snapshots alive at once in Ray's object store: ``train.rollout_lag + 1`` with
    engines on devices of their own (the schedule in this module's docstring), 0 with
    colocated engines (they take the weights from their own ranks, never through the object
    store), nor with the collective push (``rollout.weight_transport``: the engines receive
    the weights straight from the ranks, ``trainer.loop.weights.weight_group``)."""
    from trainer.loop.plan.layout import weight_transport_rule

    if weight_transport_rule(cfg) != "host":
        return 0
    return _ahead(cfg)[1] + 1


def _ahead(cfg: Config) -> tuple[str, int]:
    """The key that sets how many policies the engines may lag the trainer, and its value:
    ``train.max_staleness`` of a streamed run, else ``train.rollout_lag``."""
    if cfg.train.max_staleness:
        return "train.max_staleness", cfg.train.max_staleness
    return "train.rollout_lag", cfg.train.rollout_lag


def _tensors(shape: ModelShape) -> list[tuple[int, int]]:
    """``(rows, elements per row)`` of every state-dict entry of a policy of ``shape``
    (``ModelShape.tensors``: each decoder layer's attention, MLP or experts and norms, the
    embedding, the final norm and the LM head, an entry of its own even when tied)."""
    return shape.tensors()


def _rows(total: int, rank: int, ranks: int) -> int:
    """Rows of a ``total``-row tensor that rank ``rank`` of ``ranks`` holds: FSDP2 shards dim 0
    as ``torch.chunk`` does, ``ceil(total / ranks)`` rows each, the last ranks fewer or none."""
    chunk = -(-total // ranks)
    return max(0, min(chunk, total - rank * chunk))


def node_snapshot_bytes(shape: ModelShape, dtype: str, ranks: Iterable[int], dp_size: int) -> int:
    """Bytes of one snapshot that the training ranks ``ranks`` (of ``dp_size``) put in their
    node's object store: their rows of every state-dict entry in ``dtype`` (``model.dtype``);
    all of it when ``ranks`` are all of them (alignment of a few hundred bytes per tensor and
    rank aside)."""
    ranks = list(ranks)
    size = DTYPE_BYTES[dtype]
    return sum(
        sum(_rows(total, r, dp_size) for r in ranks) * per_row * size
        for total, per_row in _tensors(shape)
    )


def snapshot_bytes(shape: ModelShape, dtype: str) -> int:
    """Bytes of one whole snapshot of a policy of ``shape`` in the engine dtype ``dtype``
    (``model.dtype``): every state-dict entry, so a tied LM head counts again."""
    return node_snapshot_bytes(shape, dtype, [0], 1)


def default_object_store_bytes(available_bytes: float, shm_free_bytes: float) -> int:
    """The object store Ray 2.60 gives a node started without ``object_store_memory``:
    ``DEFAULT_PROPORTION`` of ``available_bytes`` (the memory available when it starts), at
    most ``DEFAULT_MAX_BYTES`` and at most 95 % of ``shm_free_bytes`` (/dev/shm's free space)
    unless that is below ``SHM_FLOOR_BYTES``."""
    cap = min(DEFAULT_MAX_BYTES, max(SHM_FLOOR_BYTES, int(shm_free_bytes * 0.95)))
    return min(int(available_bytes * DEFAULT_PROPORTION), cap)


def host_object_store_bytes(cfg: Config) -> tuple[float, str]:
    """Bytes of the object store a local Ray started here will have, and where the number
    comes from: ``ray.object_store_gb``, else Ray's default for this host now."""
    if cfg.ray.object_store_gb is not None:
        return cfg.ray.object_store_gb * GB, f"ray.object_store_gb={cfg.ray.object_store_gb:g}"
    try:  # what Ray itself will read (a container's cgroup limit included)
        from ray._private.utils import estimate_available_memory

        available = float(estimate_available_memory())
    except Exception:  # noqa: BLE001 - another Ray release: the kernel's estimate
        available = _meminfo_bytes("MemAvailable")
    try:
        stat = os.statvfs("/dev/shm")
        shm = stat.f_bsize * stat.f_bavail
    except OSError:
        shm = 0
    store = default_object_store_bytes(available, shm)
    return float(store), "ray.object_store_gb=null: Ray's default for this host"


def node_object_store_bytes(node_id: str) -> float | None:
    """Bytes of the object store of the Ray node ``node_id`` in the cluster joined (its
    ``object_store_memory`` resource), or None when Ray does not list it."""
    import ray

    for node in ray.nodes():
        if node.get("NodeID") == node_id:
            return float(node.get("Resources", {}).get("object_store_memory", 0)) or None
    return None


def snapshot_problem(
    cfg: Config,
    shape: ModelShape | None,
    store_bytes: float,
    where: str,
    ranks: Sequence[int] | None = None,
) -> str | None:
    """One line when the live snapshots' rows of training ranks ``ranks`` (None: all of
    ``train.dp_size``, one node) need more than ``store_bytes``, their node's object store
    (``where`` says which and where the number comes from), naming the keys, the GB and the
    fix; None when they fit, when no snapshot is taken, or when the model's shape is unknown.
    A joined cluster (``ray.address``) sizes a node's store with ``ray start
    --object-store-memory``, a local Ray with ``ray.object_store_gb``."""
    count = live_snapshots(cfg)
    if not count or shape is None:
        return None
    dp = cfg.train.dp_size
    ranks = list(range(dp)) if ranks is None else list(ranks)
    one = node_snapshot_bytes(shape, cfg.model.dtype, ranks, dp)
    if count * one <= store_bytes:
        return None
    key, lag = _ahead(cfg)
    fits = int(store_bytes // one) - 1  # the largest lag whose snapshots fit
    least = 1 if key == "train.max_staleness" else 0
    lower = (
        f", or lower {key} to {fits}"
        if fits >= least
        else f" (not even {least + 1} snapshots fit, whatever {key})"
        if least
        else f" (not even one snapshot fits, whatever {key})"
    )
    need_gb = max(MIN_STORE_GB, math.ceil(count * one / GB * 100) / 100)
    raise_it = (
        f"restart that node's Ray with `ray start --object-store-memory` of at least {need_gb:g} GB"
        if cfg.ray.address is not None
        else f"raise ray.object_store_gb to at least {need_gb:g} (host memory allowing)"
    )
    share = "" if len(ranks) == dp else f" (the rows of its {len(ranks)} of {dp} training ranks)"
    return (
        f"{key}={lag}: {'the stream' if least else 'the fixed-lag pipeline'} keeps {count} "
        "weight snapshots alive, "
        f"{_gb(one)} each ({cfg.model.dtype}){share}, {_gb(count * one)} in all, more than "
        f"the {_gb(store_bytes)} object store of their node ({where}); {raise_it}{lower}"
    )


def _meminfo_bytes(field: str) -> float:
    """A ``/proc/meminfo`` field in bytes (the physical memory where there is none)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def format_snapshots(cfg: Config, shape: ModelShape | None) -> str | None:
    """The lines ``crossrl layout`` prints under the memory table: the live snapshots, their
    GB, and the object store they must fit (a local Ray's, or a joined cluster's, read then);
    None when no snapshot is taken or the model's shape is unknown."""
    count = live_snapshots(cfg)
    if shape is not None and cfg.rollout.engine_devices and not count:
        from rollout.engines.weights.transfer import PACKED_BUFFER_BYTES, PACKED_NUM_BUFFERS

        one = snapshot_bytes(shape, cfg.model.dtype)
        chunks = f"{PACKED_NUM_BUFFERS} chunks of {PACKED_BUFFER_BYTES >> 20} MiB"
        return (
            "weights pushed through the engines' transfer API (rollout.weight_transport): no "
            f"snapshot in Ray's object store; training rank 0 holds one copy, {_gb(one)} "
            f"({cfg.model.dtype}), in pinned host memory until the engines take it (one push "
            f"at a time; on the CPU, in the table), and sends {chunks} at once from its "
            f"device, also while the next step trains; each engine worker receives {chunks} "
            "at once (the update's, weight push's and engines' rows of the table)"
        )
    if not count or shape is None:
        return None
    one = snapshot_bytes(shape, cfg.model.dtype)
    head = (
        f"weight snapshots in Ray's object store: {count} ({_ahead(cfg)[0]} + 1) x "
        f"{_gb(one)} ({cfg.model.dtype}) = {_gb(count * one)}\n  on the training ranks' "
        "nodes, each its own ranks' rows (all of it when they share one node)"
    )
    if cfg.ray.address is not None:
        return f"{head}\n  object store: read from the cluster at ray.address once joined"
    store, source = host_object_store_bytes(cfg)
    verdict = "fits" if count * one <= store else "does NOT fit"
    return f"{head}\n  object store: {_gb(store)} ({source}): {verdict}"


def _gb(size_bytes: float) -> str:
    """``size_bytes`` in GB (1e9 bytes), three significant digits: a tiny model's snapshot
    reads 0.000448 GB, not 0.00 GB."""
    return f"{size_bytes / GB:.3g} GB"
