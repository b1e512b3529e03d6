"""The key reference in docs/config.md, generated from the schema so it cannot drift.

``python -m trainer.config --write-docs docs/config.md`` rewrites the block between the
``BEGIN GENERATED`` and ``END GENERATED`` markers; tests/test_config_docs.py checks it is current.
"""

from __future__ import annotations

import os
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import annotated_types
from pydantic import BaseModel

from trainer.config.errors import show
from trainer.config.schema import LAYOUT_KEYS, SECTIONS, SUBSECTIONS, Config

_DOC_BEGIN = "<!-- BEGIN GENERATED: python -m trainer.config --write-docs docs/config.md -->"
_DOC_END = "<!-- END GENERATED -->"


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
    return "`" + show(value).strip("'") + "`"


def config_reference_markdown() -> str:
    """The key reference of docs/config.md (key, allowed values, default, meaning), generated
    from the schema so the doc cannot drift from the code."""
    lines = []
    groups: list[tuple[str, type[BaseModel], Sequence[str]]] = [
        ("top level", Config, [n for n in Config.model_fields if n not in SECTIONS])
    ]
    for name, model in SECTIONS.items():  # a subsection's keys follow its section's
        inner = [n for n in model.model_fields if f"{name}.{n}" not in SUBSECTIONS]
        groups.append((name, model, inner))
        groups += [
            (
                f"{name}.{n}",
                SUBSECTIONS[f"{name}.{n}"],
                list(SUBSECTIONS[f"{name}.{n}"].model_fields),
            )
            for n in model.model_fields
            if f"{name}.{n}" in SUBSECTIONS
        ]
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
