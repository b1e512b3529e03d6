"""docs/config.md lists every key exactly as the schema defines it."""

from __future__ import annotations

from trainer.config import (
    all_keys,
    config_reference_markdown,
    default_config_path,
    generated_doc_block,
)

DOC = default_config_path().parent.parent.parent / "docs" / "config.md"


def test_config_doc_is_up_to_date():
    text = DOC.read_text(encoding="utf-8")
    assert generated_doc_block(text) == config_reference_markdown(), (
        "docs/config.md is stale: run python -m trainer.config --write-docs docs/config.md"
    )


def test_reference_lists_every_key_once():
    reference = config_reference_markdown()
    for key in all_keys():
        assert reference.count(f"| `{key}`") == 1, key
