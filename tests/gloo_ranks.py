"""Ending a rank that a test spawned (``torch.multiprocessing.spawn``) over gloo."""

from __future__ import annotations

import os
from typing import NoReturn

import torch.distributed as dist


def finish_rank() -> NoReturn:
    """A spawned rank whose checks passed: wait for the other ranks, then exit at once. Gloo's
    teardown (``destroy_process_group``, or the interpreter's own exit) can abort a rank whose
    peer has already closed its connections ("terminate called without an active exception",
    SIGABRT: seen in about one full-suite run in three), failing a test whose checks all held;
    ``os._exit`` skips it. A rank whose check failed raises instead, as before."""
    dist.barrier()
    os._exit(0)


def report_and_finish(queue, item) -> NoReturn:
    """A spawned rank whose checks passed puts ``item`` on its ``multiprocessing`` queue,
    flushes it (``os._exit`` would drop what the queue's feeder thread has not sent yet),
    then ends as ``finish_rank`` does."""
    queue.put(item)
    queue.close()
    queue.join_thread()
    finish_rank()
