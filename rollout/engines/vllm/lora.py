"""LoRA adapters served by vLLM (a LoRA run's weight updates, ``model.lora``): vLLM holds the
base, and each update's adapters are written as a peft adapter directory and loaded in place
of the ones it served (``LoRARequest(..., load_inplace=True)`` through ``LLMEngine.add_lora``:
the same names in vLLM 0.24.0 and 0.32.0). What trains whole beside them
(``model.lora.train_embeddings``: the input embedding and the LM head), which vLLM's LoRA
serving does not take (its ``PEFTHelper`` refuses ``modules_to_save``), is loaded whole into
the base through the model's own ``load_weights`` (``VLLMWorkerExtension.crossrl_load_whole``)
before the adapters: the engine computes ``W x + (alpha / r) B (A x)`` as the trainer does,
never a ``W + (alpha / r) B A`` folded and rounded to the engine's dtype, which in bf16 drops
most of a small update. Imports vLLM only when an adapter is loaded."""

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
    """The adapters one vLLM engine serves. ``lora``: ``rank``, ``alpha``, ``target_modules``.
    ``in_process``: vLLM's worker runs in this process (whole tensors are handed over as they
    are; else through a safetensors file, as ``VLLMEngine.update_weights`` does)."""

    def __init__(self, lora: Mapping[str, Any], in_process: bool = True) -> None:
        self.lora = dict(lora)
        self.in_process = in_process
        self.directory = tempfile.mkdtemp(prefix="crossrl-lora-")
        self.pending: dict[str, torch.Tensor] = {}  # the adapters of the update under way
        self.whole: dict[str, torch.Tensor] = {}  # what trains whole (embedding, LM head)
        self.request = None  # the LoRARequest of the adapters loaded last

    def engine_options(self) -> dict[str, Any]:
        """``vllm.LLM`` keywords that let it serve these adapters (one at a time), on the
        target modules alone (``lora_target_modules``: vLLM would otherwise also wrap the
        embedding and LM head of models that list them, a Llama's, whose whole loads then
        find no parameter of their names)."""
        leaves = sorted({name.rsplit(".", 1)[-1] for name in self.lora["target_modules"]})
        return {
            "enable_lora": True,
            "max_loras": 1,
            "max_lora_rank": lora_slot(self.lora["rank"]),
            "lora_target_modules": leaves,
        }

    def stash(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Keep one bucket of an update (copied: the bucket's memory is reused): the adapters
        in float32 for the adapter file, what trains whole in the dtype it came in."""
        from rollout.lora import is_adapter

        for name, tensor in named:
            if is_adapter(name):
                self.pending[name] = tensor.detach().to("cpu", torch.float32, copy=True)
            else:
                self.whole[name] = tensor.detach().to("cpu", copy=True)

    def load(self, llm) -> Any:
        """Load the stashed update into ``llm``: the whole tensors into the base, then the
        adapters in place of those it served; returns the ``LoRARequest`` that generation
        passes from now on (None while no adapters were ever loaded)."""
        from vllm.lora.request import LoRARequest

        from rollout.lora import peft_config, write_adapter

        if self.whole:
            self._load_whole(llm)
        if self.pending:
            lora = self.lora
            config = peft_config(lora["rank"], lora["alpha"], 0.0, lora["target_modules"])
            write_adapter(self.directory, self.pending, config)
            llm.llm_engine.add_lora(
                LoRARequest("crossrl", ADAPTER_ID, self.directory, load_inplace=True)
            )
            self.pending = {}
            self.request = LoRARequest("crossrl", ADAPTER_ID, self.directory)
        return self.request

    def _load_whole(self, llm) -> None:
        """The stashed whole tensors into every vLLM worker's model
        (``VLLMWorkerExtension.crossrl_load_whole``)."""
        weights, self.whole = list(self.whole.items()), {}
        if self.in_process:
            llm.collective_rpc("crossrl_load_whole", args=(weights,))
            return
        import os

        from safetensors.torch import save_file

        # vLLM's worker broadcast cannot pickle tensors received across processes
        path = os.path.join(self.directory, "whole.safetensors")
        save_file({n: t.contiguous() for n, t in weights}, path)
        try:
            llm.collective_rpc("crossrl_load_whole", args=(None, path))
        finally:
            os.remove(path)

    def close(self) -> None:
        """Remove the adapter directory."""
        shutil.rmtree(self.directory, ignore_errors=True)
