"""crossrl's requests and results in vLLM's terms (pure: no vLLM import): one request's
``vllm.SamplingParams`` keywords, whether its top-k / top-p filters renormalise vLLM's
log-probs, and one ``CompletionOutput`` as a ``GenerationResult`` (``rollout.engines.vllm.engine``
sends and reads them).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rollout.engines.base import GenerationResult, SamplingParams

# vLLM's "top-k off" value: -1, which every pinned vLLM accepts (0 also means off in 0.24 and
# 0.32).
VLLM_TOP_K_OFF = -1


def vllm_sampling_kwargs(
    sampling: SamplingParams, seed: int, max_new_tokens: int | None = None
) -> dict[str, Any]:
    """Keyword arguments for ``vllm.SamplingParams`` for one request (pure, no vllm import).

    ``max_tokens`` counts new tokens: the request's own ``max_new_tokens`` when given
    (``GenerationRequest.budget``), else the call's. Only ``stop_token_ids`` end a sequence (``ignore_eos``):
    the EOS id is not implicit, exactly as in the HF engine, so callers list it when they want
    it. ``logprobs=0`` asks for the sampled token's logprob only; ``detokenize=False`` because
    crossrl works on token ids and the engine starts without a tokenizer.
    """
    return {
        "n": 1,
        "max_tokens": int(sampling.max_new_tokens if max_new_tokens is None else max_new_tokens),
        "temperature": float(sampling.temperature),
        "top_p": float(sampling.top_p),
        "top_k": int(sampling.top_k) if sampling.top_k > 0 else VLLM_TOP_K_OFF,
        "seed": int(seed),
        "stop_token_ids": [int(t) for t in sampling.stop_token_ids],
        "ignore_eos": True,
        "logprobs": 0,
        "detokenize": False,
        "skip_special_tokens": False,
    }


def filters_active(sampling: SamplingParams, vocab_size: int | None = None) -> bool:
    """True when top-k or top-p removes tokens, i.e. vLLM's logprobs are renormalised."""
    top_k_on = sampling.top_k > 0 and (vocab_size is None or sampling.top_k < vocab_size)
    return top_k_on or sampling.top_p < 1.0


def crossrl_routes(routes: Any, moe_layers: list[int]) -> np.ndarray:
    """vLLM's ``CompletionOutput.routed_experts`` (``[tokens, num_hidden_layers, top_k]``
    expert ids, one row per decoder layer, dense ones included: read in 0.24's
    ``routed_experts_capturer``) as crossrl's routes: the MoE layers' rows (``moe_layers``,
    decoder-layer indices), int16 expert id + 1 (``rollout.moe_routing``)."""
    routes = np.asarray(routes)
    if routes.ndim != 3 or (moe_layers and max(moe_layers) >= routes.shape[1]):
        raise RuntimeError(
            f"vLLM returned routed_experts of shape {routes.shape}; expected [tokens, layers, "
            f"top_k] with a row for each of the decoder layers {moe_layers}"
        )
    return routes[:, moe_layers, :].astype(np.int16) + 1


def result_from_vllm_completion(
    completion: Any, interrupted: bool = False, moe_layers: list[int] | None = None
) -> GenerationResult:
    """Map one vLLM ``CompletionOutput`` (duck-typed: ``token_ids``, ``logprobs``,
    ``finish_reason``, ``stop_reason``) to a ``GenerationResult``.

    ``logprobs`` must hold, per generated token, a mapping ``token_id -> Logprob`` (an object with
    ``.logprob``) or ``token_id -> float`` that contains the sampled token. vLLM's finish reasons
    ``stop`` and ``length`` pass through; anything else (``abort``, ``None``) raises
    ``RuntimeError``, since an unfinished sequence must never reach the trainer, unless
    ``interrupted`` (the caller ended the call: ``interrupted``, continued by the caller).
    """
    token_ids = [int(t) for t in completion.token_ids]
    reason = completion.finish_reason
    if interrupted and reason not in ("stop", "length"):
        reason = "interrupted"
    if reason not in ("stop", "length", "interrupted"):
        raise RuntimeError(
            f"vLLM returned finish_reason={reason!r} after {len(token_ids)} tokens; expected "
            "'stop' or 'length' (was the request aborted or the engine put to sleep?)"
        )
    per_token = completion.logprobs
    if per_token is None or len(per_token) != len(token_ids):
        got = None if per_token is None else len(per_token)
        raise RuntimeError(
            f"vLLM returned {got} logprob entries for {len(token_ids)} tokens; the request "
            "must ask for logprobs=0 (see vllm_sampling_kwargs)"
        )
    logprobs = []
    for pos, (tok, entry) in enumerate(zip(token_ids, per_token)):
        if tok not in entry:
            raise RuntimeError(f"vLLM logprobs at position {pos} lack the sampled token {tok}")
        value = entry[tok]
        logprobs.append(float(getattr(value, "logprob", value)))
    extra = {}
    if completion.stop_reason is not None:
        extra["stop_reason"] = completion.stop_reason
    routes = getattr(completion, "routed_experts", None)
    if moe_layers is not None and routes is not None:
        extra["routed_experts"] = crossrl_routes(routes, moe_layers)
    return GenerationResult(
        token_ids=token_ids, logprobs=logprobs, finish_reason=reason, extra=extra
    )
