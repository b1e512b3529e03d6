"""The weight snapshots of engines on devices of their own, held against Ray's object store.

With ``rollout.engine_devices > 0`` the ranks put a snapshot of the new weights into Ray's
object store after every update (``WeightPush.snapshot_weights``: rank 0's ``ray.put``, so the
primary copies live in the object store of training rank 0's node), and the fixed-lag pipeline
(``trainer.loop.pipeline``, ``train.rollout_lag`` = k) queues the rollout of step t+1+k with
the snapshot of step t. A snapshot lives as long as a queued call holds it: Ray keeps a task's
arguments until that task finishes, not until it has loaded them. So while the ranks put the
snapshot of step t+1, the live ones are:

- those of steps t+1-k .. t, held by the queued rollouts of steps t+2 .. t+1+k (the rollout
  of step t+1, which held the snapshot of step t-k, has finished: step t+1 trained on it);
- a validation after step s (``run.val_every``) is queued with the snapshot of step s, which
  the rollout of step s+1+k holds anyway: no extra copy;
- the new one of step t+1.

That is k + 1 whole-model copies (``live_snapshots``); colocated engines take none. Each
holds every state-dict entry of the policy in the engine's dtype (``model.dtype``): the
parameters, and the LM head again when it is tied to the embedding (the state dict names
both), ``snapshot_bytes``. ``snapshot_problem`` refuses a job whose snapshots exceed the object
store (``ray.object_store_gb``, else Ray's default: ``default_object_store_bytes``). Pure but
for ``host_object_store_bytes`` / ``node_object_store_bytes``, which read this host or Ray.
"""

from __future__ import annotations

import math
import os

from trainer.config.schema import Config
from trainer.loop.model_shape import ModelShape

__all__ = [
    "default_object_store_bytes",
    "format_snapshots",
    "host_object_store_bytes",
    "live_snapshots",
    "node_object_store_bytes",
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
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def live_snapshots(cfg: Config) -> int:
    """Whole-model weight snapshots alive at once in the object store of training rank 0's
    node: ``train.rollout_lag + 1`` with engines on devices of their own (the schedule in this
    module's docstring), 0 with colocated engines (they take the weights from their own
    ranks, never through the object store)."""
    if not cfg.rollout.engine_devices:
        return 0
    return cfg.train.rollout_lag + 1


def snapshot_bytes(shape: ModelShape, dtype: str) -> int:
    """Bytes of one snapshot of a policy of ``shape`` in the engine dtype ``dtype``
    (``model.dtype``): every state-dict entry, so a tied LM head counts again (alignment of a
    few hundred bytes per tensor aside)."""
    tied = shape.embedding_params if shape.tie_word_embeddings else 0
    return (shape.num_params + tied) * _DTYPE_BYTES[dtype]


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
    cfg: Config, shape: ModelShape | None, store_bytes: float, where: str
) -> str | None:
    """One line when the live snapshots (``live_snapshots`` x ``snapshot_bytes``) need more
    than ``store_bytes``, the object store of rank 0's node (``where`` says where the number
    comes from), naming the keys and the fix; None when they fit, when no snapshot is taken,
    or when the model's shape is unknown. A joined cluster (``ray.address``) sizes its store
    with ``ray start --object-store-memory``, a local Ray with ``ray.object_store_gb``."""
    count = live_snapshots(cfg)
    if not count or shape is None:
        return None
    one = snapshot_bytes(shape, cfg.model.dtype)
    if count * one <= store_bytes:
        return None
    lag = cfg.train.rollout_lag
    fits = int(store_bytes // one) - 1  # the largest lag whose snapshots fit
    lower = (
        f", or lower train.rollout_lag to {fits}"
        if fits >= 0
        else " (not even one snapshot fits, whatever train.rollout_lag)"
    )
    need_gb = max(MIN_STORE_GB, math.ceil(count * one / GB * 100) / 100)
    raise_it = (
        f"restart that node's Ray with `ray start --object-store-memory` of at least {need_gb:g} GB"
        if cfg.ray.address is not None
        else f"raise ray.object_store_gb to at least {need_gb:g} (host memory allowing)"
    )
    return (
        f"train.rollout_lag={lag}: the fixed-lag pipeline keeps {count} weight snapshots of "
        f"{_gb(one)} ({cfg.model.dtype}) alive, {_gb(count * one)}, more than the "
        f"{_gb(store_bytes)} object store of training rank 0's node ({where}); "
        f"{raise_it}{lower}"
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
    if not count or shape is None:
        return None
    one = snapshot_bytes(shape, cfg.model.dtype)
    head = (
        f"weight snapshots in Ray's object store of training rank 0's node: {count} "
        f"(train.rollout_lag + 1) x {_gb(one)} ({cfg.model.dtype}) = {_gb(count * one)}"
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
