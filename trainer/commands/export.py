"""``crossrl export RUN_DIR OUT_DIR [--step N]``: a run's trained actor as a Hugging Face model
directory that transformers (``AutoModelForCausalLM`` / ``AutoTokenizer``), vLLM and crossrl
itself (``model.path=OUT_DIR``) load.

What it writes: ``config.json`` and ``generation_config.json`` (from ``model.path``'s config),
the weights as safetensors in ``model.dtype`` of the run's ``config.yaml`` (shards plus
``model.safetensors.index.json`` above ``max_shard_mb``), and the tokenizer files the run
used (``rollout.tokenizer.save_tokenizer``: checked to tokenize like the run did). Weights come
from a committed checkpoint (``latest``, or ``--step N``), read whole in this one process from
the sharded files; no process group, no device. Everything is written into a staging
directory next to OUT_DIR and renamed onto it at the end: OUT_DIR is whole or absent.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from rollout.files import temp_sibling

if TYPE_CHECKING:
    import torch

#: The role whose model is exported: the policy.
ROLE = "actor"
#: Largest safetensors file, in MB (1e6 bytes): transformers' own default size.
DEFAULT_MAX_SHARD_MB = 5000.0


class ExportError(ValueError):
    """Bad export input (run dir, step, output dir); the message names it and the fix."""


def export_run(
    run_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    step: int | None = None,
    max_shard_mb: float = DEFAULT_MAX_SHARD_MB,
    merged: bool = False,
) -> Path:
    """Write the actor of ``run_dir``'s checkpoint ``step`` (None: ``latest``) as a Hugging Face
    model directory ``out_dir``, its weights in the run's ``model.dtype``, in safetensors files
    of at most ``max_shard_mb`` MB (1e6 bytes) each. Returns ``out_dir``.

    A LoRA run's checkpoint (``model.lora``) holds its adapters, not the base: they are
    written as a peft adapter directory (``adapter_config.json``, ``adapter_model.
    safetensors``, the tokenizer), or, ``merged``, folded into the base read from
    ``model.path`` and written as a whole model.

    Raises ExportError for a bad run dir, step or output dir (nothing is written then).
    """
    from rollout.models import parse_dtype

    run_dir = Path(run_dir).expanduser()
    cfg = _run_config(run_dir)
    lora = cfg.model.lora
    if merged and not lora.enabled:
        raise ExportError(
            f"--merged: {run_dir} trained the whole model (model.lora.rank=0), there are no "
            "adapters to fold in; export without --merged"
        )
    ckpt = _checkpoint(run_dir, step)
    out = _fresh_out_dir(out_dir)
    if not max_shard_mb > 0:
        raise ExportError(f"--max-shard-mb {max_shard_mb!r}: give a size in MB above 0, e.g. 5000")
    dtype = parse_dtype(cfg.model.dtype)

    from trainer.records.checkpoint import CheckpointError, read_model_weights

    try:
        weights = read_model_weights(ckpt, ROLE)
    except CheckpointError as err:
        raise ExportError(f"{err} (export: pass --step with another checkpoint)") from None
    staging = temp_sibling(out)
    staging.mkdir(parents=True)
    try:
        if lora.enabled and not merged:
            _write_adapter(cfg, weights, staging, dtype)
        else:
            if lora.enabled:  # the base from model.path with the adapters folded in
                weights = _fold_adapters(cfg, ckpt, weights)
            _write_model(cfg.model.path, weights, staging, dtype, max_shard_mb)
        del weights
        from rollout.tokenizer import save_tokenizer

        try:
            save_tokenizer(cfg.model.path, staging)
        except ValueError as err:
            raise ExportError(str(err)) from None
        if out.exists():  # an empty dir (checked above): a dir rename needs it gone
            out.rmdir()
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def _run_config(run_dir: Path):
    """The run's resolved ``config.yaml`` (no checks of this machine: export needs no device)."""
    from trainer.config import ConfigError, load_config

    fix = "pass the run.dir of a `crossrl train` run"
    if not run_dir.is_dir():
        raise ExportError(f"RUN_DIR {run_dir}: no such directory; {fix}")
    config = run_dir / "config.yaml"
    if not config.is_file():
        raise ExportError(f"RUN_DIR {run_dir}: has no config.yaml, so it is not a run; {fix}")
    try:
        return load_config(str(config), [], check_environment=False)
    except ConfigError as err:
        raise ExportError(f"{config}: {err}") from None


def _checkpoint(run_dir: Path, step: int | None) -> Path:
    """The verified checkpoint to export: ``latest``, or ``step_<step>``."""
    from trainer.records.checkpoint import (
        LAYOUT,
        CheckpointError,
        checkpoint_step,
        find_latest,
        list_checkpoints,
        verify_checkpoint,
    )

    try:
        if step is None:
            ckpt = find_latest(run_dir)
            if ckpt is None:
                raise ExportError(
                    f"RUN_DIR {run_dir}: no committed checkpoint ({LAYOUT.checkpoints_dir}/"
                    f"{LAYOUT.latest} is missing); let the run save one (run.save_every, or "
                    "train to the end) or export another run"
                )
        else:
            have = [checkpoint_step(p) for p in list_checkpoints(run_dir)]
            if isinstance(step, bool) or not isinstance(step, int) or step not in have:
                raise ExportError(
                    f"--step {step}: RUN_DIR {run_dir} has no checkpoint step_{step} (it has "
                    f"steps {have}); pass one of them, or leave --step out for the latest"
                )
            ckpt = run_dir / LAYOUT.checkpoints_dir / f"step_{step}"
        verify_checkpoint(ckpt)
    except CheckpointError as err:
        raise ExportError(f"{err} (export: pass --step with another checkpoint)") from None
    return ckpt


def _fresh_out_dir(out_dir: str | os.PathLike) -> Path:
    out = Path(out_dir).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(
            f"OUT_DIR {out}: exists and is not an empty directory; give a new path "
            "(export never overwrites)"
        )
    return out


def _write_model(
    model_path: str, weights: dict, directory: Path, dtype: torch.dtype, max_shard_mb: float
) -> None:
    """``config.json``, ``generation_config.json`` and safetensors weights of ``model_path``'s
    architecture holding ``weights``, through transformers' own ``save_pretrained`` (tied
    weights stored once, shards with an index)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from rollout.models import builtin_config_dir
    from rollout.tokenizer import is_builtin

    source = builtin_config_dir(model_path) if is_builtin(model_path) else Path(model_path)
    if not (source / "config.json").is_file():
        raise ExportError(
            f"model.path={model_path}: no config.json there any more (the run's model dir "
            "moved?); put the model back there, export needs its config and tokenizer"
        )
    config = AutoConfig.from_pretrained(str(source), local_files_only=True)
    # On the meta device the model costs no memory; the checkpoint's tensors are assigned.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    result = model.load_state_dict(weights, strict=False, assign=True)
    missing = result.missing_keys
    if getattr(config, "tie_word_embeddings", False):  # the base's files store it once
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or result.unexpected_keys:
        raise ExportError(
            f"the checkpoint's {ROLE} weights do not fit model.path={model_path}'s config "
            f"(missing {missing[:3]}, unexpected {result.unexpected_keys[:3]}); "
            "export a checkpoint of this run's own model"
        )
    model.tie_weights()
    model.to(dtype)
    hf_logging.disable_progress_bar()
    model.save_pretrained(str(directory), max_shard_size=int(max_shard_mb * 1e6))


def _fold_adapters(cfg, ckpt: Path, adapters: dict) -> dict:
    """The base weights of ``model.path`` (a LoRA run's checkpoint ``ckpt`` holds the adapters
    only) with ``adapters`` folded in, by Hugging Face name; the base must be the one the
    adapters trained on (the digest the checkpoint recorded)."""
    from rollout.lora import base_digest, fold
    from rollout.models import checkpoint_tensors
    from trainer.records.checkpoint import LAYOUT, load_json

    saved = load_json(ckpt / LAYOUT.trainer_state).get("lora", {}).get("base_digest")
    if saved is not None and saved != base_digest(cfg.model.path, cfg.seed):
        raise ExportError(
            f"model.path={cfg.model.path}: its weights are not those the adapters of {ckpt} "
            "trained on (another digest); put the run's base model back there, or export "
            "the adapters alone (without --merged)"
        )
    source = checkpoint_tensors(cfg.model.path, cfg.seed)
    base = {name: source.read(name) for name in source.files}
    return fold(base, adapters, cfg.model.lora.scale)


def _write_adapter(cfg, adapters: dict, directory: Path, dtype: torch.dtype) -> None:
    """A peft adapter directory of a LoRA run's ``adapters`` (checkpoint names): its
    ``adapter_config.json`` (``model.lora``'s settings, the base ``model.path``) and
    ``adapter_model.safetensors`` in ``dtype``, as peft's ``save_pretrained`` writes them."""
    from rollout.lora import peft_config, write_adapter

    lora = cfg.model.lora
    config = peft_config(
        lora.rank, lora.alpha, lora.dropout, lora.target_modules, lora.train_embeddings
    )
    config.base_model_name_or_path = cfg.model.path
    config.task_type = "CAUSAL_LM"
    write_adapter(directory, adapters, config, embeddings=lora.train_embeddings, dtype=dtype)
