"""The sizes the memory budget chooses: ``train.max_tokens_per_micro_batch: auto`` and
``train.activation_checkpointing: auto``, resolved once before start-up into plain values
that every later reader sees (``resolve_auto_sizes``).

The rule, over the budget of the step (``trainer.loop.plan.memory_budget``) on the job's
device, with the update phase (the one the micro-batch and checkpointing size) held to
``FILL`` of the device's memory as its caching allocator reserves it
(``MemoryBudget.reserved``: the tensors times the device's ``hal.allocator_reserve``, 1.20
measured on an H100, for its cached blocks and fragmentation; the kernel set's own buffers
counted in the estimate; the other phases are the preflight's to check):

1. activation checkpointing stays off when a micro-batch of at least ``EFFICIENT_TOKENS``
   tokens per rank (or a rank's whole mini-batch, when smaller) fits without it: the largest
   such micro-batch is taken (checkpointing recomputes every layer's forward, about a third
   more compute; a larger micro-batch beyond that buys little);
2. else checkpointing goes on, with the largest micro-batch that fits with it;
3. else (nothing fits with it either) the largest micro-batch that fits without it;
4. else the smallest micro-batch (one row), checkpointing on: the preflight then refuses the
   job, naming the key that lowers it most.

The micro-batch: a rank's whole mini-batch (``null``) when it fits, else the largest budget
that does, a multiple of ``STEP_TOKENS`` (memory grows with it: found by bisection), never
below one row (``rollout.max_input_len + rollout.max_new_tokens``: a longer row goes alone).
A key the user set keeps its value; only ``auto`` ones are chosen.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from trainer.config.checks import compile_problem
from trainer.config.errors import raise_first
from trainer.config.schema import Config
from trainer.loop.plan.memory_budget import GB, MemoryBudget
from trainer.loop.plan.rank_memory import micro_batch_tokens

__all__ = [
    "AUTO",
    "EFFICIENT_TOKENS",
    "FILL",
    "STEP_TOKENS",
    "AutoSizes",
    "choose_sizes",
    "resolve_auto_sizes",
]

AUTO = "auto"
#: Share of a device's memory the update's reserved bytes may fill when the budget chooses;
#: the rest is for what no estimate sees (first-call workspaces, the estimate's own error).
#: Before issue 56 it was 0.85 of the allocated estimate, 1.02 of the device as reserved.
FILL = 0.90
#: Tokens per rank's micro-batch from which activation checkpointing is not worth turning on
#: to get a larger one.
EFFICIENT_TOKENS = 8192
#: The micro-batch budget is chosen to a multiple of this many tokens.
STEP_TOKENS = 1024


@dataclass(frozen=True)
class AutoSizes:
    """What the budget chose: ``tokens`` (``train.max_tokens_per_micro_batch``; None = a
    rank's whole mini-batch), ``checkpointing`` (``train.activation_checkpointing``) and one
    line saying so (``note``)."""

    tokens: int | None
    checkpointing: bool
    note: str

    def apply(self, cfg: Config) -> Config:
        """``cfg`` with these sizes in place of its ``auto`` keys."""
        new = cfg.model_copy(deep=True)
        if cfg.train.max_tokens_per_micro_batch == AUTO:
            new.train.max_tokens_per_micro_batch = self.tokens
        if cfg.train.activation_checkpointing == AUTO:
            new.train.activation_checkpointing = self.checkpointing
        return new


def _tokens(cfg: Config, budget: int | None) -> int:
    sized = cfg.model_copy(deep=True)
    sized.train.max_tokens_per_micro_batch = budget
    sized.train.activation_checkpointing = False  # plain values; the count does not read it
    return micro_batch_tokens(sized)


def choose_sizes(
    cfg: Config, estimate: Callable[[Config], MemoryBudget | None]
) -> AutoSizes | None:
    """The sizes for ``cfg``'s ``auto`` keys (see the module docstring); ``estimate``: the
    budget of a config with plain values (None: the model's shape is unknown). None when no
    key is ``auto``."""
    train = cfg.train
    tokens_auto = train.max_tokens_per_micro_batch == AUTO
    ckpt_auto = train.activation_checkpointing == AUTO
    if not (tokens_auto or ckpt_auto):
        return None
    checkpointing = [False, True] if ckpt_auto else [train.activation_checkpointing]
    row = cfg.rollout.max_input_len + cfg.rollout.max_new_tokens
    whole = _tokens(cfg, None)
    memory = None

    def fits(budget: int | None, ckpt: bool) -> bool:
        nonlocal memory
        trial = AutoSizes(budget, ckpt, "").apply(cfg)
        estimated = estimate(trial)
        if estimated is None:
            return True  # no shape, no estimate: nothing to refuse
        memory = estimated
        return estimated.reserved("update") <= FILL * estimated.device_memory_bytes

    def largest(ckpt: bool) -> int | None | bool:
        """The largest budget that fits (None: the whole mini-batch), False if none does;
        memory grows with the micro-batch, so a bisection in steps of ``STEP_TOKENS``."""
        if not tokens_auto:
            return (
                train.max_tokens_per_micro_batch
                if fits(train.max_tokens_per_micro_batch, ckpt)
                else False
            )
        if fits(None, ckpt):
            return None
        if not fits(row, ckpt):
            return False
        low, high = row // STEP_TOKENS, -(-whole // STEP_TOKENS)  # in steps: fits, does not
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if fits(max(row, mid * STEP_TOKENS), ckpt) else (low, mid)
        return max(row, low * STEP_TOKENS)

    chosen: tuple[int | None, bool] | None = None
    enough = min(EFFICIENT_TOKENS, whole)
    if False in checkpointing:
        off = largest(False)
        if off is not False and (not ckpt_auto or _tokens(cfg, off) >= enough):
            chosen = (off, False)
    if chosen is None and True in checkpointing:
        on = largest(True)
        if on is not False:
            chosen = (on, True)
    if chosen is None and False in checkpointing and ckpt_auto:
        off = largest(False)
        if off is not False:
            chosen = (off, False)
    if chosen is None:
        smallest = row if tokens_auto else train.max_tokens_per_micro_batch
        chosen = (smallest, True if ckpt_auto else checkpointing[0])
    return AutoSizes(*chosen, _note(cfg, chosen, memory))


def _note(cfg: Config, chosen: tuple[int | None, bool], memory: MemoryBudget | None) -> str:
    budget, ckpt = chosen
    parts = []
    if cfg.train.max_tokens_per_micro_batch == AUTO:
        size = "null (a rank's whole mini-batch)" if budget is None else str(budget)
        parts.append(f"train.max_tokens_per_micro_batch={size}")
    if cfg.train.activation_checkpointing == AUTO:
        parts.append(f"train.activation_checkpointing={str(ckpt).lower()}")
    where = (
        "no estimate (the model's shape is unknown)"
        if memory is None
        else f"{FILL:.0%} of {memory.device_memory_bytes / GB:.1f} GB ({memory.memory_source}) "
        f"as reserved (tensors x {memory.allocator_reserve:.2f})"
    )
    return f"auto sizes from the memory budget: {', '.join(parts)}; the update within {where}"


def resolve_auto_sizes(
    cfg: Config, estimate: Callable[[Config], MemoryBudget | None] | None = None
) -> tuple[Config, str | None]:
    """``cfg`` with its ``auto`` sizes chosen (``choose_sizes``) and the line that says what
    was chosen; ``cfg`` itself and None when no key is ``auto``. A choice the config's checks
    refuse (``train.compile_blocks`` with checkpointing chosen on) raises ``ConfigError``
    naming both keys, as the explicit pair does. ``estimate``: default the
    budget ``crossrl layout`` prints for this machine (``memory_report.budget_for_cli``)."""
    if estimate is None:
        from trainer.loop.plan.memory_report import budget_for_cli

        estimate = budget_for_cli
    sizes = choose_sizes(cfg, estimate)
    if sizes is None:
        return cfg, None
    sized = sizes.apply(cfg)
    # the config's checks of the keys auto sets, again on the values it chose
    chosen = cfg.train.activation_checkpointing == AUTO
    raise_first([p for p in (compile_problem(sized, chosen=chosen),) if p])
    return sized, sizes.note
