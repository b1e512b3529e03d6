"""Does a shipped config's update fit the card? One real actor update at a published shape
cut to as many decoder layers as the budget says one card holds, measured against the budget.

    python -m bench.device_budget [--config configs/gpu/qwen2.5-7b-grpo.yaml] [--layers L]
                                  [--json FILE] [key=value ...]

The config's keys, at ``train.dp_size=1`` and ``algorithm.kl_coef=0`` (the actor alone on the
card: no reference, whose weights sit in another process), on the device the config names.
Without ``--layers``: the most layers of ``model.path``'s shape (a published Qwen2.5 name or a
local directory's ``config.json``) whose update-phase estimate
(``trainer.loop.plan.memory_budget.estimate_memory``, what ``crossrl layout`` prints) is at most
``FILL`` of the device. The layer count is a model-config field, so the cut model is the
published architecture, shallower.

Measured (for real, on the device): the shipped ``PolicyWorker`` built as the trainer builds it
(meta device, FSDP2, fp32 master weights, the config's compute dtype, activation checkpointing,
lean log-probs), its weights random on the device (nothing read from disk: the weights are
materialised in place, normal(0, 0.02), where the trainer would load them), then what a step's
update does (``trainer.loop.ranks.memory_tracker``'s batch: two mini-batches of two micro-batches of
the budget's micro-batch tokens, the AdamW step and its state's first allocation). The peak is
the allocator's (``max_memory_allocated``, and ``max_memory_reserved`` where the device has
one), reset just before the update. The estimate compared is the update phase without the
engine (asleep off the card) and the device context (the allocator does not see it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path

__all__ = ["FILL", "estimate_update_bytes", "measure", "pick_layers"]

#: The share of the device the picked layer count's update estimate may fill.
FILL = 0.85
DEFAULT_CONFIG = "configs/gpu/qwen2.5-7b-grpo.yaml"
#: One rank, one card, the actor alone (the engine's tensor parallelism must divide dp 1).
ONE_CARD = (
    "train.dp_size=1",
    "rollout.tensor_parallel_size=1",
    "algorithm.kl_coef=0",
    "algorithm.use_kl_loss=false",
)


def _config(path: str, overrides: list[str]):
    from trainer.config import load_config

    return load_config(
        path,
        [*overrides, *ONE_CARD],
        check_environment=False,
    )


def estimate_update_bytes(cfg, shape, device_bytes: float) -> float:
    """The budget's update phase for ``cfg`` at ``shape``, less the engine and the context."""
    from trainer.loop.plan.memory_budget import estimate_memory

    budget = estimate_memory(cfg, shape, device_bytes, device=_device_name(cfg))
    update = budget.phase("update")
    return update.total - update.parts.get("engine", 0.0) - update.parts.get("ctx", 0.0)


def _device_name(cfg) -> str:
    import hal

    return hal.available_backends()[0] if cfg.device == "auto" else cfg.device


def _cut_shape(shape_config: dict, layers: int, root: Path):
    from trainer.loop.plan.model_shape import model_shape
    from trainer.loop.ranks.memory_tracker import _model_dir

    directory = _model_dir(shape_config, layers, root / f"layers-{layers}")
    return directory, model_shape(str(directory))


def pick_layers(cfg, device_bytes: float, root: Path, fill: float = FILL) -> int:
    """The most decoder layers of ``cfg``'s model shape whose update estimate is at most
    ``fill`` of ``device_bytes``; raises ValueError when not even one layer fits."""
    from trainer.loop.ranks.memory_tracker import _shape_config

    shape_config = _shape_config(cfg)
    best = 0
    for layers in range(1, shape_config["num_hidden_layers"] + 1):
        _, shape = _cut_shape(shape_config, layers, root)
        if estimate_update_bytes(cfg, shape, device_bytes) > fill * device_bytes:
            break
        best = layers
    if best == 0:
        raise ValueError(
            f"model.path={cfg.model.path!r}: even one decoder layer's update is estimated above "
            f"{fill:.0%} of {device_bytes / 1e9:.1f} GB; lower train.max_tokens_per_micro_batch"
        )
    return best


@contextlib.contextmanager
def _random_weights_in_place():
    """``ModelLoading._load_initial_weights`` replaced by random weights made on the device."""
    import torch

    from rollout.models import reset_non_persistent_buffers
    from trainer.loop.ranks import model_loading

    def materialise(self, model, own):
        tied = model_loading.tied_parameter_names(model)
        model.to_empty(device=self.device)
        model_loading.retie(model, tied)
        reset_non_persistent_buffers(model, self.device)
        with torch.no_grad():
            for param in model.parameters():
                param.normal_(0.0, 0.02)

    cls = model_loading.ModelLoading
    saved = cls.__dict__["_load_initial_weights"]
    cls._load_initial_weights = materialise
    try:
        yield
    finally:
        cls._load_initial_weights = saved


def measure(cfg, layers: int, root: Path) -> dict:
    """One update of ``cfg`` at its shape cut to ``layers`` layers, for real on ``cfg``'s
    device: peak bytes allocated (and reserved) against the estimate (module docstring)."""
    import numpy as np

    import hal
    from trainer.loop.cluster.group import free_port
    from trainer.loop.plan.rank_memory import micro_batch_tokens
    from trainer.loop.ranks.memory_tracker import _batch, _shape_config
    from trainer.loop.ranks.policy import PolicyWorker
    from trainer.loop.ranks.spec import WorkerSpec

    directory, shape = _cut_shape(_shape_config(cfg), layers, root)
    cfg = cfg.model_copy(deep=True)
    cfg.model.path = str(directory)
    cfg.train.share_prompts = False  # the rows share no prompt; the budget counts every token
    backend = hal.get_backend(cfg.device)
    device_bytes = float(hal.device_total_memory(backend.name) or 0) or None
    tokens = micro_batch_tokens(cfg)
    batch, groups = _batch(cfg, tokens, 4)
    everything = list(range(batch.num_rows))
    zeros = np.zeros(batch.num_tokens, np.float32)
    module = backend.device_module()
    with _random_weights_in_place():
        worker = PolicyWorker(WorkerSpec(role="actor", rank=0, cfg=cfg))
        try:
            worker.setup("127.0.0.1", free_port())
            worker.load_batch([batch.to_numpy()])
            for name in ("old_logprobs", "ref_logprobs"):
                worker.set_token_field(name, [(np.arange(batch.num_rows), zeros)])
            worker.compute_advantages(mismatch=False)
            resident = backend.memory_stats()["allocated"] if backend.is_accelerator else None
            backend.reset_peak_memory()
            for m in range(2):
                worker.train_mini_batch(
                    groups[2 * m : 2 * m + 2], everything, old_from_update=m == 0
                )
            backend.synchronize()
            allocated = backend.peak_memory_bytes()
            reserved = (
                int(module.max_memory_reserved())
                if hasattr(module, "max_memory_reserved")
                else None
            )
        finally:
            worker.shutdown()
    estimate = estimate_update_bytes(cfg, shape, device_bytes or 80e9)
    return {
        "device": backend.name,
        "device_names": backend.device_names(),
        "device_memory_gb": None if device_bytes is None else device_bytes / 1e9,
        "layers": layers,
        "params": shape.num_params,
        "micro_batch_tokens": tokens,
        "resident_before_update_gb": None if resident is None else resident / 1e9,
        "peak_allocated_gb": allocated / 1e9,
        "peak_reserved_gb": None if reserved is None else reserved / 1e9,
        "estimate_gb": estimate / 1e9,
        "estimate_over_allocated": estimate / allocated,
        "estimate_over_reserved": None if not reserved else estimate / reserved,
    }


def format_result(res: dict) -> str:
    """One paragraph for docs/gpu.md."""
    reserved = res["peak_reserved_gb"]
    return (
        f"{res['device']} ({', '.join(res['device_names'])}): {res['layers']} layers, "
        f"{res['params'] / 1e9:.2f}e9 parameters, micro-batch {res['micro_batch_tokens']:,} "
        f"tokens\n"
        f"  peak allocated {res['peak_allocated_gb']:.2f} GB"
        + ("" if reserved is None else f", reserved {reserved:.2f} GB")
        + f"; the budget's update (no engine, no context) {res['estimate_gb']:.2f} GB\n"
        f"  estimate / allocated {res['estimate_over_allocated']:.2f}"
        + (
            ""
            if res["estimate_over_reserved"] is None
            else f", estimate / reserved {res['estimate_over_reserved']:.2f}"
        )
    )


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=DEFAULT_CONFIG)
    parser.add_argument("--layers", type=int, help="decoder layers (default: the most that fit)")
    parser.add_argument("--device-memory-gb", type=float, help="size the layer pick for this")
    parser.add_argument("--json", type=Path)
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args(argv)
    import hal

    try:
        cfg = _config(args.config, args.overrides)
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            layers = args.layers
            if layers is None:
                name = _device_name(cfg)
                memory = (
                    args.device_memory_gb * 1e9
                    if args.device_memory_gb
                    else hal.device_total_memory(name)
                )
                if memory is None:
                    raise ValueError(f"device={name}: its memory is unknown; pass --layers")
                layers = pick_layers(cfg, memory, root)
            res = measure(cfg, layers, root)
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"device_budget: {exc}", file=sys.stderr)
        return 2
    print(format_result(res))
    if args.json is not None:
        args.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
