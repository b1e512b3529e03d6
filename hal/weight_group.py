"""A process group of its own, outside ``torch.distributed``'s default one, for crossrl's own
weight transport (``rollout.engines.transfer``: the CPU lane's vLLM engine and the HF engine
anywhere; vLLM's engines on accelerators use their own transfer engines, named by
``DeviceBackend.weight_transfer_engine``). Its members share no default group (an engine has
none), so each builds the group's backend directly on a store they all reach: gloo on the CPU,
NCCL on CUDA, HCCL on Ascend (``torch_npu``'s ``ProcessGroupHCCL``, the class its own ``hccl``
backend registration builds; given a group name and its global ranks, as torch_npu's own
``new_group`` does, and built on the caller's current device, which the caller sets). The group
is used through the backend's own calls (``broadcast``), never through
``torch.distributed``'s functions, which know only registered groups."""

from __future__ import annotations

from datetime import timedelta

import torch


def new_process_group(
    backend, store, rank: int, size: int, timeout_s: float, name: str = "crossrl_transfer"
):
    """A ``size``-member process group in which this process is ``rank``, met through
    ``store`` (a ``torch.distributed`` store, prefixed per group), for device backend
    ``backend`` (a ``hal.DeviceBackend``); a collective not done in ``timeout_s`` seconds
    fails; ``name``: the group's name, the same on every member (HCCL's ``group_id``).
    Accelerators: the process's current device is the group's."""
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
        if hasattr(options, "global_ranks_in_group"):  # not the global group: its own ranks
            options.global_ranks_in_group = list(range(size))
        if hasattr(options, "group_id"):  # the same on every member, one per group
            options.group_id = name
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
