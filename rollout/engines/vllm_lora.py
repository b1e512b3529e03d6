"""LoRA adapters served by vLLM (a LoRA run's weight updates, ``model.lora``): vLLM holds the
base, and each update's adapters are written as a peft adapter directory and loaded in place
of the ones it served (``LoRARequest(..., load_inplace=True)`` through ``LLMEngine.add_lora``:
the same names in vLLM 0.24.0 and 0.32.0). Imports vLLM only when an adapter is loaded."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterable, Mapping
from typing import Any

import torch

__all__ = ["LORA_SLOTS", "VLLMAdapter", "lora_slot"]

#: The adapter ranks vLLM serves (``LoRAConfig.max_lora_rank``, vLLM 0.24 and 0.32).
LORA_SLOTS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: vLLM's id of the one adapter an engine serves.
ADAPTER_ID = 1


def lora_slot(rank: int) -> int:
    """vLLM's ``max_lora_rank`` for adapters of rank ``rank``: the smallest it takes that holds
    them. ValueError above vLLM's largest."""
    for slot in LORA_SLOTS:
        if slot >= rank:
            return slot
    raise ValueError(
        f"model.lora.rank={rank}: vLLM serves adapters up to rank {LORA_SLOTS[-1]}; lower it"
    )


class VLLMAdapter:
    """The adapters one vLLM engine serves. ``lora``: ``rank``, ``alpha``, ``target_modules``."""

    def __init__(self, lora: Mapping[str, Any]) -> None:
        self.lora = dict(lora)
        self.directory = tempfile.mkdtemp(prefix="crossrl-lora-")
        self.pending: dict[str, torch.Tensor] = {}

    def engine_options(self) -> dict[str, Any]:
        """``vllm.LLM`` keywords that let it serve these adapters (one at a time)."""
        return {"enable_lora": True, "max_loras": 1, "max_lora_rank": lora_slot(self.lora["rank"])}

    def stash(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Keep one bucket of an update's adapters (copied: the bucket's memory is reused)."""
        self.pending.update((n, t.to("cpu", torch.float32).clone()) for n, t in named)

    def load(self, llm) -> Any:
        """Load the stashed adapters into ``llm`` in place of those it served; returns the
        ``LoRARequest`` that generation passes from now on."""
        from vllm.lora.request import LoRARequest

        from rollout.lora import peft_config, write_adapter

        lora = self.lora
        config = peft_config(lora["rank"], lora["alpha"], 0.0, lora["target_modules"])
        write_adapter(self.directory, self.pending, config)
        llm.llm_engine.add_lora(
            LoRARequest("crossrl", ADAPTER_ID, self.directory, load_inplace=True)
        )
        self.pending = {}
        return LoRARequest("crossrl", ADAPTER_ID, self.directory)

    def close(self) -> None:
        """Remove the adapter directory."""
        shutil.rmtree(self.directory, ignore_errors=True)
