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

import math

import torch
from transformers.cache_utils import Cache, DynamicLayer


class KVArena:
    """Memory for the KV buffers of ``generate`` calls, kept from one call to the next.

    Fresh memory costs a page fault per page on first touch (on the CPU as much as filling
    it), so every call's buffers are views of one block that grows when a call needs more and
    is kept until ``release`` (the engine's ``sleep``). One ``generate`` call at a time.
    """

    def __init__(self) -> None:
        self._block: torch.Tensor | None = None

    def take(self, shapes: list[tuple[int, ...]], like: torch.Tensor) -> list[torch.Tensor]:
        """Contiguous tensors of ``shapes`` (contents undefined) with ``like``'s dtype and
        device, views of the kept block; they are valid until the next ``take``."""
        sizes = [math.prod(shape) for shape in shapes]
        block = self._block
        if (
            block is None
            or block.numel() < sum(sizes)
            or block.dtype != like.dtype
            or block.device != like.device
        ):
            self._block = block = None  # the old block goes before the new one comes
            self._block = block = like.new_empty(sum(sizes))
        views, at = [], 0
        for shape, size in zip(shapes, sizes):
            views.append(block[at : at + size].view(shape))
            at += size
        return views

    def release(self) -> None:
        """Free the block (the next ``take`` allocates a new one)."""
        self._block = None


class BufferLayer(DynamicLayer):
    """A full-attention cache layer over key/value buffers ``[rows, heads, capacity, dim]``.

    Starts from row ``source[i]`` of ``keys``/``values`` ``[prompts, heads, length, dim]`` for
    row ``i``; what later ``update`` calls add must fit in the buffers' capacity (tokens).
    ``self.keys``/``self.values`` are views of the filled part, so transformers' length and
    mask bookkeeping works unchanged. ``scratch``: a flat tensor of at least one buffer's
    size, used when rows leave.
    """

    def __init__(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        source: torch.Tensor,
        buffers: tuple[torch.Tensor, torch.Tensor],
        scratch: torch.Tensor,
    ) -> None:
        super().__init__()
        length = keys.shape[-2]
        if buffers[0].shape[-2] < length:
            raise ValueError(
                f"KV buffer of {buffers[0].shape[-2]} tokens is below the {length} cached tokens"
            )
        self.dtype, self.device = keys.dtype, keys.device
        self._keys, self._values = buffers
        self._scratch = scratch
        torch.index_select(keys, 0, source, out=self._keys[:, :, :length])
        torch.index_select(values, 0, source, out=self._values[:, :, :length])
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
        """Keep only the rows ``indices`` (ascending; finished rows leave the batch), moved to
        the front of the same buffers through the scratch; copies the filled part only."""
        rows = len(indices)
        for filled in (self.keys, self.values):
            gathered = self._scratch[: rows * filled[0].numel()].view(rows, *filled.shape[1:])
            torch.index_select(filled, 0, indices, out=gathered)
            filled[:rows].copy_(gathered)
        self._keys, self._values = self._keys[:rows], self._values[:rows]
        self._refresh()

    def get_max_length(self) -> int:
        """The buffers' capacity in tokens."""
        return self._keys.shape[-2]


def share_prefill(cache: Cache, source: torch.Tensor, capacity: int, arena: KVArena) -> Cache:
    """The prefill ``cache`` of the distinct prompts, made the cache of the batch's rows: row
    ``i`` continues distinct prompt ``source[i]``. Full-attention layers become ``BufferLayer``s
    of ``capacity`` tokens in ``arena``'s memory; any other kind of layer (sliding window, ...)
    keeps its own class and just has its rows selected. Changes and returns ``cache``."""
    rows = len(source)
    shared = [
        i
        for i, layer in enumerate(cache.layers)
        if type(layer) is DynamicLayer and layer.is_initialized
    ]
    shapes = []
    for i in shared:
        layer = cache.layers[i]
        for tensor in (layer.keys, layer.values):
            shapes.append((rows, tensor.shape[1], capacity, tensor.shape[-1]))
    if shared:
        shapes.append((max(math.prod(shape) for shape in shapes),))  # the scratch
        *buffers, scratch = arena.take(shapes, like=cache.layers[shared[0]].keys)
    for i, layer in enumerate(cache.layers):
        if i in shared:
            k = shared.index(i)
            cache.layers[i] = BufferLayer(
                layer.keys, layer.values, source, (buffers[2 * k], buffers[2 * k + 1]), scratch
            )
        else:
            layer.batch_select_indices(source)
    return cache


def join_rows(
    cache: Cache,
    kept: torch.Tensor,
    lead: int,
    filled: int,
    joined: Cache,
    source: torch.Tensor,
    width: int,
    capacity: int,
    arena: KVArena,
) -> Cache:
    """``cache`` (every layer a ``BufferLayer`` holding ``filled`` tokens) laid out anew with
    rows joining it: its rows ``kept`` (their columns from ``lead`` on) and then the rows of
    the prefill cache ``joined`` (row ``i`` continues its prompt ``source[i]``), each
    right-aligned at column ``width`` (zeros before it: masked padding), in buffers of
    ``capacity`` tokens in ``arena``'s memory. Changes and returns ``cache``."""
    combined = []
    for layer, extra in zip(cache.layers, joined.layers):
        pair = []
        for mine, theirs in ((layer.keys, extra.keys), (layer.values, extra.values)):
            old = mine.index_select(0, kept)[:, :, lead:filled]
            new = theirs.index_select(0, source)
            both = mine.new_zeros((len(kept) + len(source), mine.shape[1], width, mine.shape[-1]))
            both[: len(kept), :, width - old.shape[-2] :] = old
            both[len(kept) :, :, width - new.shape[-2] :] = new
            pair.append(both)
        combined.append(pair)
    # The old buffers are copied out above: the arena may hand their memory out again.
    rows = len(kept) + len(source)
    shapes = [(rows, k.shape[1], capacity, k.shape[-1]) for pair in combined for k in pair]
    shapes.append((max(math.prod(shape) for shape in shapes),))  # the scratch
    *buffers, scratch = arena.take(shapes, like=combined[0][0])
    everyone = torch.arange(rows, device=kept.device)
    for i, (keys, values) in enumerate(combined):
        pair = (buffers[2 * i], buffers[2 * i + 1])
        cache.layers[i] = BufferLayer(keys, values, everyone, pair, scratch)
    return cache
