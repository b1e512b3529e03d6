"""A process group of its own, outside ``torch.distributed``'s default one: the weight push
between the training ranks and engines on devices of their own (``trainer.loop.weights.
weight_group``) joins processes that share no default group (the engines have none), so each
member builds the group's backend directly on a store they all reach: gloo on the CPU, NCCL on
CUDA, HCCL on Ascend (``torch_npu``'s ``ProcessGroupHCCL``, the class its own ``hccl`` backend
registration builds). The group is used through the backend's own calls (``broadcast``), never
through ``torch.distributed``'s functions, which know only registered groups."""

from __future__ import annotations

from datetime import timedelta

import torch


def new_process_group(backend, store, rank: int, size: int, timeout_s: float):
    """A ``size``-member process group in which this process is ``rank``, met through
    ``store`` (a ``torch.distributed`` store, prefixed per group), for device backend
    ``backend`` (a ``hal.DeviceBackend``); a collective not done in ``timeout_s`` seconds
    fails. Accelerators: the process's current device is the group's."""
    import torch.distributed as dist

    timeout = timedelta(seconds=float(timeout_s))
    kind = backend.process_group_backend
    if kind == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if kind == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    if kind == "hccl":
        from hal.npu import import_torch_npu

        import_torch_npu()
        from torch_npu._C._distributed_c10d import ProcessGroupHCCL

        options = ProcessGroupHCCL.Options()
        options._timeout = timeout
        return ProcessGroupHCCL(store, rank, size, options)
    raise ValueError(f"no weight group for process-group backend {kind!r}")


def broadcast(group, tensor: torch.Tensor, root: int = 0):
    """Start broadcasting ``tensor`` from member ``root`` of ``group`` (``new_process_group``)
    into every other member's ``tensor`` (same size and dtype); returns the work to
    ``wait()`` on."""
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = root
    return group.broadcast([tensor], options)
