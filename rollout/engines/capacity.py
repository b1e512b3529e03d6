"""How many sequences an engine decodes at once: what its KV cache holds.

A rollout whose trajectories outnumber that decodes in waves, one after another; the
controller's rollout limit counts them (``trainer.loop.plan.call_limits``).
"""

from __future__ import annotations

from typing import Any


def concurrent_sequences(engine: Any) -> int | None:
    """Sequences of the longest length the engine serves (vLLM's ``max_model_len``: prompt
    and response at their longest) that ``engine`` holds in its KV cache at once: the
    cache's blocks times their size (``cache_config.num_gpu_blocks`` x ``block_size``, which
    vLLM sets once it has sized the cache) over that length, at most
    ``scheduler_config.max_num_seqs``, at least 1. None for an engine that decodes every
    request it is given in one batch (the HF engine), or a vLLM whose cache size is not
    known."""
    llm = getattr(engine, "llm", None)
    config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    if config is None:
        return None
    blocks = getattr(config.cache_config, "num_gpu_blocks", None)
    block_size = getattr(config.cache_config, "block_size", None)
    if not blocks or not block_size:
        return None
    seq_tokens = max(int(config.model_config.max_model_len), 1)
    held = max(1, int(blocks) * int(block_size) // seq_tokens)
    max_seqs = getattr(config.scheduler_config, "max_num_seqs", None)
    return min(held, int(max_seqs)) if max_seqs else held
