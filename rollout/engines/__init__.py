"""Generation engines behind one interface (see base.py).

``make_engine("hf", model, tokenizer)`` runs anywhere (the CPU default);
``make_engine("vllm", model_dir, tokenizer, ...)`` needs vLLM (or vllm-ascend) and is imported
only when asked for, so importing this package never imports vllm.
"""

from __future__ import annotations

from rollout.engines.base import Engine, GenerationRequest, GenerationResult, SamplingParams

__all__ = [
    "ENGINES",
    "Engine",
    "GenerationRequest",
    "GenerationResult",
    "SamplingParams",
    "make_engine",
]

ENGINES = ("hf", "vllm")


def make_engine(name: str, model, tokenizer=None, **opts) -> Engine:
    """Build an engine by name.

    ``hf``: ``model`` is a loaded ``PreTrainedModel`` or a path/``builtin:<name>`` loaded with
    ``rollout.models.load_model`` (``dtype``, ``seed``, ``device`` taken from ``opts``); other opts
    go to ``HFEngine``. ``vllm``: ``model`` and ``opts`` go to ``VLLMEngine`` unchanged.
    """
    if name == "hf":
        from rollout.engines.hf.engine import HFEngine

        if not hasattr(model, "config"):
            from rollout.models import load_model

            model = load_model(
                model,
                dtype=opts.pop("dtype", "float32"),
                seed=opts.pop("seed", 0),
                device=opts.pop("device", "cpu"),
            )
        return HFEngine(model, tokenizer, **opts)
    if name == "vllm":
        from rollout.engines.vllm.engine import VLLMEngine

        return VLLMEngine(model, tokenizer, **opts)
    raise ValueError(f"rollout.engine={name!r}: use one of {list(ENGINES)}")
