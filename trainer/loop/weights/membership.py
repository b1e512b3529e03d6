"""Who is in the weight push's transfer group (``trainer.loop.weights.weight_group``): the
control store's ``wanted`` members (a version bumped at each change: a lost replica left out,
its replacement let in) and the ``group`` generation built from them, on a port of training
rank 0's host held from its announcement until the sender joins the group there."""

from __future__ import annotations

import atexit
import pickle
import socket
from dataclasses import dataclass

#: The control store's keys: the transfer group as built, and the members it should have.
GROUP_KEY, WANTED_KEY = "group", "wanted"


@dataclass(frozen=True)
class Generation:
    """One build of the transfer group: its number, the port its members meet on, its
    replicas in member order, and the ``wanted`` version it was built from."""

    number: int
    port: int
    members: tuple[int, ...]
    built_from: int


def start_membership(store, replicas: int) -> None:
    """Every replica wanted, version 0, generation 0 built from it (training rank 0, at
    start-up)."""
    store.set(WANTED_KEY, pickle.dumps((0, tuple(range(replicas)))))
    announce_group(store, Generation(0, 0, tuple(range(replicas)), 0))


#: Ports announced for a transfer group and held by this process (training rank 0) until its
#: sender joins the group there (``release_port``): port -> the socket bound to it.
_RESERVED: dict[int, socket.socket] = {}


def reserve_port(tries: int = 64) -> int:
    """A port free on this host, held bound (``SO_REUSEADDR``, never listening) so no other
    process takes it between its announcement and the group's rendezvous; the rendezvous
    binds it once ``release_port`` let it go."""
    from trainer.loop.cluster.group import free_port

    for _ in range(tries):
        port = free_port("")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError:  # taken since free_port looked
            sock.close()
            continue
        _RESERVED[port] = sock
        return port
    raise RuntimeError(f"no free port for the weight push's transfer group after {tries} tries")


def release_port(port: int) -> None:
    """Let go of ``port`` (``reserve_port``), right before the rendezvous binds it."""
    sock = _RESERVED.pop(int(port), None)
    if sock is not None:
        sock.close()


@atexit.register
def release_ports() -> None:
    """Let go of every port this process still holds (the sender stops, the process ends)."""
    for port in list(_RESERVED):
        release_port(port)


def announce_group(store, generation: Generation) -> Generation:
    """Name ``generation`` of the transfer group, on a port of this host (training rank 0's)
    held from now until the sender joins it (``reserve_port``); returns it with that port."""
    from dataclasses import replace

    generation = replace(generation, port=reserve_port())
    store.set(GROUP_KEY, pickle.dumps(generation))
    return generation


def current_group(store) -> Generation:
    """The transfer group as the store names it now."""
    return pickle.loads(store.get(GROUP_KEY))


def wanted(store) -> tuple[int, tuple[int, ...]]:
    """The version and the replicas the transfer group should have now."""
    return pickle.loads(store.get(WANTED_KEY))


def change_members(store, change) -> None:
    """Set the wanted members to ``change(members)``, bumping the version (atomic against
    another change: the store's compare-and-set)."""
    while True:
        raw = store.get(WANTED_KEY)
        version, members = pickle.loads(raw)
        new = pickle.dumps((version + 1, tuple(sorted(change(set(members))))))
        if store.compare_set(WANTED_KEY, raw, new) == new:
            return
