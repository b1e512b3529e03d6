"""What a backend says about its collectives failing.

Two things differ per device and live with its backend (``DeviceBackend`` mixes this class in):

- ``collective_timeout_env``: the environment a job's processes start with so that a
  collective stuck past ``run.collective_timeout_s`` fails instead of hanging (the device
  library's own timeouts and watchdog);
- ``collective_error_patterns``: how the device's collective library words a broken
  collective (a peer gone, a link down, a timeout) in an error that is not one of
  torch.distributed's own classes, e.g. HCCL's "error code is 9" in a plain RuntimeError.

``hal.registry.is_collective_error`` asks every backend: the process that reads a worker's error (the
driver) does not always run the device that raised it (``rollout.device``, a replay).
"""

from __future__ import annotations

import re
from collections.abc import Mapping


class CollectiveFaults:
    """The collective-failure half of a ``hal.DeviceBackend`` (see the module docstring)."""

    collective_error_patterns: tuple[str, ...] = ()
    """Regular expressions (``re.search`` on the error's text) that mark an error this
    device's collective library raised because a collective broke: a peer that died or never
    arrived, a link that failed, a timeout. Not errors a restart would repeat (bad
    arguments, a wrong dtype)."""

    def collective_timeout_env(
        self, timeout_s: float, environ: Mapping[str, str] | None = None
    ) -> dict[str, str]:
        """Environment a job's processes start with so that a collective stuck for
        ``timeout_s`` seconds (``run.collective_timeout_s``) fails instead of hanging, beyond
        the process group's own timeout (``init_process_group``): the device library's
        watchdog. A variable already set in ``environ`` (this process's environment by
        default) is left to it. None here: gloo has only the process group's timeout."""
        return {}

    @classmethod
    def is_collective_error(cls, err: BaseException) -> bool:
        """Whether ``err`` says a collective broke: one of torch.distributed's errors
        (``DistError``: ``DistBackendError``, ``DistNetworkError``, ``DistStoreError``), or
        an error whose text matches ``collective_error_patterns``."""
        import torch.distributed as dist

        dist_error = getattr(dist, "DistError", None)
        if dist_error is not None and isinstance(err, dist_error):
            return True
        text = str(err)
        return any(re.search(pattern, text) for pattern in cls.collective_error_patterns)


def all_gather_flat(output, input, group=None) -> None:
    """Gather every rank's ``input`` (same size on each) into ``output`` (world size x its
    size), rank order, by the name the running torch offers: ``all_gather_single`` from torch
    2.13 on, which deprecates ``all_gather_into_tensor`` (a ``FutureWarning`` at every call),
    the only name in torch 2.10/2.11 (the NPU and GPU pins)."""
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, input, group=group)
