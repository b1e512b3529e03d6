"""What a streamed run (``train.max_staleness`` = s) holds on its rollout host, held against
that host's memory before start-up.

The stream keeps up to ``(s + 1) x train.batch_size`` groups in flight (sampling, or finished
and not yet trained on: ``trainer.loop.engines.stream_host``), each on a thread of its own, and
never more than the groups the run's steps still take (``train.total_steps x
train.batch_size`` from the start; ``groups_in_flight``). Their rows live in the rollout
host's memory as Python lists: at most ``rollout.max_input_len + rollout.max_new_tokens``
tokens per row (a row per turn when rows are step-wise), ``ROW_BYTES_PER_TOKEN`` bytes a token
(``in_flight_bytes``). ``in_flight_problem`` refuses a job whose groups in flight need more than
``HOST_SHARE`` of the host's memory, naming ``train.max_staleness``, the GB and the largest
bound that fits. The bound's other side, ``train.max_staleness <= train.total_steps - 1`` (no
group can be older), is a config check (``trainer.config.engine_checks``).
"""

from __future__ import annotations

import os
import textwrap

from trainer.config.schema import Config

__all__ = [
    "HOST_SHARE",
    "ROW_BYTES_PER_TOKEN",
    "format_in_flight",
    "groups_in_flight",
    "host_memory_bytes",
    "in_flight_bytes",
    "in_flight_problem",
]

GB = 1e9
#: Host bytes a streamed group's rows take per token (Python lists of token id, mask,
#: log-prob and version, and the row's share of its messages), an upper figure.
ROW_BYTES_PER_TOKEN = 128
#: The share of the rollout host's memory its groups in flight may take: the rest holds the
#: engine processes, Ray's object store (30 % of it by default) and, on one machine, the
#: training ranks.
HOST_SHARE = 0.5


def groups_in_flight(cfg: Config, staleness: int | None = None) -> int:
    """Groups a streamed run holds at once at ``staleness`` (default ``train.max_staleness``):
    ``(s + 1) x train.batch_size``, at most the ``train.total_steps x train.batch_size`` its
    steps take; 0 without streaming."""
    s = cfg.train.max_staleness if staleness is None else staleness
    if not s:
        return 0
    return min(s + 1, cfg.train.total_steps) * cfg.train.batch_size


def _tokens_per_group(cfg: Config) -> int:
    roll = cfg.rollout
    rows = roll.max_turns if roll.step_wise else 1
    return roll.n * rows * (roll.max_input_len + roll.max_new_tokens)


def in_flight_bytes(cfg: Config, staleness: int | None = None) -> int:
    """Host bytes of the rows of the groups in flight (``groups_in_flight``), an upper figure."""
    return groups_in_flight(cfg, staleness) * _tokens_per_group(cfg) * ROW_BYTES_PER_TOKEN


def in_flight_problem(cfg: Config, host_bytes: float, where: str) -> str | None:
    """One line when the rows of a streamed run's groups in flight need more than
    ``HOST_SHARE`` of ``host_bytes`` (the rollout host's memory; ``where`` says whose), naming
    ``train.max_staleness``, the GB and the fix; None when they fit or nothing streams."""
    s = cfg.train.max_staleness
    need = in_flight_bytes(cfg)
    room = HOST_SHARE * host_bytes
    if not s or need <= room:
        return None
    per_step = cfg.train.batch_size * _tokens_per_group(cfg) * ROW_BYTES_PER_TOKEN
    fits = int(room // per_step) - 1  # the largest s whose (s + 1) steps of groups fit
    fix = (
        f"lower train.max_staleness to {fits}"
        if fits >= 1
        else "lower train.batch_size, rollout.n or rollout.max_input_len + "
        "rollout.max_new_tokens (not even train.max_staleness=1 fits)"
    )
    return (
        f"train.max_staleness={s}: up to {groups_in_flight(cfg)} groups in flight ((s + 1) x "
        f"train.batch_size={cfg.train.batch_size}), their rows up to {need / GB:.2f} GB in the "
        f"rollout host ({ROW_BYTES_PER_TOKEN} bytes a token), more than {HOST_SHARE:.0%} of "
        f"{where} ({host_bytes / GB:.1f} GB); {fix}"
    )


def host_memory_bytes() -> float:
    """This host's physical memory in bytes."""
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def format_in_flight(cfg: Config) -> str:
    """The groups a streamed run holds at once, for ``crossrl layout``: sampling or finished
    and not yet trained, and their rows in the rollout host's memory."""
    groups = groups_in_flight(cfg)
    tokens = groups * _tokens_per_group(cfg)
    return textwrap.fill(
        f"streaming: up to {groups} groups in flight ((train.max_staleness + 1) x "
        f"train.batch_size), {groups * cfg.rollout.n} trajectories; their rows in the rollout "
        f"host's memory, at most {tokens:,} tokens ({tokens * ROW_BYTES_PER_TOKEN / GB:.2f} "
        "GB); the engines hold one engine call's rows at a time (inside the rollout table's "
        "KV cache)",
        width=96,
        subsequent_indent="  ",
    )
