"""A mixture-of-experts layer's experts as an engine's loader names them.

transformers 5 keeps a layer's experts fused, one tensor each (``Qwen3MoeExperts`` and the
other ``@use_experts_implementation`` modules): ``<layer>.mlp.experts.gate_up_proj``
``[E, 2I, H]`` (each expert's gate rows, then its up rows) and ``<layer>.mlp.experts.down_proj``
``[E, H, I]``; that is what the trainer's state dict pushes. A checkpoint on disk, and the
loaders of vLLM 0.24 and 0.26 (Qwen3-MoE's ``load_weights`` maps only these; a fused name
is skipped), name each expert apart: ``<layer>.mlp.experts.<e>.gate_proj.weight`` ``[I, H]``,
``.up_proj.weight`` ``[I, H]`` and ``.down_proj.weight`` ``[H, I]``. ``per_expert`` splits the
fused tensors into those (views, no copy); transformers' own loading rule (per-expert
checkpoint names stacked into the fused tensors) is the test's reference. vLLM 0.32's loader
takes both (measured: the same log-probs either way). ``split_fused_experts`` makes a vLLM
model's ``load_weights`` take fused names on every release, whatever path calls it.

The pattern is the ``mlp.experts.`` naming of Qwen2-MoE, Qwen3-MoE, OLMoE and DeepSeek-V3;
Mixtral's ``w1`` / ``w3`` / ``w2`` names are not mapped (not a pinned test model).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Iterator

import torch

__all__ = ["FUSED_DOWN", "FUSED_GATE_UP", "fused_experts", "per_expert", "split_fused_experts"]

#: The fused experts' names' endings in transformers 5.
FUSED_GATE_UP = "mlp.experts.gate_up_proj"
FUSED_DOWN = "mlp.experts.down_proj"


def per_expert(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """``named_tensors`` with every fused experts tensor split into one tensor per expert under
    its checkpoint name (module docstring), in expert order; every other entry unchanged.
    ValueError naming the tensor for a fused name whose shape is not ``[E, 2I, H]`` /
    ``[E, H, I]``."""
    for name, tensor in named_tensors:
        if name.endswith(FUSED_GATE_UP):
            base = name[: -len("gate_up_proj")]
            if tensor.dim() != 3 or tensor.shape[1] % 2:
                raise ValueError(
                    f"{name}: shape {tuple(tensor.shape)} is not [experts, 2 x intermediate, "
                    "hidden]; transformers 5's fused gate_up_proj has that layout"
                )
            inter = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                yield f"{base}{e}.gate_proj.weight", tensor[e, :inter]
                yield f"{base}{e}.up_proj.weight", tensor[e, inter:]
        elif name.endswith(FUSED_DOWN):
            base = name[: -len("down_proj")]
            if tensor.dim() != 3:
                raise ValueError(
                    f"{name}: shape {tuple(tensor.shape)} is not [experts, hidden, "
                    "intermediate]; transformers 5's fused down_proj has that layout"
                )
            for e in range(tensor.shape[0]):
                yield f"{base}{e}.down_proj.weight", tensor[e]
        else:
            yield name, tensor


def fused_experts(name: str, names: Container[str], read: Callable[[str], torch.Tensor]):
    """The fused experts tensor ``name`` (``...mlp.experts.gate_up_proj`` or ``down_proj``)
    built from a checkpoint's per-expert tensors (``names`` holds them, ``read`` reads one),
    stacked as transformers 5 loads them; None when ``name`` is no fused name or the
    checkpoint has no per-expert tensors for it. One fused tensor in memory at a time (plus
    one expert's): a loader that streams tensor by tensor never holds the whole model."""
    if name.endswith(FUSED_GATE_UP):
        base, parts = name[: -len("gate_up_proj")], ("gate_proj", "up_proj")
    elif name.endswith(FUSED_DOWN):
        base, parts = name[: -len("down_proj")], ("down_proj",)
    else:
        return None
    count = 0
    while f"{base}{count}.{parts[0]}.weight" in names:
        count += 1
    if not count:
        return None
    first = [read(f"{base}0.{part}.weight") for part in parts]
    rows = sum(t.shape[0] for t in first)
    out = torch.empty((count, rows, first[0].shape[1]), dtype=first[0].dtype)
    for e in range(count):
        pieces = first if e == 0 else [read(f"{base}{e}.{part}.weight") for part in parts]
        torch.cat(pieces, dim=0, out=out[e])
    return out


#: The attribute a model's converting ``load_weights`` is marked with.
_MARK = "_crossrl_per_expert"


def split_fused_experts(model) -> None:
    """Make ``model.load_weights`` (a vLLM model's, on the instance) take transformers' fused
    expert names, split by ``per_expert`` before its own loader sees them. Every path that
    loads a push calls ``model.load_weights`` (vLLM's worker and weight-transfer engines,
    crossrl's worker extension and transfer engines); ``loaded_names.watch`` wraps this one
    and puts it back. Once per model; a model without ``load_weights`` is left alone."""
    original = getattr(model, "load_weights", None)
    if original is None or getattr(original, _MARK, False):
        return

    def load_weights(weights: Iterable, *args, **kwargs):
        return original(per_expert(weights), *args, **kwargs)

    setattr(load_weights, _MARK, True)
    vars(model)["load_weights"] = load_weights
