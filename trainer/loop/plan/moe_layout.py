"""The experts of a mixture-of-experts model, read from its ``config.json`` (transformers'
names) for the memory budget (``trainer.loop.plan.model_shape``): how many layers hold experts, how
many experts each has and how wide they are, the router, the shared experts, and how many
experts a token goes through. Pure: reads a dict; no torch.

Counted (``COUNTED``), each checked parameter for parameter against transformers' own model
built from the same config on the meta device (``tests/test_moe_budget.py``):

- ``qwen2_moe``: ``num_experts`` of ``moe_intermediate_size``, a shared expert of
  ``shared_expert_intermediate_size`` with its one-output gate; a layer is dense (an MLP of
  ``intermediate_size``) when its index is in ``mlp_only_layers`` or ``(index + 1)`` is no
  multiple of ``decoder_sparse_step``;
- ``qwen3_moe``: the same rule, no shared expert;
- ``mixtral``: ``num_local_experts`` of ``intermediate_size`` in every layer;
- ``olmoe``: ``num_experts`` of ``intermediate_size`` in every layer;
- ``glm4_moe`` (DeepSeek's layout with grouped-query attention): ``n_routed_experts`` of
  ``moe_intermediate_size`` and ``n_shared_experts`` shared ones of the same width; the first
  ``first_k_dense_replace`` layers are dense.

Every counted router is one ``[experts, hidden]`` weight. Any other config with experts (a key
ending in ``experts`` above 0, at its top or in a nested config such as ``text_config``) raises
``ModelShapeError`` naming the model type: a dense count would leave out the experts' weights,
gradients and optimizer state (DeepSeek V2/V3's multi-head latent attention, for one, is not
counted).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["COUNTED", "Experts", "ModelShapeError", "experts_of"]

#: The mixture-of-experts model types whose layout the budget counts (the module docstring).
COUNTED = ("qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "glm4_moe")


class ModelShapeError(ValueError):
    """A ``config.json`` whose model the memory budget cannot count: one line naming the
    file, the model type and what is counted."""


@dataclass(frozen=True)
class Experts:
    """The mixture-of-experts part of a decoder: ``sparse_layers`` of its layers hold
    ``count`` routed experts of ``intermediate_size`` each (gate, up, down), a router, and
    shared experts of ``shared_intermediate_size`` in all (0: none) that every token goes
    through; a token goes through ``per_token`` routed experts. The other layers are dense
    MLPs of the model's ``intermediate_size``."""

    count: int
    per_token: int
    intermediate_size: int
    sparse_layers: int
    shared_intermediate_size: int = 0
    shared_gate: bool = False  # qwen2_moe: a one-output gate of the shared expert, [1, hidden]

    def backward_bytes(self, tokens: int, hidden: int, param_bytes: int) -> float:
        """Bytes a sparse layer's MLP holds at the peak of its backward, for ``tokens`` tokens
        in ``param_bytes``-byte floats (where a dense MLP holds six ``[T, i]`` tensors,
        ``rank_memory.recompute_bytes``): the router's float32 probabilities ``[T, E]``, and
        the routed experts' peak, the largest of three moments FSDPMemTracker sees in
        transformers' grouped experts (``tests/test_moe_budget.py``), with the shared experts'
        three saved ``[T, s]`` beside it (they run first, so their backward comes last and
        holds six). Per routed copy of a token (``T x k``): early, ``4 m + 6 h`` elements (the
        gathered input, the gate-up output, activation and product, the down output, their
        gradients); once the down projection's weight gradient exists, ``6 m + h`` beside it;
        at the end, the experts' weight gradients twice (the gradient of each transposed
        weight and its contiguous copy)."""
        routed, m = tokens * self.per_token, self.intermediate_size
        weights = self.count * hidden * m  # one projection of every expert
        peak = max(
            routed * (4 * m + 6 * hidden),
            weights + routed * (6 * m + hidden),
            2 * 3 * weights,
        )
        shared = tokens * self.shared_intermediate_size
        mlp = max(peak + 3 * shared, 6 * shared) * param_bytes
        return float(mlp + tokens * self.count * 4)

    def saved_bytes(self, tokens: int, hidden: int, param_bytes: int) -> float:
        """Bytes a sparse layer's MLP saves for its backward without activation checkpointing
        (a dense MLP's three ``[T, i]``): the shared experts' three ``[T, s]``, and per routed
        copy of a token its gathered input and down output (``2 h``) and the gate-up output,
        activation and product (``4 m``)."""
        routed = tokens * self.per_token
        own = routed * (2 * hidden + 4 * self.intermediate_size)
        return float((own + tokens * 3 * self.shared_intermediate_size) * param_bytes)


def _int(config: dict, key: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise KeyError(key)
    return value


#: The key of the routed experts' count per model type, then the alias transformers' config
#: class maps to it (a config saved by transformers 5.x may hold either).
COUNT_KEYS: dict[str, tuple[str, str]] = {
    "qwen2_moe": ("num_experts", "num_local_experts"),
    "qwen3_moe": ("num_experts", "num_local_experts"),
    "mixtral": ("num_local_experts", "num_experts"),
    "olmoe": ("num_experts", "num_local_experts"),
    "glm4_moe": ("n_routed_experts", "num_local_experts"),
}


def _qwen_sparse_layers(config: dict, layers: int, count: int) -> int:
    """Layers of a qwen2_moe / qwen3_moe holding experts (transformers' rule)."""
    only = set(config.get("mlp_only_layers") or [])
    step = _int(config, "decoder_sparse_step", 1) or 1
    if count == 0:
        return 0
    return sum(1 for i in range(layers) if i not in only and (i + 1) % step == 0)


def _counted(model_type: str, config: dict, layers: int) -> Experts:
    """The experts of a ``COUNTED`` model type; KeyError naming a missing or bad key."""
    per_token = _int(config, "num_experts_per_tok")
    key, alias = COUNT_KEYS[model_type]
    count = _int(config, key if key in config else alias)
    if model_type in ("qwen2_moe", "qwen3_moe"):
        shared = model_type == "qwen2_moe"
        return Experts(
            count=count,
            per_token=per_token,
            intermediate_size=_int(config, "moe_intermediate_size"),
            sparse_layers=_qwen_sparse_layers(config, layers, count),
            shared_intermediate_size=(
                _int(config, "shared_expert_intermediate_size") if shared else 0
            ),
            shared_gate=shared,
        )
    if model_type in ("mixtral", "olmoe"):
        return Experts(
            count=count,
            per_token=per_token,
            intermediate_size=_int(config, "intermediate_size"),
            sparse_layers=layers,
        )
    # glm4_moe
    width = _int(config, "moe_intermediate_size")
    dense = min(layers, _int(config, "first_k_dense_replace", 1))
    return Experts(
        count=count,
        per_token=per_token,
        intermediate_size=width,
        sparse_layers=layers - dense,
        shared_intermediate_size=width * _int(config, "n_shared_experts", 1),
    )


def _expert_key(config: dict, prefix: str = "") -> str | None:
    """The first ``key=value`` (dotted into nested configs) saying ``config`` has experts: a
    key ending in ``experts`` above 0, unless the config turns its experts off."""
    if config.get("is_moe") is False or config.get("enable_moe_block") is False:
        return None
    for key, value in config.items():
        if isinstance(value, dict):
            found = _expert_key(value, f"{prefix}{key}.")
            if found:
                return found
        elif (
            str(key).endswith("experts")
            and isinstance(value, int)
            and not isinstance(value, bool)
            and value > 0
        ):
            return f"{prefix}{key}={value}"
    return None


def experts_of(config: dict, source: str) -> Experts | None:
    """The experts of the model a ``config.json`` dict describes (``source``: where it was
    read, for the message); None for a dense model. Raises ``ModelShapeError`` for a model
    with experts whose type is not ``COUNTED`` or whose expert keys are missing or bad."""
    key = _expert_key(config)
    if key is None:
        return None
    model_type = config.get("model_type") or "(no model_type)"
    counted = ", ".join(COUNTED)
    if model_type not in COUNTED:
        raise ModelShapeError(
            f"{source}: model_type {model_type} is a mixture of experts ({key}) whose layout "
            f"the memory budget cannot count (it counts {counted}); a dense count would leave "
            "out the experts' weights, gradients and optimizer state: point model.path at a "
            "model of a counted type"
        )
    layers = _int(config, "num_hidden_layers", 0)
    try:
        return _counted(model_type, config, layers)
    except KeyError as err:
        raise ModelShapeError(
            f"{source}: model_type {model_type} has experts ({key}) but {err.args[0]}="
            f"{config.get(err.args[0])!r} is no count the memory budget can read: fix "
            "config.json"
        ) from None
