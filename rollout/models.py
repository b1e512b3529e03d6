"""Model loading: shipped tiny Qwen2-style configs (``builtin:tiny``, ``builtin:small``) or a local
HF model directory.

Builtin weights are random-initialised from ``seed`` on the CPU at first use and cached as
safetensors under ``$CROSSRL_CACHE`` (default ``~/.cache/crossrl``); later loads read the cache, so
every process and machine sees identical weights. Nothing is ever downloaded.

``BUILTIN_MODELS`` is the one list of builtin names (the config schema validates against it), so
transformers is imported inside the functions: loading a config does not pay for it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rollout.files import temp_sibling

if TYPE_CHECKING:
    from transformers import PreTrainedModel

from rollout.assets import BUILTIN_MODELS, BUILTIN_MODELS_DIR  # noqa: F401 - re-exported

#: Published architectures, for random-weight stand-ins on machines without the real weights
#: (accelerator bring-up, benchmarks). Each is the model's own config.json, weights random.
SHAPES: dict[str, dict] = {
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
        "pad_token_id": 151643,
    },
}
# Qwen2.5-1.5B: the 0.5B's config with its own sizes (the GPU lane's vLLM job).
SHAPES["qwen2.5-1.5b"] = {
    **SHAPES["qwen2.5-0.5b"],
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
}

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``torch.float32`` from ``"float32"``/``"fp32"`` etc.; a torch.dtype passes through."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    raise ValueError(f"model.dtype={dtype!r}: use one of {sorted(_DTYPES)} or a torch.dtype")


def cache_root() -> Path:
    """Where builtin weights are cached: ``$CROSSRL_CACHE`` or ``~/.cache/crossrl``."""
    return Path(os.environ.get("CROSSRL_CACHE", "~/.cache/crossrl")).expanduser()


def builtin_config_dir(name: str) -> Path:
    """Directory of the shipped ``config.json`` for ``builtin:<name>``."""
    short = name.split(":", 1)[1] if name.startswith("builtin:") else name
    if short not in BUILTIN_MODELS:
        raise ValueError(
            f"model.path={name!r}: unknown builtin model; use one of "
            f"{[f'builtin:{m}' for m in BUILTIN_MODELS]} or a local model directory"
        )
    return BUILTIN_MODELS_DIR / short


def builtin_weights_dir(name: str, seed: int) -> Path:
    """Cache directory of ``builtin:<name>`` weights for ``seed``, materialised on first call.

    The key includes a digest of the shipped config, so editing a config never reuses stale
    weights. The directory is written under a temporary name and renamed, so a concurrent or
    interrupted writer never leaves a half-written cache behind.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed={seed!r}: builtin model weights need an integer seed >= 0")
    config_dir = builtin_config_dir(name)
    digest = hashlib.sha256((config_dir / "config.json").read_bytes()).hexdigest()[:12]
    final = cache_root() / "models" / f"{config_dir.name}-{digest}-seed{seed}"
    if (final / "config.json").is_file():
        return final
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    final.parent.mkdir(parents=True, exist_ok=True)
    # A directory is published whole by one rename; rollout.files names the temp sibling.
    tmp = temp_sibling(final)
    config = AutoConfig.from_pretrained(str(config_dir), local_files_only=True)
    # Initialise on the CPU from a private RNG state: same seed -> same weights on any machine,
    # and the caller's global RNG stream is left untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    hf_logging.disable_progress_bar()
    model.save_pretrained(str(tmp))
    try:
        os.replace(tmp, final)
    except OSError:
        if not (final / "config.json").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another process won the race; its copy is equal
    return final


def write_random_model(
    out_dir: str | Path, shape: str | dict, *, seed: int = 0, dtype: str = "float32"
) -> Path:
    """Write a local model directory with random weights: ``config.json``, safetensors and the
    shipped tokenizer's files, loadable as ``model.path=<out_dir>``.

    ``shape``: a name from ``SHAPES`` (e.g. ``qwen2.5-0.5b``) or a config.json dict.
    ``dtype``: storage dtype of the written weights. The tokenizer is the shipped
    character-level one: token ids past its 102 entries decode to nothing, which a random
    model's samples mostly are. The directory is written under a temporary name and renamed;
    an existing ``out_dir`` is an error (nothing is overwritten).
    """
    from transformers import AutoModelForCausalLM, Qwen2Config
    from transformers.utils import logging as hf_logging

    from rollout.tokenizer import BUILTIN_TOKENIZER_DIR

    if isinstance(shape, str):
        if shape not in SHAPES:
            raise ValueError(f"shape={shape!r}: unknown; use one of {sorted(SHAPES)} or a dict")
        shape = SHAPES[shape]
    final = Path(out_dir).expanduser()
    if final.exists():
        raise ValueError(f"{str(final)!r} exists; give a new directory (nothing is overwritten)")
    config = Qwen2Config(**{k: v for k, v in shape.items() if k != "architectures"})
    tmp = temp_sibling(final)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=parse_dtype(dtype))
    hf_logging.disable_progress_bar()
    model.save_pretrained(str(tmp))
    for item in BUILTIN_TOKENIZER_DIR.iterdir():
        if item.is_file():
            shutil.copy2(item, tmp / item.name)
    os.replace(tmp, final)
    return final


def model_directory(path_or_name: str | Path, seed: int = 0) -> Path:
    """The local directory holding the model's ``config.json`` and safetensors weights.

    ``builtin:tiny`` / ``builtin:small``: the seed's cached weights (written on first use); a
    local directory must have a ``config.json`` (nothing is downloaded).
    """
    name = str(path_or_name)
    if name.startswith("builtin:"):
        return builtin_weights_dir(name, seed)
    directory = Path(name).expanduser()
    if not (directory / "config.json").is_file():
        raise ValueError(
            f"model.path={name!r}: no config.json there; pass a local HF model directory or "
            f"one of {[f'builtin:{m}' for m in BUILTIN_MODELS]} (nothing is downloaded)"
        )
    return directory


def load_model(
    path_or_name: str | Path,
    *,
    dtype: str | torch.dtype = torch.float32,
    seed: int = 0,
    attn_implementation: str | None = None,
    device: str | torch.device = "cpu",
) -> PreTrainedModel:
    """Load a causal LM offline and move it to ``device``.

    ``path_or_name``: ``builtin:tiny`` / ``builtin:small`` (weights from ``seed``, cached) or a
    local directory with ``config.json`` + safetensors weights (``seed`` is then unused).
    ``attn_implementation``: None keeps the model's default (sdpa); the training path passes the
    HAL's varlen attention name.
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    directory = model_directory(path_or_name, seed)
    kwargs = {"dtype": parse_dtype(dtype), "local_files_only": True}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    # One "Loading weights" bar per worker per load drowns the training progress bar.
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(str(directory), **kwargs)
    return model.to(torch.device(device))


def build_empty_model(
    path_or_name: str | Path,
    *,
    dtype: str | torch.dtype = torch.float32,
    seed: int = 0,
    attn_implementation: str | None = None,
) -> PreTrainedModel:
    """The architecture of ``load_model(path_or_name, ...)`` with every parameter and buffer on
    the meta device: no memory, no weights read (only ``config.json``).

    For sharded training: shard it, ``to_empty`` it onto the device, then call
    ``reset_non_persistent_buffers`` and load the weights. Tied weights are tied here already.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = model_directory(path_or_name, seed)
    config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
    kwargs = {"dtype": parse_dtype(dtype)}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, **kwargs)


class CheckpointTensors:
    """The tensors of a model directory's safetensors files, read one at a time by name.

    Holds only the names and which file has each; ``read(name)`` copies one tensor into
    memory. Each read opens and closes its file, so the memory-mapped pages leave the process
    with it: reading a whole model this way never holds more than one tensor. A mixture's
    experts stored one per expert (every published Qwen-MoE checkpoint) are also read under
    transformers 5's fused names (``...mlp.experts.gate_up_proj`` / ``down_proj``), stacked
    one fused tensor at a time (``rollout.engines.weights.expert_names.fused_experts``).
    """

    def __init__(self, directory: Path) -> None:
        from safetensors import safe_open

        self.directory = directory
        self.files: dict[str, Path] = {}
        for file in sorted(directory.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as handle:
                self.files.update(dict.fromkeys(handle.keys(), file))

    def __contains__(self, name: object) -> bool:
        if name in self.files:
            return True
        return isinstance(name, str) and self._fused_base(name) is not None

    def _fused_base(self, name: str) -> str | None:
        from rollout.engines.weights.expert_names import FUSED_DOWN, FUSED_GATE_UP

        for fused, part in ((FUSED_GATE_UP, "gate_proj"), (FUSED_DOWN, "down_proj")):
            if name.endswith(fused):
                base = name[: -len(fused)] + "mlp.experts."
                return base if f"{base}0.{part}.weight" in self.files else None
        return None

    def read(self, name: str) -> torch.Tensor:
        """Tensor ``name`` as stored (its file's dtype), on the CPU."""
        from safetensors import safe_open

        if name not in self.files:
            from rollout.engines.weights.expert_names import fused_experts

            fused = fused_experts(name, self.files, self.read)
            if fused is None:
                raise KeyError(f"{name!r} is not in the safetensors files of {self.directory}")
            return fused
        with safe_open(str(self.files[name]), framework="pt") as handle:
            return handle.get_tensor(name)


def checkpoint_tensors(path_or_name: str | Path, seed: int = 0) -> CheckpointTensors:
    """``CheckpointTensors`` of ``load_model(path_or_name, seed=seed)``'s weights files."""
    return CheckpointTensors(model_directory(path_or_name, seed))


@torch.no_grad()
def tied_parameter_names(model: torch.nn.Module) -> list[list[str]]:
    """Names of each parameter held under more than one name (tied embeddings), the first
    name first (the order of ``named_parameters``)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def reset_non_persistent_buffers(model: PreTrainedModel, device: str | torch.device) -> int:
    """Recompute, on ``device``, the buffers a checkpoint does not hold (e.g. rotary
    ``inv_freq``): after meta init and ``to_empty`` they are garbage.

    The values come from transformers' own initialiser for the module (computed on the CPU,
    as ``from_pretrained`` computes them), so they equal ``load_model``'s bit for bit. Only
    modules without parameters of their own are touched: initialising one would also redraw
    parameters. Returns the number of buffers reset.
    """
    count = 0
    for name, module in model.named_modules():
        owned = [
            n for n in module._non_persistent_buffers_set if module._buffers.get(n) is not None
        ]
        if not owned:
            continue
        if any(True for _ in module.parameters(recurse=False)):
            raise NotImplementedError(
                f"{name or type(module).__name__}: a module with both parameters and "
                "non-persistent buffers cannot be rebuilt after meta-device init"
            )
        for buffer_name in owned:
            old = module._buffers[buffer_name]
            module._buffers[buffer_name] = torch.empty_like(old, device=torch.device(device))
        model._init_weights(module)
        count += len(owned)
    return count


def main(argv: list[str] | None = None) -> int:
    """``python -m rollout.models random SHAPE OUT_DIR [--seed N] [--dtype D]``."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m rollout.models",
        description="write a random-weight model directory of a published shape",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    rnd = sub.add_parser("random", help="random weights in SHAPE's architecture")
    rnd.add_argument("shape", choices=sorted(SHAPES))
    rnd.add_argument("out_dir")
    rnd.add_argument("--seed", type=int, default=0)
    rnd.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args(argv)
    try:
        path = write_random_model(args.out_dir, args.shape, seed=args.seed, dtype=args.dtype)
    except ValueError as exc:
        print(f"error: {exc}")
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
