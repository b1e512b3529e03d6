"""Load, check and write job configs.

``load_config(path, overrides)`` reads a YAML job file (following its ``include:`` files),
applies ``key.path=value`` overrides, validates the result against the typed schema in
``trainer/config_schema.py`` and then runs the cross-field checks and, unless told not to,
the checks against this machine (devices, packages, files). Every failure is a
``ConfigError`` whose one-line message names the key, the bad value and what is allowed,
so a typo fails in the first second instead of after Ray and the models have started.

Run ``python -m trainer.config [--config FILE] [key=value ...]`` to print a resolved config,
or ``python -m trainer.config --write-docs docs/config.md`` to regenerate the key reference.
"""

from __future__ import annotations

import difflib
import importlib.util
import logging
import os
import re
import sys
import tempfile
import types
import typing
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import annotated_types
import yaml
from pydantic import BaseModel, ValidationError

from trainer.config_schema import (
    SECTIONS,
    AlgorithmConfig,
    Config,
    CriticConfig,
    DataConfig,
    ModelConfig,
    RayConfig,
    RolloutConfig,
    RunConfig,
    TrainConfig,
)

__all__ = [
    "LAYOUT_KEYS",
    "AlgorithmConfig",
    "Config",
    "ConfigError",
    "CriticConfig",
    "DataConfig",
    "ModelConfig",
    "RayConfig",
    "RolloutConfig",
    "RunConfig",
    "TrainConfig",
    "all_keys",
    "config_reference_markdown",
    "default_config_path",
    "dump_config",
    "generated_doc_block",
    "load_config",
    "main_check",
    "parse_override",
    "read_yaml",
    "update_config_doc",
    "validate_config",
]

log = logging.getLogger("crossrl.config")

# Keys that describe how a job is laid out on a machine, not what it computes. The
# versions of one job for different device types (configs/<device>/<job>.yaml) may differ
# only in these, which makes their runs comparable step for step
# (tests/test_config_pairs.py holds configs/ to it).
LAYOUT_KEYS: frozenset[str] = frozenset(
    {
        "device",
        "train.dp_size",
        "rollout.memory_fraction",
        "rollout.tensor_parallel_size",
        "train.max_tokens_per_micro_batch",
        "train.param_offload",
        "train.optimizer_offload",
    }
)

INCLUDE_KEY = "include"
_DOC_BEGIN = "<!-- BEGIN GENERATED: python -m trainer.config --write-docs docs/config.md -->"
_DOC_END = "<!-- END GENERATED -->"


class ConfigError(ValueError):
    """A bad job config. ``key`` is the dotted key to fix (e.g. ``"train.lr"``), ``value`` the
    offending value, ``str(err)`` one line naming both and what is allowed. ``problems`` lists
    every ``(key, value, message)`` found when several keys were wrong at once."""

    def __init__(
        self,
        key: str,
        value: Any,
        message: str,
        problems: list[tuple[str, Any, str]] | None = None,
    ) -> None:
        self.key = key
        self.value = value
        self.problems = problems or [(key, value, message)]
        more = len(self.problems) - 1
        suffix = f" (and {more} more problem{'s' if more > 1 else ''})" if more > 0 else ""
        super().__init__(message + suffix)


def _problem(key: str, value: Any, allowed: str) -> tuple[str, Any, str]:
    return (key, value, f"{key}: got {_show(value)}; {allowed}")


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict | list):
        return " ".join(yaml.safe_dump(value, default_flow_style=True).split())
    return repr(value)


def _raise_first(problems: list[tuple[str, Any, str]]) -> None:
    if problems:
        key, value, message = problems[0]
        raise ConfigError(key, value, message, problems)


# ---------------------------------------------------------------------------- YAML reading


class _Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that also reads ``1e-3`` as a float. YAML 1.1 (PyYAML) wants a dot
    and a signed exponent, so ``lr: 1e-6`` would otherwise be the string "1e-6"."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _yaml_load(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader


def read_yaml(path: str | os.PathLike[str], _stack: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read one config file and the files it ``include:``s (a path or a list of paths,
    relative to the including file), deep-merged in order, the including file last so its
    values win. Dicts merge key by key; any other value (lists too) replaces. Raises
    ``ConfigError`` for a missing or malformed file and for an include cycle."""
    path = Path(path)
    resolved = path.resolve()
    if resolved in _stack:
        chain = " -> ".join(str(p) for p in (*_stack, resolved))
        raise ConfigError(INCLUDE_KEY, str(path), f"include: cycle {chain}; remove one include")
    if not resolved.is_file():
        key = INCLUDE_KEY if _stack else "--config"
        where = f" (included from {_stack[-1]})" if _stack else ""
        raise ConfigError(key, str(path), f"{key}: file {str(path)!r} not found{where}")
    try:
        tree = _yaml_load(resolved.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        flat_err = " ".join(str(err).split())
        raise ConfigError("--config", str(path), f"{path}: not valid YAML: {flat_err}") from err
    if tree is None:
        tree = {}
    if not isinstance(tree, dict):
        raise ConfigError(
            "--config", str(path), f"{path}: must be a mapping of keys, got {type(tree).__name__}"
        )
    includes = tree.pop(INCLUDE_KEY, None)
    if includes is None:
        return tree
    if isinstance(includes, str):
        includes = [includes]
    if not isinstance(includes, list) or not all(isinstance(p, str) for p in includes):
        raise ConfigError(
            INCLUDE_KEY, includes, f"include: got {_show(includes)} in {path}; use a path or a list"
        )
    merged: dict[str, Any] = {}
    for inc in includes:
        child = read_yaml(resolved.parent / inc, (*_stack, resolved))
        merged = _deep_merge(merged, child)
    return _deep_merge(merged, tree)


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


# ---------------------------------------------------------------------------- overrides


def parse_override(text: str) -> tuple[str, Any]:
    """Split ``"key.path=value"`` into the dotted key and the value read as YAML, so
    ``true``, ``3``, ``null``, ``1e-3`` and ``[1, 2]`` become bool, int, None, float, list."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*", key):
        raise ConfigError(
            key or text,
            text,
            f"override {text!r}: expected key.path=value, e.g. train.lr=1e-5",
        )
    if key == INCLUDE_KEY:
        raise ConfigError(key, raw, "include: cannot be overridden; use --config FILE")
    try:
        value = _yaml_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw  # e.g. an unbalanced quote: take the text as the user typed it
    return key, value


def _apply_override(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            parent = ".".join(parts[: depth + 1])
            raise ConfigError(
                key, value, f"{key}: {parent} is a value ({_show(child)}), not a section"
            )
        node = child
    if isinstance(value, dict) and isinstance(node.get(parts[-1]), dict):
        node[parts[-1]] = _deep_merge(node[parts[-1]], value)
    else:
        node[parts[-1]] = value


# ---------------------------------------------------------------------------- schema


def all_keys() -> list[str]:
    """Every dotted leaf key of the schema, in schema order (``device``, ..., ``ray.num_cpus``)."""
    keys: list[str] = []
    for name in Config.model_fields:
        if name in SECTIONS:
            keys.extend(f"{name}.{sub}" for sub in SECTIONS[name].model_fields)
        else:
            keys.append(name)
    return keys


def _first_leaf(prefix: str, value: Any) -> tuple[str, Any]:
    """The dotted path and value of the first leaf under ``value`` (itself if not a dict)."""
    while isinstance(value, dict) and value:
        key, value = next(iter(value.items()))
        prefix = f"{prefix}.{key}"
    return prefix, value


def _field_description(key: str) -> str:
    head, _, tail = key.partition(".")
    if tail and head in SECTIONS:
        field = SECTIONS[head].model_fields.get(tail)
    else:
        field = Config.model_fields.get(head)
    return (field.description or "") if field else ""


def _pydantic_problems(err: ValidationError) -> list[tuple[str, Any, str]]:
    known = set(all_keys()) | set(SECTIONS)
    problems = []
    for item in err.errors():
        loc = [str(p) for p in item["loc"]]
        # Keep the part of the location that names a config key (unions add member names).
        key = ".".join(loc)
        for cut in range(len(loc), 0, -1):
            if ".".join(loc[:cut]) in known:
                key = ".".join(loc[:cut])
                break
        value = item.get("input")
        if item["type"] == "extra_forbidden":
            leaf, value = _first_leaf(".".join(loc), value)
            close = difflib.get_close_matches(leaf, all_keys(), n=1, cutoff=0.6)
            if not close:  # a misspelt section name with a right leaf: compare leaf names
                tail = leaf.rsplit(".", 1)[-1]
                close = [k for k in all_keys() if k.rsplit(".", 1)[-1] == tail][:1]
            hint = f"did you mean {close[0]!r}?" if close else "see docs/config.md for all keys"
            problems.append((leaf, value, f"{leaf}: unknown key; {hint}"))
            continue
        msg = item["msg"].removeprefix("Value error, ")
        if item["type"] == "missing":
            msg = "is required"
        desc = _field_description(key)
        if key in SECTIONS:
            msg, desc = f"must be a mapping of {key}.* keys (see docs/config.md)", ""
        allowed = f"{msg[0].lower()}{msg[1:]}" + (f" [{desc}]" if desc else "")
        problems.append(_problem(key, value, allowed))
    return problems


def _build(tree: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(tree)
    except ValidationError as err:
        _raise_first(_pydantic_problems(err))
        raise  # unreachable: a ValidationError always has at least one error


# ---------------------------------------------------------------------------- checks


def _builtin_env_names() -> list[str] | None:
    """Names of rollout's built-in environments, or None when rollout cannot be imported."""
    try:
        from rollout.envs import BUILTIN_ENVS
    except ImportError:
        return None
    return sorted(BUILTIN_ENVS)


def _static_problems(cfg: Config) -> tuple[list[tuple[str, Any, str]], list[str]]:
    """Checks that relate fields to each other; no file, package or device is looked at."""
    p: list[tuple[str, Any, str]] = []
    warn: list[str] = []
    tr, ro, alg = cfg.train, cfg.rollout, cfg.algorithm

    if tr.mini_batch_size > tr.batch_size:
        p.append(
            _problem(
                "train.mini_batch_size",
                tr.mini_batch_size,
                f"must be <= train.batch_size ({tr.batch_size}); both count prompts",
            )
        )
    elif tr.batch_size % tr.mini_batch_size:
        # Like verl we require equal mini-batches: a short last mini-batch would take an
        # optimizer step on fewer prompts, i.e. a noisier, differently weighted update.
        p.append(
            _problem(
                "train.batch_size",
                tr.batch_size,
                f"must be a multiple of train.mini_batch_size ({tr.mini_batch_size}) so every "
                "optimizer step sees the same number of prompts",
            )
        )
    if alg.adv_estimator == "gae" and not cfg.critic.enable:
        p.append(
            _problem(
                "critic.enable",
                cfg.critic.enable,
                "algorithm.adv_estimator=gae needs a critic; set critic.enable=true",
            )
        )
    if cfg.critic.enable and alg.adv_estimator != "gae":
        # An error, not a warning: a critic nobody reads doubles memory and time.
        p.append(
            _problem(
                "critic.enable",
                cfg.critic.enable,
                f"only gae uses a critic, but algorithm.adv_estimator={alg.adv_estimator}; "
                "set critic.enable=false or algorithm.adv_estimator=gae",
            )
        )
    builtin_envs = _builtin_env_names()
    if ":" not in ro.env and builtin_envs is not None and ro.env not in builtin_envs:
        close = difflib.get_close_matches(ro.env, builtin_envs, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        p.append(
            _problem(
                "rollout.env",
                ro.env,
                f"not a built-in environment ({', '.join(builtin_envs)}); {hint}"
                "for your own class write module.path:ClassName",
            )
        )
    if any(not stop for stop in ro.stop_strings):
        p.append(
            _problem(
                "rollout.stop_strings",
                ro.stop_strings,
                "an empty string would end every turn at its first token; remove it",
            )
        )
    if ro.merge_stepwise and not ro.step_wise:
        p.append(
            _problem(
                "rollout.merge_stepwise",
                ro.merge_stepwise,
                "merges step-wise rows, so it needs rollout.step_wise=true",
            )
        )
    if (
        alg.loss_agg == "seq-mean-token-sum-norm"
        and alg.loss_agg_horizon is None
        and ro.max_turns > 1
        and (not ro.step_wise or ro.merge_stepwise)
    ):
        p.append(
            _problem(
                "algorithm.loss_agg_horizon",
                None,
                "seq-mean-token-sum-norm divides by a fixed horizon in tokens; rows here hold "
                "several turns, so rollout.max_new_tokens is not it: set "
                "algorithm.loss_agg_horizon",
            )
        )
    if alg.adv_estimator in ("grpo", "rloo") and ro.n < 2:
        p.append(
            _problem(
                "rollout.n",
                ro.n,
                f"{alg.adv_estimator} compares samples of one prompt, so it needs rollout.n >= 2",
            )
        )
    if ro.engine == "hf" and ro.tensor_parallel_size != 1:
        p.append(
            _problem(
                "rollout.tensor_parallel_size",
                ro.tensor_parallel_size,
                "the hf engine runs one device per replica; use 1 or rollout.engine=vllm",
            )
        )
    elif tr.dp_size % ro.tensor_parallel_size:
        p.append(
            _problem(
                "rollout.tensor_parallel_size",
                ro.tensor_parallel_size,
                f"must divide train.dp_size ({tr.dp_size}): engine replicas share the "
                "trainer's devices",
            )
        )
    if alg.use_kl_loss and alg.kl_coef == 0:
        p.append(
            _problem(
                "algorithm.kl_coef",
                alg.kl_coef,
                "algorithm.use_kl_loss=true needs algorithm.kl_coef > 0 (else the KL term is "
                "zero and the reference model is wasted)",
            )
        )
    total_opt_steps = cfg.optimizer_steps_per_step() * tr.total_steps
    for key, warmup in (
        ("train.warmup_steps", tr.warmup_steps),
        ("critic.warmup_steps", cfg.critic.warmup_steps),
    ):
        if tr.batch_size % tr.mini_batch_size == 0 and warmup and warmup >= total_opt_steps:
            p.append(
                _problem(
                    key,
                    warmup,
                    f"counts optimizer steps and must be < the run's {total_opt_steps} "
                    "(train.total_steps x mini-batches per step x train.ppo_epochs)",
                )
            )

    if (
        tr.max_tokens_per_micro_batch is not None
        and tr.max_tokens_per_micro_batch < ro.max_input_len + ro.max_new_tokens
    ):
        warn.append(
            f"train.max_tokens_per_micro_batch={tr.max_tokens_per_micro_batch} < "
            f"rollout.max_input_len + rollout.max_new_tokens "
            f"({ro.max_input_len + ro.max_new_tokens}): a longer row gets a micro-batch alone"
        )
    if tr.lr_schedule == "constant" and tr.min_lr_ratio:
        warn.append("train.min_lr_ratio is ignored with train.lr_schedule=constant")
    if cfg.model.critic_path is not None and not cfg.critic.enable:
        warn.append("model.critic_path is ignored with critic.enable=false")
    if cfg.ray.num_cpus is not None and cfg.ray.address is not None:
        warn.append("ray.num_cpus is ignored when joining a cluster (ray.address is set)")
    if tr.mini_batch_size * ro.n < tr.dp_size:
        warn.append(
            f"train.mini_batch_size x rollout.n = {tr.mini_batch_size * ro.n} trajectories per "
            f"mini-batch < train.dp_size ({tr.dp_size}): some ranks will train on padding rows only"
        )
    return p, warn


def _model_dir_problem(key: str, path: str) -> tuple[str, Any, str] | None:
    if path.startswith("builtin:"):
        return None
    if not Path(path).is_dir():
        return _problem(
            key,
            path,
            "must be builtin:tiny, builtin:small or an existing local model directory "
            "(download the model first; nothing is fetched at run time)",
        )
    if not (Path(path) / "config.json").is_file():
        return _problem(key, path, "directory has no config.json; point at a HF model directory")
    return None


def _module_available(name: str) -> bool:
    """Whether ``import name`` would find a module, without importing it (a dotted name
    imports its parent packages)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _environment_problems(cfg: Config) -> list[tuple[str, Any, str]]:
    """Checks against this machine: devices, packages and files."""
    p: list[tuple[str, Any, str]] = []
    if cfg.device not in ("auto", "cpu"):  # a CPU is always there
        try:
            from hal import available_backends
        except ImportError:  # the HAL is missing: get_backend will fail loudly later
            log.warning(
                "cannot check device=%s: hal.available_backends is not importable", cfg.device
            )
        else:
            found = list(available_backends())
            if cfg.device not in found:
                p.append(
                    _problem(
                        "device",
                        cfg.device,
                        f"no such device on this machine (found: {', '.join(found) or 'none'}); "
                        "run `crossrl devices`, or set device=auto",
                    )
                )
    if cfg.rollout.engine == "vllm" and not _module_available("vllm"):
        p.append(
            _problem(
                "rollout.engine",
                "vllm",
                "the vllm package is not importable here; install it (see docs/cluster.md) or "
                "set rollout.engine=hf",
            )
        )
    for key, path in (("model.path", cfg.model.path), ("model.critic_path", cfg.model.critic_path)):
        if path is not None and (key == "model.path" or cfg.critic.enable):
            problem = _model_dir_problem(key, path)
            if problem:
                p.append(problem)
    if cfg.data.source != "env" and not Path(cfg.data.source).is_file():
        p.append(
            _problem(
                "data.source", cfg.data.source, "file not found; give an existing .jsonl/.parquet"
            )
        )
    if cfg.run.resume not in ("auto", "never") and not Path(cfg.run.resume).exists():
        p.append(
            _problem(
                "run.resume",
                cfg.run.resume,
                "must be auto, never or an existing checkpoint directory",
            )
        )
    env = cfg.rollout.env
    if ":" not in env and cfg.rollout.env_kwargs:
        try:
            from rollout.envs import make_env

            make_env(env)(**cfg.rollout.env_kwargs)
        except (TypeError, ValueError) as exc:
            p.append(
                _problem(
                    "rollout.env_kwargs",
                    cfg.rollout.env_kwargs,
                    f"{env} does not accept them: {exc}",
                )
            )
    if ":" in env:
        module = env.split(":", 1)[0]
        if not _module_available(module):
            p.append(
                _problem(
                    "rollout.env",
                    env,
                    f"module {module!r} is not importable; check PYTHONPATH or the spelling",
                )
            )
        else:
            try:
                from rollout.envs import make_env
            except ImportError:
                make_env = None
            try:
                if make_env is not None:
                    make_env(env)  # imports the class and checks it has reset/step
            except ValueError as exc:
                reason = str(exc).split(": ", 1)[-1]  # drop its own "rollout.env=...: " head
                p.append(_problem("rollout.env", env, reason))
    return p


def validate_config(cfg: Config, *, check_environment: bool = True) -> list[str]:
    """Run the cross-field checks (and, with ``check_environment``, the device, package and
    file checks). Raises ``ConfigError`` for the first problem (``.problems`` has them all);
    returns warnings about settings that are legal but probably not what was meant."""
    problems, warnings = _static_problems(cfg)
    if check_environment:
        problems += _environment_problems(cfg)
    _raise_first(problems)
    return warnings


# ---------------------------------------------------------------------------- public API


def default_config_path() -> Path:
    """The CPU default job, ``configs/cpu/tiny.yaml`` at the repository root (the package is
    installed editable, so the root is the parent of the ``trainer`` package)."""
    return Path(__file__).resolve().parent.parent / "configs" / "cpu" / "tiny.yaml"


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: Iterable[str] = (),
    *,
    check_environment: bool = True,
) -> Config:
    """Read a job config, apply ``key.path=value`` overrides and validate it.

    ``path=None`` loads ``default_config_path()``. ``check_environment=False`` skips the checks
    that look at this machine (device present, vllm importable, model/data/resume paths
    exist), e.g. to inspect a cluster config on a laptop. Raises ``ConfigError``.
    """
    tree = read_yaml(default_config_path() if path is None else path)
    for text in overrides:
        key, value = parse_override(text)
        _apply_override(tree, key, value)
    cfg = _build(tree)
    for message in validate_config(cfg, check_environment=check_environment):
        log.warning("config: %s", message)
    return cfg


def dump_config(cfg: Config, path: str | os.PathLike[str]) -> Path:
    """Write the resolved config as YAML, atomically (temp file, fsync, rename), so a reader
    never sees half a file. Returns the path written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(cfg.to_yaml())
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    try:  # make the rename itself durable; not every filesystem lets a directory be opened
        dir_fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return path
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)
    return path


# ---------------------------------------------------------------------------- docs


def _type_text(model: type[BaseModel], name: str) -> str:
    field = model.model_fields[name]
    ann = field.annotation
    nullable = False
    args = typing.get_args(ann)
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        nullable = type(None) in args
        ann = next(a for a in args if a is not type(None))
    if typing.get_origin(ann) is typing.Literal:
        text = " \\| ".join(str(v) for v in typing.get_args(ann))
    else:
        text = getattr(ann, "__name__", str(ann))
    bounds = []
    for meta in field.metadata:
        for attr, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if isinstance(meta, getattr(annotated_types, attr.capitalize())):
                bounds.append(f"{sym} {getattr(meta, attr)}")
    if bounds:
        text += " " + ", ".join(bounds)
    return text + (" or null" if nullable else "")


def _default_text(value: Any) -> str:
    if isinstance(value, BaseModel):
        return ""
    return "`" + _show(value).strip("'") + "`"


def config_reference_markdown() -> str:
    """The key reference of docs/config.md (key, allowed values, default, meaning), generated
    from the schema so the doc cannot drift from the code."""
    lines = []
    groups: list[tuple[str, type[BaseModel], Sequence[str]]] = [
        ("top level", Config, [n for n in Config.model_fields if n not in SECTIONS])
    ]
    groups += [(name, model, list(model.model_fields)) for name, model in SECTIONS.items()]
    for title, model, names in groups:
        lines.append(f"### {title}")
        if model.__doc__ and model is not Config:
            lines.append("")
            lines.append(model.__doc__.strip())
        lines += ["", "| key | allowed | default | meaning |", "|---|---|---|---|"]
        for name in names:
            field = model.model_fields[name]
            key = name if model is Config else f"{title}.{name}"
            layout = " *(layout)*" if key in LAYOUT_KEYS else ""
            lines.append(
                f"| `{key}`{layout} | {_type_text(model, name)} | "
                f"{_default_text(field.get_default(call_default_factory=True))} | "
                f"{field.description} |"
            )
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def update_config_doc(path: str | os.PathLike[str]) -> bool:
    """Replace the generated block of ``path`` (docs/config.md) with the current reference;
    returns whether the file changed."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    start, end = text.index(_DOC_BEGIN) + len(_DOC_BEGIN), text.index(_DOC_END)
    new = text[:start] + "\n\n" + config_reference_markdown() + "\n" + text[end:]
    if new != text:
        path.write_text(new, encoding="utf-8")
    return new != text


def generated_doc_block(text: str) -> str:
    """The generated block of a docs/config.md text, as ``update_config_doc`` writes it."""
    start, end = text.index(_DOC_BEGIN) + len(_DOC_BEGIN), text.index(_DOC_END)
    return text[start:end].strip("\n") + "\n"


# ---------------------------------------------------------------------------- command line


def main_check(argv: Sequence[str] | None = None) -> int:
    """``python -m trainer.config [--config FILE] [--no-env-check] [key=value ...]``: print the
    resolved config and return 0, or print the error and return 2.
    ``--write-docs PATH`` regenerates the key reference in PATH instead."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--write-docs"] and len(args) == 2:
        changed = update_config_doc(args[1])
        print(f"{args[1]}: {'updated' if changed else 'up to date'}")
        return 0
    path = None
    check_env = True
    overrides = []
    it = iter(args)
    for arg in it:
        if arg == "--config":
            path = next(it, None)
            if path is None:
                print("config error: --config needs a FILE", file=sys.stderr)
                return 2
        elif arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        elif arg == "--no-env-check":
            check_env = False
        else:
            overrides.append(arg)
    try:
        cfg = load_config(path, overrides, check_environment=check_env)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    print(cfg.to_yaml(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main_check())
