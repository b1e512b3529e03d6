"""Load a job config: YAML files with ``include:``, ``key.path=value`` overrides, the schema.

``load_config(path, overrides)`` reads a YAML job file (following its ``include:`` files),
applies the overrides, builds the typed ``Config`` (``trainer/config/schema.py``), turning
pydantic's errors into ``ConfigError``s that name the key, and then runs the checks in
``trainer/config/checks.py``.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from rollout.files import undecodable
from trainer.config.checks import validate_config
from trainer.config.errors import ConfigError, Problem, problem, raise_first, show
from trainer.config.schema import SECTIONS, SUBSECTIONS, Config

log = logging.getLogger("crossrl.config")

INCLUDE_KEY = "include"


# ---------------------------------------------------------------------------- YAML reading


class _Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that also reads ``1e-3`` as a float. YAML 1.1 (PyYAML) wants a dot
    and a signed exponent, so ``lr: 1e-6`` would otherwise be the string "1e-6"."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


class DuplicateKeyError(yaml.YAMLError):
    """A mapping names the same key twice (YAML would keep the last one silently)."""


def _construct_unique_mapping(loader: _Loader, node: yaml.MappingNode, deep: bool = False):
    seen: dict[Any, int] = {}
    for key_node, _value in node.value:
        key = loader.construct_object(key_node, deep=deep)
        line = key_node.start_mark.line + 1
        if key in seen:
            raise DuplicateKeyError(
                f"line {line}: key {key!r} appears twice in one mapping (first on line "
                f"{seen[key]}); keep one"
            )
        seen[key] = line
    return loader.construct_mapping(node, deep=deep)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping)


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
    except DuplicateKeyError as err:
        raise ConfigError("--config", str(path), f"{path}: {err}") from None
    except UnicodeDecodeError as err:
        raise ConfigError("--config", str(path), f"{path}: {undecodable(resolved, err)}") from None
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
            INCLUDE_KEY, includes, f"include: got {show(includes)} in {path}; use a path or a list"
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
                key, value, f"{key}: {parent} is a value ({show(child)}), not a section"
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
        if name not in SECTIONS:
            keys.append(name)
            continue
        for sub in SECTIONS[name].model_fields:
            key = f"{name}.{sub}"
            if key in SUBSECTIONS:
                keys.extend(f"{key}.{leaf}" for leaf in SUBSECTIONS[key].model_fields)
            else:
                keys.append(key)
    return keys


def _first_leaf(prefix: str, value: Any) -> tuple[str, Any]:
    """The dotted path and value of the first leaf under ``value`` (itself if not a dict)."""
    while isinstance(value, dict) and value:
        key, value = next(iter(value.items()))
        prefix = f"{prefix}.{key}"
    return prefix, value


def _field_description(key: str) -> str:
    head, _, tail = key.rpartition(".")
    owner = SUBSECTIONS.get(head) or SECTIONS.get(head) or (Config if not head else None)
    field = owner.model_fields.get(tail) if owner is not None else None
    return (field.description or "") if field else ""


def _pydantic_problems(err: ValidationError) -> list[Problem]:
    known = set(all_keys()) | set(SECTIONS) | set(SUBSECTIONS)
    problems = []
    messages: dict[tuple[str, str], tuple[object, list[str]]] = {}
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
        if key in SECTIONS or key in SUBSECTIONS:
            msg = f"must be a mapping of {key}.* keys (see docs/config.md)"
        messages.setdefault((key, repr(value)), (value, []))[1].append(msg[0].lower() + msg[1:])
    for (key, _), (value, said) in messages.items():
        # a union's members each say what they want of the one value: one problem, all of it
        desc = "" if key in SECTIONS or key in SUBSECTIONS else _field_description(key)
        allowed = ", or ".join(dict.fromkeys(said)) + (f" [{desc}]" if desc else "")
        problems.append(problem(key, value, allowed))
    return problems


def _build(tree: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(tree)
    except ValidationError as err:
        raise_first(_pydantic_problems(err))
        raise  # unreachable: a ValidationError always has at least one error


# ---------------------------------------------------------------------------- public API


def default_config_path() -> Path:
    """The CPU default job, ``configs/cpu/tiny.yaml`` at the repository root (the package is
    installed editable, so the root is the parent of the ``trainer`` package)."""
    return Path(__file__).resolve().parents[2] / "configs" / "cpu" / "tiny.yaml"


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
