"""The routers of a mixture-of-experts model under crossrl's control: the experts each token
goes to can be recorded (what an engine returns), replayed (routing replay, R3: the trainer
routes as the engine that sampled did) and reused by an activation-checkpoint recompute (which
must route as the forward it recomputes did, or its gradients are wrong).

``control_routers(model)`` gives each router of a supported family (softmax in float32, top-k,
renormalised when ``norm_topk_prob``: transformers' Qwen3-MoE, Qwen2-MoE and OLMoE routers) a
forward of its own. With no routing context it returns what the family's own forward returns,
to the bit: the top-k values are the softmax gathered at the top-k experts. The contexts, set
per thread (an engine and a trainer may share a process):

- ``recording(sink)``: each router call appends its choice (``[N, K]`` expert ids) to ``sink``;
- ``replaying(RouterPass(routes))``: each MoE layer takes the given experts (``routes``
  ``[L, K, N]``, expert id + 1, 0 where a token has none and routes itself); its weights are
  its own softmax at those experts, renormalised as the family does, so gradients reach the
  router as usual; ``flips`` counts, per token, the MoE layers whose own top-k set differs
  from the given one;
- ``checkpoint_contexts`` (torch.utils.checkpoint's ``context_fn``): the forward records each
  router's choice, the recompute takes it back.

Routes are stored as expert id + 1 in int16 (``ROUTE_DTYPE``), so 0 means "no route" and the
zeros a padding row is filled with route nothing.
"""

from __future__ import annotations

import contextlib
import threading
import types
from collections.abc import Iterator

import numpy as np
import torch
import torch.nn.functional as F

__all__ = [
    "ROUTE_DTYPE",
    "ROUTER_CLASSES",
    "RouterPass",
    "checkpoint_contexts",
    "control_routers",
    "moe_layer_indices",
    "moe_routers",
    "prompt_routes",
    "recording",
    "replaying",
    "step_routes",
]

#: Router classes whose forward is softmax (float32), top-k, renormalised per
#: ``norm_topk_prob``, scores cast to the logits' dtype (read in transformers 5.24).
ROUTER_CLASSES = ("Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter", "OlmoeTopKRouter")

#: dtype of stored routes (expert id + 1; 0 = none): every expert count up to 32,766.
ROUTE_DTYPE = torch.int16

_STATE = threading.local()


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    return list(layers) if layers is not None else []


def is_moe(model: torch.nn.Module) -> bool:
    """Whether ``model``'s config declares routed experts (any family)."""
    config = getattr(model, "config", None)
    return any(
        getattr(config, key, 0) for key in ("num_experts", "num_local_experts", "n_routed_experts")
    )


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The supported routers of ``model``'s MoE layers (``layer.mlp.gate``), in layer order;
    dense layers have none."""
    routers = []
    for layer in _decoder_layers(model):
        gate = getattr(getattr(layer, "mlp", None), "gate", None)
        if gate is not None and type(gate).__name__ in ROUTER_CLASSES:
            routers.append(gate)
    return routers


def moe_layer_indices(model: torch.nn.Module, *, required: str | None = None) -> list[int]:
    """The decoder-layer indices of ``model``'s supported routers (the rows of vLLM's
    per-layer routing that crossrl keeps); ``required`` as ``control_routers``'s."""
    _check_supported(model, required)
    return [
        i
        for i, layer in enumerate(_decoder_layers(model))
        if type(getattr(getattr(layer, "mlp", None), "gate", None)).__name__ in ROUTER_CLASSES
    ]


def _check_supported(model: torch.nn.Module, required: str | None) -> None:
    if required is None or not is_moe(model):
        return
    layers = _decoder_layers(model)
    gates = [getattr(getattr(x, "mlp", None), "gate", None) for x in layers]
    expected = sum(getattr(getattr(x, "mlp", None), "experts", None) is not None for x in layers)
    supported = sum(type(g).__name__ in ROUTER_CLASSES for g in gates)
    if not supported or supported != expected:
        found = sorted({type(g).__name__ for g in gates})
        raise ValueError(
            f"{required}: {type(model).__name__}'s routers ({', '.join(found)}) are not ones "
            f"crossrl replays ({', '.join(ROUTER_CLASSES)}); set algorithm.routing_replay=none"
        )


def control_routers(model: torch.nn.Module, *, required: str | None = None) -> int:
    """Give every supported router of ``model`` the controlled forward (module docstring);
    returns how many MoE layers it covers. ``required`` (a config key, e.g.
    ``algorithm.routing_replay=rollout``): a mixture whose routers are not all supported
    raises, naming it, instead of training unreplayed."""
    _check_supported(model, required)
    routers = moe_routers(model)
    for index, router in enumerate(routers):
        router.crossrl_moe_layer = index
        router.forward = types.MethodType(_routed_forward, router)
    return len(routers)


def _routed_forward(self, hidden_states: torch.Tensor):
    """A supported router's forward, its choice of experts taken from the thread's context."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = F.linear(hidden_states, self.weight)
    probs = torch.softmax(logits, dtype=torch.float, dim=-1)
    chosen = _choose(self.crossrl_moe_layer, probs, self.top_k)
    router_pass: RouterPass | None = getattr(_STATE, "replay", None)
    if router_pass is not None and router_pass.weights is not None:
        if getattr(_STATE, "reuse", None) is None:  # the forward's loads, not a recompute's
            router_pass.add_loads(probs, chosen)
    scores = probs.gather(-1, chosen)
    if self.norm_topk_prob:
        scores = scores / scores.sum(dim=-1, keepdim=True)
    return logits, scores.to(logits.dtype), chosen


def _choose(layer: int, probs: torch.Tensor, top_k: int) -> torch.Tensor:
    reuse = getattr(_STATE, "reuse", None)
    if reuse is not None:  # a checkpoint's recompute: the forward's own choice
        return next(reuse)
    chosen = torch.topk(probs.detach(), top_k, dim=-1).indices  # ids only: nothing saved
    replay: RouterPass | None = getattr(_STATE, "replay", None)
    if replay is not None and replay.routes is not None:
        given = replay.routes[layer].to(probs.device, torch.long).transpose(0, 1) - 1  # [N, K]
        has = given[:, 0] >= 0
        differs = (chosen.sort(-1).values != given.sort(-1).values).any(-1) & has
        replay.flips = replay.flips + differs.to(torch.float32)
        if replay.enforce:
            chosen = torch.where(has[:, None], given, chosen)
    sink = getattr(_STATE, "record", None)
    if sink is not None:
        sink.append(chosen)
    return chosen


def step_routes(sink: list[torch.Tensor], rows: int) -> np.ndarray:
    """One forward's recorded choices (``sink``: one ``[rows * width, K]`` per MoE layer) as
    int16 ``[rows, width, layers, K]``, expert id + 1: what an engine returns."""
    stacked = torch.stack(sink, dim=1).to("cpu", ROUTE_DTYPE) + 1  # [N, L, K]
    return stacked.reshape(rows, -1, *stacked.shape[1:]).numpy()


def prompt_routes(sink: list[torch.Tensor], lens: list[int], head: int) -> list[np.ndarray]:
    """Each prompt's routes from an engine prefill's recorded choices: an optional shared head
    (one forward of ``head`` tokens, its ``L`` choices first in ``sink``) then the prompts'
    rests, left-padded to one width (``L`` more); ``lens`` the prompts' lengths. int16
    ``[len, layers, K]`` per prompt, expert id + 1."""
    layers = len(sink) // (2 if head else 1)
    rests = step_routes(sink[-layers:], len(lens))  # [B, width, L, K]
    shared = step_routes(sink[:layers], 1)[0] if head else None
    out = []
    for b, length in enumerate(lens):
        rest = rests[b, rests.shape[1] - (length - head) :]
        out.append(rest if shared is None else np.concatenate([shared, rest]))
    return out


class RouterPass:
    """What one trainer forward asks of a mixture's routers, and what they report.

    ``routes`` (``[L, K, N]``, expert id + 1, on the model's device; None: route freely): the
    engine's routing, replayed (``enforce``) or only compared; ``flips`` counts, per token,
    the MoE layers whose own top-k differed (float32 ``[N]``; 0 where a token had no route).
    ``weights`` (float32 ``[N]``; None: no loads): how many of the batch's real tokens each
    position stands for (0 for padding; a prompt shared by several rows and run once counts
    for each of them), by which each layer reports its expert loads for the load-balancing
    loss: ``counts`` (top-k slots per expert, no gradient) and ``prob_sums`` (router
    probabilities summed per expert, with gradient), one ``[E]`` per MoE layer."""

    def __init__(
        self,
        routes: torch.Tensor | None = None,
        *,
        enforce: bool = True,
        weights: torch.Tensor | None = None,
    ) -> None:
        if routes is not None and routes.dim() != 3:
            raise ValueError(
                f"routes has shape {tuple(routes.shape)}; expected [layers, top_k, tokens]"
            )
        self.routes, self.enforce, self.weights = routes, enforce, weights
        self.flips: torch.Tensor | float = 0.0
        self.per_target: torch.Tensor | None = None  # set by the trainer's forward
        self._raw: list[tuple[torch.Tensor, torch.Tensor]] = []  # (probs, chosen) per layer

    def in_layout(self, index: torch.Tensor, multiplicity: torch.Tensor) -> None:
        """Take the tokens at ``index`` (a shared-prompt layout's ``token_index``), each
        standing for ``multiplicity`` tokens of the usual layout."""
        if self.routes is not None:
            self.routes = self.routes.index_select(-1, index.to(self.routes.device))
        if self.weights is not None:
            taken = self.weights.index_select(0, index.to(self.weights.device))
            self.weights = taken * multiplicity.to(taken)

    def flip_share(self, num_tokens: int, device: torch.device) -> torch.Tensor:
        """Per token, the share of MoE layers whose own choice differed (float32 ``[N]``)."""
        flips = self.flips
        if self.routes is None or not isinstance(flips, torch.Tensor):
            return torch.zeros(num_tokens, dtype=torch.float32, device=device)
        return flips.to(device) / max(int(self.routes.shape[0]), 1)

    def add_loads(self, probs: torch.Tensor, chosen: torch.Tensor) -> None:
        """One MoE layer's router output (``probs`` ``[N, E]``, ``chosen`` ``[N, K]``), kept
        as it is: the loads are computed after the forward (``loads``), so a checkpointed
        layer's forward runs no operation its recompute would not."""
        self._raw.append((probs, chosen))

    def loads(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per MoE layer, the ``weights``-weighted top-k slots per expert (no gradient) and
        router probabilities summed per expert (with gradient): ``(counts, prob_sums)``."""
        counts, prob_sums = [], []
        for probs, chosen in self._raw:
            weights = self.weights.to(probs.device, torch.float32)
            slots = weights.repeat_interleave(chosen.shape[-1])
            per_expert = torch.bincount(chosen.reshape(-1), slots, minlength=probs.shape[-1])
            counts.append(per_expert.float())
            prob_sums.append((probs * weights[:, None]).sum(0))
        return counts, prob_sums


@contextlib.contextmanager
def _setting(name: str, value) -> Iterator:
    before = getattr(_STATE, name, None)
    setattr(_STATE, name, value)
    try:
        yield value
    finally:
        setattr(_STATE, name, before)


def recording(sink: list[torch.Tensor]) -> contextlib.AbstractContextManager:
    """Each router call in this thread appends its chosen experts (``[N, K]``) to ``sink``."""
    return _setting("record", sink)


def replaying(replay: RouterPass | None) -> contextlib.AbstractContextManager:
    """Each MoE layer in this thread routes as ``replay.routes`` says (module docstring),
    counts into ``replay.flips`` the layers whose own choice differed and reports its loads
    when ``replay.real`` is given. ``None``: the routers route freely."""
    if replay is None:
        return contextlib.nullcontext(None)
    return _setting("replay", replay)


class _Recompute:
    """The recompute side of ``checkpoint_contexts``: the forward's choices, in order."""

    def __init__(self, saved: list[torch.Tensor]) -> None:
        self.saved = saved
        self.inner: contextlib.AbstractContextManager | None = None

    def __enter__(self):
        self.inner = _setting("reuse", iter(list(self.saved)))
        return self.inner.__enter__()

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)


def checkpoint_contexts() -> tuple[contextlib.AbstractContextManager, _Recompute]:
    """``torch.utils.checkpoint``'s ``context_fn``: in the forward every router's choice is
    recorded (besides any replay or outer recording), in the recompute taken back in order, so
    a checkpointed layer routes in backward exactly as it did in the forward."""
    saved: list[torch.Tensor] = []
    return _Chained(saved), _Recompute(saved)


class _Chained:
    """The forward side of ``checkpoint_contexts``: records into ``saved`` and into the
    thread's outer sink, if any."""

    def __init__(self, saved: list[torch.Tensor]) -> None:
        self.saved = saved
        self.inner: contextlib.AbstractContextManager | None = None

    def __enter__(self):
        outer = getattr(_STATE, "record", None)
        sink = self.saved if outer is None else _Tee(self.saved, outer)
        self.inner = _setting("record", sink)
        return self.inner.__enter__()

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)


class _Tee:
    """Appends to two lists."""

    def __init__(self, first: list, second: list) -> None:
        self.first, self.second = first, second

    def append(self, value) -> None:
        """Append ``value`` to both."""
        self.first.append(value)
        self.second.append(value)
