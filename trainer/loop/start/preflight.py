"""Everything about a job's input, checked before Ray and the models start.

``load_config`` has already checked each key, the keys against each other, that files and
devices exist, and imported and constructed the environment once. ``preflight`` reads what
those files hold, so a bad line 3 of a prompt file, a truncated safetensors file or a corrupt
checkpoint fails in seconds with one line (exit 2) instead of after every worker started:

- prompt files, every record (``rollout.envs.prompts``: file, line or row, field), and the
  environment constructed with the first record's fields (``trainer.config.checks``);
- model directories (``model.path``, and ``model.critic_path`` with a critic): config.json
  readable, weights present, safetensors headers whole, tokenizer loadable; ``builtin:`` skip;
  a LoRA run's ``model.lora.target_modules`` name linear layers of that model;
- the resume target, resolved and verified against its manifest (``trainer.records.checkpoint``);
- the memory budget: every phase of a step fits its device (``trainer.loop.plan.memory_budget``),
  and a local Ray's object store holds the live weight snapshots of engines on devices of
  their own (``trainer.loop.plan.snapshot_budget``; a joined cluster's, once joined: ``launch``),
  and this host's memory a streamed run's groups in flight (``trainer.loop.plan.stream_budget``);
- ``run.dir``: a directory we can create and write (``trainer.records.run_dir``; that a fresh start
  may not overwrite a run there is checked once the directory's lock is held).

Each check lives with the module that owns the input; this module only calls them in order.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from trainer.config import Config

#: safetensors: an 8-byte little-endian header length, then that many bytes of JSON.
_SAFETENSORS_MAX_HEADER_BYTES = 100 << 20


class PreflightError(ValueError):
    """Bad job input found before start-up; one line naming the file or key, the value and the
    fix. The CLI exits 2 on it."""


def preflight(cfg: Config, *, command: str = "train", replay: bool = False) -> None:
    """Check the job's input files and run directory; raise ``PreflightError`` on the first
    problem. ``replay``: a probe replays recorded rollouts, so no prompts are read and nothing
    is resumed (the probe checks its recording itself, ``trainer.commands.probe``)."""
    from trainer.records.run_dir import usable_problem

    problem = usable_problem(cfg.run.dir, command=command)
    if problem:
        raise PreflightError(problem)
    if not replay:
        _check_prompts(cfg)
    _check_layout(cfg)
    _check_memory(cfg, replay=replay)
    if not replay:
        _check_snapshots(cfg)
        _check_stream(cfg)
    _check_model(cfg)
    _check_lora_targets(cfg)
    if not replay:
        _check_resume(cfg)


def _check_layout(cfg: Config) -> None:
    """A local run's layout must fit this machine (``trainer.loop.plan.layout``); a cluster's is
    checked against the cluster's resources once Ray has joined it."""
    if cfg.ray.address is not None:
        return
    from trainer.loop.plan.layout import LayoutError, layout_for_cli

    try:
        layout_for_cli(cfg)
    except LayoutError as err:
        raise PreflightError(str(err)) from None


def _check_memory(cfg: Config, *, replay: bool = False) -> None:
    """Every phase of a step must fit its device (``trainer.loop.plan.memory_budget``: an estimate
    from the model's shape and the layout keys; no estimate, no refusal). On the CPU the budget
    only refuses a job whose phase exceeds the host's RAM, and a cluster's CPU ranks (spread
    over hosts we cannot see from here) are not checked. ``replay``: a probe runs no engine,
    so only the update is checked."""
    if cfg.device == "cpu" and cfg.ray.address is not None:
        return
    from trainer.loop.plan.memory_report import budget_for_cli, memory_problem

    try:
        budget = budget_for_cli(cfg)
    except ValueError as err:  # an environment setting the budget reads, e.g. a buffer size
        raise PreflightError(" ".join(str(err).split())) from None
    phases = ("update",) if replay else None
    problem = memory_problem(budget, cfg, phases) if budget is not None else None
    if problem:
        raise PreflightError(problem)


def _check_snapshots(cfg: Config) -> None:
    """The weight snapshots of engines on devices of their own fit the object store of a local
    Ray (``ray.object_store_gb`` or Ray's default here); a cluster's is read once joined."""
    if cfg.ray.address is not None or not cfg.rollout.engine_devices:
        return  # (snapshot_problem finds none with the collective push)
    from trainer.loop.plan.model_shape import model_shape
    from trainer.loop.plan.snapshot_budget import host_object_store_bytes, snapshot_problem

    store, source = host_object_store_bytes(cfg)
    problem = snapshot_problem(cfg, model_shape(cfg.model.path), store, source)
    if problem:
        raise PreflightError(problem)


def _check_stream(cfg: Config) -> None:
    """A streamed run's groups in flight fit the rollout host's memory
    (``trainer.loop.plan.stream_budget``): this host's, for a local Ray; a joined cluster's rollout
    host is on a node not known here."""
    if cfg.ray.address is not None or not cfg.train.max_staleness:
        return
    from trainer.loop.plan.stream_budget import host_memory_bytes, in_flight_problem

    problem = in_flight_problem(cfg, host_memory_bytes(), "this host's memory")
    if problem:
        raise PreflightError(problem)


def _check_prompts(cfg: Config) -> None:
    if cfg.data.source == "env":
        return
    from rollout.envs.prompts import PromptSource
    from trainer.config.checks import env_problem

    try:
        source = PromptSource(cfg.data.source, seed=cfg.seed)  # reads and checks every record
    except (ValueError, OSError) as err:
        raise PreflightError(f"data.source: {err}") from None
    # The environment, constructed as the rollout will: with a record's fields.
    bad_env = env_problem(cfg, record=source.item(0).env_kwargs)
    if bad_env:
        raise PreflightError(bad_env[2])


def _check_model(cfg: Config) -> None:
    paths = [("model.path", cfg.model.path)]
    if cfg.critic.enable and cfg.model.critic_path is not None:
        paths.append(("model.critic_path", cfg.model.critic_path))
    for key, path in paths:
        if not path.startswith("builtin:"):
            problem = model_dir_problem(key, Path(path).expanduser())
            if problem:
                raise PreflightError(problem)


def _check_lora_targets(cfg: Config) -> None:
    """Every ``model.lora.target_modules`` name matches a linear layer of ``model.path``'s
    model (``rollout.lora.target_problem``), built on the meta device from its config.json:
    no weights read, nothing allocated."""
    if not cfg.model.lora.enabled:
        return
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rollout.lora import target_problem
    from rollout.models import builtin_config_dir

    path = cfg.model.path
    directory = builtin_config_dir(path) if path.startswith("builtin:") else Path(path).expanduser()
    try:
        config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001 - an architecture transformers cannot build here:
        return  # the worker's own injection names the key then (rollout.lora.inject)
    problem = target_problem(model, cfg.model.lora.target_modules)
    if problem:
        raise PreflightError(problem)


def model_dir_problem(key: str, directory: Path) -> str | None:
    """Why ``directory`` is not a loadable HF model directory, or None: config.json must be a
    JSON object, weights present (safetensors, whole headers; or pytorch_model*.bin) and the
    tokenizer loadable. Reads headers only, never the weights."""
    head = f"{key}={str(directory)!r}"
    config = directory / "config.json"
    try:
        loaded = json.loads(config.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return f"{head}: no config.json there; point at a Hugging Face model directory"
    except UnicodeDecodeError as err:
        from rollout.files import undecodable

        return f"{head}: {config}: {undecodable(config, err)}"
    except json.JSONDecodeError as err:
        return f"{head}: {config} is not valid JSON (line {err.lineno}: {err.msg}); fix or re-download it"
    except OSError as err:
        return f"{head}: cannot read {config} ({err.strerror or err})"
    if not isinstance(loaded, dict):
        return f"{head}: {config} holds a JSON {type(loaded).__name__}, not an object"
    shards = sorted(directory.glob("*.safetensors"))
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            return f"{head}: {index} is not a safetensors index ({err}); re-download the model"
        missing = sorted(n for n in names if not (directory / n).is_file())
        if missing:
            return (
                f"{head}: {index.name} lists {missing[0]}, which is missing "
                f"({len(missing)} of {len(names)} shards); finish the download"
            )
    if not shards and not sorted(directory.glob("pytorch_model*.bin")):
        return f"{head}: no weights (*.safetensors) next to config.json; download the weights too"
    for shard in shards:
        problem = safetensors_header_problem(shard)
        if problem:
            return f"{head}: {shard.name} {problem}; re-download that file"
    return _tokenizer_problem(head, directory)


#: Files that hold a tokenizer's vocabulary (transformers builds an empty one without them).
_VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


def _tokenizer_problem(head: str, directory: Path) -> str | None:
    from rollout.tokenizer import load_tokenizer

    if not any((directory / name).is_file() for name in _VOCAB_FILES):
        return (
            f"{head}: no tokenizer there (none of {', '.join(_VOCAB_FILES)}); copy the model's "
            "tokenizer files next to config.json"
        )
    try:
        tokenizer = load_tokenizer(directory)
    except Exception as err:  # noqa: BLE001 - transformers raises many types for a bad tokenizer
        text = " ".join(str(err).split())[:200]
        return (
            f"{head}: its tokenizer does not load ({type(err).__name__}: {text}); re-download "
            "the tokenizer files"
        )
    if tokenizer.eos_token is None:
        return (
            f"{head}: its tokenizer has no eos_token, which ends every turn; set eos_token in "
            "tokenizer_config.json"
        )
    return None


def safetensors_header_problem(path: Path) -> str | None:
    """What is wrong with a safetensors file's header, or None: the 8-byte length, the JSON
    header, and every tensor's byte range inside the file (a truncated download fails here)."""
    try:
        size = path.stat().st_size
        with path.open("rb") as fh:
            first = fh.read(8)
            if len(first) < 8:
                return f"is {size} bytes, too short for a safetensors header (truncated)"
            (length,) = struct.unpack("<Q", first)
            if length > min(size - 8, _SAFETENSORS_MAX_HEADER_BYTES):
                return (
                    f"is not a whole safetensors file (header of {length} bytes in a file of "
                    f"{size} bytes)"
                )
            header = json.loads(fh.read(length).decode("utf-8"))
    except OSError as err:
        return f"cannot be read ({err.strerror or err})"
    except (UnicodeDecodeError, ValueError):
        return "has a damaged safetensors header (not JSON)"
    if not isinstance(header, dict):
        return "has a damaged safetensors header (not a JSON object)"
    data_bytes = size - 8 - length
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            end = int(info["data_offsets"][1])
        except (TypeError, KeyError, IndexError, ValueError):
            return f"has a damaged safetensors header (tensor {name!r} has no data_offsets)"
        if end > data_bytes:
            return (
                f"is truncated: tensor {name!r} ends at byte {end} of the data, which holds "
                f"{data_bytes} bytes"
            )
    return None


def _check_resume(cfg: Config) -> None:
    if cfg.run.resume == "never":
        return
    from trainer.records.checkpoint import resolve_resume

    try:
        # Every file's size and sha256 against the manifest; the trainer then loads it
        # without hashing it again (Trainer._resume).
        ckpt = resolve_resume(cfg.run.dir, cfg.run.resume)
    except ValueError as err:  # CheckpointError is a ValueError
        raise PreflightError(" ".join(str(err).split())) from None
    if ckpt is None:
        return
    _check_metrics_file(cfg)
    _check_checkpoint_shapes(cfg, ckpt)
    _check_resumed_lag(cfg, ckpt)
    _check_resumed_lora(cfg, ckpt)


def _check_resumed_lora(cfg: Config, ckpt: Path) -> None:
    """A LoRA checkpoint holds the adapters and their optimizer state, not the base: it
    resumes only with the same adapters on the same base weights (``model.path``, checked by
    digest); a full fine-tune's checkpoint does not resume as LoRA, nor the other way."""
    from trainer.loop.plan.lora_layout import lora_record
    from trainer.records.checkpoint import LAYOUT, load_json

    saved = load_json(ckpt / LAYOUT.trainer_state).get("lora")
    lora = cfg.model.lora
    fresh = "or start afresh with run.resume=never"
    if saved is None and lora.enabled:
        raise PreflightError(
            f"model.lora.rank={lora.rank}: checkpoint {ckpt} is a full fine-tune's (no "
            f"adapters); resume with model.lora.rank=0, {fresh}"
        )
    if saved is None:
        return
    if not lora.enabled:
        raise PreflightError(
            f"model.lora.rank=0: checkpoint {ckpt} holds LoRA adapters of rank "
            f"{saved['rank']} and not the base; resume with model.lora.rank={saved['rank']}, "
            f"{fresh}"
        )
    now = lora_record(cfg)
    for key in ("rank", "alpha", "target_modules", "train_embeddings"):
        if now[key] != saved[key]:
            raise PreflightError(
                f"model.lora.{key}={now[key]}: checkpoint {ckpt} trained adapters with "
                f"model.lora.{key}={saved[key]}; resume with it, {fresh}"
            )
    if now["base_digest"] != saved["base_digest"]:
        raise PreflightError(
            f"model.path={cfg.model.path}: its weights are not those checkpoint {ckpt}'s "
            "adapters trained on (another digest); point model.path at the run's base model "
            f"(see its config.yaml), {fresh}"
        )


def _check_resumed_lag(cfg: Config, ckpt: Path) -> None:
    """A lagged run's step t is sampled by the weights after step t-1-k (``trainer.loop.
    schedule.pipeline``), and its checkpoint keeps the rollouts of the k steps after it, sampled by
    weights it does not hold. Resuming exactly needs the same ``train.rollout_lag`` and every
    kept rollout the resumed steps train on; a checkpoint of a crossrl that kept none past
    ``train.total_steps`` may lack some, and a run with another lag would sample with other
    weights than the saved run did."""
    from trainer.records.checkpoint import LAYOUT, load_json
    from trainer.records.checkpoint.pending import read_pending_steps

    state = load_json(ckpt / LAYOUT.trainer_state)
    step, lag = int(state["step"]), cfg.train.rollout_lag
    kept = read_pending_steps(ckpt)
    # Checkpoints from before the lag was saved: as many kept rollouts as the lag, else 0.
    saved_lag = int(state.get("rollout_lag", len(kept)))
    if saved_lag != lag:
        raise PreflightError(
            f"train.rollout_lag={lag}: checkpoint {ckpt} was saved by a run with "
            f"train.rollout_lag={saved_lag}, whose steps after {step} sample with other weights; "
            f"resume with train.rollout_lag={saved_lag} (and rollout.engine_devices > 0 when it "
            "is > 0), or start afresh with run.resume=never"
        )
    needed = set(range(step + 1, min(step + lag, cfg.train.total_steps) + 1))
    missing = sorted(needed - set(kept))
    if missing:
        raise PreflightError(
            f"train.total_steps={cfg.train.total_steps}: checkpoint {ckpt} keeps no rollout of "
            f"step(s) {missing}, which the lag-{lag} schedule samples with weights before step "
            f"{step} (a crossrl that stopped sampling at the saved run's end wrote it); resume "
            f"with train.total_steps={step + len(needed) - len(missing)}, or start afresh with "
            "run.resume=never"
        )


def _check_metrics_file(cfg: Config) -> None:
    """A resumed run appends to ``metrics.jsonl``: every line of it must read (a torn last
    line, from a crash mid-write, is dropped as the logger does)."""
    from trainer.records.jsonl_files import MetricsFileError, read_jsonl

    path = Path(cfg.run.dir) / "metrics.jsonl"
    if not path.is_file():
        return
    try:
        read_jsonl(path, allow_torn_tail=True)
    except (MetricsFileError, OSError, UnicodeDecodeError) as err:
        raise PreflightError(
            f"run.resume={cfg.run.resume}: {' '.join(str(err).split())} (or start afresh with "
            "run.resume=never in another run.dir)"
        ) from None


def _check_checkpoint_shapes(cfg: Config, ckpt: Path) -> None:
    """The checkpoint's actor weights have the shapes of ``model.path``'s model: resuming a
    run with another model would fail while loading, after start-up."""
    from trainer.records.checkpoint import LAYOUT

    sharded = ckpt / LAYOUT.model_dir("actor")
    if not (sharded / ".metadata").is_file():
        return  # the single-file layout of older checkpoints: checked when it loads
    import torch
    from torch.distributed.checkpoint import FileSystemReader

    from rollout.models import build_empty_model

    saved = {
        name: tuple(meta.size)
        for name, meta in FileSystemReader(str(sharded)).read_metadata().state_dict_metadata.items()
        if hasattr(meta, "size")
    }
    model = build_empty_model(cfg.model.path, dtype=torch.float32, seed=cfg.seed)
    for name, tensor in model.state_dict().items():
        if name in saved and saved[name] != tuple(tensor.shape):
            raise PreflightError(
                f"model.path={cfg.model.path}: {name} has shape {tuple(tensor.shape)}, the "
                f"checkpoint {ckpt} has {saved[name]}; resume with the model the run trained "
                "(see its config.yaml) or start afresh with run.resume=never"
            )
