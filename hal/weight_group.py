"""A gloo process group of its own, outside ``torch.distributed``'s default one, for crossrl's
own weight transport on the CPU (``rollout.engines.weights.transfer``: the CPU lane's vLLM engine and
the HF engine). Its members share no default group (an engine has none), so each builds the
group directly on a store they all reach. On accelerators no group is built here: vLLM's and
vllm-ascend's own weight-transfer engines build theirs (``DeviceBackend.
weight_transfer_engine``), and the HF engine on devices of its own takes host-memory snapshots
(``trainer.loop.plan.layout.weight_transport_rule``). The group is used through its own calls
(``broadcast``), never through ``torch.distributed``'s functions, which know only registered
groups."""

from __future__ import annotations

from datetime import timedelta

import torch


def new_process_group(
    backend, store, rank: int, size: int, timeout_s: float, name: str = "crossrl_transfer"
):
    """A ``size``-member gloo process group in which this process is ``rank``, met through
    ``store`` (a ``torch.distributed`` store, prefixed per group), for device backend
    ``backend`` (a ``hal.DeviceBackend`` whose collectives are gloo's; any other raises); a
    collective not done in ``timeout_s`` seconds fails; ``name``: the group's name, the same
    on every member."""
    import torch.distributed as dist

    timeout = timedelta(seconds=float(timeout_s))
    kind = backend.process_group_backend
    if kind == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    raise ValueError(
        f"crossrl builds weight groups over gloo only, not {kind!r}: on this device the "
        "engine's own weight-transfer engine builds its group (DeviceBackend."
        "weight_transfer_engine)"
    )


def broadcast(group, tensor: torch.Tensor, root: int = 0):
    """Start broadcasting ``tensor`` from member ``root`` of ``group`` (``new_process_group``)
    into every other member's ``tensor`` (same size and dtype); returns the work to
    ``wait()`` on."""
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = root
    return group.broadcast([tensor], options)
