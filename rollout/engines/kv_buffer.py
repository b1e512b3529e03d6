"""The HF engine's KV cache during decoding: one buffer per layer, allocated once per batch.

transformers' ``DynamicLayer`` grows its keys and values with ``torch.cat`` at every decode
step, copying the whole cache each time (a quarter of a decode step's CPU time on
``builtin:small``). ``BufferLayer`` holds keys and values in buffers of a fixed capacity
(tokens) and writes each step's entries in place; attention sees a view of the filled part.

``share_prefill`` turns the cache of a prefill over DISTINCT prompts into the cache of the
batch's rows (several rows may continue the same prompt: the n samples of a GRPO group), so a
prompt's tokens go through the model once however many samples continue it.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer


class BufferLayer(DynamicLayer):
    """A full-attention cache layer over key/value buffers ``[rows, heads, capacity, dim]``.

    Starts from ``keys``/``values`` ``[rows, heads, length, dim]``; ``capacity`` (tokens) bounds
    what later ``update`` calls may add. ``self.keys``/``self.values`` are views of the filled
    part, so transformers' length and mask bookkeeping works unchanged.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> None:
        super().__init__()
        rows, heads, length, dim = keys.shape
        if capacity < length:
            raise ValueError(f"capacity={capacity} tokens is below the {length} cached tokens")
        self.dtype, self.device = keys.dtype, keys.device
        self._keys = keys.new_empty((rows, heads, capacity, dim))
        self._values = values.new_empty((rows, heads, capacity, values.shape[-1]))
        self._keys[:, :, :length].copy_(keys)
        self._values[:, :, :length].copy_(values)
        self._length = length
        self.is_initialized = True
        self._refresh()

    def _refresh(self) -> None:
        self.keys = self._keys[:, :, : self._length]
        self.values = self._values[:, :, : self._length]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new entries after the filled part; return every entry so far (views)."""
        end = self._length + key_states.shape[-2]
        if end > self._keys.shape[-2]:
            raise RuntimeError(
                f"KV buffer full: {end} tokens exceed its capacity of {self._keys.shape[-2]}"
            )
        self._keys[:, :, self._length : end].copy_(key_states)
        self._values[:, :, self._length : end].copy_(value_states)
        self._length = end
        self._refresh()
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the rows ``indices`` (finished rows leave the batch); copies the filled
        part only."""
        keys = self._keys.new_empty((len(indices), *self._keys.shape[1:]))
        values = self._values.new_empty((len(indices), *self._values.shape[1:]))
        keys[:, :, : self._length].copy_(self.keys.index_select(0, indices))
        values[:, :, : self._length].copy_(self.values.index_select(0, indices))
        self._keys, self._values = keys, values
        self._refresh()

    def get_max_length(self) -> int:
        """The buffer's capacity in tokens."""
        return self._keys.shape[-2]


def share_prefill(cache: Cache, source: torch.Tensor, capacity: int) -> Cache:
    """The prefill ``cache`` of the distinct prompts, made the cache of the batch's rows: row
    ``i`` continues distinct prompt ``source[i]``. Full-attention layers become ``BufferLayer``s
    of ``capacity`` tokens; any other kind of layer (sliding window, ...) keeps its own class and
    just has its rows selected. Changes and returns ``cache``."""
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer and layer.is_initialized:
            cache.layers[i] = BufferLayer(
                layer.keys.index_select(0, source), layer.values.index_select(0, source), capacity
            )
        else:
            layer.batch_select_indices(source)
    return cache
