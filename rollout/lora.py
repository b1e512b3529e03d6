"""LoRA adapters on a causal LM, shared by the trainer's policy and the HF engine.

``inject`` puts peft's LoRA layers into the model in place (``peft.inject_adapter_in_model``:
the model keeps its class, its forward and its module tree; each target ``X`` becomes a peft
layer holding the frozen ``X.base_layer`` and the adapters ``X.lora_A.default`` (r x in) and
``X.lora_B.default`` (out x r)), works on the meta device (FSDP2 shards the model after it) and
leaves only the adapters trainable. The names it gives the model's state dict map back to the
Hugging Face checkpoint's by ``base_name``.

``initial_adapters``: the adapters' starting values, drawn from a seed (A as ``nn.Linear``
draws its weight, kaiming-uniform; B zero, so the policy starts as the base). ``adapters_off``:
a context in which the model is its base (the reference policy, with no second copy of the
decoder's weights; the embedding and LM head, when they train whole, swapped with copies of
their base values, ``base_copies``). ``fold``: Hugging Face weights with a checkpoint's
adapters folded in (``W + (alpha / r) B A``), for a merged export (engines take the adapters
unfolded). ``peft_names``: the adapter names peft's own files use (``save_pretrained``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch

__all__ = [
    "ADAPTER",
    "adapters_off",
    "base_copies",
    "base_digest",
    "base_name",
    "fold",
    "inject",
    "initial_adapters",
    "is_adapter",
    "peft_config",
    "peft_names",
    "target_problem",
    "trained_names",
    "write_adapter",
]

#: The one adapter a model carries (peft's default name).
ADAPTER = "default"
_A, _B = f".lora_A.{ADAPTER}.", f".lora_B.{ADAPTER}."


def is_adapter(name: str) -> bool:
    """Whether state-dict entry ``name`` is an adapter's (A or B)."""
    return _A in name or _B in name


def base_name(name: str) -> str:
    """The Hugging Face name of a model state-dict entry (``X.base_layer.weight`` ->
    ``X.weight``); an adapter's name is returned unchanged."""
    return name.replace(".base_layer.", ".")


def peft_config(
    rank: int, alpha: float, dropout: float, targets: Sequence[str], embeddings: bool = False
):
    """peft's ``LoraConfig`` for these settings (``embeddings``: the input embedding and the LM
    head train in full, ``modules_to_save`` in peft's files)."""
    from peft import LoraConfig

    return LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=list(targets),
        bias="none",
        modules_to_save=["embed_tokens", "lm_head"] if embeddings else None,
        # one tensor for a tied embedding and LM head, in peft's files as in the model
        ensure_weight_tying=embeddings,
    )


def inject(
    model: torch.nn.Module,
    rank: int,
    alpha: float,
    dropout: float,
    targets: Sequence[str],
    *,
    embeddings: bool = False,
) -> list[str]:
    """Put LoRA adapters of rank ``rank`` on the modules named ``targets`` (a module whose name
    ends with one), in place, and leave trainable only them (and, ``embeddings``, the input
    embedding and the LM head). Returns the trainable parameters' names. A name that matches
    no linear layer raises ValueError naming ``model.lora.target_modules``."""
    from peft import inject_adapter_in_model

    problem = target_problem(model, targets)  # peft refuses only when no target matches
    if problem:
        raise ValueError(problem)
    config = peft_config(rank, alpha, dropout, targets)  # modules_to_save: trained in place
    # On a meta-device model the adapters are made there at once: peft would make them on the
    # CPU and move them, which fake tensors (the memory tracker's) cannot swap.
    meta = next(model.parameters()).is_meta
    with torch.device("meta") if meta else contextlib.nullcontext():
        inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    trainable = []
    for name, param in model.named_parameters():
        train = is_adapter(name) or (embeddings and _is_embedding(name))
        param.requires_grad_(train)
        if train:
            trainable.append(name)
    return trainable


def _is_linear(module: torch.nn.Module) -> bool:
    # transformers' Conv1D (GPT-2's projections) is a linear layer with its weight transposed
    return isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"


def target_problem(model: torch.nn.Module, targets: Sequence[str]) -> str | None:
    """Why ``targets`` (``model.lora.target_modules``) cannot all take adapters on ``model``
    (the plain model, on the meta device or not), or None: each must match a linear layer as
    peft matches names (``check_target_module_exists``: the module's name, or its end after a
    dot). One line naming the key, the bad value and the linear layers the model has."""
    from peft.tuners.tuners_utils import check_target_module_exists

    modules = dict(model.named_modules())
    leaves = [n.rsplit(".", 1)[-1] for n, m in modules.items() if _is_linear(m)]
    have = ", ".join(n for n in dict.fromkeys(leaves) if n not in ("lm_head", "embed_tokens"))
    for target in targets:
        config = peft_config(1, 1.0, 0.0, [target])
        hits = [n for n in modules if n and check_target_module_exists(config, n)]
        if any(_is_linear(modules[n]) for n in hits):
            continue
        what = (
            f"names {type(modules[hits[0]]).__name__}, not a linear layer,"
            if hits
            else "matches no module"
        )
        return (
            f"model.lora.target_modules={list(targets)}: {target!r} {what} in "
            f"{type(model).__name__}; its linear layers are {have}: name some of them"
        )
    return _experts_problem(model, modules, targets)


#: The names a mixture's experts answer to in peft's targets: transformers 4's per-expert
#: projections, which peft maps onto transformers 5's fused experts weights.
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _experts_problem(model, modules: dict, targets: Sequence[str]) -> str | None:
    """Why ``targets`` cannot go on ``model``'s mixture layers, or None: peft (0.21) puts a
    target naming an expert projection on the fused experts weights themselves
    (``target_parameters``, its transformers-5 conversion), and crossrl neither pushes such
    adapters to the engines nor folds them yet."""
    from peft.tuners.tuners_utils import check_target_module_exists

    from hal.moe_experts import is_fused_experts

    experts = [n for n, m in modules.items() if is_fused_experts(m)]
    for target in targets:
        config = peft_config(1, 1.0, 0.0, [target])
        if any(
            check_target_module_exists(config, f"{container}.{projection}")
            for container in experts[:1]
            for projection in EXPERT_PROJECTIONS
        ):
            others = [t for t in targets if t not in EXPERT_PROJECTIONS] or ["q_proj", "v_proj"]
            return (
                f"model.lora.target_modules={list(targets)}: {target!r} also names the experts "
                f"of {type(model).__name__}'s mixture layers (peft would put adapters on their "
                "fused weights), which crossrl cannot push to the engines or fold yet; name "
                f"the other layers only, e.g. {others}"
            )
    return None


def trained_names(model: torch.nn.Module) -> set[str]:
    """Names of ``model``'s trainable parameters, each name of a tied one included (a tied LM
    head's ``lm_head.weight`` beside ``model.embed_tokens.weight``)."""
    return {n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}


def _is_embedding(name: str) -> bool:
    return name.endswith("embed_tokens.weight") or name.endswith("lm_head.weight")


def initial_adapters(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Starting values of every adapter of ``model`` (on the CPU, float32), the same for a
    given ``seed`` whatever the device: A kaiming-uniform as ``nn.Linear`` draws its weight, B
    zero (the policy starts as the base)."""
    generator = torch.Generator(device="cpu").manual_seed(int(seed))
    out = {}
    for name, tensor in model.state_dict().items():
        if _A in name:
            value = torch.empty(tuple(tensor.shape), dtype=torch.float32)
            torch.nn.init.kaiming_uniform_(value, a=math.sqrt(5), generator=generator)
            out[name] = value
        elif _B in name:
            out[name] = torch.zeros(tuple(tensor.shape), dtype=torch.float32)
    return out


def base_copies(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Frozen copies of the parameters of ``model`` that train whole beside the adapters (the
    embedding and LM head with ``model.lora.train_embeddings``; a tied pair once), by name,
    taken while they still hold the base's values: what ``adapters_off`` swaps in. An FSDP2
    parameter's copy is a DTensor of the same placement, so each rank holds its own shard."""
    _reshard(model)  # the sharded parameters, not what a forward left gathered
    return {
        name: param.detach().clone()
        for name, param in model.named_parameters()
        if param.requires_grad and not is_adapter(name)
    }


#: Rows of a tensor exchanged at a time by ``_swap`` (its temporary: this many rows).
_SWAP_ROWS = 4096


@torch.no_grad()
def _swap(param: torch.Tensor, other: torch.Tensor) -> None:
    """Exchange the values of ``param`` and ``other`` in place (this rank's shards of
    DTensors), a block of rows at a time: no whole third copy."""
    mine = param.to_local() if hasattr(param, "to_local") else param.data
    theirs = other.to_local() if hasattr(other, "to_local") else other
    for a, b in zip(mine.split(_SWAP_ROWS), theirs.split(_SWAP_ROWS)):
        held = a.clone()
        a.copy_(b)
        b.copy_(held)


def _reshard(model: torch.nn.Module) -> None:
    """Free what FSDP2 keeps gathered after a forward (the root's parameters, embedding and LM
    head, wait for a backward that a no-grad pass never runs), so the next forward gathers
    the shards as they are now."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


@contextmanager
def adapters_off(
    model: torch.nn.Module, base: Mapping[str, torch.Tensor] | None = None
) -> Iterator[None]:
    """Within it, ``model`` computes as its base: every adapter bypassed and, ``base`` given
    (``base_copies``), the parameters that train whole (the embedding and LM head) holding the
    base's values again, swapped in place with their copies; after it, as before, its adapters
    trainable again and the trained values back (the copies hold the base again)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    # peft's own switch (``enable_adapters``) also flips the adapters' requires_grad, which
    # FSDP2's sharded parameters should not see change between passes: the flag it reads
    # (``BaseTunerLayer.disable_adapters``, peft 0.21) is set alone.
    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    if base:
        # A forward must gather the base's values, not reuse the trained ones; and while
        # gathered, FSDP2 registers the whole parameters in place of the sharded ones.
        _reshard(model)
    params = dict(model.named_parameters())
    swapped = [(params[name], copy) for name, copy in (base or {}).items()]
    for param, copy in swapped:
        _swap(param, copy)
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer in layers:
            layer._disable_adapters = False
        if swapped:
            _reshard(model)
        for param, copy in swapped:
            _swap(param, copy)


def fold(
    base: Mapping[str, torch.Tensor], trained: Mapping[str, torch.Tensor], scale: float
) -> dict[str, torch.Tensor]:
    """Hugging Face weights ``base`` with a LoRA checkpoint's ``trained`` entries in: each
    target's weight plus ``scale x B A`` (in float32, back to its dtype), and the entries
    that trained whole (the embeddings) as they are."""
    out = dict(base)
    for name, tensor in trained.items():
        if _A in name:
            prefix = name.split(_A)[0]
            b, weight = trained[f"{prefix}{_B}weight"], out[f"{prefix}.weight"]
            folded = weight.float() + scale * (b.float() @ tensor.float())
            out[f"{prefix}.weight"] = folded.to(weight.dtype)
        elif not is_adapter(name):
            out[name] = tensor
    return out


def peft_names(state: Mapping[str, torch.Tensor], embeddings: bool) -> dict[str, torch.Tensor]:
    """The adapters of ``state`` (a model state dict, whole tensors) under the names peft's
    ``adapter_model.safetensors`` uses (``base_model.model.<module>.lora_A.weight``), and, with
    ``embeddings``, the input embedding and LM head as peft saves ``modules_to_save``."""
    out = {}
    for name, tensor in state.items():
        if is_adapter(name):
            out["base_model.model." + name.replace(f".{ADAPTER}.", ".")] = tensor
        elif embeddings and _is_embedding(name):
            out["base_model.model." + name] = tensor
    return out


#: Bytes of each end of a weights file that ``base_digest`` reads (beside its header).
_DIGEST_SAMPLE_BYTES = 1 << 20


def base_digest(path_or_name: str, seed: int = 0) -> str:
    """A digest of the base model's weight files (``model.path``; a ``builtin:`` model's
    files as ``seed`` writes them), which a LoRA checkpoint records: its adapters only fit the
    weights they trained on. Read cheaply, for models of any size: each safetensors file's
    name, size, header (every tensor's name, dtype, shape and offsets) and first and last MiB,
    not every byte."""
    import hashlib
    import struct

    from rollout.models import model_directory

    digest = hashlib.sha256()
    for file in sorted(model_directory(path_or_name, seed).glob("*.safetensors")):
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}:".encode())
        with open(file, "rb") as handle:
            head = handle.read(8)
            header = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
            digest.update(head + handle.read(min(header, size)))
            digest.update(handle.read(_DIGEST_SAMPLE_BYTES))
            handle.seek(max(0, size - _DIGEST_SAMPLE_BYTES))
            digest.update(handle.read())
    return digest.hexdigest()[:32]


def write_adapter(
    directory,
    trained: Mapping[str, torch.Tensor],
    config,
    *,
    embeddings: bool = False,
    dtype: torch.dtype = torch.float32,
) -> None:
    """A peft adapter directory, as peft's ``save_pretrained`` writes one: ``config`` (a
    ``peft_config``) as ``adapter_config.json`` and ``trained`` (model state-dict names, the
    adapters and, with ``embeddings``, the embedding and LM head) as
    ``adapter_model.safetensors`` in ``dtype``: what ``PeftModel.from_pretrained`` loads and
    vLLM serves."""
    import os

    from safetensors.torch import save_file

    config.save_pretrained(str(directory))
    tensors = {n: t.to(dtype).contiguous() for n, t in peft_names(trained, embeddings).items()}
    path = os.path.join(str(directory), "adapter_model.safetensors")
    save_file(tensors, path, metadata={"format": "pt"})
