"""Start a local Ray or join a cluster (``ray.address``), failing in one line when the
cluster does not answer; a local Ray's object store is sized by ``ray.object_store_gb``."""

from __future__ import annotations

import os
import socket
from typing import Any


class RayConnectError(ValueError):
    """The cluster at ``ray.address`` did not answer; the message names it and the fix."""


def _cluster_address(address: str) -> str | None:
    """``host:port`` that ``address`` (``auto``, ``host:port`` or ``ray://host:port``) points
    at, or None when it cannot be told without asking Ray (``ray.init`` then reports)."""
    if address == "auto":
        try:  # RAY_ADDRESS, else the cluster this machine last started
            from ray._private.services import canonicalize_bootstrap_address

            return canonicalize_bootstrap_address("auto")
        except Exception:  # noqa: BLE001 - none found: ray.init says so itself
            return None
    return address.removeprefix("ray://")


def check_reachable(address: str, timeout_s: float) -> None:
    """Raise ``RayConnectError`` unless a TCP connection to the cluster at ``address`` opens
    within ``timeout_s`` seconds (``ray.init`` itself retries an unreachable address forever)."""
    target = _cluster_address(address)
    if not target:
        return
    host, _, port = target.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return
    except (OSError, ValueError) as err:
        reason = "timed out" if isinstance(err, TimeoutError) else (err.strerror or str(err))
    shown = address if target == address else f"{address} ({target})"
    raise RayConnectError(
        f"ray.address={shown}: no Ray cluster answered ({reason}; waited at most "
        f"{timeout_s:g} s); start "
        "one there (`ray start --head`), fix the address, set ray.address=null for a local Ray, "
        "or raise ray.connect_timeout_s"
    )


def start_ray(
    address: str | None,
    *,
    num_cpus: int | None = None,
    connect_timeout_s: float = 60.0,
    object_store_bytes: int | None = None,
) -> bool:
    """Start a local Ray (``address=None``; its object store ``object_store_bytes`` bytes,
    None: Ray's default) or join a cluster (``auto`` or ``host:port``), failing with
    ``RayConnectError`` when the cluster does not answer within ``connect_timeout_s`` seconds.

    Returns False when Ray was already running in this process (the caller then leaves it
    running), True when this call started or joined it.
    """
    import ray

    if ray.is_initialized():
        return False
    if address is not None:
        check_reachable(address, connect_timeout_s)
    # Local runs need no token; a cluster the user started keeps its own settings.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # Runs are offline: no usage report for Ray's processes to prepare and fail to send.
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    kwargs: dict[str, Any] = {
        "include_dashboard": False,
        "logging_level": "ERROR",
        "log_to_driver": True,
    }
    if address is None:
        # "local": a new Ray even when another runs on this host (ray.init() would join it)
        ray.init(
            address="local",
            num_cpus=num_cpus,
            object_store_memory=object_store_bytes,
            **kwargs,
        )
    else:
        ray.init(address=address, **kwargs)
    return True
